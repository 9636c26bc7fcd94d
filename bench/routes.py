"""Record each MoE layer's router ids while a program is traced, for byte floors and agreement checks.

The recorder wraps `model.moe.route` at trace time only: the jitted program returns the ids it recorded as an
extra output of that very step, so a floor counts the experts this step selected. It observes; it selects no
kernel (kernels are chosen by `model.config.Kernels` on the config a program is traced with).
"""

from __future__ import annotations

import contextlib

import model.moe as moe_module


@contextlib.contextmanager
def record_routes(recorder: list):
    """Append each MoE layer's global router ids [T, K] to `recorder` where `model.moe.moe` routes (outside the
    expert-parallel shard_map, so sharded programs record global ids too)."""
    saved = moe_module.route

    def recorded(*args, **kwargs):
        weights_TK, ids_TK = saved(*args, **kwargs)
        recorder.append(ids_TK)
        return weights_TK, ids_TK

    moe_module.route = recorded
    try:
        yield
    finally:
        moe_module.route = saved
