"""The platform a program's kernels are chosen and lowered for.

Normally the default backend's: a program traced on a GPU takes the GPU kernels, on a CPU their plain references
(or Pallas' interpret mode where a kernel is forced). `compiling_for` names another target for the programs traced
inside it, for a host that builds a GPU program without running it: lowering for CUDA on a CPU-only machine, and
compiling ahead of time against a GPU's description (bench.labs.gpu_census counts a program's kernels that way).
The dispatch (model.kernels.dispatch) and the kernels' interpret switch read it at trace time only.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax


class Target(NamedTuple):
    platform: str  # "gpu", "cpu", "tpu": what jax.default_backend() would say on the target
    compute_capability: str = ""  # a GPU's, e.g. "9.0" for Hopper


_NAMED: contextvars.ContextVar[Target | None] = contextvars.ContextVar("jaxspec_compile_target", default=None)


def platform() -> str:
    """The target's platform: the one `compiling_for` names, else the default backend."""
    named = _NAMED.get()
    return named.platform if named is not None else jax.default_backend()


def compute_capability() -> str:
    """The target GPU's compute capability ("" off a GPU)."""
    named = _NAMED.get()
    if named is not None:
        return named.compute_capability if named.platform == "gpu" else ""
    dev = jax.devices()[0]
    return str(getattr(dev, "compute_capability", "")) if dev.platform == "gpu" else ""


def on_hopper() -> bool:
    """The target is a Hopper GPU (sm_90: the Mosaic GPU kernels' TMA and WGMMA)."""
    return platform() == "gpu" and compute_capability().startswith("9")


def interpret() -> bool:
    """Pallas kernels run in interpret mode (off a GPU target)."""
    return platform() != "gpu"


@contextlib.contextmanager
def compiling_for(platform_name: str, compute_capability_name: str = ""):
    """Trace the programs inside for another target than this host's default backend (see the module's doc).
    JAX caches traces by their arguments, not by this target: a function traced under it should not be reused
    outside it (jax.clear_caches() after, where the same functions run on the host too)."""
    if platform_name not in ("gpu", "cpu", "tpu"):
        raise ValueError(f"compiling_for: platform {platform_name!r} is not one of gpu, cpu, tpu")
    token = _NAMED.set(Target(platform_name, compute_capability_name))
    try:
        yield
    finally:
        _NAMED.reset(token)
