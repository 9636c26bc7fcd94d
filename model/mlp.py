"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)); the dense layers and the shared expert."""

from __future__ import annotations

import jax
from flax import struct
from jax.sharding import PartitionSpec as P

from model.kernels import target
from model.kernels.dispatch import norm_gemv_applies
from model.kernels.norm_gemv import norm_gemv
from model.quant import Weight, linear
from model.shard_local import axis_of, per_device_replicated, shard_map_unchecked, sharded_mesh


@struct.dataclass
class MLPWeights:
    gate: Weight  # [F, H]
    up: Weight  # [F, H]
    down: Weight  # [H, F]


def swiglu(x_BTH: jax.Array, w: MLPWeights) -> jax.Array:
    return linear(jax.nn.silu(linear(x_BTH, w.gate)) * linear(x_BTH, w.up), w.down)


def normed_swiglu_hidden(x_BTH: jax.Array, residual_BTH: jax.Array, norm_H: jax.Array, w: MLPWeights, cfg, *,
                         ffn_split: bool = True):
    """silu(gate(n)) * up(n) [T, F] for n = rms_norm(x + residual, norm), gate and up in one launch of the norm +
    projection kernel where it applies (`model.kernels.dispatch.norm_gemv_applies`: a few tokens), else None (the
    caller's XLA add, norm and `swiglu`). `cfg`: the model's (TextConfig) or a drafter's (DraftConfig): its kernels
    and rms_norm_eps. Under a mesh each device projects onto the rows of F it holds where gate and up are split
    over F (`ffn_split`: the target's, model.sharding.TARGET_RULES), onto all of them where every device holds them
    whole (the draft's), so that no collective is added either way."""
    b, t, h = x_BTH.shape
    if not norm_gemv_applies(cfg.kernels, b, t, (w.gate, w.up)):
        return None

    def hidden(x_TH, residual_TH, norm_H, gate_FH, up_FH):
        f = gate_FH.shape[0]
        gu_TX = norm_gemv(x_TH, norm_H, (gate_FH, up_FH), cfg.rms_norm_eps, residual_TH=residual_TH,
                          interpret=target.interpret())
        return jax.nn.silu(gu_TX[:, :f]) * gu_TX[:, f:]  # swiglu's products, in the activations' dtype

    args = (x_BTH.reshape(b * t, h), residual_BTH.reshape(b * t, h), norm_H, w.gate, w.up)
    mesh = sharded_mesh()
    if mesh is None or not ffn_split:
        return per_device_replicated(hidden, *args)
    f_ax = axis_of("ffn", w.gate.shape[0], mesh)
    return shard_map_unchecked(hidden, mesh, (P(), P(), P(), P(f_ax, None), P(f_ax, None)), P(None, f_ax))(*args)
