"""Mixture of experts: routed SwiGLU experts (bf16, INT4 or FP8) plus the shared expert.

Two plain-XLA reference paths compute the routed experts:
- gather: pull only the selected experts' weights (few tokens: decode, verify);
- dense: run every expert on every token and weight the results (many tokens: prefill), which reads
  each expert once instead of materializing T*K weight copies.
GPU kernels (bench/, issue 6) are held to these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.config import TextConfig
from model.mlp import MLPWeights, swiglu
from model.moe_parallel import routed_experts_parallel
from model.quant import Weight, dequantize, linear
from model.router import route


@struct.dataclass
class ExpertWeights:
    gate: Weight  # [E, F, H]
    up: Weight  # [E, F, H]
    down: Weight  # [E, H, F]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


@struct.dataclass
class MoEWeights:
    router: jax.Array  # [E, H] float32
    router_bias: jax.Array  # [E] float32 (e_score_correction_bias: used for choosing only)
    experts: ExpertWeights
    shared: MLPWeights | None


def experts_gather(x_TH: jax.Array, experts: ExpertWeights, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    dt = x_TH.dtype
    gate_TKFH = dequantize(experts.gate[ids_TK], dt)
    up_TKFH = dequantize(experts.up[ids_TK], dt)
    down_TKHF = dequantize(experts.down[ids_TK], dt)
    h_TKF = jax.nn.silu(jnp.einsum("th,tkfh->tkf", x_TH, gate_TKFH)) * jnp.einsum("th,tkfh->tkf", x_TH, up_TKFH)
    y_TKH = jnp.einsum("tkf,tkhf->tkh", h_TKF, down_TKHF)
    return jnp.einsum("tk,tkh->th", weights_TK.astype(dt), y_TKH)


def experts_dense(x_TH: jax.Array, experts: ExpertWeights, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    dt = x_TH.dtype
    t, e = x_TH.shape[0], experts.num_experts
    gate_EFH, up_EFH, down_EHF = (dequantize(m, dt) for m in (experts.gate, experts.up, experts.down))
    h_TEF = jax.nn.silu(jnp.einsum("th,efh->tef", x_TH, gate_EFH)) * jnp.einsum("th,efh->tef", x_TH, up_EFH)
    combine_TE = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], ids_TK].add(weights_TK)
    return jnp.einsum("te,tef,ehf->th", combine_TE.astype(dt), h_TEF, down_EHF)


def plain_routed_experts(x_TH: jax.Array, experts: ExpertWeights, ids_TK: jax.Array,
                         weights_TK: jax.Array) -> jax.Array:
    """The plain XLA paths: every expert on every token once the picks reach one per expert, else a gather."""
    plain = experts_dense if ids_TK.size >= experts.num_experts else experts_gather
    return plain(x_TH, experts, ids_TK, weights_TK)


def routed_experts(x_TH: jax.Array, experts: ExpertWeights, ids_TK: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Per-device dispatch: the fused Pallas MoE on GPU when the shapes fit, else a plain reference path."""
    from model.kernels import fused_moe_applies, fused_routed_experts  # lazy: the kernels import this module

    if fused_moe_applies(x_TH, experts):
        return fused_routed_experts(x_TH, experts, ids_TK, weights_TK)
    return plain_routed_experts(x_TH, experts, ids_TK, weights_TK)


def moe(x_BTH: jax.Array, w: MoEWeights, cfg: TextConfig, shared_stream: int | None = None) -> jax.Array:
    """Routed experts plus the shared expert. `shared_stream` (GPU): XLA runs the shared expert on that CUDA stream
    (`shared_expert`), where it may overlap the routing and the routed experts; measured no faster on the H200 (one
    K2.5 block: 97.4 against 95.9 us at one token, bench/results/README.md run 21), so the decoder leaves it off."""
    b, t, h = x_BTH.shape
    x_TH = x_BTH.reshape(b * t, h)
    weights_TK, ids_TK = route(x_TH, w.router, w.router_bias, cfg)
    y_TH = routed_experts_parallel(x_TH, w.experts, ids_TK, weights_TK)  # = routed_experts without a mesh
    if w.shared is not None:
        y_TH = y_TH + shared_expert(x_TH, w.shared, shared_stream)
    return y_TH.reshape(b, t, h)


def shared_expert(x_TH: jax.Array, shared: MLPWeights, stream: int | None = None) -> jax.Array:
    """The shared expert's SwiGLU; with `stream`, as a call that XLA places on GPU stream `stream` (jax's
    `compute_on("gpu_stream:N")`; other backends ignore the annotation): it needs neither the router nor the routed
    experts, so on a stream of its own it can stream its 88 MB while they wait on their launches and tails."""
    if stream is None:
        return swiglu(x_TH, shared)
    from jax.experimental import compute_on as jax_compute_on

    # jax 0.10 names the function form compute_on2 (its compute_on is a context manager); jax 0.11 compute_on
    on_stream = getattr(jax_compute_on, "compute_on2", None) or jax_compute_on.compute_on
    return on_stream(_swiglu_without_calls, compute_type=f"gpu_stream:{stream}",
                     out_memory_spaces=jax.memory.Space.Device)(x_TH, shared)


def _swiglu_without_calls(x_TH: jax.Array, w: MLPWeights) -> jax.Array:
    """`swiglu` with SiLU written out (jax.nn.silu is a jitted function of its own): XLA cannot place a call nested in
    a stream-annotated computation ("No ExecutionStreamId found", jax 0.11.2 on the H200). The same operations."""
    g = linear(x_TH, w.gate)
    return linear(g * jax.lax.logistic(g) * linear(x_TH, w.up), w.down)
