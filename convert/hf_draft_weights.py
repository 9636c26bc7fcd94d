"""Hugging Face EAGLE-3 drafters -> DraftWeights: `LlamaForCausalLMEagle3` (SGLang / SpecForge) and
`Eagle3DeepseekV2ForCausalLM` (MLA, vLLM / TorchSpec), either with the EAGLE-3.1 fc_norm. docs/drafters.md has
the sources. The layer's tensors are named `midlayer.*` (SpecForge) or `layers.0.*` (TorchSpec's export).

    fc.weight [H, A*Ht]   fc_norm.{i}.weight [Ht] (EAGLE-3.1, i < A)
    {layer}.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
    Llama: {layer}.self_attn.{q,k,v}_proj.weight [.., 2H]   {layer}.self_attn.o_proj.weight [H, N*D]
    MLA:   {layer}.self_attn.q_a_proj.weight [Q, 2H]  q_a_layernorm.weight [Q]  q_b_proj.weight [N*(Dn+R), Q]
           (q_proj.weight [N*(Dn+R), 2H] without q-LoRA)  kv_a_proj_with_mqa.weight [C+R, 2H]
           kv_a_layernorm.weight [C]  kv_b_proj.weight [N*(Dn+Dv), C]  o_proj.weight [H, N*Dv]
    {layer}.mlp.{gate,up,down}_proj.weight   norm.weight [H]   lm_head.weight [Vd, H]
    d2t [Vd] int64 (target id = draft id + d2t)   t2d [V] bool   embed_tokens.weight [V, H] (optional)

A drafter is one layer, so it is read whole (still one tensor at a time from disk).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from convert.safetensors_reader import CheckpointError, CheckpointReader
from convert.tensor_plan import FLOAT_DTYPES
from model.attention_mla import MLAWeights
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


def layer_prefix(reader: CheckpointReader) -> str:
    """`midlayer.` or `layers.0.`: whichever the checkpoint uses (an error if it holds both)."""
    names = reader.names()
    has = [p for p in ("midlayer.", "layers.0.") if any(n.startswith(p) for n in names)]
    if len(has) > 1:
        raise CheckpointError(f"{reader.index_path or reader.directory}: tensors under both 'midlayer.' and 'layers.0.' "
                              "(a drafter has one decoder layer)")
    return has[0] if has else "midlayer."


def _attention_tensors(cfg: DraftConfig, m: str, fl) -> list[DraftTensor]:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    a = m + "self_attn."
    if cfg.attention == "llama":
        nkv, d = cfg.num_key_value_heads, cfg.head_dim
        return [
            DraftTensor(a + "q_proj.weight", (n * d, 2 * h), fl),
            DraftTensor(a + "k_proj.weight", (nkv * d, 2 * h), fl),
            DraftTensor(a + "v_proj.weight", (nkv * d, 2 * h), fl),
            DraftTensor(a + "o_proj.weight", (h, n * d), fl),
        ]
    dk, dv, c, r, q = cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
    query = [DraftTensor(a + "q_proj.weight", (n * dk, 2 * h), fl)] if q is None else [
        DraftTensor(a + "q_a_proj.weight", (q, 2 * h), fl),
        DraftTensor(a + "q_a_layernorm.weight", (q,), fl),
        DraftTensor(a + "q_b_proj.weight", (n * dk, q), fl),
    ]
    return query + [
        DraftTensor(a + "kv_a_proj_with_mqa.weight", (c + r, 2 * h), fl),
        DraftTensor(a + "kv_a_layernorm.weight", (c,), fl),
        DraftTensor(a + "kv_b_proj.weight", (n * (cfg.qk_nope_head_dim + dv), c), fl),
        DraftTensor(a + "o_proj.weight", (h, n * dv), fl),
    ]


def draft_tensors(cfg: DraftConfig, has_reduced_vocab: bool, m: str = "midlayer.") -> list[DraftTensor]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    fl = frozenset(FLOAT_DTYPES)
    ht = cfg.target_hidden_size or h
    fc_norm = [DraftTensor(f"fc_norm.{i}.weight", (ht,), fl) for i in range(cfg.aux_count)] if cfg.fc_norm else []
    return [
        DraftTensor("fc.weight", (h, cfg.aux_width), fl),
        *fc_norm,
        DraftTensor(m + "input_layernorm.weight", (h,), fl),
        DraftTensor(m + "hidden_norm.weight", (h,), fl),
        DraftTensor(m + "post_attention_layernorm.weight", (h,), fl),
        *_attention_tensors(cfg, m, fl),
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
    for t in draft_tensors(cfg, reduced, layer_prefix(reader)):
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
    kind = "an Eagle3DeepseekV2ForCausalLM (MLA)" if cfg.attention == "mla" else "a LlamaForCausalLMEagle3"
    for name in reader.names():
        if name not in names and not name.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor '{name}' is unknown: not part of {kind} drafter with this config.json"
                + (" (fc_norm.* needs \"fc_norm\": true)" if name.startswith("fc_norm.") else "")
            )
    return names


def _mla_weights(f, cfg: DraftConfig, a: str, names: list[str]) -> MLAWeights:
    """HF MLA tensors -> the target's MLAWeights layout (per-head q_b / kv_b / o_proj, w_uk as [N, C, Dn])."""
    n, dn, dv, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_lora = a + "q_a_proj.weight" in names
    q_b = f(a + ("q_b_proj.weight" if q_lora else "q_proj.weight"))
    kv_b = f(a + "kv_b_proj.weight").reshape(n, dn + dv, c)
    return MLAWeights(
        q_a_proj=f(a + "q_a_proj.weight") if q_lora else None,
        q_a_norm=f(a + "q_a_layernorm.weight") if q_lora else None,
        q_b_proj=q_b.reshape(n, cfg.head_dim, q_b.shape[-1]),
        kv_a_proj=f(a + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=f(a + "kv_a_layernorm.weight"),
        w_uk=np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1)),
        w_uv=np.ascontiguousarray(kv_b[:, dn:]),
        o_proj=f(a + "o_proj.weight").reshape(cfg.hidden_size, n, dv),
    )


def build_draft(src, cfg: DraftConfig, names: list[str], dtype) -> DraftWeights:
    """Read the planned tensors into numpy DraftWeights (floats in `dtype`, d2t int32)."""
    dtype = np.dtype(dtype)

    def f(name):
        return src.get(name).astype(dtype, copy=False)

    m = "layers.0." if any(n.startswith("layers.0.") for n in names) else "midlayer."
    a = m + "self_attn."
    llama = cfg.attention == "llama"
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
        q_proj=f(a + "q_proj.weight") if llama else None,
        k_proj=f(a + "k_proj.weight") if llama else None,
        v_proj=f(a + "v_proj.weight") if llama else None,
        o_proj=f(a + "o_proj.weight") if llama else None,
        mlp=MLPWeights(gate=f(m + "mlp.gate_proj.weight"), up=f(m + "mlp.up_proj.weight"), down=f(m + "mlp.down_proj.weight")),
        final_norm=f("norm.weight"),
        lm_head=f("lm_head.weight") if "lm_head.weight" in names else None,
        embed=f("embed_tokens.weight") if "embed_tokens.weight" in names else None,
        d2t=d2t,
        mla=None if llama else _mla_weights(f, cfg, a, names),
        fc_norm=np.stack([f(f"fc_norm.{i}.weight") for i in range(cfg.aux_count)]) if cfg.fc_norm else None,
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
