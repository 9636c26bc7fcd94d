"""Benchmarks: decode / verify / speculative cycle against their byte floors (`python -m bench.step`)."""

# the benchmarks time the engine as it runs: with its XLA flags (a flag set in XLA_FLAGS stays as set)
from jaxspec import xla_flags as _xla_flags  # noqa: E402

_xla_flags.apply()
