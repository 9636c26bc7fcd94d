"""Frozen configs of the Kimi K2 family (DeepseekV3 architecture), read from Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json value jaxspec cannot serve; the message names the key."""


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN rope scaling as DeepSeek-V3 / Kimi configure it (`rope_scaling.type == "yarn"`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint stores quantized weights (None on `TextConfig.quant` means bf16 / fp32)."""

    method: str  # "fp8" (block) or "int4" (compressed-tensors pack-quantized)
    group_size: int = 32  # int4: elements per scale along the input dim
    block_size: tuple[int, int] = (128, 128)  # fp8: [out, in] block of one scale
    ignore: tuple[str, ...] = ()  # compressed-tensors: module names / "re:" patterns left unquantized


KERNEL_CHOICES = {
    "moe": ("auto", "off", "wgmma", "grouped", "triton"),
    "mla": ("auto", "off", "on"),
    "router": ("auto", "off", "on"),
}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation each kernel family runs: data on the model config, so a program's kernels are part of
    its static key and tests and bench switch them with `dataclasses.replace`.

    "auto" picks by backend and shape (`model.kernels.dispatch`): the GPU kernels where they serve the shapes they were
    tuned for on one GPU (under a mesh: over one device's block), the plain XLA reference elsewhere (CPU, prefill).
    "off" always runs the plain XLA reference. moe "wgmma" / "triton" names the routed-experts kernel (Mosaic GPU on
    Hopper, or the Triton gemv / mma pair) wherever its shapes fit; moe "grouped" takes what "auto" takes but, for
    verify of 2 to 8 tokens on Hopper, the kernels that convert an expert several slots chose once for all its tokens
    (moe_grouped); mla / router "on" takes the kernel for every shape it can compute (off the GPU in Pallas' interpret
    mode: slow, for tests)."""

    moe: str = "auto"
    mla: str = "auto"
    router: str = "auto"

    def __post_init__(self):
        for family, allowed in KERNEL_CHOICES.items():
            value = getattr(self, family)
            if value not in allowed:
                raise ConfigError(f"kernels.{family}={value!r}: expected one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The text backbone of a Kimi K2 / DeepseekV3 checkpoint."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: YarnRope | None
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    quant: QuantConfig | None = None
    # residual stream leaving these layers feeds EAGLE-3 (None: the EAGLE-3 default 1, N//2-1, N-4)
    aux_layer_ids: tuple[int, ...] | None = None
    model_type: str = "deepseek_v3"
    weight_prefix: str = ""  # "language_model." for K2.5's multimodal wrapper
    kernels: Kernels = Kernels()  # how this model runs, not what it is: never read from or written to a checkpoint

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eagle_aux_layers(self) -> tuple[int, ...]:
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        n = self.num_hidden_layers
        return (1, n // 2 - 1, n - 4)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim:
            m = yarn_mscale(y.factor, y.mscale_all_dim)
            scale *= m * m
        return scale

    def replace(self, **changes: Any) -> "TextConfig":
        return dataclasses.replace(self, **changes)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


_SUPPORTED_ARCHS = {"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing key '{key}'")
    return d[key]


# JSON types of config.json fields, checked before any is used: a hand-edited or hostile file says which
# key is wrong instead of failing inside int() or .get(). "int+": a positive integer; "?": may be null.
_FIELD_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "int+": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "int>=0": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "ints>=0": (lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
                "a list of non-negative integers"),
    "int|ints": (lambda v: (isinstance(v, int) and not isinstance(v, bool))
                 or (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)),
                 "an integer or a list of integers"),
}


def check_field_types(d: dict, fields: dict[str, str], where: str) -> None:
    """Each present key of `fields` has its JSON type ("?" suffix: null allowed)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: must be a JSON object, not {type(d).__name__}")
    for key, kind in fields.items():
        if key not in d:
            continue
        v = d[key]
        if kind.endswith("?"):
            if v is None:
                continue
            kind = kind[:-1]
        ok, expected = _FIELD_KINDS[kind]
        if not ok(v):
            raise ConfigError(f"{where}: '{key}' must be {expected}, got {v!r}"[:300])


_TEXT_FIELDS = {
    "vocab_size": "int+", "hidden_size": "int+", "num_hidden_layers": "int+", "num_attention_heads": "int+",
    "kv_lora_rank": "int+", "qk_nope_head_dim": "int+", "qk_rope_head_dim": "int+", "v_head_dim": "int+",
    "intermediate_size": "int+", "q_lora_rank": "int+?", "moe_intermediate_size": "int>=0?",
    "n_routed_experts": "int>=0?", "num_experts_per_tok": "int>=0?", "n_shared_experts": "int>=0?",
    "first_k_dense_replace": "int>=0?", "n_group": "int+?", "topk_group": "int+?", "num_key_value_heads": "int+?",
    "moe_layer_freq": "int+?", "num_nextn_predict_layers": "int>=0?", "max_position_embeddings": "int+?",
    "routed_scaling_factor": "number?", "rms_norm_eps": "number?", "rope_theta": "number?",
    "norm_topk_prob": "bool?", "rope_interleave": "bool?", "attention_bias": "bool?", "tie_word_embeddings": "bool?",
    "rope_scaling": "object?", "rope_parameters": "object?", "quantization_config": "object?",
    "topk_method": "str?", "scoring_func": "str?", "hidden_act": "str?", "model_type": "str?",
    "bos_token_id": "int?", "pad_token_id": "int?", "eos_token_id": "int|ints?",
}
_WRAPPER_FIELDS = {
    "architectures": "strs?", "text_config": "object", "quantization_config": "object?", "model_type": "str?",
    "eagle_aux_hidden_state_layer_ids": "ints>=0?", "bos_token_id": "int?", "pad_token_id": "int?",
    "eos_token_id": "int|ints?",
}


def _check(ok: bool, key: str, value: Any, expected: str, where: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: unsupported {key}={value!r} (jaxspec supports {expected})")


def parse_rope_scaling(d: dict, where: str) -> YarnRope | None:
    rs = d.get("rope_scaling")
    if rs is None:
        rp = d.get("rope_parameters")  # transformers v5 spelling
        if rp is not None and rp.get("rope_type", rp.get("type", "default")) != "default":
            rs = rp
    if rs is None:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    _check(kind == "yarn", "rope_scaling.type", kind, "'yarn' or no rope_scaling", where)
    return YarnRope(
        factor=float(_require(rs, "factor", where + " rope_scaling")),
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
        mscale=None if rs.get("mscale") is None else float(rs["mscale"]),
        mscale_all_dim=None if rs.get("mscale_all_dim") is None else float(rs["mscale_all_dim"]),
    )


def _parse_quant(q: dict | None, where: str) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        _check(fmt == "e4m3", "quantization_config.fmt", fmt, "'e4m3'", where)
        block = tuple(int(b) for b in q.get("weight_block_size", (128, 128)))
        _check(len(block) == 2, "quantization_config.weight_block_size", block, "[out, in]", where)
        return QuantConfig(method="fp8", block_size=block)  # type: ignore[arg-type]
    if method == "compressed-tensors":
        fmt = q.get("format")
        _check(fmt == "pack-quantized", "quantization_config.format", fmt, "'pack-quantized'", where)
        groups = q.get("config_groups") or {}
        _check(len(groups) == 1, "quantization_config.config_groups", list(groups), "exactly one group", where)
        w = next(iter(groups.values())).get("weights") or {}
        _check(w.get("num_bits") == 4, "quantization_config...weights.num_bits", w.get("num_bits"), "4", where)
        _check(w.get("type", "int") == "int", "quantization_config...weights.type", w.get("type"), "'int'", where)
        _check(bool(w.get("symmetric", True)), "quantization_config...weights.symmetric", w.get("symmetric"), "true", where)
        _check(w.get("strategy") == "group", "quantization_config...weights.strategy", w.get("strategy"), "'group'", where)
        gs = int(w.get("group_size") or 0)
        _check(gs > 0, "quantization_config...weights.group_size", w.get("group_size"), "a positive group size", where)
        return QuantConfig(method="int4", group_size=gs, ignore=tuple(q.get("ignore") or ()))
    raise ConfigError(
        f"{where}: unsupported quantization_config.quant_method={method!r} "
        "(jaxspec supports 'fp8' block and 'compressed-tensors' pack-quantized int4)"
    )


def text_config_from_dict(raw: dict, where: str = "config.json") -> TextConfig:
    """Validate a HF config dict (DeepseekV3, Kimi K2 / K2-Thinking, or K2.5 with `text_config`)."""
    check_field_types(raw, _WRAPPER_FIELDS, where)
    check_field_types(raw.get("text_config", raw), _TEXT_FIELDS, where + (" text_config" if "text_config" in raw else ""))
    archs = raw.get("architectures") or ["DeepseekV3ForCausalLM"]
    _check(any(a in _SUPPORTED_ARCHS for a in archs), "architectures", archs, sorted(_SUPPORTED_ARCHS), where)
    prefix = ""
    d = raw
    if "text_config" in raw:
        d = dict(raw["text_config"])
        where = where + " text_config"
        prefix = "language_model."
    quant = _parse_quant(d.get("quantization_config") or raw.get("quantization_config"), where)

    for key, expected in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("hidden_act", "silu")):
        if key in d:
            _check(d[key] == expected, key, d[key], repr(expected), where)
    if d.get("attention_bias", False):
        raise ConfigError(f"{where}: unsupported attention_bias=true (Kimi / DeepseekV3 use no bias)")
    if d.get("num_key_value_heads", d.get("num_attention_heads")) != d.get("num_attention_heads"):
        raise ConfigError(f"{where}: num_key_value_heads must equal num_attention_heads for MLA")
    if int(d.get("moe_layer_freq", 1)) != 1:
        raise ConfigError(f"{where}: unsupported moe_layer_freq={d['moe_layer_freq']!r} (jaxspec supports 1)")
    if int(d.get("num_nextn_predict_layers", 0) or 0) not in (0, 1):
        raise ConfigError(f"{where}: unsupported num_nextn_predict_layers={d['num_nextn_predict_layers']!r}")
    if d.get("tie_word_embeddings", False):
        raise ConfigError(f"{where}: unsupported tie_word_embeddings=true")

    n_group = int(d.get("n_group", 1) or 1)
    topk_group = int(d.get("topk_group", 1) or 1)
    n_experts = int(d.get("n_routed_experts", 0) or 0)
    if n_experts:
        _check(n_experts % n_group == 0, "n_group", n_group, "a divisor of n_routed_experts", where)
        _check(1 <= topk_group <= n_group, "topk_group", topk_group, f"1..n_group={n_group}", where)
        k = int(_require(d, "num_experts_per_tok", where))
        _check(1 <= k <= n_experts, "num_experts_per_tok", k, f"1..n_routed_experts={n_experts}", where)
    eos = d.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    eagle = raw.get("eagle_aux_hidden_state_layer_ids")

    return TextConfig(
        vocab_size=int(_require(d, "vocab_size", where)),
        hidden_size=int(_require(d, "hidden_size", where)),
        num_hidden_layers=int(_require(d, "num_hidden_layers", where)),
        num_attention_heads=int(_require(d, "num_attention_heads", where)),
        q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
        kv_lora_rank=int(_require(d, "kv_lora_rank", where)),
        qk_nope_head_dim=int(_require(d, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_require(d, "qk_rope_head_dim", where)),
        v_head_dim=int(_require(d, "v_head_dim", where)),
        intermediate_size=int(_require(d, "intermediate_size", where)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 0) or 0),
        n_routed_experts=n_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0) or 0),
        n_shared_experts=int(d.get("n_shared_experts", 0) or 0),
        first_k_dense_replace=int(d.get("first_k_dense_replace", 0) or 0),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        rope_scaling=parse_rope_scaling(d, where),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_id=eos_ids,
        pad_token_id=d.get("pad_token_id", raw.get("pad_token_id")),
        tie_word_embeddings=False,
        rope_interleave=bool(d.get("rope_interleave", True)),
        quant=quant,
        aux_layer_ids=None if eagle is None else tuple(int(i) for i in eagle),
        model_type=str(raw.get("model_type", "deepseek_v3")),
        weight_prefix=prefix,
    )


def load_text_config(path: str | Path) -> TextConfig:
    """Read `config.json` (a file, or a checkpoint directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return text_config_from_dict(raw, where=str(path))
