"""Every test process sees 8 simulated CPU devices (set before jax is imported), its programs compiled without
LLVM's expensive optimizations, and one test run shares one persistent XLA compilation cache."""

import os
import shutil
import tempfile

# The tiny test models spend far longer compiling than running: LLVM at -O0 compiles test_speculative_limits in
# 83 s instead of 117 on the 2-core machine. XLA's HLO passes (fusion, layouts, the programs' semantics) are the
# same at every backend level; a user's own XLA_FLAGS replace all of this.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# importing jaxspec would point XLA's GPU autotuner at ~/.cache (jaxspec.xla_flags); a CPU run has nothing to keep
os.environ.setdefault("JAXSPEC_AUTOTUNE_CACHE", "off")


def pytest_configure(config):
    # The xdist workers and the CLI subprocesses they start inherit this process's environment, so the tiny models'
    # programs compile once per run instead of once per process (4:50 -> 4:14 for test_speculative + test_cli on
    # the 2-core machine). Results are the same either way; a cache dir set by the user is left alone.
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="jaxspec-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    config._jaxspec_jax_cache_dir = path


def pytest_unconfigure(config):
    path = getattr(config, "_jaxspec_jax_cache_dir", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
