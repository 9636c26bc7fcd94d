"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)); the dense layers and the shared expert."""

from __future__ import annotations

import jax
from flax import struct

from model.norms import NormScale
from model.quant import Weight, linear


@struct.dataclass
class MLPWeights:
    gate: Weight  # [F, H]
    up: Weight  # [F, H]
    down: Weight  # [H, F]


def swiglu(x_BTH: jax.Array, w: MLPWeights, norm_scale: NormScale | None = None) -> jax.Array:
    """`norm_scale`: where given, x_BTH is a norm's first factor and this its second (`model.norms.rms_norm_factors`):
    gate and up scale their outputs by it."""
    return linear(jax.nn.silu(linear(x_BTH, w.gate, norm_scale)) * linear(x_BTH, w.up, norm_scale), w.down)
