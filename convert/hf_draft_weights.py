"""Hugging Face EAGLE-3 drafters (LlamaForCausalLMEagle3, SGLang / SpecForge names) -> DraftWeights.

    fc.weight [H, 3*Ht]   midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [.., 2H]   midlayer.self_attn.o_proj.weight [H, N*D]
    midlayer.mlp.{gate,up,down}_proj.weight   norm.weight [H]   lm_head.weight [Vd, H]
    d2t [Vd] int64 (target id = draft id + d2t)   t2d [V] bool   embed_tokens.weight [V, H] (optional)

A drafter is one layer, so it is read whole (still one tensor at a time from disk).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from convert.safetensors_reader import CheckpointError, CheckpointReader
from convert.tensor_plan import FLOAT_DTYPES
from model.eagle3 import DraftConfig, DraftWeights
from model.mlp import MLPWeights

INT_DTYPES = {np.dtype(t) for t in (np.int64, np.int32)}
BOOL_DTYPES = {np.dtype(np.bool_), np.dtype(np.uint8)}


@dataclasses.dataclass(frozen=True)
class DraftTensor:
    name: str
    shape: tuple[int, ...]
    dtypes: frozenset
    required: bool = True


def draft_tensors(cfg: DraftConfig, has_reduced_vocab: bool) -> list[DraftTensor]:
    h, n, nkv, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    fl, m = frozenset(FLOAT_DTYPES), "midlayer."
    return [
        DraftTensor("fc.weight", (h, cfg.aux_width), fl),
        DraftTensor(m + "input_layernorm.weight", (h,), fl),
        DraftTensor(m + "hidden_norm.weight", (h,), fl),
        DraftTensor(m + "post_attention_layernorm.weight", (h,), fl),
        DraftTensor(m + "self_attn.q_proj.weight", (n * d, 2 * h), fl),
        DraftTensor(m + "self_attn.k_proj.weight", (nkv * d, 2 * h), fl),
        DraftTensor(m + "self_attn.v_proj.weight", (nkv * d, 2 * h), fl),
        DraftTensor(m + "self_attn.o_proj.weight", (h, n * d), fl),
        DraftTensor(m + "mlp.gate_proj.weight", (f, h), fl),
        DraftTensor(m + "mlp.up_proj.weight", (f, h), fl),
        DraftTensor(m + "mlp.down_proj.weight", (h, f), fl),
        DraftTensor("norm.weight", (h,), fl),
        # a reduced draft vocabulary needs its own head and the d2t map; a full one may use the target's head
        DraftTensor("lm_head.weight", (cfg.draft_vocab_size, h), fl, required=has_reduced_vocab),
        DraftTensor("d2t", (cfg.draft_vocab_size,), frozenset(INT_DTYPES), required=cfg.draft_vocab_size < cfg.vocab_size),
        DraftTensor("t2d", (cfg.vocab_size,), frozenset(BOOL_DTYPES), required=False),
        DraftTensor("embed_tokens.weight", (cfg.vocab_size, h), fl, required=False),
    ]


def plan_draft(reader: CheckpointReader, cfg: DraftConfig, raw_config: dict) -> list[str]:
    """Check names, shapes and dtypes from the headers; -> the tensor names to read."""
    reduced = "draft_vocab_size" in raw_config or cfg.draft_vocab_size != cfg.vocab_size
    names = []
    for t in draft_tensors(cfg, reduced):
        if not reader.has(t.name):
            if t.required:
                raise CheckpointError(f"{reader.index_path or reader.directory}: missing tensor '{t.name}'")
            continue
        where = reader.file_of(t.name)
        if tuple(reader.shape(t.name)) != t.shape:
            raise CheckpointError(
                f"{where}: tensor '{t.name}' has shape {list(reader.shape(t.name))}, config.json expects {list(t.shape)}"
            )
        if reader.dtype(t.name) not in t.dtypes:
            raise CheckpointError(
                f"{where}: tensor '{t.name}' has dtype {reader.dtype(t.name)}, expected one of {sorted(str(d) for d in t.dtypes)}"
            )
        names.append(t.name)
    for name in reader.names():
        if name not in names:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor '{name}' is unknown: not part of a LlamaForCausalLMEagle3 drafter "
                "(MLA drafters with fc_norm / norm_output are not supported)"
            )
    return names


def build_draft(src, cfg: DraftConfig, names: list[str], dtype) -> DraftWeights:
    """Read the planned tensors into numpy DraftWeights (floats in `dtype`, d2t int32)."""
    dtype = np.dtype(dtype)

    def f(name):
        return src.get(name).astype(dtype, copy=False)

    m = "midlayer."
    d2t = None
    if "d2t" in names:
        d2t = src.get("d2t").astype(np.int64)
        target_ids = np.arange(cfg.draft_vocab_size) + d2t
        if target_ids.min(initial=0) < 0 or target_ids.max(initial=0) >= cfg.vocab_size:
            raise CheckpointError(f"{src.file_of('d2t')}: tensor 'd2t' maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
        if "t2d" in names:
            t2d = src.get("t2d").astype(bool)
            if int(t2d.sum()) != cfg.draft_vocab_size or not t2d[target_ids].all():
                raise CheckpointError(f"{src.file_of('t2d')}: tensor 't2d' disagrees with 'd2t' (they must mark the same target ids)")
        d2t = d2t.astype(np.int32)
    return DraftWeights(
        fc=f("fc.weight"),
        input_norm=f(m + "input_layernorm.weight"),
        hidden_norm=f(m + "hidden_norm.weight"),
        post_attention_norm=f(m + "post_attention_layernorm.weight"),
        q_proj=f(m + "self_attn.q_proj.weight"),
        k_proj=f(m + "self_attn.k_proj.weight"),
        v_proj=f(m + "self_attn.v_proj.weight"),
        o_proj=f(m + "self_attn.o_proj.weight"),
        mlp=MLPWeights(gate=f(m + "mlp.gate_proj.weight"), up=f(m + "mlp.up_proj.weight"), down=f(m + "mlp.down_proj.weight")),
        final_norm=f("norm.weight"),
        lm_head=f("lm_head.weight") if "lm_head.weight" in names else None,
        embed=f("embed_tokens.weight") if "embed_tokens.weight" in names else None,
        d2t=d2t,
    )


def load_hf_draft(directory, dtype=np.float32) -> tuple[DraftConfig, DraftWeights]:
    """A HF EAGLE-3 drafter directory -> (DraftConfig, numpy DraftWeights), without converting to disk."""
    import json
    from pathlib import Path

    from model.eagle3 import draft_config_from_dict

    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text())
    cfg = draft_config_from_dict(raw, str(path))
    reader = CheckpointReader(directory)
    return cfg, build_draft(reader, cfg, plan_draft(reader, cfg, raw), dtype)
