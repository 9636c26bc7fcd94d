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


# Adaptive speculation (the draft length chosen as it runs, K = 0 included) is the default on every backend, and on
# every backend it changes K between calls of fixed-K programs (jaxspec.adaptive_calls): a call's cycle is the
# fixed-K program's, and plain decoding, once chosen, is plain decoding's own loop. The per-cycle program
# (jaxspec.adaptive, `--speculative-adaptive-kind per_cycle`) holds every K behind a switch in one loop and probes
# the other K from its plain steps: on GPUs the switch makes every cycle dearer than the fixed-K program's, and on a
# CPU, where a cycle is compute-bound and speculation seldom pays, its probes ran below plain decoding where the
# drafter accepts much but not enough (docs/performance.md, "Adaptive speculation", "On a CPU").
ADAPTIVE_KIND_BY_BACKEND: dict[str, str] = {}
DEFAULT_ADAPTIVE_KIND = "per_call"
ADAPTIVE_KINDS = ("per_call", "per_cycle")


def default_adaptive_kind(backend: str) -> str:
    """How adaptive speculation chooses K on `backend`: "per_call" or "per_cycle"."""
    return ADAPTIVE_KIND_BY_BACKEND.get(backend, DEFAULT_ADAPTIVE_KIND)
