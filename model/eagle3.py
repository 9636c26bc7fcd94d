"""EAGLE-3 draft models: the Llama-shaped draft (`LlamaForCausalLMEagle3`, SGLang / SpecForge) and the MLA draft
(`Eagle3DeepseekV2ForCausalLM`, vLLM / TorchSpec), each optionally in the EAGLE-3.1 form (`fc_norm`, `norm_output`).

One decoder layer whose input is cat(input_layernorm(embed(token)), hidden_norm(h)) (width 2H), where h is
fc(target aux states [A*Ht]) for a position the target has verified, or the draft's own previous output [H] while
drafting ahead. The attention is Llama's (own K/V cache) or DeepSeek's MLA (own latent cache, interleaved rope,
YaRN). EAGLE-3.1 adds a per-chunk RMSNorm on each aux state before fc (`fc_norm`) and feeds the final-normed output
forward as the next step's h (`norm_output`). Logits are over a draft vocabulary mapped to target ids by d2t
(target = draft + d2t[draft]). docs/drafters.md gives the formats and their sources.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from model.attention_mla import MLAWeights, mla
from model.config import ConfigError, Kernels, TextConfig, YarnRope, check_field_types, parse_rope_scaling
from model.embedding import embedding_rows
from model.kv_cache import read_head_major_pages, visible_slots, write_head_major_pages, write_slots
from model.mlp import MLPWeights, swiglu
from model.norms import rms_norm
from model.quant import linear
from model.rope import apply_neox, cos_sin, inv_frequencies, target_rope_tables
from model.shard_local import held_to_rules

LLAMA_ARCHS = ("LlamaForCausalLMEagle3",)
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    # target layers whose output residual stream feeds fc (jaxspec's convention: id i = the output of layer i)
    aux_layer_ids: tuple[int, ...] | None
    target_hidden_size: int | None = None  # width of each aux state (= hidden_size for known drafters)
    max_position_embeddings: int = 2048
    attention: str = "llama"  # "llama" (Llama MHA / GQA, NeoX rope) or "mla" (DeepSeek MLA, interleaved rope)
    # MLA attention only (the target's field names and meaning)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_scaling: YarnRope | None = None
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm on each aux chunk before fc
    norm_output: bool = False  # EAGLE-3.1: the next step's h is the final-normed output (else the pre-norm one)
    norm_before_residual: bool = False  # vLLM option: the residual carries hidden_norm(h) instead of h
    kernels: Kernels = Kernels()  # the MLA draft's attention kernel (model.kernels.dispatch), as the target's

    @property
    def aux_count(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def aux_width(self) -> int:
        return self.aux_count * (self.target_hidden_size or self.hidden_size)

    @property
    def mla_config(self) -> TextConfig:
        """The MLA attention's shape as the target's attention code reads it (its input is the 2H-wide concat)."""
        return TextConfig(
            vocab_size=self.vocab_size, hidden_size=2 * self.hidden_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            intermediate_size=self.intermediate_size, moe_intermediate_size=0, n_routed_experts=0, num_experts_per_tok=0,
            n_shared_experts=0, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            norm_topk_prob=False, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
            kernels=self.kernels,
        )


def aux_ids_from_hf(ids: list[int]) -> tuple[int, ...]:
    """`eagle_aux_hidden_state_layer_ids` -> layer-output ids. Drafters ship two conventions (SGLang PR 25454):
    lists starting at 0 or 1 name layer outputs (SGLang's historic reading); the others name the boundary before
    that layer (vLLM's reading, and SGLang's for them), i.e. the output of layer id - 1."""
    ids = [int(i) for i in ids]
    if not ids or min(ids) <= 1:
        return tuple(ids)
    return tuple(i - 1 for i in ids)


def aux_ids_to_hf(ids: tuple[int, ...]) -> list[int]:
    """The inverse of `aux_ids_from_hf`."""
    return list(ids) if not ids or min(ids) <= 1 else [i + 1 for i in ids]


def _int_key(d: dict, key: str, where: str) -> int:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: missing key '{key}'")
    try:
        return int(d[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key}={d[key]!r} is not an integer") from None


_DRAFT_FIELDS = {
    "architectures": "strs?", "num_hidden_layers": "int+?", "hidden_size": "int+", "num_attention_heads": "int+",
    "num_key_value_heads": "int+?", "head_dim": "int+?", "intermediate_size": "int+", "vocab_size": "int+",
    "draft_vocab_size": "int+?", "rope_theta": "number?", "rms_norm_eps": "number?", "hidden_act": "str?",
    "rope_scaling": "object?", "rope_parameters": "object?", "eagle_config": "object?", "target_hidden_size": "int+?",
    "max_position_embeddings": "int+?", "quantization_config": "object?", "model_type": "str?",
    # MLA drafters
    "q_lora_rank": "int+?", "kv_lora_rank": "int+?", "qk_nope_head_dim": "int+?", "qk_rope_head_dim": "int+?",
    "v_head_dim": "int+?", "attention_bias": "bool?", "tie_word_embeddings": "bool?",
    # EAGLE-3.1
    "fc_norm": "bool?", "norm_output": "bool?", "norm_before_residual": "bool?",
}


def draft_config_from_dict(d: dict, where: str = "config.json") -> DraftConfig:
    check_field_types(d, _DRAFT_FIELDS, where)
    check_field_types(d.get("eagle_config") or {}, {"eagle_aux_hidden_state_layer_ids": "ints>=0?",
                                                    "use_aux_hidden_state": "bool?"}, where + " eagle_config")
    archs = d.get("architectures") or []
    if any(a in MLA_ARCHS for a in archs):
        attention = "mla"
    elif any(a in LLAMA_ARCHS for a in archs) or any("Eagle3" in a and "Deepseek" not in a for a in archs):
        attention = "llama"
    else:
        raise ConfigError(f"{where}: architectures={archs!r} is not an EAGLE-3 drafter "
                          f"(jaxspec reads {', '.join(LLAMA_ARCHS + MLA_ARCHS)})")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"{where}: unsupported num_hidden_layers={d['num_hidden_layers']} (EAGLE-3 drafters have 1)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act={d['hidden_act']!r} (silu only)")
    for key, why in (("use_moe", "MoE draft layers"), ("mla_use_nope", "NoPE MLA (Kimi K3) drafts"),
                     ("norm_before_fc", "one RMSNorm over the whole fc input")):
        if d.get(key) or (d.get("eagle_config") or {}).get(key):
            raise ConfigError(f"{where}: unsupported {key}=true ({why} are not supported)")
    if d.get("tie_word_embeddings"):
        raise ConfigError(f"{where}: unsupported tie_word_embeddings=true (EAGLE-3 drafters have their own lm_head)")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        _int_key(d, key, where)
    eagle = d.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state=false (EAGLE-1/2 drafters) is not supported")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ConfigError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids={ids!r} is not a list of layer ids")
    h, n = int(d["hidden_size"]), int(d["num_attention_heads"])
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    common = dict(
        hidden_size=h, num_attention_heads=n, intermediate_size=int(d["intermediate_size"]),
        vocab_size=int(d["vocab_size"]), draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
        rope_theta=float(theta), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        aux_layer_ids=None if ids is None else aux_ids_from_hf(ids),
        target_hidden_size=d.get("target_hidden_size"),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        fc_norm=bool(d.get("fc_norm", False)), norm_output=bool(d.get("norm_output", False)),
        norm_before_residual=bool(d.get("norm_before_residual", False)),
    )
    if attention == "llama":
        rs = d.get("rope_scaling")
        if rs and rs.get("type", rs.get("rope_type", "default")) not in ("default", None):
            raise ConfigError(f"{where}: unsupported rope_scaling={rs!r} for a Llama-shaped draft (plain rope only)")
        return DraftConfig(num_key_value_heads=int(d.get("num_key_value_heads") or n),
                           head_dim=int(d.get("head_dim") or h // n), **common)
    if d.get("num_key_value_heads", n) != n:
        raise ConfigError(f"{where}: num_key_value_heads must equal num_attention_heads for MLA")
    if d.get("attention_bias", False):
        raise ConfigError(f"{where}: unsupported attention_bias=true (MLA drafts use no bias)")
    q_lora = d.get("q_lora_rank")
    dn, r = _int_key(d, "qk_nope_head_dim", where), _int_key(d, "qk_rope_head_dim", where)
    if r % 2:
        raise ConfigError(f"{where}: qk_rope_head_dim={r} must be even (rope rotates pairs)")
    return DraftConfig(
        num_key_value_heads=n, head_dim=dn + r, attention="mla",
        q_lora_rank=None if q_lora is None else _int_key(d, "q_lora_rank", where),
        kv_lora_rank=_int_key(d, "kv_lora_rank", where), qk_nope_head_dim=dn, qk_rope_head_dim=r,
        v_head_dim=_int_key(d, "v_head_dim", where), rope_scaling=parse_rope_scaling(d, where), **common,
    )


def load_draft_config(path: str | Path) -> DraftConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return draft_config_from_dict(json.loads(path.read_text()), str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


@struct.dataclass
class DraftWeights:
    fc: jax.Array  # [H, A * Ht]
    input_norm: jax.Array  # [H] on the token embedding
    hidden_norm: jax.Array  # [H] on h
    post_attention_norm: jax.Array  # [H]
    # Llama attention (None in an MLA draft)
    q_proj: jax.Array | None  # [N * D, 2H]
    k_proj: jax.Array | None  # [Nkv * D, 2H]
    v_proj: jax.Array | None  # [Nkv * D, 2H]
    o_proj: jax.Array | None  # [H, N * D]
    mlp: MLPWeights
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [Vd, H]; None: the target's lm_head (then Vd = V)
    embed: jax.Array | None  # [V, H]; None: the target's embeddings
    d2t: jax.Array | None  # [Vd] int32 offsets: target id = draft id + d2t[draft id]; None: identity
    mla: MLAWeights | None = None  # MLA attention over the 2H input (the target's layout); None in a Llama draft
    fc_norm: jax.Array | None = None  # [A, Ht] EAGLE-3.1 per-chunk norms; None: fc reads the aux states as they are


@struct.dataclass
class DraftCache:
    # Head-major: the attention's dots batch over (b, kv head), and with a [B, S, Nkv, D] cache XLA's GPU layout
    # put a transpose of the whole cache in and out of every dispatch (at long contexts and large batches, more
    # time than the cycle's own work). A device loop pays them once per loop; synchronised and streamed cycles
    # paid them every cycle.
    # Paged (`init_paged_draft_cache`, the server's slots): pools [N, Nkv, P, D] read through the target cache's
    # block table (model.kv_cache), passed to the draft forward as `pages_BM`.
    k: jax.Array  # [B, Nkv, S, D]
    v: jax.Array  # [B, Nkv, S, D]

    @property
    def capacity(self) -> int:
        """Positions of a contiguous cache (a paged one's are its block table's)."""
        return self.k.shape[2]


@struct.dataclass
class DraftLatentCache:
    """An MLA draft's cache: like one target layer's, the normalized latent and the roped shared key per slot.
    Paged (`init_paged_draft_cache`): pools [N, P, C] / [N, P, R] read through the target cache's block table."""

    latent: jax.Array  # [B, S, C]
    k_rope: jax.Array  # [B, S, R]

    @property
    def capacity(self) -> int:
        """Positions of a contiguous cache (a paged one's are its block table's)."""
        return self.latent.shape[1]


def init_draft_cache(cfg: DraftConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> DraftCache | DraftLatentCache:
    if cfg.attention == "mla":
        return DraftLatentCache(jnp.zeros((batch, capacity, cfg.kv_lora_rank), dtype),
                                jnp.zeros((batch, capacity, cfg.qk_rope_head_dim), dtype))
    shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return DraftCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def init_paged_draft_cache(cfg: DraftConfig, num_pages: int, page_tokens: int,
                           dtype=jnp.bfloat16) -> DraftCache | DraftLatentCache:
    """The draft's cache as pools of `num_pages` pages of `page_tokens` positions, each page holding the same
    positions of the same sequence as the target cache's page of that id: the target cache's block table
    (model.kv_cache) serves both, so a sequence's pages are taken and given back once for the two models."""
    if cfg.attention == "mla":
        return DraftLatentCache(jnp.zeros((num_pages, page_tokens, cfg.kv_lora_rank), dtype),
                                jnp.zeros((num_pages, page_tokens, cfg.qk_rope_head_dim), dtype))
    shape = (num_pages, cfg.num_key_value_heads, page_tokens, cfg.head_dim)
    return DraftCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class DraftOutput(NamedTuple):
    logits: jax.Array  # [B, T, Vd] float32 over the draft vocabulary
    hidden: jax.Array  # [B, T, H]: the next step's h (pre-norm output, or the normed one with norm_output)
    cache: DraftCache | DraftLatentCache


def draft_to_target_ids(w: DraftWeights, draft_ids: jax.Array) -> jax.Array:
    if w.d2t is None:
        return draft_ids
    return draft_ids + w.d2t[draft_ids]


def _llama_attention(x_BT2H, w: DraftWeights, cfg: DraftConfig, positions_BT, cache: DraftCache, pages_BM=None):
    """Llama attention over the draft's own K/V cache; with `pages_BM` the cache is paged (pools [N, Nkv, P, D]):
    the new keys and values go to their pages and each sequence's pages are read as its contiguous cache."""
    b, t, _ = x_BT2H.shape
    n, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = cos_sin(positions_BT, inv_frequencies(d, cfg.rope_theta, None))
    q_BTND = apply_neox(linear(x_BT2H, w.q_proj).reshape(b, t, n, d), cos, sin)
    k_BTND = apply_neox(linear(x_BT2H, w.k_proj).reshape(b, t, nkv, d), cos, sin)
    v_BTND = linear(x_BT2H, w.v_proj).reshape(b, t, nkv, d)
    if pages_BM is None:
        k_cache = k_BKSD = write_slots(cache.k, k_BTND, positions_BT, slot_axis=2)
        v_cache = v_BKSD = write_slots(cache.v, v_BTND, positions_BT, slot_axis=2)
    else:
        k_cache = write_head_major_pages(cache.k, k_BTND, positions_BT, pages_BM)
        v_cache = write_head_major_pages(cache.v, v_BTND, positions_BT, pages_BM)
        k_BKSD, v_BKSD = read_head_major_pages(k_cache, pages_BM), read_head_major_pages(v_cache, pages_BM)
    q_BTNJD = q_BTND.reshape(b, t, nkv, n // nkv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BTNJD, k_BKSD.astype(q_BTND.dtype), preferred_element_type=jnp.float32)
    mask = visible_slots(positions_BT, k_BKSD.shape[2])[:, None, None]
    probs = jax.nn.softmax(jnp.where(mask, scores * d**-0.5, -jnp.inf), axis=-1).astype(q_BTND.dtype)
    out_BTNJD = jnp.einsum("bkgts,bksd->btkgd", probs, v_BKSD.astype(q_BTND.dtype))
    return linear(out_BTNJD.reshape(b, t, n * d), w.o_proj), DraftCache(k_cache, v_cache)


def _mla_attention(x_BT2H, w: DraftWeights, cfg: DraftConfig, positions_BT, cache: DraftLatentCache, pages_BM=None):
    """The target's MLA (absorbed, over the draft's own latent cache) with the draft's YaRN rope and its LoRA norms
    at rms_norm_eps, as vLLM's and TorchSpec's MLA drafts build them; with `pages_BM` over pools, as the target's
    paged cache."""
    acfg = cfg.mla_config
    inv_freq, multiplier = target_rope_tables(acfg)
    cos, sin = cos_sin(positions_BT, inv_freq, multiplier)
    out_BTH, latent, k_rope = mla(x_BT2H, w.mla, acfg, cos, sin, positions_BT, cache.latent, cache.k_rope,
                                  norm_eps=cfg.rms_norm_eps, pages_BM=pages_BM)
    return out_BTH, DraftLatentCache(latent, k_rope)


def project_aux(w: DraftWeights, cfg: DraftConfig, aux_BTA: jax.Array) -> jax.Array:
    """Target aux states [B, T, A * Ht] -> h [B, T, H]: fc, after the per-chunk fc_norm when the draft has one."""
    if w.fc_norm is not None:
        chunks = jnp.split(aux_BTA, cfg.aux_count, axis=-1)
        aux_BTA = jnp.concatenate([rms_norm(c, w.fc_norm[i], cfg.rms_norm_eps) for i, c in enumerate(chunks)], -1)
    return linear(aux_BTA, w.fc)


def held_as_head(logits_XV: jax.Array, w: DraftWeights) -> jax.Array:
    """Draft logits held in the layout their head gives them (model.shard_local.held_to_rules): split over the
    vocabulary when the head is the target's lm_head, whole on every device when it is the draft's own (replicated,
    DRAFT_RULES). So sampling's layout by rows does not spread back into the draft's forward."""
    return held_to_rules(logits_XV, (*(None,) * (logits_XV.ndim - 1), "vocab") if w.lm_head is None else ())


def draft_forward(
    w: DraftWeights,
    cfg: DraftConfig,
    target_embed: jax.Array,
    target_lm_head: jax.Array,
    tokens_BT: jax.Array,
    h_BTX: jax.Array,
    positions_BT: jax.Array,
    cache: DraftCache | DraftLatentCache,
    pages_BM: jax.Array | None = None,
) -> DraftOutput:
    """Draft positions: token x[t+1] paired with h at t (aux states [A*Ht] or the draft's own output [H]).
    `pages_BM`: the block table of a paged cache (`init_paged_draft_cache`; the target cache's table)."""
    # the draft's own table is replicated (model/sharding.py's DRAFT_RULES); the target's is split by vocabulary
    e_BTH = embedding_rows(target_embed, tokens_BT, vocab_sharded=True) if w.embed is None else w.embed[tokens_BT]
    dt = e_BTH.dtype
    h_BTH = project_aux(w, cfg, h_BTX.astype(dt)) if h_BTX.shape[-1] != cfg.hidden_size else h_BTX.astype(dt)
    normed_h = rms_norm(h_BTH, w.hidden_norm, cfg.rms_norm_eps)
    residual = normed_h if cfg.norm_before_residual else h_BTH
    x = jnp.concatenate([rms_norm(e_BTH, w.input_norm, cfg.rms_norm_eps), normed_h], axis=-1)
    attend = _mla_attention if cfg.attention == "mla" else _llama_attention
    attn, cache = attend(x, w, cfg, positions_BT, cache, pages_BM)
    residual = residual + attn
    out_BTH = residual + swiglu(rms_norm(residual, w.post_attention_norm, cfg.rms_norm_eps), w.mlp)
    head = target_lm_head if w.lm_head is None else w.lm_head
    normed = rms_norm(out_BTH, w.final_norm, cfg.rms_norm_eps)
    logits = jnp.einsum("bth,vh->btv", normed, head.astype(dt), preferred_element_type=jnp.float32)
    return DraftOutput(held_as_head(logits, w), normed if cfg.norm_output else out_BTH, cache)
