"""Compiled programs kept on disk between runs of the entry points (JAX's persistent compilation cache), so a second
`python -m jaxspec.generate` or `python -m jaxspec.serve` on the same model, shapes and flags loads its programs
instead of compiling them again.

Where: $JAXSPEC_COMPILE_CACHE (a directory, or `off`), by default ~/.cache/jaxspec/xla-compile ($XDG_CACHE_HOME is
honoured). A cache the user gave JAX itself (JAX_COMPILATION_CACHE_DIR, or `jax.config` set before) is left as it
is. JAX keys each entry by the program, its compile options, the XLA flags, the devices and jaxlib's version, so a
changed model, flag or jaxlib compiles anew, and it keeps only programs whose compilation took a second or more. A
directory that cannot be created leaves the cache off: the run compiles as it would without one. The library
(`jaxspec.engine.Engine`) never turns it on by itself.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPILE_CACHE_ENV = "JAXSPEC_COMPILE_CACHE"


def compile_cache_dir(environ=os.environ) -> Path | None:
    """$JAXSPEC_COMPILE_CACHE (None if it is empty or 'off'), else the user cache's jaxspec/xla-compile."""
    chosen = environ.get(COMPILE_CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off") else Path(chosen).expanduser()
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxspec" / "xla-compile"


def enable(environ=os.environ) -> Path | None:
    """Point JAX's persistent compilation cache at `compile_cache_dir` (created) unless JAX already has one; the
    directory in use, or None. Call it before the process compiles anything: JAX settles its cache at the first
    compilation."""
    import jax  # noqa: PLC0415 - the entry points import this before JAX, to answer --help quickly

    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    path = compile_cache_dir(environ)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: every run compiles, as without a cache
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
