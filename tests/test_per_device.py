"""bench.per_device held to the engine on 8 simulated CPU devices: the per-device program's arrays have the shard
shapes of what the sharded engine compiles for one device, and its cut collectives are the all-reduces and
all-gathers of the engine's compiled programs (decode, a verify of 4 tokens, a cycle whose verify is 4 tokens);
and the bench's --tiny run writes its rows."""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import per_device as pd
from bench.cycle import spec_configs, spec_pair
from jaxspec.baseline_step import baseline_step
from jaxspec.models import SpecWeights
from jaxspec.prefill import baseline_prefill, spec_prefill
from jaxspec.sampling import SamplingParams
from jaxspec.sharded import lower_program, weights_to_run
from jaxspec.spec_step import speculative_cycle
from model.decoder import forward
from model.init import init_draft_weights, init_kimi_weights
from model.sharding import DRAFT_RULES, make_mesh, path_str
from tests.sharded_pair import numpy_like

LAYERS, K, BATCH, CONTEXT, MAX_NEW = 3, 3, 1, 16, 8
CAPACITY = 64  # round_capacity(CONTEXT + 16): the bench's step caches and the engine's prefill alike
COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")


def collectives(compiled) -> dict[str, int]:
    return dict(Counter(COLLECTIVE.findall(compiled.as_text())))


@functools.cache
def engine():
    """The engine's programs for the bench's tiny pair on a 1 x 8 mesh: {name: (compiled, args, the shardings its
    arguments are laid out in)}."""
    cfg = pd.per_device_config(LAYERS, tiny=True)
    spec_cfg, dcfg = spec_configs(cfg, tiny=True)
    target = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, jnp.bfloat16, experts="int4"), jax.random.key(0))
    d2t = np.zeros(dcfg.draft_vocab_size, np.int32)  # the draft's own lm_head, as bench.cycle draws it
    draft = jax.eval_shape(lambda k: init_draft_weights(dcfg, k, jnp.bfloat16, d2t=d2t), jax.random.key(0))
    mesh = make_mesh((1, pd.SHARD_OF))
    w = weights_to_run(SpecWeights(numpy_like(target, 0), numpy_like(draft, 1)), mesh)
    sp = SamplingParams().as_arrays()
    prompt = (jnp.arange(16, dtype=jnp.int32)[None], jnp.array([5], jnp.int32), jax.random.key(0), sp)
    base = jax.eval_shape(functools.partial(baseline_prefill, cfg=spec_cfg, capacity=CAPACITY, greedy=True,
                                            max_new_tokens=MAX_NEW), w, *prompt)
    spec = jax.eval_shape(functools.partial(spec_prefill, cfg=spec_cfg, capacity=CAPACITY, k=K, greedy=True,
                                            max_new_tokens=MAX_NEW, max_cycles=MAX_NEW), w, *prompt)
    tokens = jax.ShapeDtypeStruct((BATCH, K + 1), jnp.int32)

    def verify(w, tokens_BT, positions_BT, cache):  # the target's forward and greedy pick, as a cycle runs them
        out = forward(w.target, spec_cfg.target, tokens_BT, positions_BT, cache)
        return jnp.argmax(out.logits, -1), out.cache

    programs = {
        "decode": (functools.partial(baseline_step, cfg=spec_cfg, greedy=True, max_new_tokens=MAX_NEW), (w, base, sp)),
        "verify": (verify, (w, tokens, tokens, base.target_cache)),
        "cycle": (functools.partial(speculative_cycle, cfg=spec_cfg, k=K, greedy=True, max_new_tokens=MAX_NEW),
                  (w, spec, sp)),
    }
    lowered = {name: lower_program(fn, args, mesh=mesh) for name, (fn, args) in programs.items()}
    return {name: (low.compile(), programs[name][1], in_shardings) for name, (low, in_shardings) in lowered.items()}


@functools.cache
def bench():
    """The bench's per-device programs for the same pair (traced: that records their cuts): {name: Program}."""
    cfg = pd.per_device_config(LAYERS, tiny=True)
    w = pd.local_weights(cfg, pd.SHARD_OF, tiny=True)
    spec_cfg, _, sw = spec_pair(w, cfg, True)
    sw = SpecWeights(w, pd.local_block(sw.draft, DRAFT_RULES, pd.SHARD_OF))
    key = jax.random.PRNGKey(0)
    programs = {
        "decode": pd.step_loop(w, cfg, pd.step_arguments(w, cfg, BATCH, 1, CONTEXT, key)),
        "verify": pd.step_loop(w, cfg, pd.step_arguments(w, cfg, BATCH, K + 1, CONTEXT, key)),
        "cycle": pd.cycle_loop(sw, spec_cfg, K, BATCH, CONTEXT, CAPACITY, key),
    }
    for p in programs.values():
        jax.jit(p.fn).trace(*p.args)
    return programs


def shard_shapes(program, i: int) -> list:
    """(path, one device's shape) of every leaf of argument `i` of an engine program, as it is laid out."""
    _, args, in_shardings = program
    shardings = jax.tree_util.tree_leaves(in_shardings[i])
    leaves = jax.tree_util.tree_flatten_with_path(args[i])[0]
    assert len(shardings) == len(leaves)
    return [(path_str(p), s.shard_shape(tuple(x.shape))) for (p, x), s in zip(leaves, shardings)]


def local_shapes(tree) -> list:
    return [(path_str(p), tuple(x.shape)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_local_shapes_are_the_engines_shards():
    """Weights (target and draft) and caches of the bench's per-device programs have, leaf for leaf, the shape one
    device's shard has in the engine's compiled decode and cycle programs."""
    eng, mine = engine(), bench()
    weights = shard_shapes(eng["decode"], 0)
    assert weights == local_shapes(mine["cycle"].args[0])  # SpecWeights(target, draft), as the bench's cycle runs
    assert weights == shard_shapes(eng["cycle"], 0)
    experts = [s for p, s in weights if p.endswith("mlp.experts.gate.packed")]
    assert len(experts) == LAYERS - 1 and all(s[0] == 16 // pd.SHARD_OF for s in experts)  # split: no vacuous match

    def field(leaves, name):
        return [(p[len(name) + 1:], s) for p, s in leaves if p.split(".")[0] == name]

    assert field(shard_shapes(eng["decode"], 1), "target_cache") == local_shapes(mine["decode"].args[3])
    state = mine["cycle"].args[1]
    for name in ("target_cache", "draft_cache", "draft_logits", "draft_hidden", "pending"):
        theirs = field(shard_shapes(eng["cycle"], 1), name)
        assert theirs and theirs == field(local_shapes({name: getattr(state, name)}), name)


@pytest.mark.parametrize("name", ["decode", "verify", "cycle"])
def test_collectives_cut_are_the_engines(name):
    """Every all-reduce and all-gather of the engine's compiled sharded program is one cut in the bench's (decode:
    7 all-reduces = embed + 2 per layer, 2 all-gathers for the argmax over vocab shards)."""
    compiled = engine()[name][0]
    theirs, mine = collectives(compiled), bench()[name].cuts.by_kind()
    assert theirs == mine
    if name == "decode":
        assert mine == {pd.ALL_REDUCE: 1 + 2 * LAYERS, pd.ALL_GATHER: 2}


def test_kernel_launches_counts_top_level_work():
    """Fusions and custom calls count, values and fusion bodies do not, a loop's body counts once."""
    hlo = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}

%body (c: (s32[], f32[4])) -> (s32[], f32[4]) {
  %c = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%c), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %g = f32[4]{0} custom-call(%f), custom_call_target="__cublas$gemm"
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %g)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
}
"""
    assert pd.kernel_launches(hlo) == 3
    assert pd.kernel_census(hlo) == {"__cublas$gemm": 1, "f": 1, "r": 1}  # fusions by name, custom calls by target


def test_tiny_run_writes_its_rows(tmp_path):
    """`python -m bench.per_device --tiny`: decode and cycle rows with the fields a script reads."""
    result = pd.main(["--tiny", "--layers", "3", "--tokens", "1", "--cycle-k", "1", "--routing", "model",
                      "--iters", "1", "--loop-steps", "1", "--hlo", "--out", str(tmp_path)])
    assert not result["errors"], result["errors"]
    rows = json.loads(next(tmp_path.glob("per-device-*.json")).read_text())["rows"]
    assert [r["kind"] for r in rows] == ["decode", "cycle"]
    decode = rows[0]
    assert decode["shard_of"] == 8 and decode["layers"] == 3 and decode["tokens"] == 1
    assert decode["collectives_cut"] == {pd.ALL_REDUCE: 7, pd.ALL_GATHER: 2}
    assert decode["collectives_per_layer"][pd.ALL_REDUCE] == 2  # layers 1..2 over the dense prefix
    assert decode["kernels_per_layer"] > 0 and decode["floor_ms"] > 0 and "layer_us" in decode
    assert sum(decode["kernels_per_layer_by_kind"].values()) == pytest.approx(decode["kernels_per_layer"])
    assert min(decode["busiest_device_slots"]) >= 1  # the busiest device of 8 takes at least one of 4 choices
    assert (tmp_path / next(tmp_path.glob("per-device-*.json")).name.replace(".json", ".md")).exists()
    # --hlo: each timed program's optimised HLO, named for bench.depth_gap_hlo (the 3-layer step, its 1-layer prefix)
    hlo = {re.search(r"-(step-T\d+-L\d+|cycle-K\d+)\.hlo\.txt\.gz$", p.name).group(1): p
           for p in tmp_path.glob("per-device-*.hlo.txt.gz")}
    assert sorted(hlo) == ["cycle-K1", "step-T1-L1", "step-T1-L3"]
    assert all(gzip.open(p, "rt").read().startswith("HloModule") for p in hlo.values())


def test_local_choices_run_every_step_as_the_engines():
    """The bench replays the same expert ids every step, where the engine's router chooses them anew: what the
    engine derives from them in every step (a device's local choices) stays in the bench's loop, not hoisted out
    of it by XLA."""
    program = bench()["decode"]
    text = jax.jit(program.fn).lower(*program.args).compile().as_text()
    comps, _ = pd.hlo_computations(text)
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))

    def reached(name, seen):  # a computation and everything it calls
        if name in seen or name not in comps:
            return seen
        seen.add(name)
        for ins in comps[name]:
            for callee in re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", ins.rest):
                reached(callee, seen)
        return seen

    in_loop = set().union(*(reached(b, set()) for b in bodies))
    sites = {c for c, instrs in comps.items() for ins in instrs if "local_choices" in ins.rest}
    assert sites and sites <= in_loop
