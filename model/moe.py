"""Mixture of experts: routed SwiGLU experts (bf16, INT4 or FP8) plus the shared expert.

Two plain-XLA reference paths compute the routed experts:
- gather: pull only the selected experts' weights (few tokens: decode, verify);
- dense: run every expert on every token and weight the results (many tokens: prefill), which reads
  each expert once instead of materializing T*K weight copies.
The GPU kernels (model/kernels/, chosen by `model.kernels.dispatch` from the config's `Kernels`) are held to these.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from model.config import Kernels, TextConfig
from model.kernels.dispatch import fused_routed_experts, moe_kernel_for
from model.mlp import MLPWeights, swiglu
from model.moe_parallel import local_choices, routed_experts_parallel
from model.quant import Weight, dequantize
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
    router: jax.Array  # [E, H] as the checkpoint stores it (Kimi: bf16); the logits are float32 from it
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


def routed_experts(x_TH: jax.Array, experts: ExpertWeights, ids_TK: jax.Array, weights_TK: jax.Array,
                   kernels: Kernels = Kernels(), first_expert=None) -> jax.Array:
    """Per-device routed experts: the GPU kernel `kernels` and the shapes select, else a plain reference path.

    `first_expert`: the ids are global and `experts` this device's, [first_expert, first_expert + E) (expert
    parallelism, model.moe_parallel): moe_wgmma keeps to them itself, every other path is given the choices
    restricted to them (`local_choices`)."""
    kernel = moe_kernel_for(x_TH.shape[0], experts, kernels)
    if first_expert is not None and kernel != "wgmma":
        ids_TK, weights_TK = local_choices(ids_TK, weights_TK, first_expert, experts.num_experts)
        first_expert = None
    if kernel is not None:
        return fused_routed_experts(x_TH, experts, ids_TK, weights_TK, kernel, first_expert)
    return plain_routed_experts(x_TH, experts, ids_TK, weights_TK)


def moe(x_BTH: jax.Array, w: MoEWeights, cfg: TextConfig,
        expert_ids_TK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Routed experts (expert-parallel over the ambient mesh, if any) plus the shared expert: (output [B, T, H], the
    experts each token ran [B*T, K]).

    `expert_ids_TK` replaces the router's choices (each slot keeps the router's weight for that slot): benchmarks
    time the kernels at routings a random model does not produce (`bench.routes`)."""
    b, t, h = x_BTH.shape
    x_TH = x_BTH.reshape(b * t, h)
    weights_TK, ids_TK = route(x_TH, w.router, w.router_bias, cfg)
    if expert_ids_TK is not None:
        ids_TK = expert_ids_TK.astype(ids_TK.dtype)
    per_device = functools.partial(routed_experts, kernels=cfg.kernels)
    y_TH = routed_experts_parallel(x_TH, w.experts, ids_TK, weights_TK, per_device)
    if w.shared is not None:
        y_TH = y_TH + swiglu(x_TH, w.shared)
    return y_TH.reshape(b, t, h), ids_TK
