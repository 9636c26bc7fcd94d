"""Named sets of XLA flags that the H200 A/B runs compare, each on top of the engine's own (`jaxspec.xla_flags`):
`bash bench/scripts/h200_xla_flags.sh` times `bench.step` under each, `python -m bench.labs.graph_mode_check --modes MODE+SET`
checks that a set gives the same tokens. `python -m bench.labs.xla_flag_sets NAME` prints one set (for the shell).

The command-buffer ones aimed at the synchronised step's host round trip (~0.5 ms at B=1 1k: bench/results/README.md,
host-overhead-gpu-20261130-0310). Run 17 measured concurrent-regions, exclusive-lock and trace-cache-64: none moved
the synchronised steps beyond the spread (bench/results/run17/flags-*.log); run 21 custom-calls-apart and fusion-only:
slower device loops, synchronised steps within the spread; block-level-rewriter: the same device loop
(bench/results/run21/flags-*.log). `--xla_gpu_command_buffer_update_mode`
(jax 0.10's XLA knows it) is refused by the H200's jax 0.11.2 XLA, which aborts the process, so it has no set here."""

from __future__ import annotations

import sys

from jaxspec.xla_flags import SCHEDULING_FLAG

# XLA's orders for the kernels of a step's CUDA graph: LHS (XLA's default) as the latency-hiding scheduler ordered
# them, CONCURRENT (the engine's since run 16) with edges only where kernels share buffers, SERIALIZE one after
# another, CONCURRENT_REGIONS a further XLA mode; each is also a flag set named in lower case ("concurrent-regions")
SCHEDULING_MODES = ("LHS", "CONCURRENT", "SERIALIZE", "CONCURRENT_REGIONS")

# flags that the XLA of jax 0.11 (the H200's) knows and that of jax 0.10 (CI's) does not
NEWER_XLA_ONLY = ("--xla_gpu_enable_pdl_launch",)

FLAG_SETS = {
    "default": "",  # the engine's flags alone
    "no-command-buffers": "--xla_gpu_enable_command_buffer=",
    "while-in-command-buffers":
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    # the Pallas kernels (custom calls) launched by their own thunks: the step's one CUDA graph becomes a run of
    # small graphs between them, so the device starts on the first while the host still launches the rest (a
    # synchronised step pays the whole graph's launch before its first kernel, run 12)
    "custom-calls-apart": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN",
    "fusion-only": "--xla_gpu_enable_command_buffer=FUSION",
    # fewer, larger kernels: a decode layer's RMSNorms run as a reduction and an elementwise kernel each (run 15's
    # step profile); XLA's block-level (Triton) fusions may take a norm in one
    "block-level-rewriter": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
    "triton-heroless": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
    # programmatic dependent launch (Hopper): a kernel may start while the previous one drains
    "pdl-off": "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false",  # *_launch: jax 0.11's XLA only
    "pdl-on": "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true",
    **{mode.lower().replace("_", "-"): f"{SCHEDULING_FLAG}={mode}" for mode in SCHEDULING_MODES},
    # XLA: "running gpu executable will require exclusive lock on gpu ... can enable some optimizations that reduce
    # the cost of resource management, e.g. command buffer update"
    "exclusive-lock": "--xla_gpu_require_exclusive_lock=true",
    # custom calls (the Pallas kernels) enter the graph by stream capture; a larger cache re-captures less often
    "trace-cache-64": "--xla_cmd_buffer_trace_cache_size=64",
    # computations of fewer kernels run without a command buffer (XLA's default minimum is 5): the adaptive loop's
    # small ones (the rule, the conditional's branches) then need no graph update at their first run in a call
    "min-graph-20": "--xla_gpu_graph_min_graph_size=20",
    # the GEMM autotuner's candidates: without XLA's Triton GEMMs only cuBLAS's algorithms are timed (a 61-layer
    # by-call set's cold build 2.59x a fixed loop's against 4.75x, 2026-12-06); level 1 skips the candidates'
    # correctness checks
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "autotune-1": "--xla_gpu_autotune_level=1",
}


def flags_of(names: list[str]) -> str:
    """The flags of the named sets, in order; an unknown name is a KeyError that lists the known ones."""
    unknown = [n for n in names if n not in FLAG_SETS]
    if unknown:
        raise KeyError(f"unknown XLA flag set(s) {unknown}; known: {sorted(FLAG_SETS)}")
    return " ".join(f for f in (FLAG_SETS[n] for n in names) if f)


if __name__ == "__main__":
    try:
        print(flags_of(sys.argv[1:]))
    except KeyError as e:
        raise SystemExit(f"error: {e.args[0]}") from None
