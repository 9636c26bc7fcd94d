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
