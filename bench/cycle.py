"""The full speculative cycle (K draft steps + verify of K+1 + accept + draft extend, one jit) from
`jaxspec.spec_step.speculative_cycle`, timed on a state placed at a given context length.

The state is built directly (random caches, no prefill): timing does not depend on cache contents, and a
prefill of 32k tokens through the reference MoE would cost more device time than the whole benchmark.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.bytes_floor import draft_bytes, step_bytes, unique_experts_per_layer
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.spec_step import speculative_cycle_accepting
from jaxspec.state import SpecState
from model.config import Kernels
from model.eagle3 import DraftConfig, init_draft_cache
from model.kv_cache import LatentCache, round_capacity
from model.sharding import STATE_RULES, replicated, shardings_for

MAX_NEW_TOKENS = 4096
LOG_CYCLES = 256


DRAFT_KINDS = ("llama", "mla")


def k25_draft_config(cfg, tiny: bool, kind: str = "llama") -> DraftConfig:
    """A one-layer EAGLE-3 draft: "llama" shaped like the SpecForge Kimi recipe (REFERENCE.md section 5), "mla" like
    the public MLA drafters (model/configs/drafts/kimi-k2.5-eagle3-mla.json: the target's attention shape, a full
    vocabulary), with the EAGLE-3.1 fc_norm, norm_output and YaRN of the K2.6 / K2.7 ones."""
    if kind == "mla":
        return DraftConfig(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_attention_heads, head_dim=cfg.qk_head_dim,
            intermediate_size=512 if tiny else 18432, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
            rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, aux_layer_ids=cfg.eagle_aux_layers,
            attention="mla", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            rope_scaling=cfg.rope_scaling, fc_norm=True, norm_output=True,
        )
    return DraftConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=4 if tiny else 64,
        num_key_value_heads=4 if tiny else 64,
        head_dim=16 if tiny else 128,
        intermediate_size=512 if tiny else 18432,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=256 if tiny else 32000,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        aux_layer_ids=cfg.eagle_aux_layers,
    )


def _random_like(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def initial_state(cfg, dcfg, batch: int, context: int, capacity: int, key, dtype=jnp.bfloat16) -> SpecState:
    keys = iter(jax.random.split(key, 2 * cfg.num_hidden_layers + 6))
    n = cfg.num_hidden_layers
    cache = LatentCache(
        latent=tuple(_random_like(next(keys), (batch, capacity, cfg.kv_lora_rank), dtype) for _ in range(n)),
        k_rope=tuple(_random_like(next(keys), (batch, capacity, cfg.qk_rope_head_dim), dtype) for _ in range(n)),
        lengths=jnp.full((batch,), context, jnp.int32),
    )
    dcache = jax.tree.map(lambda x: _random_like(next(keys), x.shape, dtype), init_draft_cache(dcfg, batch, capacity, dtype))
    return SpecState(
        target_cache=cache,
        draft_cache=dcache,
        pending=jax.random.randint(next(keys), (batch,), 0, cfg.vocab_size, jnp.int32),
        draft_logits=jax.random.normal(next(keys), (batch, dcfg.draft_vocab_size), jnp.float32),
        draft_hidden=_random_like(next(keys), (batch, cfg.hidden_size), dtype),
        done=jnp.zeros((batch,), bool),
        generated=jnp.ones((batch,), jnp.int32),
        out_tokens=jnp.zeros((batch, MAX_NEW_TOKENS + 16), jnp.int32),
        accepted_log=jnp.full((batch, LOG_CYCLES), -1, jnp.int32),
        cycles=jnp.int32(0),
        key=jax.random.PRNGKey(0),
    )


def spec_configs(cfg, tiny: bool, kind: str = "llama") -> tuple[SpecConfig, DraftConfig]:
    """The pair's configs: the target `cfg` with a `k25_draft_config` draft of `kind`."""
    from jaxspec.models import check_draft_fits

    dcfg = k25_draft_config(cfg, tiny, kind)
    return SpecConfig(target=check_draft_fits(cfg, dcfg), draft=dcfg), dcfg


def spec_pair(w, cfg, tiny: bool, kind: str = "llama"):
    """The target weights `w` with a random K2.5-shaped one-layer draft of `kind` (DRAFT_KINDS), with its own
    lm_head: (SpecConfig, DraftConfig, SpecWeights)."""
    from model.init import init_draft_weights

    spec_cfg, dcfg = spec_configs(cfg, tiny, kind)
    # tiny: drawn by numpy (nothing to compile on a CPU), as bench.step.draw_weights draws the target
    source = np.random.default_rng(5) if tiny else jax.random.PRNGKey(5)
    dw = init_draft_weights(dcfg, source, d2t=np.zeros(dcfg.draft_vocab_size, np.int64))
    return spec_cfg, dcfg, SpecWeights(target=w, draft=dw)


def _greedy_cycle(spec_cfg: SpecConfig, k: int):
    """(weights, state) -> `CycleOutput` of one greedy cycle."""
    return lambda w, state: speculative_cycle_accepting(w, state, {}, cfg=spec_cfg, k=k, greedy=True,
                                                        max_new_tokens=MAX_NEW_TOKENS)


def _with_kernels(spec_cfg: SpecConfig, kernels: Kernels) -> SpecConfig:
    return dataclasses.replace(spec_cfg, target=spec_cfg.target.replace(kernels=kernels),
                               draft=dataclasses.replace(spec_cfg.draft, kernels=kernels))


def make_cycle(spec_cfg: SpecConfig, k: int, kernels: Kernels):
    """Jitted cycle under `kernels` (state donated) that also returns the verify's expert ids
    [moe layers, B*(K+1), topk] (where the router runs: global ids under a mesh too)."""
    one_cycle = _greedy_cycle(_with_kernels(spec_cfg, kernels), k)

    def cycle(w: SpecWeights, state: SpecState):
        out = one_cycle(w, state)
        return out.state, jnp.stack(out.verify_expert_ids)

    return jax.jit(cycle, donate_argnums=(1,))


def make_cycle_loop(spec_cfg: SpecConfig, k: int, kernels: Kernels):
    """`cycles` (an argument: one program for every length) cycles inside one jitted loop (state donated), as
    `Engine.generate` runs them."""
    one_cycle = _greedy_cycle(_with_kernels(spec_cfg, kernels), k)

    def loop(w: SpecWeights, state: SpecState, cycles):
        return jax.lax.fori_loop(0, cycles, lambda _, s: one_cycle(w, s).state, state)

    return jax.jit(loop, donate_argnums=(1,))


def cycle_floor(w: SpecWeights, spec_cfg: SpecConfig, batch: int, context: int, k: int, ids_LTK) -> dict:
    """Verify of K+1 tokens plus K draft forwards (K-1 chain steps, one extend over K+1 tokens)."""
    verify = step_bytes(w.target, spec_cfg.target, batch, k + 1, context, unique_experts_per_layer(ids_LTK))
    drafts = (k - 1) * draft_bytes(w.draft, spec_cfg.draft, batch, 1, context) + draft_bytes(
        w.draft, spec_cfg.draft, batch, k + 1, context
    )
    return dict(verify=verify["total"], drafts=drafts, total=verify["total"] + drafts,
                unique_experts=unique_experts_per_layer(ids_LTK))


def run_cycle(cycle_fn, w, state):
    """A `median_ms` closure threading the donated state through successive cycles."""
    holder = {"state": state}

    def run():
        holder["state"], ids = cycle_fn(w, holder["state"])
        return ids

    return run, holder


def bench_cycles(w, cfg, args, kernels: Kernels, copy_tbs, over_budget, result, log, batch_contexts, *, tiny: bool,
                 loop_cycles: int = 0, mesh=None) -> list[dict]:
    """Median synchronised ms per cycle at each (batch, context) and K; with `loop_cycles`, also the time per
    cycle when that many run inside one jitted loop ("device loop"). With `mesh` (call inside its context): the
    draft replicated and the state laid out as the engine lays it out. Each of `args.draft_kinds` (default
    llama) in turn."""
    rows = []
    for kind in getattr(args, "draft_kinds", None) or ["llama"]:
        rows += _bench_kind(w, cfg, args, kernels, copy_tbs, over_budget, result, log, batch_contexts, kind, tiny,
                            loop_cycles, mesh)
    return rows


def _bench_kind(w, cfg, args, kernels: Kernels, copy_tbs, over_budget, result, log, batch_contexts, kind, tiny,
                loop_cycles, mesh) -> list[dict]:
    from bench.bytes_floor import HBM_TBS, floor_ms
    from bench.timing import device_loop_ms, device_loop_steps_run, median_ms

    spec_cfg, dcfg, sw = spec_pair(w, cfg, tiny, kind)
    if mesh is not None:
        sw = SpecWeights(target=w, draft=jax.device_put(sw.draft, replicated(sw.draft, mesh)))
    rows = []
    key = jax.random.PRNGKey(9)
    for b, c in batch_contexts:
        for k in args.cycle_k:
            if over_budget():
                result["skipped"].append(f"cycle {kind} B={b} ctx={c} K={k}")
                continue
            key, sub = jax.random.split(key)
            try:
                loop_timed = device_loop_steps_run(loop_cycles, args.iters) if loop_cycles else 0
                capacity = round_capacity(c + 16 + (3 + 2 * args.iters + 2 + loop_timed) * (k + 1))
                state = initial_state(spec_cfg.target, dcfg, b, c, capacity, sub)
                if mesh is not None:
                    state = jax.device_put(state, shardings_for(state, mesh, STATE_RULES))
                cycle_fn = make_cycle(spec_cfg, k, kernels)
                state, ids = cycle_fn(sw, state)
                ids = np.asarray(ids)
                run, holder = run_cycle(cycle_fn, sw, state)
                stats = median_ms(run, warmup=2, iters=args.iters)
                if loop_cycles:
                    loop_fn = make_cycle_loop(spec_cfg, k, kernels)

                    def run_loop(cycles):
                        holder["state"] = loop_fn(sw, holder["state"], jnp.int32(cycles))
                        return holder["state"].generated

                    stats.update(device_loop_ms(run_loop, loop_cycles, args.iters))
                floor = cycle_floor(sw, spec_cfg, b, c, k, ids)
                row = dict(draft=kind, batch=b, context=c, k=k, **stats, bytes=floor,
                           floor_ms_4p3=floor_ms(floor["total"], HBM_TBS),
                           floor_ms_copy=floor_ms(floor["total"], copy_tbs))
                row["ratio_4p3"] = row["median_ms"] / row["floor_ms_4p3"]
                loop_note = ""
                if "device_loop_ms" in row:
                    row["device_loop_ratio_4p3"] = row["device_loop_ms"] / row["floor_ms_4p3"]
                    loop_note = (f" (device loop {row['device_loop_ms']:.3f} ms + {row['device_loop_fixed_ms']:.3f} a loop, "
                                 f"ratio {row['device_loop_ratio_4p3']:.2f}; loop / N {row['device_loop_chained_ms']:.3f})")
                rows.append(row)
                log(f"cycle {kind} B={b} ctx={c} K={k}: {row['median_ms']:.3f} ms, floor {row['floor_ms_4p3']:.3f} ms, "
                    f"ratio {row['ratio_4p3']:.2f}{loop_note}")
                del holder, state
            except Exception as e:
                result["errors"].append(f"cycle {kind} B={b} ctx={c} K={k}: {type(e).__name__}: {e}"[:2000])
                import traceback

                traceback.print_exc()
    return rows
