"""XLA flags the engine sets before JAX starts its backend (XLA reads XLA_FLAGS once, when the backend starts).

- `--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`: XLA records a step's kernels into a CUDA graph with edges
  only where kernels share buffers, so independent kernels (a layer's shared expert beside its routed experts)
  may overlap. The default, LHS, chains them in the latency-hiding scheduler's order. On the H200 it is faster at
  every B=1 1k step and gives bit-identical tokens and logits (`python -m bench.labs.graph_mode_check`; the
  figures are in docs/performance.md).
- `--xla_gpu_per_fusion_autotune_cache_dir=DIR`: XLA's autotuner picks each GEMM's kernel by timing candidates,
  so two processes can compile different kernels and round differently: greedy decoding of the same prompt then
  diverged between processes (on a random model, from the tenth token on). With the choices kept in DIR every run
  on the machine compiles the first run's kernels (and skips the autotuning). DIR is $JAXSPEC_AUTOTUNE_CACHE, by
  default ~/.cache/jaxspec/xla-autotune/jaxlib-<version> ($XDG_CACHE_HOME is honoured) where a GPU backend can
  start (a JAX GPU plugin is installed and JAX_PLATFORMS, if set, names a GPU platform): a CPU-only machine gets no
  directory. JAXSPEC_AUTOTUNE_CACHE=off leaves the autotuner to each process, as does a directory that cannot be
  created or whose path holds whitespace (XLA_FLAGS is split on it).

A flag already in XLA_FLAGS is left as the user set it. On a CPU both flags change nothing. Importing `jaxspec` (or
`bench`) applies them, so that must happen before the first JAX computation; otherwise `apply` warns that they
did not take effect.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import sys
import warnings
from importlib import metadata
from pathlib import Path

SCHEDULING_FLAG = "--xla_gpu_command_buffer_scheduling_mode"
AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
AUTOTUNE_CACHE_ENV = "JAXSPEC_AUTOTUNE_CACHE"
GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def _has_flag(xla_flags: str, flag: str) -> bool:
    return any(f == flag or f.startswith(flag + "=") for f in xla_flags.split())


def jax_gpu_plugin_installed() -> bool:
    """Whether a JAX GPU plugin (jax-cuda*-plugin, jax-rocm*-plugin) is installed, found the way JAX finds plugins
    (the `jax_plugins` entry points and namespace package) without importing JAX."""
    if any(ep.name for ep in metadata.entry_points(group="jax_plugins")):
        return True
    spec = importlib.util.find_spec("jax_plugins")
    return bool(spec and spec.submodule_search_locations
                and any(pkgutil.iter_modules(spec.submodule_search_locations)))


def gpu_backend_possible(environ=os.environ) -> bool:
    """Whether JAX may start a GPU backend in this process: JAX_PLATFORMS names one, or it is unset and a GPU plugin
    is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms.strip():
        return any(p.strip() in GPU_PLATFORMS for p in platforms.split(","))
    return jax_gpu_plugin_installed()


def default_autotune_cache_dir(environ=os.environ) -> Path | None:
    """Where autotune choices are kept: $JAXSPEC_AUTOTUNE_CACHE, None if it is 'off'; else, where a GPU backend can
    start, under the user cache, one directory per jaxlib version (another XLA may time and name its candidates
    differently); else None (XLA:CPU does not autotune)."""
    chosen = environ.get(AUTOTUNE_CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off") else Path(chosen).expanduser()
    if not gpu_backend_possible(environ):
        return None
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        version = "unknown"
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxspec" / "xla-autotune" / f"jaxlib-{version}"


def engine_xla_flags(xla_flags: str, autotune_cache_dir: Path | None) -> str:
    """`xla_flags` with the engine's flags added where the user set none."""
    flags = xla_flags.split()
    if not _has_flag(xla_flags, SCHEDULING_FLAG):
        flags.append(f"{SCHEDULING_FLAG}=CONCURRENT")
    if autotune_cache_dir is not None and not _has_flag(xla_flags, AUTOTUNE_CACHE_FLAG):
        flags.append(f"{AUTOTUNE_CACHE_FLAG}={autotune_cache_dir}")
    return " ".join(flags)


def apply(environ=os.environ) -> str:
    """Set the engine's flags in environ["XLA_FLAGS"] (creating the autotune cache directory; without one if it
    cannot be created) and return the new value."""
    cache_dir = default_autotune_cache_dir(environ)
    if cache_dir is not None and any(c.isspace() for c in str(cache_dir)):
        cache_dir = None  # XLA_FLAGS is split on whitespace: JAXSPEC_AUTOTUNE_CACHE can name another directory
    if cache_dir is not None and not _has_flag(environ.get("XLA_FLAGS", ""), AUTOTUNE_CACHE_FLAG):
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: runs stay correct, only their GEMM choices may differ
            cache_dir = None
    before = environ.get("XLA_FLAGS", "")
    environ["XLA_FLAGS"] = engine_xla_flags(before, cache_dir)
    if environ["XLA_FLAGS"] != before and backend_started():
        warnings.warn("jaxspec: JAX's backend started before jaxspec was imported, so XLA did not read the engine's "
                      f"flags ({environ['XLA_FLAGS']}); import jaxspec first for CONCURRENT graph scheduling and "
                      "reproducible GEMM choices", stacklevel=2)
    return environ["XLA_FLAGS"]


def backend_started() -> bool:
    """Whether JAX's backend has started (XLA has read XLA_FLAGS); False if JAX is not even imported."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bool(started and started())
