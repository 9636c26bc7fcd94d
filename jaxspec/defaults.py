"""Defaults shared by the entry points (`jaxspec.generate`, `jaxspec.plan`, the benchmark notebook), so that they
describe the same run."""

from __future__ import annotations

# Draft tokens per cycle K when the user names none.
DEFAULT_NUM_STEPS = 4

# Activation dtype per backend: on GPUs bf16 halves the bytes every step reads; XLA:CPU has no fast bf16 matmul
# and upcasts around each one, so float32 is faster there as well as exact.
DTYPE_BY_BACKEND = {"cpu": "float32"}
DEFAULT_ACCELERATOR_DTYPE = "bfloat16"


def default_dtype(backend: str) -> str:
    """The activation dtype for `backend` (jax.default_backend(): 'cpu', 'gpu', 'tpu')."""
    return DTYPE_BY_BACKEND.get(backend, DEFAULT_ACCELERATOR_DTYPE)


# Adaptive speculation (the draft length chosen as it runs, K = 0 included) is the default on every backend; each
# backend takes the kind that costs least there. On a CPU a cycle is compute-bound, so a verify of K + 1 tokens costs
# about as many plain steps: the per-cycle program (jaxspec.adaptive) falls back to plain steps and back, and costs
# what plain decoding costs. On GPUs that program's switch makes every cycle dearer than the fixed-K program's
# (docs/performance.md, "Adaptive speculation"), so K changes between calls of fixed-K programs instead
# (jaxspec.adaptive_calls), where a change pays for the extra call.
ADAPTIVE_KIND_BY_BACKEND = {"cpu": "per_cycle"}
DEFAULT_ADAPTIVE_KIND = "per_call"
ADAPTIVE_KINDS = ("per_call", "per_cycle")


def default_adaptive_kind(backend: str) -> str:
    """How adaptive speculation chooses K on `backend`: "per_call" or "per_cycle"."""
    return ADAPTIVE_KIND_BY_BACKEND.get(backend, DEFAULT_ADAPTIVE_KIND)
