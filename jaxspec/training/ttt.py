"""EAGLE-3's training-time test: several draft steps unrolled over a whole sequence at once.

Step 0 at index t is the draft position the engine computes from verified data: token x[t+1] with the
target's aux states at t, at position t. Step k >= 1 at index t is the k-th position drafted ahead of a
chain rooted at t: token x[t+k+1] with h = the draft's own step k-1 output at t, at position t+k. Like
the engine's draft cache, it sees step-0 keys at positions <= t plus its own chain's keys (steps 1..k at
index t): step-0 keys causally, the chain's keys on the diagonal. The per-step math is model.eagle3's
draft layer; tests hold this unroll to a position-by-position `draft_forward` over a DraftCache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.eagle3 import DraftConfig, DraftWeights
from model.mlp import swiglu
from model.norms import rms_norm
from model.quant import linear
from model.rope import apply_neox, cos_sin, inv_frequencies


def shift_left(x_BT, k: int, fill=0):
    """y[:, t] = x[:, t + k] (positions past the end hold `fill`)."""
    if k == 0:
        return x_BT
    pad = jnp.full((x_BT.shape[0], k, *x_BT.shape[2:]), fill, x_BT.dtype)
    return jnp.concatenate([x_BT[:, k:], pad], axis=1)


def _chain_attention(q_BTNJD, k0_BSND, v0_BSND, chain_k, chain_v, scale):
    """Softmax over [step-0 keys at s <= t] + [this index's chain keys]; -> [B, T, K, G, D]."""
    t = q_BTNJD.shape[1]
    s0 = jnp.einsum("btkgd,bskd->bkgts", q_BTNJD, k0_BSND, preferred_element_type=jnp.float32) * scale
    causal_TS = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    s0 = jnp.where(causal_TS, s0, -jnp.inf)
    diag = [jnp.einsum("btkgd,btkd->bkgt", q_BTNJD, kj, preferred_element_type=jnp.float32) * scale for kj in chain_k]
    scores = jnp.concatenate([s0] + [d[..., None] for d in diag], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BTNJD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0_BSND)
    for j, vj in enumerate(chain_v):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + j], vj)
    return out


def ttt_unroll(w: DraftWeights, cfg: DraftConfig, embed_VH, tokens_BT, aux_BTA, steps: int):
    """-> list over steps of logits [B, T, Vd] (float32) over the draft vocabulary."""
    b, t = tokens_BT.shape
    n, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dt = embed_VH.dtype
    inv_freq = inv_frequencies(d, cfg.rope_theta, None)
    h_BTH = linear(aux_BTA.astype(dt), w.fc)
    head = w.lm_head
    k0 = v0 = None
    chain_k, chain_v, logits = [], [], []
    for k in range(steps):
        e_BTH = embed_VH[shift_left(tokens_BT, k + 1)]
        x = jnp.concatenate(
            [rms_norm(e_BTH, w.input_norm, cfg.rms_norm_eps), rms_norm(h_BTH, w.hidden_norm, cfg.rms_norm_eps)], axis=-1
        )
        cos, sin = cos_sin(jnp.broadcast_to(jnp.arange(t) + k, (b, t)), inv_freq)
        q_BTND = apply_neox(linear(x, w.q_proj).reshape(b, t, n, d), cos, sin)
        k_BTND = apply_neox(linear(x, w.k_proj).reshape(b, t, nkv, d), cos, sin)
        v_BTND = linear(x, w.v_proj).reshape(b, t, nkv, d)
        if k == 0:
            k0, v0 = k_BTND, v_BTND
        else:
            chain_k.append(k_BTND)
            chain_v.append(v_BTND)
        ctx = _chain_attention(q_BTND.reshape(b, t, nkv, n // nkv, d), k0, v0, chain_k, chain_v, d**-0.5)
        residual = h_BTH + linear(ctx.reshape(b, t, n * d), w.o_proj)
        h_BTH = residual + swiglu(rms_norm(residual, w.post_attention_norm, cfg.rms_norm_eps), w.mlp)
        normed = rms_norm(h_BTH, w.final_norm, cfg.rms_norm_eps)
        logits.append(jnp.einsum("bth,vh->btv", normed, head.astype(dt), preferred_element_type=jnp.float32))
    return logits
