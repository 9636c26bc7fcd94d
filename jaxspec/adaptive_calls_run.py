"""The host side of adaptive speculation by call (jaxspec.adaptive_calls): compile one loop per K, price them, run
call after call, and report what ran. `Engine.generate` and `Engine.stream` hand over to `generate` and `stream`
here when the engine's policy is a PerCallPolicy."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import adaptive_costs
from jaxspec.adaptive_calls import (FIRST_BLOCK, CallSummary, Pool, ProbeSummary, acceptance_BJ, better_k,
                                    call_outweighs_step, expected_tokens_BN, finish_times_N, observed_GN,
                                    plain_leave_remaining, plain_loop, plain_to_the_end, probe_array, probe_loop,
                                    probe_observations, read_plain_summary, rule_array, spec_loop, stay_band, to_plain,
                                    window_counts)
from jaxspec.baseline_step import baseline_step
from jaxspec.generation_result import AdaptiveReport, GenerationResult
from jaxspec.sampling import SamplingParams
from jaxspec.spec_step import speculative_cycle
from jaxspec.state import new_tokens, read_progress, with_progress
from jaxspec.state import progress as state_progress

NO_LIMIT = np.iinfo(np.int32).max
# the key of the plain loop with the draft's catch-ups among a generation's programs (`probe_loop`); in the device
# loop it is K = 0's program too
PROBE = "probe"


@dataclasses.dataclass
class Calls:
    """What a generation's calls ran and observed (host side)."""
    steps: tuple[int, ...]
    pool: Pool
    costs: np.ndarray
    switch_s: float
    k_per_cycle: list = dataclasses.field(default_factory=list)
    calls: int = 0  # device calls the decode made
    # plain steps at the end that ran on plain decoding's state (`to_plain`: not in the acceptance log); those of a
    # plain call with probes are cycles of the log that accepted nothing
    unlogged: int = 0
    # the last call's (CallSummary, first cycle, K, the rows' acceptance estimate, live rows): neither tallied nor in
    # the pool until `settle`, so the decode ends at the host's test of whether the batch is done
    unsettled: tuple | None = None
    # what each call ran, for the report: (K, cycles or steps, the rows' acceptance estimate or None, tokens or live
    # rows). Priced once the tokens are out (`expected`): the decode's last read is followed by nothing but the
    # host's test of whether the batch is done
    tallies: list = dataclasses.field(default_factory=list)

    def choose(self, hits_BJ, trials_BJ, remaining_B, live_B, prior, margin, current):
        """(the K to run next, the rows' acceptance estimate): the fastest K, or `current` where leaving it does
        not pay (None: no K runs yet, the fastest is taken)."""
        c_BJ = acceptance_BJ(hits_BJ, trials_BJ, self.pool.hits, self.pool.trials, np.float32(prior))
        times = finish_times_N(c_BJ, remaining_B, live_B, self.costs, self.steps)
        observed = observed_GN((trials_BJ.sum(axis=0) + self.pool.trials)[None], self.steps)[0]
        best, leave = better_k(times, None if current is None else self.steps.index(current), self.switch_s,
                               margin, observed)
        return (self.steps[int(best)] if leave else current), c_BJ

    def settle(self, policy, c_BJ):
        """The last call's cycles tallied and its counts into the pool, after the generation's timing; returns the
        rows' acceptance estimate at the end (its window with the pool as the call found it), else `c_BJ`."""
        if self.unsettled is None:
            return c_BJ
        # rows: a K call's live rows; a plain call's, the tokens each row had before it
        read, start, k, c_ran_BJ, rows = self.unsettled
        self.unsettled = None
        if k == 0:  # a plain call with probes: its steps, and the c_1 its last block observed
            self.plain(read.plain_steps, read.generated_B - rows, logged=True)
            hits, trials = c1_counts(read, max(self.steps))
            c_BJ = acceptance_BJ(hits, trials, self.pool.hits, self.pool.trials, np.float32(policy.prior))
            self.pool.add(hits, trials)
            return c_BJ
        live_B = rows
        cycles, log = read.cycles, read.log_BC
        self.ran(k, cycles - start, c_ran_BJ, live_B)
        if read.plain_steps:  # the loop's plain tail ran plain decoding to the end in the same call
            self.plain(read.plain_steps, read.generated_B - read.plain_from_B)
        hits, trials = window_counts(log, start, cycles, k, max(self.steps), policy.window)
        c_BJ = acceptance_BJ(hits, trials, self.pool.hits, self.pool.trials, np.float32(policy.prior))
        self.pool.add(*window_counts(log, start, cycles, k, max(self.steps), NO_LIMIT))
        return c_BJ

    def plain(self, steps: int, tokens_B, logged: bool = False) -> None:
        """Plain decoding ran `steps` steps that emitted `tokens_B` a row (`logged`: as cycles of the acceptance log,
        a plain call with probes)."""
        self.k_per_cycle += [0] * steps
        self.unlogged += 0 if logged else steps
        self.tallies.append((0, steps, None, tokens_B))

    def ran(self, k: int, cycles: int, c_BJ, live_B) -> None:
        """A call ran `cycles` cycles at K for the rows `live_B`, whose acceptance the host estimated as `c_BJ`."""
        self.k_per_cycle += [k] * cycles
        self.tallies.append((k, cycles, c_BJ, live_B))

    def expected(self) -> tuple[float, float]:
        """(the model's E[tokens], t(K) summed) over every cycle and plain step run: plain steps count the tokens
        they emitted, a cycle the E[tokens | K] of the estimate its call ran on."""
        tokens = seconds = 0.0
        for k, n, c_BJ, rows in self.tallies:
            if k == 0:
                tokens += float(np.sum(rows))
            else:
                e_B = expected_tokens_BN(c_BJ, self.steps)[:, self.steps.index(k)]
                tokens += n * float(np.sum(np.where(rows, e_B, 0.0)))
            seconds += n * float(self.costs[self.steps.index(k)])
        return tokens, seconds


def _pool(engine, greedy: bool, j_max: int, window: int) -> Pool:
    """The engine's position counts for greedy or sampled generation (acceptance differs between them)."""
    if greedy not in engine.acceptance_pools:
        engine.acceptance_pools[greedy] = Pool(j_max, float(window))
    return engine.acceptance_pools[greedy]


def rule_inputs(run: Calls, k: int, remaining_B, live_B, policy, min_cycles: int, limit: int) -> np.ndarray:
    """The leaving test's inputs for a call of at most `limit` cycles at K (`stay_band` for windows of the call's
    first test), one array (`rule_array`). Where a call costs no more than a plain step, the band's low edge is at
    least where a full window would send the host to plain decoding: the first test's band, priced for its few
    cycles, leans on the pool and the prior, and a K they made look good (K = 1 at an acceptance of 0.15 at
    Kimi's depth) would otherwise run to the end of the batch though its window shows plain decoding faster. A
    window that dips there on noise costs a call, which there is cheap; where a call is dear the band stays wide
    (docs/performance.md, "A loop leaves for plain decoding on a full window's evidence")."""
    args = (k, remaining_B, live_B, run.costs, run.steps, run.switch_s, policy.margin, run.pool.hits,
            run.pool.trials, policy.prior)
    low, high, plain_high = stay_band(*args, min(min_cycles, policy.window))
    if not call_outweighs_step(run.costs, run.steps, run.switch_s):
        full_window_plain = np.float32(stay_band(*args, policy.window)[2])
        low = max(low, float(np.nextafter(full_window_plain, np.float32(np.inf))))  # that mean itself leaves
    return rule_array(low, high, min_cycles, limit, plain_high)


def never_leaving(limit: int) -> np.ndarray:
    """A call that runs its K for `limit` cycles (or to the end)."""
    return rule_array(-np.inf, np.inf, 0, limit)


def c1_counts(read: ProbeSummary, j_max: int):
    """(hits_BJ, trials_BJ) of a plain call's last block: c_1 observed at every entry, the deeper positions not."""
    hits, trials = np.zeros((read.b, j_max), np.float32), np.zeros((read.b, j_max), np.float32)
    hits[:, 0], trials[:, 0] = read.c1_hits_B, read.c1_trials_B
    return hits, trials


def probe_inputs(run: Calls, remaining_B, live_B, policy, min_steps: int, limit: int = NO_LIMIT):
    """A plain call's leaving test inputs (`probe_array`), or None where no c_1 would take the host off plain
    decoding for the tokens the slowest live row still wants: plain decoding then runs to the end without probes."""
    # one table a block, priced for its observations: the host weighs a block's counts against the pool's, so a
    # short first block may need a c_1 a longer one does not; where even the longest block at full acceptance would
    # not take the host off plain decoding, no block will
    need_SG = np.stack([plain_leave_remaining(run.costs, run.steps, run.switch_s, policy.margin, run.pool.hits,
                                              run.pool.trials, policy.prior, observed)
                        for observed in probe_observations(policy.probe_every)])
    slowest = float(np.max(np.where(live_B, remaining_B, 0)))
    if not np.min(need_SG[:, -1]) <= slowest:  # not even full acceptance pays the switch back
        return None
    return probe_array(need_SG, min_steps, limit, min(FIRST_BLOCK, policy.probe_every))


def _program_specs(engine, state, sp, greedy: bool, max_new_tokens: int, streamed: bool,
                   tails: tuple[int, ...] = ()) -> list[tuple]:
    """The `Engine._compile` specs of the loops, one per K of the set in order (`state`: the prefilled state or its
    shapes): device loops (`spec_loop`, the K in `tails` with their plain tail; for K = 0 `probe_loop` where plain
    calls probe, else `plain_loop`) or, streamed, `probe_loop` where plain calls probe, then single cycles that also
    return their progress. The probe loop, the set's slowest build but for a tailed loop, comes first: each program
    goes to XLA as soon as it is lowered."""
    policy = engine.adaptive
    steps = policy.resolve_steps(engine.k)
    plain_state = to_plain(state)  # a restructuring: its shapes need no trace
    w = engine.weights
    baked = (greedy, max_new_tokens, policy.compiled(engine.k))
    probe = ("calls_loop_probe", functools.partial(probe_loop, cfg=engine.cfg, greedy=greedy,
                                                   max_new_tokens=max_new_tokens, width=policy.probe_every),
             {}, (w, state, sp, plain_to_the_end(0)), (1,), baked + (policy.probe_every,))
    specs = [probe] if streamed and probes(engine) else []
    for k in steps:
        if k == 0 and streamed:
            step = functools.partial(baseline_step, cfg=engine.cfg, greedy=greedy, max_new_tokens=max_new_tokens)
            specs.append(("calls_cycle_plain", with_progress(step), {}, (w, plain_state, sp), (1,), baked))
        elif k == 0 and probes(engine):
            specs.append(probe)
        elif k == 0:
            fn = functools.partial(plain_loop, cfg=engine.cfg, greedy=greedy, max_new_tokens=max_new_tokens)
            specs.append(("calls_loop_plain", fn, {}, (w, plain_state, sp, jnp.int32(0)), (1,), baked))
        elif streamed:
            step = functools.partial(speculative_cycle, cfg=engine.cfg, k=k, greedy=greedy,
                                     max_new_tokens=max_new_tokens, drafter=engine.drafter)
            specs.append((f"calls_cycle_{k}", with_progress(step), {}, (w, state, sp), (1,), baked))
        else:
            specs.append(_k_loop_spec(engine, state, sp, greedy, max_new_tokens, k, k in tails))
    return specs


def _k_loop_spec(engine, state, sp, greedy: bool, max_new_tokens: int, k: int, tail: bool) -> tuple:
    """The `Engine._compile` spec of K's device loop (`spec_loop`), with its plain tail where `tail`."""
    compiled = engine.adaptive.compiled(engine.k)
    fn = functools.partial(spec_loop, cfg=engine.cfg, k=k, window=compiled[1], greedy=greedy,
                           max_new_tokens=max_new_tokens, drafter=engine.drafter, plain_tail=tail)
    return (f"calls_loop_{k}" + ("_tail" if tail else ""), fn, {}, (engine.weights, state, sp, never_leaving(0)), (1,),
            (greedy, max_new_tokens, compiled))


def _keyed(steps: tuple[int, ...], loops: list, engine, streamed: bool) -> dict:
    """{K: program} (`_program_specs`' order), with the plain loop that probes under PROBE where there is one."""
    streamed_probe = streamed and probes(engine)
    programs = dict(zip(steps, loops[1:] if streamed_probe else loops))
    if probes(engine):
        programs[PROBE] = loops[0] if streamed_probe else programs[0]
    return programs


def probes(engine) -> bool:
    """Whether a plain call keeps the draft current and observes c_1 (`probe_loop`): plain decoding in the K set
    and the EAGLE-3 draft's own predictions (a drafter plug is not what the catch-up's draft forward predicts
    with). The device loop and streaming run the same program (streaming one block a call)."""
    policy = engine.adaptive
    return policy.probe_every > 0 and engine.drafter is None and 0 in policy.resolve_steps(engine.k)


def _programs(engine, state, sp, greedy: bool, max_new_tokens: int, streamed: bool, tails: tuple[int, ...] = ()):
    """{K: program} for every K of the set (`_program_specs`), compiled side by side. Returns (programs, compile
    seconds)."""
    steps = engine.adaptive.resolve_steps(engine.k)
    specs = _program_specs(engine, state, sp, greedy, max_new_tokens, streamed, tails)
    built = engine._compile_together(specs)
    return _keyed(steps, [program for program, _ in built], engine, streamed), sum(c for _, c in built)


def _cost_table(engine, state, sp, programs, greedy: bool, streamed: bool):
    """(t(K) per cycle of each K, the price of one more call, where they came from, seconds spent measuring). The
    device loops are timed for `generate`; streamed, the single-cycle programs called back to back, as streaming
    calls them (their host round trip is what a streamed cycle costs)."""
    known = _known_costs(engine, state, greedy, streamed)
    if known is not None:
        return known
    policy = engine.adaptive
    steps = policy.resolve_steps(engine.k)
    key = engine.cost_key(state, greedy, "per_call_stream" if streamed else "per_call")

    probed = probes(engine) and not streamed  # K = 0's device loop is the plain loop that probes

    def run_forced(copy, branch, n):
        k, program = steps[branch], programs[steps[branch]]
        s = to_plain(copy) if k == 0 and not probed else copy
        count = (lambda x: int(x.steps)) if k == 0 and not probed else (lambda x: int(x.cycles))
        start = count(s)
        if streamed:
            for _ in range(n):
                s, _ = program(engine.weights, s, sp)
        elif k == 0 and probed:
            s, _ = program(engine.weights, s, sp, plain_to_the_end(n))
        elif k == 0:
            s, _ = program(engine.weights, s, sp, np.int32(n))
        else:
            s, _ = program(engine.weights, s, sp, never_leaving(n))
        return s, count(s) - start

    t0 = time.perf_counter()
    table = adaptive_costs.measure(run_forced, state, len(steps))
    measure_s = time.perf_counter() - t0
    if table is None:  # nothing left to generate: any table serves
        return np.ones(len(steps)), 0.0, "none", measure_s
    adaptive_costs.remember(key, table, steps)
    return _table_costs(policy, table, "measured", measure_s)


def _known_costs(engine, state, greedy: bool, streamed: bool):
    """The cost table where it is known without timing anything (given, or measured earlier for this device and
    shape), else None. `state` may be still computing: only its shapes are read."""
    policy = engine.adaptive
    if policy.costs is not None:
        switch = policy.switch_s if policy.switch_s is not None else 0.0
        return np.array([c for _, c in policy.costs], np.float64), switch, "given", 0.0  # reported as given
    table = adaptive_costs.cached(engine.cost_key(state, greedy, "per_call_stream" if streamed else "per_call"))
    return None if table is None else _table_costs(policy, table, "cached", 0.0)


def _table_costs(policy, table, source: str, measure_s: float):
    switch = policy.switch_s if policy.switch_s is not None else table.first_run_s
    return np.array(table.costs_s, np.float64), switch, source, measure_s


def _start(engine, prompts, max_new_tokens, sampling: SamplingParams, seed, streamed: bool):
    """Prefill, the programs, the cost table and this generation's `Calls`. Where the table is known before the
    prefill ends (`_known_costs`), the host's first choice and the first call's rule are computed while the device
    prefills: `first` = (K, the rows' acceptance estimate, the rule) or None where `drive` computes them."""
    policy = engine.adaptive
    steps, window, _ = policy.compiled(engine.k)
    sp = sampling.validate().as_arrays()
    early = {}

    def meanwhile(pending_state):
        known = early["known"]  # looked up from the state's shapes when its programs were specified (`specs`)
        if known is None:
            return
        early["run"] = run = _calls(engine, steps, window, sampling.greedy, *known[:2])
        early["costs"] = known
        if not streamed:
            k, c_BJ, rule = first_call(run, policy, pending_state.pending.shape[0], max_new_tokens)
            if rule is not None and engine.mesh is None:  # on the device before the call (a mesh program places it)
                rule = jax.device_put(rule)
            early["first"] = k, c_BJ, rule

    def specs(shapes):
        # the loops compile beside the prefill, so the first call follows the prefill without a host gap; the plain
        # tails the cost table asks for where it is known already (`PerCallPolicy.built_tails`)
        early["known"] = known = _known_costs(engine, shapes, sampling.greedy, streamed)
        early["tails"] = () if known is None or streamed else policy.built_tails(engine.k, known[0], known[1])
        return _program_specs(engine, shapes, sp, sampling.greedy, max_new_tokens, streamed, early["tails"])

    state, prefill_s, compile_s, lengths, *loops = engine._prefill(prompts, max_new_tokens, sampling, seed, True,
                                                                   then=specs, meanwhile=meanwhile)
    programs = _keyed(steps, loops, engine, streamed)
    if "run" in early:
        run, (_, _, source, measure_s) = early["run"], early["costs"]
    else:
        costs, switch, source, measure_s = _cost_table(engine, state, sp, programs, sampling.greedy, streamed)
        run = _calls(engine, steps, window, sampling.greedy, costs, switch)
        # a table measured only now: the loops it gives a plain tail are built again with it (a later process
        # finds the table and builds them so at once)
        late = () if streamed else tuple(k for k in policy.built_tails(engine.k, costs, switch)
                                         if k not in early["tails"])
        if late:
            built = engine._compile_together([_k_loop_spec(engine, state, sp, sampling.greedy, max_new_tokens, k, True)
                                              for k in late])
            programs.update(zip(late, (program for program, _ in built)))
            compile_s += sum(seconds for _, seconds in built)
    return (state, sp, prefill_s, compile_s, lengths, programs, run, (source, measure_s), early.get("first"))


def _calls(engine, steps, window, greedy: bool, costs, switch) -> Calls:
    """A generation's `Calls`, its pool the engine's (aged by one generation)."""
    pool = _pool(engine, greedy, max(steps), window)
    pool.new_generation()
    return Calls(steps, pool, costs, switch)


def first_call(run: Calls, policy, b: int, max_new_tokens: int):
    """(K, the rows' acceptance estimate, the rule) of a generation's first call, from a prefilled state's
    progress: one token out a row, none done, no cycle run (a row its first token finished is found done after
    the first call, which runs nothing for it), so the prefill need not be read back."""
    zeros = np.zeros((b, max(run.steps)), np.float32)
    remaining, live = np.full(b, max_new_tokens - 1, np.int64), np.ones(b, bool)
    k, c_BJ = run.choose(zeros, zeros, remaining, live, policy.prior, policy.margin, None)
    rule = None if k == 0 else rule_inputs(run, k, remaining, live, policy, policy.min_cycles, NO_LIMIT)
    return k, c_BJ, rule


def generate(engine, prompts, max_new_tokens: int, sampling: SamplingParams, seed: int) -> GenerationResult:
    """Prefill, then calls of one fixed-K loop each until the batch is done (plain decoding last, where chosen)."""
    policy = engine.adaptive
    state, sp, prefill_s, compile_s, lengths, loops, run, (source, measure_s), first = _start(
        engine, prompts, max_new_tokens, sampling, seed, streamed=False)
    call_probe = None if PROBE not in loops else lambda s, probe_F: loops[PROBE](engine.weights, s, sp, probe_F)
    t0 = time.perf_counter()
    # without probes K = 0 is plain decoding's own loop over the converted state
    state, spec_log, plain_from, c_BJ, host = drive(
        state, lambda k, s, rule: loops[k](engine.weights, s, sp, rule),
        lambda s: loops[0](engine.weights, s, sp, np.int32(NO_LIMIT)), run, policy, max_new_tokens, first,
        call_probe)
    decode_s = time.perf_counter() - t0
    c_BJ = run.settle(policy, c_BJ)
    return _result(state, spec_log, lengths, plain_from, prefill_s, decode_s, compile_s, run, source, measure_s,
                   c_BJ, host)


def drive(state, call_k, call_plain, run: Calls, policy, max_new_tokens: int, first=None, call_probe=None):
    """The calls of one generation from its prefilled state: `call_k(k, state, rule) -> (state, summary)` runs the
    K loop (`spec_loop`), `call_plain(plain state) -> (state, summary)` plain decoding to the end (`plain_loop`),
    `call_probe(state, probe_F) -> (state, summary)` plain decoding with the draft's catch-ups until its test
    leaves (`probe_loop`; None: plain decoding always runs to the end); `first`: the first call's (`first_call`),
    where computed already. Returns (the final state, the acceptance log where it ended on plain decoding's state
    else None, the tokens each row had at the switch to that state or None, the rows' last acceptance estimate,
    and a function that returns the final (generated_B, out_tokens_BN) from what the host read: the decode ends
    with its tokens read back, as `Engine.generate`'s does, and they are cut from that read once it has ended). The
    last call is left to `Calls.settle`, which tallies it and pools its counts after the decode's timing."""
    window, margin, j_max = policy.window, policy.margin, max(run.steps)
    b, log_shape = state.pending.shape[0], state.accepted_log.shape
    # what the host knows of the rows, from each call's summary; the prefilled state is not read back, so the first
    # call follows the prefill without a wait (`first_call`)
    generated, done, cycles = np.ones(b, np.int64), np.zeros(b, bool), 0
    k, c_BJ, rule = first if first is not None else first_call(run, policy, b, max_new_tokens)
    # a plain call's steps before its first test: each plain call runs at least twice the last one's, so a drafter
    # whose probes and cycles disagree costs a few calls a generation, not one every block
    min_cycles, probe_min_steps = policy.min_cycles, 0
    while True:  # a call's summary says whether the batch is done; plain decoding's own loop runs to the end
        run.calls += 1
        if k == 0:
            if call_probe is None:
                out, summary = call_plain(to_plain(state))
                steps, final, out_tokens = read_plain_summary(summary, b)
                run.plain(int(steps), final - generated)
                return out, state.accepted_log, generated, c_BJ, lambda: (final, out_tokens)
            probe_F = probe_inputs(run, max_new_tokens - generated, ~done, policy, probe_min_steps)
            if probe_F is None:  # nothing could pay: no catch-up before the end
                probe_F = plain_to_the_end(NO_LIMIT)
            before = generated
            state, summary = call_probe(state, probe_F)
            read = ProbeSummary(summary, b)
            if read.all_done:
                run.unsettled = (read, cycles, 0, c_BJ, before)
                return state, None, None, c_BJ, read.tokens
            cycles, done, generated = read.cycles, read.done_B, read.generated_B
            run.plain(read.plain_steps, generated - before, logged=True)
            hits, trials = c1_counts(read, j_max)
            k_next, c_BJ = run.choose(hits, trials, max_new_tokens - generated, ~done, policy.prior, margin, 0)
            run.pool.add(hits, trials)
            probe_min_steps = min(max(policy.probe_every, 2 * probe_min_steps), NO_LIMIT)
            min_cycles, k = policy.min_cycles, k_next
            continue
        start, live_B = cycles, ~done
        if rule is None:
            rule = rule_inputs(run, k, max_new_tokens - generated, live_B, policy, min_cycles, NO_LIMIT)
        (state, summary), rule = call_k(k, state, rule), None
        # one read of everything the host weighs next: each array read is a round trip to the device, which waits
        read = CallSummary(summary, *log_shape)
        if read.all_done:  # the last call: tallied, and its counts in the pool, once the tokens are out (`settle`)
            run.unsettled = (read, start, k, c_BJ, live_B)
            if read.plain_steps:  # the loop's plain tail ran plain decoding to the end in the same call
                return state, state.accepted_log, read.plain_from_B, c_BJ, read.tokens
            return state, None, None, c_BJ, read.tokens
        cycles, done, generated, log = read.cycles, read.done_B, read.generated_B, read.log_BC
        run.ran(k, cycles - start, c_BJ, live_B)
        # the call's leaving test read its last `window` cycles; the host weighs them per position with the pool
        # as it was, and the pool then takes the whole call
        hits, trials = window_counts(log, start, cycles, k, j_max, window)
        k_next, c_BJ = run.choose(hits, trials, max_new_tokens - generated, ~done, policy.prior, margin, k)
        run.pool.add(*window_counts(log, start, cycles, k, j_max, NO_LIMIT))
        min_cycles = min(2 * min_cycles, NO_LIMIT) if k_next == k else policy.min_cycles
        k = k_next


def stream(engine, prompts, max_new_tokens: int, sampling: SamplingParams, seed: int,
           pipelined: bool = True) -> Iterator[list[list[int]] | GenerationResult]:
    """`Engine.stream` by call: one cycle a call as fixed K streams, the rule run on the host between them from
    the tokens each cycle emitted (a live row that emitted n tokens accepted n - 1 drafts). Plain decoding with
    probes runs one block of FIRST_BLOCK steps a call (`probe_loop`), its tokens shown as the block ends, and the
    host weighs the block's c_1 as `drive` does."""
    policy = engine.adaptive
    steps, window, _ = policy.compiled(engine.k)
    min_cycles, margin = policy.min_cycles, policy.margin
    state, sp, prefill_s, compile_s, lengths, cycles_by_k, run, (source, measure_s), _ = _start(
        engine, prompts, max_new_tokens, sampling, seed, streamed=True)
    j_max, b = max(steps), len(prompts)
    zeros = np.zeros((b, j_max), np.float32)
    progress = read_progress(jax.device_get(state_progress(state)), b)
    k, c_BJ = run.choose(zeros, zeros, max_new_tokens - progress[0], ~progress[2], policy.prior, margin, None)
    shown = np.zeros(b, np.int64)
    dispatched: list = []  # K of every call queued (PROBE: a plain block; past-the-end calls change nothing)
    at_k: list[np.ndarray] = []  # accepted per row of each cycle observed since K last changed (-1: not live)
    plain_from = spec_log = None
    probe_F = None  # where plain decoding runs with probes: the block calls' test inputs

    def plain_inputs(generated, done):
        if PROBE not in cycles_by_k:
            return None
        return probe_inputs(run, max_new_tokens - generated, ~done, policy, 0, limit=FIRST_BLOCK)

    if k == 0:
        probe_F = plain_inputs(progress[0], progress[2])

    def dispatch(s):
        nonlocal plain_from, spec_log
        if k == 0 and probe_F is not None:
            dispatched.append(PROBE)
            s, summary = cycles_by_k[PROBE](engine.weights, s, sp, probe_F)
            return s, (PROBE, summary)
        if k == 0 and plain_from is None:
            plain_from, spec_log = np.asarray(jax.device_get(s.generated)), s.accepted_log
            s = to_plain(s)
        dispatched.append(k)
        s, queued = cycles_by_k[k](engine.weights, s, sp)
        return s, (k, queued)

    def read(call):
        kind, out = call
        if kind == PROBE:
            probed = ProbeSummary(jax.device_get(out), b)
            generated_B, out_tokens_BN = probed.tokens()
            return (generated_B, out_tokens_BN, probed.done_B), kind, probed
        return read_progress(jax.device_get(out), b), kind, None

    decode_s, t0 = 0.0, time.perf_counter()
    in_flight, kind, probed = None, None, None  # the call whose progress is read now (None: the prefill's)
    if pipelined and not progress[2].all():
        state, in_flight = dispatch(state)
    while True:
        generated, _, done = progress
        emitted = generated - shown
        new = new_tokens(progress, shown)
        if any(new):
            decode_s += time.perf_counter() - t0
            yield new
            t0 = time.perf_counter()
        if kind == PROBE:
            run.plain(probed.plain_steps, emitted, logged=True)
        elif kind is not None and kind > 0 and (emitted > 0).any():
            run.ran(kind, 1, c_BJ, emitted > 0)
        if done.all():
            break
        # a block read after the host took a K again (streaming queues one call ahead) decides nothing
        if kind == PROBE and k == 0:  # the block's c_1 against the host's rule, as `drive` weighs a plain call
            hits, trials = c1_counts(probed, j_max)
            k, c_BJ = run.choose(hits, trials, max_new_tokens - generated, ~done, policy.prior, margin, 0)
            run.pool.add(hits, trials)
            probe_F = plain_inputs(generated, done) if k == 0 else None
        elif kind == k and k > 0:  # a cycle of the K in use
            at_k.append(np.where(emitted > 0, emitted - 1, -1))
            if len(at_k) >= min_cycles:
                log = np.stack(at_k[-window:], axis=1)
                hits, trials = window_counts(log, 0, log.shape[1], k, j_max, window)
                k_next, c_BJ = run.choose(hits, trials, max_new_tokens - generated, ~done, policy.prior, margin, k)
                if k_next != k:
                    run.pool.add(*window_counts(np.stack(at_k, axis=1), 0, len(at_k), k, j_max, NO_LIMIT))
                    at_k, k = [], k_next
                    probe_F = plain_inputs(generated, done) if k == 0 else None
        state, queued = dispatch(state)
        if pipelined:
            (progress, kind, probed), in_flight = read(in_flight), queued
        else:
            progress, kind, probed = read(queued)
    jax.block_until_ready(state)
    decode_s += time.perf_counter() - t0
    if at_k and k > 0:
        run.pool.add(*window_counts(np.stack(at_k, axis=1), 0, len(at_k), k, j_max, NO_LIMIT))
    run.calls = len(dispatched)
    if plain_from is not None:
        run.plain(int(state.steps), np.asarray(jax.device_get(state.generated)) - plain_from)
    yield _result(state, spec_log, lengths, plain_from, prefill_s, decode_s, compile_s, run, source, measure_s, c_BJ)


def _result(state, spec_log, lengths, plain_from, prefill_s, decode_s, compile_s, run: Calls, source, measure_s,
            c_BJ, host=None) -> GenerationResult:
    """`spec_log`: the speculative cycles' acceptance log where the generation ended in plain steps (the final
    state is then plain decoding's). `host`: returns the final (generated, out_tokens) already read (`drive`), else
    None."""
    generated, out_tokens = host() if host is not None else jax.device_get((state.generated, state.out_tokens))
    tokens = [out_tokens[i, : generated[i]].tolist() for i in range(len(generated))]
    logged = len(run.k_per_cycle) - run.unlogged  # cycles in the acceptance log (a probed plain step's accepts 0)
    log = jax.device_get(state.accepted_log if spec_log is None else spec_log)
    accepted = [[int(a) for a in row[:logged] if a >= 0] for row in log]
    if plain_from is not None:  # a plain step emits one token a live row and accepts nothing
        accepted = [row + [0] * int(generated[i] - plain_from[i]) for i, row in enumerate(accepted)]
    report = AdaptiveReport(run.steps, tuple(float(c) for c in run.costs), source, measure_s, list(run.k_per_cycle),
                            *run.expected(), float(run.switch_s),
                            np.asarray(c_BJ, float).tolist(), run.calls)
    return GenerationResult(tokens, accepted, [int(x) for x in lengths], prefill_s, decode_s, compile_s,
                            len(run.k_per_cycle), report)
