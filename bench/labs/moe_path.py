"""Swap the routed-experts implementation that `model.moe.moe` calls, and record each layer's router ids.

Used at trace time only: the jitted step keeps whatever path it was traced with, and the recorded ids
come back as an output of that same step, so the byte floor uses the experts this very step selected.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import model.moe as moe_module

# model.moe may call either name (the engine's GPU dispatch); patch whichever exist
_NAMES = ("routed_experts", "routed_experts_for_backend")


# the plain XLA reference paths (not model.moe.routed_experts, which dispatches to the GPU kernel; moe_path
# patches that name, not this one)
PLAIN_ROUTED_EXPERTS = moe_module.plain_routed_experts


@contextlib.contextmanager
def moe_path(impl: Callable, recorder: list | None = None):
    def recorded(x_TH, experts, ids_TK, weights_TK):
        if recorder is not None:
            recorder.append(ids_TK)
        return impl(x_TH, experts, ids_TK, weights_TK)

    saved = {n: getattr(moe_module, n) for n in _NAMES if hasattr(moe_module, n)}
    for n in saved:
        setattr(moe_module, n, recorded)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(moe_module, n, f)


@contextlib.contextmanager
def record_routes(recorder: list):
    """Record each MoE layer's global router ids [T, K] where `model.moe.moe` routes, outside the expert-parallel
    shard_map (under a mesh, `moe_path`'s recorder would see each device's local ids)."""
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


@contextlib.contextmanager
def moe_path_recording(impl: Callable, recorder: list, sharded: bool):
    """`moe_path(impl)`, recording each MoE layer's router ids [T, K] into `recorder`: where the experts are
    called in a one-device program, where the router runs in a sharded one (`record_routes`: global ids)."""
    record = record_routes(recorder) if sharded else contextlib.nullcontext()
    with moe_path(impl, None if sharded else recorder), record:
        yield
