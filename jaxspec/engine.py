"""The generation engine: prefill + speculative cycles (or the T=1 baseline), on device or streaming.

Each jitted program is compiled ahead of time once per static shape (batch, prompt bucket, cache
capacity, K, greedy, max_new_tokens) and cached, so compile time is measured apart from run time and
tests can count compilations.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import adaptive_calls_run, adaptive_costs
from jaxspec.adaptive import (AdaptivePolicy, AdaptiveState, acceptance_rates, adaptive_cycle, adaptive_loop,
                              forced_schedule, init_adaptive_state)
from jaxspec.adaptive_calls import PerCallPolicy
from jaxspec.baseline_step import baseline_step
from jaxspec.generation_result import AdaptiveReport, GenerationResult
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.prefill import (DEFAULT_CHUNK, MIN_BUCKET, baseline_prefill, prompt_bucket, spec_prefill,
                             valid_chunk)
from jaxspec.sampling import SamplingParams
from jaxspec.sharded import compile_programs, output_shapes, weights_to_run
from jaxspec.spec_step import speculative_cycle
from jaxspec.state import progress as state_progress
from jaxspec.state import loop_with_progress, new_tokens, read_progress, with_progress
from model.kv_cache import round_capacity


class PromptTooLong(ValueError):
    pass


def _pad_prompts(prompts: list[list[int]], bucket: int, pad_id: int):
    tokens = np.full((len(prompts), bucket), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


# Compiled programs shared by every Engine: the key holds everything a program bakes in (configs, K, the
# drafter, greedy, max_new_tokens, mesh) and its arguments' shapes and dtypes.
_PROGRAMS: dict[tuple, Callable] = {}
_OUTPUT_SHAPES: dict[tuple, object] = {}  # what a program of _PROGRAMS returns, as shapes (same keys)


def _signature(tree) -> tuple:
    """A pytree's leaves by shape and dtype."""
    return tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(tree))


class Engine:
    def __init__(self, cfg: SpecConfig, weights: SpecWeights, *, num_steps: int = 3, max_context: int | None = None,
                 drafter=None, mesh=None, prefill_chunk: int = DEFAULT_CHUNK,
                 adaptive: AdaptivePolicy | PerCallPolicy | None = None):
        """`mesh` (model.sharding.make_mesh): shard weights by the partition rules and run every program on it.
        `prefill_chunk`: prompt positions per prefill step (a power of two >= 16); longer prompts run in chunks.
        `adaptive`: choose K among a compiled set up to `num_steps`, per cycle inside one program
        (AdaptivePolicy, jaxspec.adaptive) or per call of fixed-K programs (PerCallPolicy, jaxspec.adaptive_calls)."""
        if num_steps > 0 and (cfg.draft is None or weights.draft is None):
            raise ValueError("speculative decoding (num_steps > 0) needs a draft model")
        if adaptive is not None:
            if num_steps < 1:
                raise ValueError("adaptive speculation needs num_steps >= 1 (the largest K it may choose)")
            adaptive.validate(num_steps)
        self.adaptive = adaptive
        if not valid_chunk(prefill_chunk):
            raise ValueError(f"prefill_chunk must be a power of two >= {MIN_BUCKET}, not {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.mesh = mesh
        self.cfg, self.weights, self.k = cfg, weights_to_run(weights, mesh), num_steps
        self._weights_signature = None  # the weights' shapes and dtypes in program keys (`_program_key`)
        self.max_context = max_context or cfg.target.max_position_embeddings
        self.drafter = drafter  # None: the EAGLE-3 draft chain
        self.compile_count = 0  # programs this engine had to compile (not found in _PROGRAMS)
        # adaptive by call: acceptance counts per draft position pooled over generations, greedy and sampled apart
        self.acceptance_pools: dict = {}

    # --- compilation ---------------------------------------------------------------------------------
    def _compile(self, name: str, fn, static: dict, args: tuple, donate: tuple = (), baked: tuple = ()):
        """`static` are keyword arguments bound into `fn`; `baked` names what `fn` already closes over. Returns
        (program, seconds compiling)."""
        return self._compile_together([(name, fn, static, args, donate, baked)])[0]

    def _compile_together(self, specs: list[tuple]) -> list[tuple]:
        """`_compile` for each `(name, fn, static, args, donate, baked)`; the ones not compiled yet side by side
        (`jaxspec.sharded.compile_programs`), their wall time charged to the first of them."""
        keys = [self._program_key(name, static, args, baked) for name, _, static, args, _, baked in specs]
        todo = [(key, spec) for key, spec in zip(keys, specs) if key not in _PROGRAMS]
        seconds = dict.fromkeys(keys, 0.0)
        if todo:
            t0 = time.perf_counter()
            programs = compile_programs([(functools.partial(fn, **static), args, donate)
                                         for _, (_, fn, static, args, donate, _) in todo], self.mesh)
            _PROGRAMS.update((key, program) for (key, _), program in zip(todo, programs))
            self.compile_count += len(todo)
            seconds[todo[0][0]] = time.perf_counter() - t0
        return [(_PROGRAMS[key], seconds.pop(key, 0.0)) for key in keys]

    def _program_key(self, name: str, static: dict, args: tuple, baked: tuple) -> tuple:
        # arguments by shape and dtype (arrays or their shapes alike): a program's placement follows from the mesh.
        # The weights' part is taken once: at Kimi's depth they are ~1,500 arrays, and a request looks up several keys
        if args and args[0] is self.weights:
            if self._weights_signature is None:
                self._weights_signature = _signature(self.weights)
            leaves = (self._weights_signature, _signature(args[1:]))
        else:
            leaves = (_signature(args),)
        return (name, self.cfg, self.k, self.drafter, self.mesh, baked, tuple(sorted(static.items())), leaves)

    def _shapes(self, prompts, max_new_tokens):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens + self.k + 1
        if need > self.max_context:
            raise PromptTooLong(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens (+{self.k + 1} verify slots) "
                f"exceeds the context of {self.max_context} tokens"
            )
        bucket = prompt_bucket(longest)
        capacity = round_capacity(max(bucket, need))
        return bucket, capacity

    # --- on-device generation ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0, speculative: bool | None = None) -> GenerationResult:
        """Run prefill, then every cycle inside one jitted `lax.while_loop` (no host round trip per cycle)."""
        speculative = self.k > 0 if speculative is None else speculative
        if speculative and isinstance(self.adaptive, PerCallPolicy):
            return adaptive_calls_run.generate(self, prompts, max_new_tokens, sampling, seed)
        sp = sampling.validate().as_arrays()
        adaptive = speculative and self.adaptive is not None
        loop = loop_with_progress(self._step_fn(speculative, sampling.greedy, max_new_tokens))
        loop_spec = lambda state: ("loop_spec" if speculative else "loop_base", loop, {}, (self.weights, state, sp),  # noqa: E731
                                   (1,), (sampling.greedy, max_new_tokens))
        state, prefill_s, compile_s, lengths, *ready = self._prefill(prompts, max_new_tokens, sampling, seed,
                                                                     speculative, then=None if adaptive else loop_spec)
        if adaptive:
            state, report, key = self._adaptive_start(state, sampling.greedy)
            compiled, c = self._adaptive_loop(state, sp, sampling.greedy, max_new_tokens)
            compile_s += c
            if key is not None:
                def run_forced(s, cycles):
                    start = int(s.cycles)
                    out = compiled(self.weights, s, sp, jnp.int32(cycles))
                    return out, int(out.cycles) - start

                state, report = self._adaptive_measure(state, report, key, run_forced)
            t0 = time.perf_counter()
            state = compiled(self.weights, state, sp, jnp.int32(np.iinfo(np.int32).max))
            host = jax.device_get((state.generated, state.out_tokens))
            decode_s = time.perf_counter() - t0
            return self._result(state, lengths, prefill_s, decode_s, compile_s, speculative, report, host)
        compiled = ready[0]
        t0 = time.perf_counter()
        state, progress_read = compiled(self.weights, state, sp)
        # the decode ends with its tokens on the host, as every engine's does; they are cut from that one array
        # after it, as the by-call engine's are (`adaptive_calls.CallSummary`)
        progress_read = np.asarray(progress_read)
        decode_s = time.perf_counter() - t0
        generated, out_tokens, _ = read_progress(progress_read, len(prompts))
        return self._result(state, lengths, prefill_s, decode_s, compile_s, speculative, host=(generated, out_tokens))

    # --- streaming ----------------------------------------------------------------------------------
    def stream(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               seed: int = 0, speculative: bool | None = None,
               pipelined: bool = True) -> Iterator[list[list[int]] | GenerationResult]:
        """Yield the tokens each cycle accepted (one list per sequence), then the final GenerationResult.

        `pipelined` (the default) keeps one cycle queued on the device behind the one the host waits for, so the
        host's round trip (copying the tokens back, the consumer's work, dispatching) overlaps the device's next
        cycle instead of adding to every cycle. The device then runs one cycle past the last one needed; on a
        finished batch a cycle changes no token, count or log (`commit`, `baseline_step`). `pipelined=False`
        runs one cycle per round trip (what bench/stream.py compares). `decode_s` is the decode phase's wall
        time, less the time the consumer held the generator between yields."""
        speculative = self.k > 0 if speculative is None else speculative
        if speculative and isinstance(self.adaptive, PerCallPolicy):
            yield from adaptive_calls_run.stream(self, prompts, max_new_tokens, sampling, seed, pipelined)
            return
        sp = sampling.validate().as_arrays()
        adaptive = speculative and self.adaptive is not None
        step = with_progress(self._step_fn(speculative, sampling.greedy, max_new_tokens))
        cycle_spec = lambda name, state, policy: (name, step, {}, (self.weights, state, sp), (1,),  # noqa: E731
                                                  (sampling.greedy, max_new_tokens, policy))
        state, prefill_s, compile_s, lengths, *ready = self._prefill(
            prompts, max_new_tokens, sampling, seed, speculative,
            then=None if adaptive else functools.partial(cycle_spec, "cycle_spec" if speculative else "cycle_base",
                                                         policy=None))
        report = key = None
        if adaptive:
            state, report, key = self._adaptive_start(state, sampling.greedy)
            program, c = self._compile(*cycle_spec("cycle_adaptive", state, self.adaptive.compiled(self.k)))
            ready, compile_s = [program], compile_s + c
        compiled = ready[0]
        if key is not None:
            def run_forced(s, cycles):  # calls queued back to back, as pipelined streaming runs them
                start = int(s.cycles)
                for _ in range(cycles):  # a forced schedule runs one cycle per call
                    s, _ = compiled(self.weights, s, sp)
                return s, int(s.cycles) - start

            state, report = self._adaptive_measure(state, report, key, run_forced)
        b = len(prompts)
        shown = np.zeros(b, np.int64)
        progress = read_progress(jax.device_get(state_progress(state)), b)  # the prefill's first tokens
        decode_s, t0 = 0.0, time.perf_counter()
        if pipelined and not progress[2].all():
            state, in_flight = compiled(self.weights, state, sp)
        while True:
            new = new_tokens(progress, shown)
            if any(new):
                decode_s += time.perf_counter() - t0
                yield new
                t0 = time.perf_counter()
            if progress[2].all():
                break
            state, queued = compiled(self.weights, state, sp)  # pipelined: queued behind the cycle waited for
            if pipelined:
                progress, in_flight = read_progress(jax.device_get(in_flight), b), queued
            else:
                progress = read_progress(jax.device_get(queued), b)
        jax.block_until_ready(state)  # pipelined: the one cycle past the end
        decode_s += time.perf_counter() - t0
        yield self._result(state, lengths, prefill_s, decode_s, compile_s, speculative, report)

    # --- pieces -------------------------------------------------------------------------------------
    def _step_fn(self, speculative: bool, greedy: bool, max_new_tokens: int):
        if speculative and isinstance(self.adaptive, AdaptivePolicy):
            return functools.partial(adaptive_cycle, **self._adaptive_kw(greedy, max_new_tokens))
        if speculative:
            return functools.partial(speculative_cycle, cfg=self.cfg, k=self.k, greedy=greedy,
                                     max_new_tokens=max_new_tokens, drafter=self.drafter)
        return functools.partial(baseline_step, cfg=self.cfg, greedy=greedy, max_new_tokens=max_new_tokens)

    # --- adaptive speculation ----------------------------------------------------------------------
    def _adaptive_kw(self, greedy: bool, max_new_tokens: int) -> dict:
        steps, ema, explore_every, _, probe, stretch, hysteresis = self.adaptive.compiled(self.k)
        return dict(cfg=self.cfg, steps=steps, greedy=greedy, max_new_tokens=max_new_tokens, ema=ema,
                    explore_every=explore_every, stretch=stretch, hysteresis=hysteresis, probe=probe,
                    drafter=self.drafter)

    def _adaptive_loop(self, state, sp, greedy: bool, max_new_tokens: int):
        """The on-device loop of adaptive cycles, (weights, state, sp, cycle limit) -> state; (program, compile s)."""
        loop = functools.partial(adaptive_loop, **self._adaptive_kw(greedy, max_new_tokens))
        return self._compile("loop_adaptive", loop, {}, (self.weights, state, sp, jnp.int32(0)), (1,),
                             baked=(greedy, max_new_tokens, self.adaptive.compiled(self.k)))

    def _adaptive_start(self, spec_state, greedy: bool):
        """The prefilled state wrapped for adaptive cycles with its cost table when one is given or cached for this
        device and shape; (state, report without the cycles, cache key or None when the table is still to measure)."""
        policy = self.adaptive
        steps = policy.resolve_steps(self.k)
        aux_width = len(self.cfg.target.aux_layer_ids) * self.cfg.target.hidden_size
        key = None
        if policy.costs is not None:  # a given table prices no first run
            table, source = adaptive_costs.Measured(tuple(c for _, c in policy.costs)), "given"
        else:
            key = self.cost_key(spec_state, greedy)
            table, source = adaptive_costs.cached(key), "cached"
        costs = table.costs_s if table is not None else (1.0,) * len(steps)
        first_run = table.first_run_s if table is not None else 0.0
        state = init_adaptive_state(spec_state, aux_width, steps, policy, costs, first_run)
        report = AdaptiveReport(steps, tuple(float(c) for c in costs) if table is not None else (), source, 0.0, [],
                                0.0, 0.0, float(first_run))
        return state, report, (key if table is None else None)

    def cost_key(self, spec_state, greedy: bool, *tag) -> str:
        """The key a cost table is kept under for this engine's programs at `spec_state`'s cache shape (`tag`
        names a kind of table other than the per-cycle program's)."""
        lat = spec_state.target_cache.latent[0]
        drafter = None if self.drafter is None else getattr(self.drafter, "__qualname__", repr(type(self.drafter)))
        return adaptive_costs.cost_key(*tag, self.cfg, drafter, self.mesh and self.mesh.devices.shape, lat.shape,
                                       str(lat.dtype), greedy, self.adaptive.compiled(self.k))

    def _adaptive_measure(self, state, report: AdaptiveReport, key: str, run_forced):
        """Time each K with `run_forced(state copy, branch, cycles) -> (state, cycles run)`; the state with the
        measured table (kept for this device and shape) and the report saying so."""
        steps = report.steps
        forced = lambda s, branch, n: run_forced(s.replace(**forced_schedule(steps, (steps[branch],))), n)  # noqa: E731
        t0 = time.perf_counter()
        measured = adaptive_costs.measure(forced, state, len(steps))
        measure_s = time.perf_counter() - t0
        if measured is None:  # nothing left to generate: any table serves
            measured, source = adaptive_costs.Measured((1.0,) * len(steps)), "none"
        else:
            source = "measured"
            adaptive_costs.remember(key, measured, steps)
        report = dataclasses.replace(report, costs_s=tuple(float(c) for c in measured.costs_s), cost_source=source,
                                     measure_s=measure_s, first_run_s=float(measured.first_run_s))
        return state.replace(cost_N=jnp.asarray(measured.costs_s, jnp.float32),
                             first_run_s=jnp.float32(measured.first_run_s)), report

    def _prefill(self, prompts, max_new_tokens, sampling: SamplingParams, seed, speculative, then=None,
                 meanwhile=None):
        """Compile (or find) and run the prefill: (state, prefill seconds, compile seconds, prompt lengths). `then(state
        shapes)`: the `_compile` spec of the program the run takes next, or a list of them; they are compiled beside
        the prefill (`_compile_together`) and returned last, in order. `meanwhile(state not yet computed)`: host
        work run while the device prefills (counted in the prefill's seconds only where it outlasts the device's
        work)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        bucket, capacity = self._shapes(prompts, max_new_tokens)
        pad = self.cfg.target.pad_token_id or 0
        tokens, lengths = _pad_prompts(prompts, bucket, pad)
        sp = sampling.validate().as_arrays()
        args = (self.weights, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed), sp)
        if speculative:
            fn, static = spec_prefill, dict(cfg=self.cfg, capacity=capacity, k=self.k, greedy=sampling.greedy,
                                            max_new_tokens=max_new_tokens, max_cycles=max_new_tokens,
                                            chunk=self.prefill_chunk)
        else:
            fn, static = baseline_prefill, dict(cfg=self.cfg, capacity=capacity, greedy=sampling.greedy,
                                                max_new_tokens=max_new_tokens, chunk=self.prefill_chunk)
        name = "prefill_spec" if speculative else "prefill_base"
        specs = [(name, fn, static, args, (), ())]
        if then is not None:
            # the state's shapes, traced once per program: tracing the prefill again costs every request tens of ms
            key = self._program_key(name, static, args, ())
            if key not in _OUTPUT_SHAPES:
                _OUTPUT_SHAPES[key] = output_shapes(functools.partial(fn, **static), args, self.mesh)
            more = then(_OUTPUT_SHAPES[key])
            specs += more if isinstance(more, list) else [more]
        built = self._compile_together(specs)
        compiled = built[0][0]
        t0 = time.perf_counter()
        state = compiled(*args)
        if meanwhile is not None:
            meanwhile(state)
        jax.block_until_ready(state.generated)
        return (state, time.perf_counter() - t0, sum(c for _, c in built), lengths, *(p for p, _ in built[1:]))

    def _result(self, state, lengths, prefill_s, decode_s, compile_s, speculative,
                report: AdaptiveReport | None = None, host=None) -> GenerationResult:
        """`host`: the final (generated, out_tokens) already read back, else None."""
        generated, out_tokens = host if host is not None else jax.device_get((state.generated, state.out_tokens))
        tokens = [out_tokens[i, : generated[i]].tolist() for i in range(len(generated))]
        if speculative:
            log = jax.device_get(state.accepted_log)
            accepted = [[int(a) for a in row if a >= 0] for row in log]
            cycles = int(state.cycles)
        else:
            accepted, cycles = [[] for _ in tokens], int(state.steps)
        if isinstance(state, AdaptiveState):
            k_log, exp_tokens, exp_s, hits_BJ, trials_BJ, prior = jax.device_get(
                (state.k_log, state.expected_tokens, state.expected_s, state.hits_BJ, state.trials_BJ, state.prior))
            estimate_BJ = np.asarray(acceptance_rates(hits_BJ, trials_BJ, prior))
            report = dataclasses.replace(report, k_per_cycle=[int(k) for k in k_log[:cycles]],
                                         expected_tokens=float(exp_tokens), expected_s=float(exp_s),
                                         acceptance_estimate=estimate_BJ.tolist())
        return GenerationResult(tokens, accepted, [int(x) for x in lengths], prefill_s, decode_s, compile_s, cycles,
                                report)
