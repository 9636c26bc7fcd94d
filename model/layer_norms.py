"""The decoder's RMSNorms, each with the residual add before it: the plain form (model.norms.add_rms_norm) or, where
`model.kernels.dispatch.norm_kernel_applies` says so, the fused kernel (model/kernels/rms_norm.py), which also runs
several norms of the same rows (MLA's q_a and kv_a norms) in one launch."""

from __future__ import annotations

import math

import jax

from model.config import Kernels
from model.kernels.dispatch import norm_kernel_applies
from model.kernels.rms_norm import NormJob, fused_rms_norms
from model.norms import add_rms_norm

__all__ = ["NormJob", "layer_norms"]


def layer_norms(jobs: tuple[NormJob, ...], eps: float, kernels: Kernels):
    """Per job (x + addend or None without an addend, the RMSNorm of its first W columns); the jobs' rows x [.., I]
    share their leading dims."""
    lead = jobs[0].x_XI.shape[:-1]
    rows = math.prod(lead)
    if not norm_kernel_applies(kernels, rows):
        return tuple(add_rms_norm(*job, eps) for job in jobs)
    flat = lambda a: None if a is None else a.reshape(rows, a.shape[-1])  # noqa: E731
    outs = fused_rms_norms(tuple(NormJob(flat(j.x_XI), flat(j.addend_XI), j.weight_W) for j in jobs), eps,
                           jax.default_backend() != "gpu")
    unflat = lambda a: None if a is None else a.reshape(*lead, a.shape[-1])  # noqa: E731
    return tuple((unflat(total), unflat(normed)) for total, normed in outs)
