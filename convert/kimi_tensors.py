"""The Hugging Face tensors a Kimi K2 / DeepseekV3 checkpoint must hold, by name and logical shape.

Linear modules are listed by module name (their storage, dense / FP8 / INT4, decides the tensor suffixes);
everything else by full tensor name. `WeightBuilder` reads exactly these; the converter checks that it did.
"""

from __future__ import annotations

import dataclasses

from model.config import TextConfig


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    module: str  # e.g. "model.layers.3.mlp.experts.7.up_proj"
    out: int
    inp: int
    role: str  # "attn", "mlp" (dense layer), "shared", "expert", "lm_head"


@dataclasses.dataclass(frozen=True)
class PlainSpec:
    name: str  # full tensor name
    shape: tuple[int, ...]
    role: str  # "norm", "router", "router_bias", "embed"


TensorSpec = LinearSpec | PlainSpec


def layer_prefix(cfg: TextConfig, layer: int) -> str:
    return f"{cfg.weight_prefix}model.layers.{layer}."


def attention_specs(cfg: TextConfig, layer: int) -> list[TensorSpec]:
    a = layer_prefix(cfg, layer) + "self_attn."
    h, n, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs: list[TensorSpec] = []
    if cfg.q_lora_rank is None:
        specs.append(LinearSpec(a + "q_proj", n * cfg.qk_head_dim, h, "attn"))
    else:
        specs += [
            LinearSpec(a + "q_a_proj", cfg.q_lora_rank, h, "attn"),
            PlainSpec(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"),
            LinearSpec(a + "q_b_proj", n * cfg.qk_head_dim, cfg.q_lora_rank, "attn"),
        ]
    return specs + [
        LinearSpec(a + "kv_a_proj_with_mqa", c + r, h, "attn"),
        PlainSpec(a + "kv_a_layernorm.weight", (c,), "norm"),
        LinearSpec(a + "kv_b_proj", n * (cfg.qk_nope_head_dim + cfg.v_head_dim), c, "attn"),
        LinearSpec(a + "o_proj", h, n * cfg.v_head_dim, "attn"),
    ]


def swiglu_specs(prefix: str, hidden: int, inter: int, role: str) -> list[TensorSpec]:
    return [
        LinearSpec(prefix + "gate_proj", inter, hidden, role),
        LinearSpec(prefix + "up_proj", inter, hidden, role),
        LinearSpec(prefix + "down_proj", hidden, inter, role),
    ]


def feed_forward_specs(cfg: TextConfig, layer: int) -> list[TensorSpec]:
    m = layer_prefix(cfg, layer) + "mlp."
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return swiglu_specs(m, h, cfg.intermediate_size, "mlp")
    e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
    specs: list[TensorSpec] = [
        PlainSpec(m + "gate.weight", (e, h), "router"),
        PlainSpec(m + "gate.e_score_correction_bias", (e,), "router_bias"),
    ]
    for i in range(e):
        specs += swiglu_specs(f"{m}experts.{i}.", h, f, "expert")
    if cfg.n_shared_experts:
        specs += swiglu_specs(m + "shared_experts.", h, f * cfg.n_shared_experts, "shared")
    return specs


def layer_specs(cfg: TextConfig, layer: int) -> list[TensorSpec]:
    p = layer_prefix(cfg, layer)
    h = cfg.hidden_size
    return [
        PlainSpec(p + "input_layernorm.weight", (h,), "norm"),
        PlainSpec(p + "post_attention_layernorm.weight", (h,), "norm"),
        *attention_specs(cfg, layer),
        *feed_forward_specs(cfg, layer),
    ]


def embed_specs(cfg: TextConfig) -> list[TensorSpec]:
    return [PlainSpec(f"{cfg.weight_prefix}model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "embed")]


def head_specs(cfg: TextConfig) -> list[TensorSpec]:
    return [
        PlainSpec(f"{cfg.weight_prefix}model.norm.weight", (cfg.hidden_size,), "norm"),
        LinearSpec(f"{cfg.weight_prefix}lm_head", cfg.vocab_size, cfg.hidden_size, "lm_head"),
    ]


def layer_item(layer: int) -> str:
    return f"layer_{layer:03d}"


def target_items(cfg: TextConfig) -> dict[str, list[TensorSpec]]:
    """Conversion units in order: embeddings, one per decoder layer, final norm + lm_head."""
    items = {"embed": embed_specs(cfg)}
    for i in range(cfg.num_hidden_layers):
        items[layer_item(i)] = layer_specs(cfg, i)
    items["head"] = head_specs(cfg)
    return items
