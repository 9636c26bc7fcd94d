"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)); the dense layers and the shared expert."""

from __future__ import annotations

import jax
from flax import struct

from model.quant import Weight, linear


@struct.dataclass
class MLPWeights:
    gate: Weight  # [F, H]
    up: Weight  # [F, H]
    down: Weight  # [H, F]


def swiglu(x_BTH: jax.Array, w: MLPWeights) -> jax.Array:
    return linear(jax.nn.silu(linear(x_BTH, w.gate)) * linear(x_BTH, w.up), w.down)
