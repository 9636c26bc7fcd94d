"""Every test process sees 8 simulated CPU devices (set before jax is imported), its programs compiled without
LLVM's expensive optimizations, and one test run shares one persistent XLA compilation cache."""

import os
import shutil
import tempfile

# The tiny test models spend far longer compiling than running: LLVM at -O0 compiles test_speculative_limits in
# 83 s instead of 117 on the 2-core machine, and XLA:CPU's older fusion code generator (fusion emitters off) takes
# the suite from 26.6 to 19.2 CPU-minutes (docs/performance.md). XLA's HLO passes (fusion, layouts, the programs'
# semantics) are the same either way; a user's own XLA_FLAGS replace all of this. XLA:CPU splits each program's LLVM
# module into parts compiled on a thread pool (32 by default); with two workers on two cores the split only adds
# work: one part compiles bench.adaptive_prompts' programs in 15.3 s of backend compile instead of 18.3 (same HLO,
# same machine code per function).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
                                   "--xla_cpu_parallel_codegen_split_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# importing jaxspec would point XLA's GPU autotuner at ~/.cache (jaxspec.xla_flags); a CPU run has nothing to keep
os.environ.setdefault("JAXSPEC_AUTOTUNE_CACHE", "off")
# the entry points keep compiled programs under ~/.cache (jaxspec.compile_cache); the suite keeps its own (below)
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")


# The suite runs as `-n 2 --dist loadfile`: whole files go to the two workers in queue order, the next file to the
# first worker free. xdist's default queue puts the files with the most tests first, which left the heaviest files
# (few long tests each) to the end, one worker finishing them alone. The queue is ordered instead longest first
# (measured seconds of each file on the 2-core machine, every file of 5 s or more; the rest follow in collection
# order), which keeps both workers busy to the end. The order changes no result; a stale list only costs time.
HEAVY_FILES = (
    "test_cli.py", "test_serve.py", "test_speculative_limits.py", "test_bench_adaptive.py", "test_speculative.py",
    "test_kernels_moe_wgmma.py", "test_train_smoke.py", "test_adaptive.py", "test_sampling_losslessness.py",
    "test_bench_step.py", "test_sharding.py", "test_model_parity.py", "test_notebook.py", "test_drafters_mla.py",
    "test_train_default_pair.py", "test_multihost.py", "test_kernels_moe.py", "test_convert_resume.py",
    "test_bench_graph_mode_check.py", "test_sampling_broken_rules.py", "test_kernels_moe_grouped.py",
    "test_convert_parity.py", "test_chunked_prefill.py", "test_kernels_mla.py", "test_bench_step_mesh.py",
    "test_kernels_router.py", "test_generate_hostile.py", "test_convert_memory.py", "test_adaptive_sampling.py",
    "test_convert_integrity.py", "test_bench_step_profile_cycles.py", "test_convert_errors.py", "test_bench_routes.py",
    "test_bench_step_profile_loop_fixed.py", "test_plan.py", "test_convert_units.py", "test_bench_peer.py",
    "test_checkpoint_versions.py", "test_bench_host_overhead.py", "test_acceptance_exact.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FILES)))  # stable: tests keep their order


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the queue in the order collected (above)
        config.option.loadscopereorder = False
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
