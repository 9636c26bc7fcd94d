"""DeepSeek-V3's auxiliary-loss-free load balancing: after each step, nudge every routed expert's
selection bias (e_score_correction_bias) toward the mean load by a fixed step `gamma * sign(...)`.

The decoder does not report routing, so the loads are recomputed from the residual stream it taps
(`aux_hidden` with every layer listed): for MoE layer i, redo its attention on layer i's input and route.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.attention_mla import mla
from model.config import TextConfig
from model.decoder import KimiWeights
from model.kv_cache import init_latent_cache
from model.moe import MoEWeights
from model.norms import rms_norm
from model.rope import cos_sin, target_rope_tables
from model.router import route


def expert_loads(w: KimiWeights, cfg: TextConfig, tokens_BT, layer_outputs_BTX) -> jax.Array:
    """[num MoE layers, E] tokens routed to each expert; `layer_outputs_BTX` is [B, T, L*H] (every layer's output)."""
    b, t = tokens_BT.shape
    h = cfg.hidden_size
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = cos_sin(positions_BT, *target_rope_tables(cfg))
    empty = init_latent_cache(cfg, b, t, layer_outputs_BTX.dtype)
    loads = []
    for i, lw in enumerate(w.layers):
        if not isinstance(lw.mlp, MoEWeights):
            continue
        x_BTH = w.embed[tokens_BT] if i == 0 else layer_outputs_BTX[..., (i - 1) * h : i * h]
        attn_BTH, _, _ = mla(rms_norm(x_BTH, lw.input_norm, cfg.rms_norm_eps), lw.attn, cfg, cos, sin,
                             positions_BT, empty.latent[i], empty.k_rope[i])
        mid_TH = rms_norm(x_BTH + attn_BTH, lw.post_attention_norm, cfg.rms_norm_eps).reshape(b * t, h)
        _, ids_TK = route(mid_TH, lw.mlp.router, lw.mlp.router_bias, cfg)
        loads.append(jnp.zeros((cfg.n_routed_experts,), jnp.float32).at[ids_TK.reshape(-1)].add(1.0))
    return jnp.stack(loads)


def rebalance_biases(w: KimiWeights, loads_LE: jax.Array, gamma: float) -> KimiWeights:
    """bias += gamma * sign(mean load - load): overloaded experts get chosen less often next step."""
    layers, j = [], 0
    for lw in w.layers:
        if isinstance(lw.mlp, MoEWeights):
            load_E = loads_LE[j]
            bias = lw.mlp.router_bias + gamma * jnp.sign(load_E.mean() - load_E)
            lw = lw.replace(mlp=lw.mlp.replace(router_bias=bias))
            j += 1
        layers.append(lw)
    return w.replace(layers=tuple(layers))


def load_imbalance(loads_LE: jax.Array) -> jax.Array:
    """Max over layers of (busiest expert's load / mean load): 1.0 is perfect balance."""
    return jnp.max(loads_LE.max(-1) / jnp.maximum(loads_LE.mean(-1), 1e-9))
