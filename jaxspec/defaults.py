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


# Adaptive speculation (the draft length chosen per cycle, K = 0 included) per backend, when the user asks for
# neither it nor a fixed K. On a CPU a cycle is compute-bound, so a verify of K + 1 tokens costs about as many plain
# steps and every fixed K ran slower than plain decoding on the embedded model; the adaptive program costs about
# what plain decoding costs there and falls back to plain steps, at the price of compiling every branch and
# timing them at start-up. On GPUs the adaptive program's own launch cost is larger than what its choices saved
# on the models measured, so fixed K stays the default (docs/performance.md, "Adaptive speculation").
ADAPTIVE_BY_BACKEND = {"cpu": True}


def default_adaptive(backend: str) -> bool:
    """Whether `generate` speculates adaptively on `backend` unless told (--[no-]speculative-adaptive)."""
    return ADAPTIVE_BY_BACKEND.get(backend, False)
