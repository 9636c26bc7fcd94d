"""What a program costs to build does not grow with depth: every layer is a call of one jitted function
(`model.decoder.layer_call`), traced and lowered once per signature, so the lowered program of 8 layers is barely
larger than that of 2, and its Pallas kernels are lowered once however many layers call them."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from bench import compile_depth
from bench.step import bench_config, draw_weights
from model.decoder import forward
from model.init import init_kimi_weights
from model.kernels.target import compiling_for
from model.kv_cache import init_latent_cache


def _bench(tmp_path, *flags):
    # its own process: the bench points JAX's persistent cache at --cache-dir, which JAX settles once a process
    out = tmp_path / ("warm" if "--warm" in flags else "cold")
    subprocess.run([sys.executable, "-m", "bench.compile_depth", "--tiny", "--layers", "3", "8", "--programs",
                    "decode", "verify4", "cycle3", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), *flags],
                   check=True, capture_output=True, cwd=Path(__file__).parents[1], timeout=600)
    result = json.loads(next(out.glob("compile-depth-*.json")).read_text())
    assert not result["errors"]
    return {(r["layers"], r["program"]): r for r in result["rows"]}, out


def test_the_bench_builds_each_program_the_lowered_size_stays_flat_and_a_later_run_loads(tmp_path):
    cold, out = _bench(tmp_path)
    assert set(cold) == {(n, p) for n in (3, 8) for p in ("decode", "verify4", "cycle3")}
    for program in ("decode", "verify4", "cycle3"):
        shallow, deep = cold[3, program], cold[8, program]
        assert deep["text_mb"] <= 1.3 * shallow["text_mb"], program
        assert deep["function_calls"] > shallow["function_calls"]  # each layer calls the shared body
    assert not any(r["compile_cache_hit"] for r in cold.values())
    assert "| 8 | cycle3 |" in next(out.glob("compile-depth-*.md")).read_text()
    warm, _ = _bench(tmp_path, "--warm")
    assert all(r["compile_cache_hit"] for r in warm.values())  # each program loaded from what the first run kept
    with pytest.raises(subprocess.CalledProcessError):  # a cold run refuses a cache that holds programs
        _bench(tmp_path)


def test_a_program_of_8_layers_lowers_to_at_most_1_3x_one_of_2():
    sizes = {}
    for layers in (2, 8):
        cfg = bench_config(layers, tiny=True)
        w = draw_weights(cfg, tiny=True, moe_layers="repeated")
        cache = init_latent_cache(cfg, 1, 64, jnp.float32)
        tokens = jnp.zeros((1, 1), jnp.int32)
        step = jax.jit(lambda w, t, c, cfg=cfg: forward(w, cfg, t, t, c).logits)
        sizes[layers] = len(step.trace(w, tokens, cache).lower().as_text())
    assert sizes[8] <= 1.3 * sizes[2], sizes


@pytest.fixture
def as_on_a_hopper_gpu():
    """Trace as on one Hopper GPU (the kernels' dispatch says yes) and lower for CUDA; JAX's caches are cleared after,
    so no program of this process reuses a trace made under the pretence."""
    with compiling_for("gpu", "9.0"):
        yield
    jax.clear_caches()


def test_the_gpu_program_lowers_each_kernel_once_whatever_the_depth(as_on_a_hopper_gpu):
    """At Kimi-K2.5's shapes (INT4 experts) the decode and verify steps lowered for CUDA hold the same Pallas custom
    calls (routed experts, MLA attention, router top-k) at 8 layers as at 2: one lowering serves every layer."""
    found = {}
    for layers in (2, 8):
        cfg = bench_config(layers, tiny=False)
        w = jax.eval_shape(lambda cfg=cfg: init_kimi_weights(cfg, jax.random.PRNGKey(0), experts="int4"))
        cache = jax.eval_shape(lambda cfg=cfg: init_latent_cache(cfg, 1, 1024, jnp.bfloat16))
        for tokens in (1, 4):
            t = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
            step = jax.jit(lambda w, t, c, cfg=cfg: forward(w, cfg, t, t, c).logits)
            text = step.trace(w, t, cache).lower(lowering_platforms=("cuda",)).as_text()
            found[layers, tokens] = (compile_depth.custom_calls(text), len(text))
    for tokens in (1, 4):
        (calls_2, size_2), (calls_8, size_8) = found[2, tokens], found[8, tokens]
        assert calls_2 >= 3  # the kernels are in the program (experts, attention, router)
        assert calls_8 == calls_2, found
        assert size_8 <= 1.1 * size_2, found


def test_the_adaptive_build_bench_lowers_what_the_by_call_engine_compiles():
    """bench.compile_adaptive's programs: the fixed engine's loop and one loop per K of the by-call set, K = 0 the
    plain loop that keeps the draft current (without probes, the plain loop over the converted state); each lowers
    at the bench's shapes, and the table reads their ratio."""
    from bench import compile_adaptive
    from jaxspec.adaptive_calls import PerCallPolicy

    spec_cfg, sw, state = compile_adaptive.abstract_pair(bench_config(3, tiny=True), tiny=True)
    steps, window, tails = PerCallPolicy().compiled(2)
    specs = [compile_adaptive.fixed_loop_spec(spec_cfg, sw, state, 2)]
    specs += compile_adaptive.per_call_specs(spec_cfg, sw, state, steps, window, tails, PerCallPolicy().probe_every)
    specs += compile_adaptive.per_call_specs(spec_cfg, sw, state, (0,), window, (), 0)
    assert steps == (0, 1, 2) and len(specs) == 5
    whiles = [jax.jit(fn, donate_argnums=donate).lower(*args).as_text().count("stablehlo.while")
              for fn, args, donate in specs]
    assert min(whiles) >= 1
    # the first run's set (no table yet): K = 1's loop without its plain tail (the tail's loop of plain steps)
    untailed = compile_adaptive.per_call_specs(spec_cfg, sw, state, steps, window, (), PerCallPolicy().probe_every)
    fn, args, donate = untailed[steps.index(1)]
    assert tails == (1,) and whiles[1 + steps.index(1)] > jax.jit(
        fn, donate_argnums=donate).lower(*args).as_text().count("stablehlo.while")
    text = compile_adaptive.markdown(dict(device="cpu", jax=jax.__version__, date="today", context=1024, k=2,
                                          steps=list(steps), cpus=2, errors=[],
                                          rows=[dict(layers=3, autotune="cold", fixed_s=2.0, per_call_s=3.0,
                                                     per_call_tailed_s=5.0)]))
    assert "| 3 | cold | 2.00 | 3.00 | 1.50 | 5.00 | 2.50 | - |" in text


def test_the_adaptive_build_bench_builds_in_a_fresh_process_and_names_a_failed_build(tmp_path):
    """Each build runs in a child process (its autotuning in its own directory); a child that fails is an error
    naming the build, not a time."""
    from bench import compile_adaptive

    with pytest.raises(RuntimeError, match="the fixed build failed: .*--layers >= 3"):
        compile_adaptive.build_fresh(2, 2, "fixed", True, tmp_path / "autotune")
