"""EAGLE-3 draft model, compatible with `LlamaForCausalLMEagle3` checkpoints (SGLang / SpecForge).

One Llama decoder layer whose input is cat(input_layernorm(embed(token)), hidden_norm(h)) (width 2H),
where h is fc(target aux states [3H]) for a position the target has verified, or the draft's own
previous output [H] while drafting ahead. Logits are over a reduced draft vocabulary mapped to target
ids by d2t (target = draft + d2t[draft]).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from model.config import ConfigError
from model.kv_cache import visible_slots, write_slots
from model.mlp import MLPWeights, swiglu
from model.norms import rms_norm
from model.quant import linear
from model.rope import apply_neox, cos_sin, inv_frequencies


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
    aux_layer_ids: tuple[int, ...] | None  # eagle_config.eagle_aux_hidden_state_layer_ids
    target_hidden_size: int | None = None  # width of each aux state (= hidden_size for known drafters)
    max_position_embeddings: int = 2048

    @property
    def aux_width(self) -> int:
        n = 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)
        return n * (self.target_hidden_size or self.hidden_size)


def draft_config_from_dict(d: dict, where: str = "config.json") -> DraftConfig:
    archs = d.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise ConfigError(f"{where}: architectures={archs!r} is not an EAGLE-3 drafter (LlamaForCausalLMEagle3)")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"{where}: unsupported num_hidden_layers={d['num_hidden_layers']} (EAGLE-3 drafters have 1)")
    rs = d.get("rope_scaling")
    if rs and rs.get("type", rs.get("rope_type", "default")) not in ("default", None):
        raise ConfigError(f"{where}: unsupported rope_scaling={rs!r} for the draft (plain rope only)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act={d['hidden_act']!r} (silu only)")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in d:
            raise ConfigError(f"{where}: missing key '{key}'")
    eagle = d.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state=false (EAGLE-1/2 drafters) is not supported")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    h, n = int(d["hidden_size"]), int(d["num_attention_heads"])
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return DraftConfig(
        hidden_size=h,
        num_attention_heads=n,
        num_key_value_heads=int(d.get("num_key_value_heads") or n),
        head_dim=int(d.get("head_dim") or h // n),
        intermediate_size=int(d["intermediate_size"]),
        vocab_size=int(d["vocab_size"]),
        draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
        rope_theta=float(theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        target_hidden_size=d.get("target_hidden_size"),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
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
    fc: jax.Array  # [H, 3 * H_target]
    input_norm: jax.Array  # [H] on the token embedding
    hidden_norm: jax.Array  # [H] on h
    post_attention_norm: jax.Array  # [H]
    q_proj: jax.Array  # [N * D, 2H]
    k_proj: jax.Array  # [Nkv * D, 2H]
    v_proj: jax.Array  # [Nkv * D, 2H]
    o_proj: jax.Array  # [H, N * D]
    mlp: MLPWeights
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [Vd, H]; None: the target's lm_head (then Vd = V)
    embed: jax.Array | None  # [V, H]; None: the target's embeddings
    d2t: jax.Array | None  # [Vd] int32 offsets: target id = draft id + d2t[draft id]; None: identity


@struct.dataclass
class DraftCache:
    # Head-major: the attention's dots batch over (b, kv head), and with a [B, S, Nkv, D] cache XLA's GPU layout
    # put a transpose of the whole cache in and out of every dispatch (at long contexts and large batches, more
    # time than the cycle's own work). A device loop pays them once per loop; synchronised and streamed cycles
    # paid them every cycle.
    k: jax.Array  # [B, Nkv, S, D]
    v: jax.Array  # [B, Nkv, S, D]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_draft_cache(cfg: DraftConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> DraftCache:
    shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return DraftCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class DraftOutput(NamedTuple):
    logits: jax.Array  # [B, T, Vd] float32 over the draft vocabulary
    hidden: jax.Array  # [B, T, H]: pre-norm output, the next step's h
    cache: DraftCache


def draft_to_target_ids(w: DraftWeights, draft_ids: jax.Array) -> jax.Array:
    if w.d2t is None:
        return draft_ids
    return draft_ids + w.d2t[draft_ids]


def _attention(x_BT2H, w: DraftWeights, cfg: DraftConfig, positions_BT, cache: DraftCache):
    b, t, _ = x_BT2H.shape
    n, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = cos_sin(positions_BT, inv_frequencies(d, cfg.rope_theta, None))
    q_BTND = apply_neox(linear(x_BT2H, w.q_proj).reshape(b, t, n, d), cos, sin)
    k_BTKD = apply_neox(linear(x_BT2H, w.k_proj).reshape(b, t, nkv, d), cos, sin)
    v_BTKD = linear(x_BT2H, w.v_proj).reshape(b, t, nkv, d)
    k_cache = write_slots(cache.k, k_BTKD, positions_BT, slot_axis=2)
    v_cache = write_slots(cache.v, v_BTKD, positions_BT, slot_axis=2)
    q_BTKGD = q_BTND.reshape(b, t, nkv, n // nkv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BTKGD, k_cache.astype(q_BTND.dtype), preferred_element_type=jnp.float32)
    mask = visible_slots(positions_BT, k_cache.shape[2])[:, None, None]
    probs = jax.nn.softmax(jnp.where(mask, scores * d**-0.5, -jnp.inf), axis=-1).astype(q_BTND.dtype)
    out_BTKGD = jnp.einsum("bkgts,bksd->btkgd", probs, v_cache.astype(q_BTND.dtype))
    return linear(out_BTKGD.reshape(b, t, n * d), w.o_proj), DraftCache(k_cache, v_cache)


def draft_forward(
    w: DraftWeights,
    cfg: DraftConfig,
    target_embed: jax.Array,
    target_lm_head: jax.Array,
    tokens_BT: jax.Array,
    h_BTX: jax.Array,
    positions_BT: jax.Array,
    cache: DraftCache,
) -> DraftOutput:
    """Draft positions: token x[t+1] paired with h at t (aux states [3H] or the draft's own output [H])."""
    embed = target_embed if w.embed is None else w.embed
    e_BTH = embed[tokens_BT]
    dt = e_BTH.dtype
    h_BTH = linear(h_BTX.astype(dt), w.fc) if h_BTX.shape[-1] != cfg.hidden_size else h_BTX.astype(dt)
    residual = h_BTH
    x = jnp.concatenate(
        [rms_norm(e_BTH, w.input_norm, cfg.rms_norm_eps), rms_norm(h_BTH, w.hidden_norm, cfg.rms_norm_eps)], axis=-1
    )
    attn, cache = _attention(x, w, cfg, positions_BT, cache)
    residual = residual + attn
    out_BTH = residual + swiglu(rms_norm(residual, w.post_attention_norm, cfg.rms_norm_eps), w.mlp)
    head = target_lm_head if w.lm_head is None else w.lm_head
    normed = rms_norm(out_BTH, w.final_norm, cfg.rms_norm_eps)
    logits = jnp.einsum("bth,vh->btv", normed, head.astype(dt), preferred_element_type=jnp.float32)
    return DraftOutput(logits, out_BTH, cache)
