"""jaxspec: EAGLE-3 speculative decoding for the Kimi K2 family on JAX.

Importing the package sets the engine's XLA flags (`jaxspec.xla_flags`) before JAX starts its backend."""

from jaxspec import xla_flags as _xla_flags

_xla_flags.apply()
