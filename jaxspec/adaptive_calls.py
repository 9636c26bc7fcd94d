"""Adaptive speculation by call: each call of the on-device loop runs one fixed-K program, and K changes only between
calls, where the time it saves over the tokens still wanted is larger than what a change costs.

Why not per cycle. The per-cycle program (jaxspec.adaptive) holds every K behind a switch in one loop. On a GPU that
program's cycle costs more than the fixed-K program's at the same K, and every further branch a call runs costs the
host a command-buffer update (docs/performance.md, "Adaptive speculation"). Here a cycle IS the fixed-K program's
cycle: what the choice adds to it is the leaving test's few scalar operations a cycle. A change of K costs
one more call, which the measured cost table prices (its intercept: what a call costs beyond its cycles).

The rule (on the host, between calls). With c_j the conditional acceptance of draft position j, a cycle of K
drafts yields E[tokens | K] = 1 + sum_{j<=K} prod_{i<=j} c_i and costs t(K) (t(0): a plain decode step, E = 1). The
loop needs about max_b R_b / E_b[K] more cycles for the tokens R_b its live rows still want, so it finishes in

    T(K) = t(K) * max_b R_b / E_b[K]

and the host takes the smallest K whose T is within `margin` of the fastest among those whose every position has
been observed, else the fastest (`fastest_G`), leaving the current one only where T(K') + switch < (1 - margin) T(K),
`switch` the measured price of one more call. Its estimate of c_j for a row counts the last call's last `window`
cycles (a cycle that accepted a of K observes positions 1..min(a + 1, K), accepted up to a), plus what earlier calls
and generations observed (`Pool`: counts per position over the batch, halved at each new generation and capped at
`window` observations so a new prompt's own cycles soon dominate), shrunk towards c_{j-1} (c_1 towards `prior`)
with the weight of PRIOR_WEIGHT observations, so a depth not yet observed expects what the shallower positions
accept.

The leaving test (in the loop, every cycle after the call's first `min_cycles`). It runs every cycle, so it reads
one figure, kept in the loop's carry: the mean drafts accepted a cycle over the call's last `window` cycles,
against a band the host computed before the call (`stay_band`: the flat acceptances for which the host's own
estimate and choice keep K). Where the host, weighing every position, keeps the K a call left anyway, the next call
of that K waits twice as many cycles before its first test, so a band that is too narrow costs a few calls, not one
every `min_cycles`. Where a call costs no more than a plain step, the band's low edge is at least where a full
window would send the host to plain decoding (`adaptive_calls_run.rule_inputs`), so a K that the pool and the prior
made look good does not run to the end of the batch.

Plain decoding and the draft. A plain step does not run the draft, so the draft's cache misses the positions it
skipped. A plain call therefore keeps the draft current where speculation could still pay (`probe_loop`): after each
block of plain steps (FIRST_BLOCK, doubling to `probe_every`) one draft forward over them
(`jaxspec.adaptive.catch_up`) writes the draft cache and observes c_1 for free (the draft's prediction at each
position against the token the target emitted), and the call ends where that block's c_1 says the host would leave
plain decoding for a K (`plain_leave_remaining`: per flat c_1, the fewest tokens still wanted for which the switch
pays), so a prompt whose text turns predictable after a stretch the draft could not follow gets speculation back.
That is one call for a drafter that never matches, as before, switched off within `min_cycles` cycles of the first
call, and a catch-up's draft forward a block. Where no K could pay even at full acceptance (a CPU's cost table, a
few tokens left) the plain call runs to the end as one block (`plain_to_the_end`), and without probes (a drafter
plug, whose drafts the catch-up's draft forward does not predict) the state is converted (`to_plain`) for plain
decoding's own loop. The loops of the K in `plain_tails` go on with plain decoding in their own call where their
test leaves for it (the band's `plain_high`), so that switch costs no call, which on a small model is the price of a
few plain steps; that tail runs to the end. Each tail compiles a plain step into its loop: a second target forward,
which doubles that loop's build, and the set builds its programs side by side, so its build is its slowest
program's. A tail is therefore built only where the cost table says a call costs more than a plain step
(`PerCallPolicy.built_tails`): a small model, where K = 1 is also where a fresh pool's prior starts. At Kimi's depth
a call is a fraction of a step, the tail saves no measurable time and would take the set's build past twice a
fixed-K loop's (docs/performance.md, "Plain decoding in the K loop's call", "The tail where a call outweighs a step").

Losslessness does not depend on K: every cycle is the fixed-K cycle or a plain step, from fresh randomness.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.adaptive import catch_up, empty_backlog, plain_decode
from jaxspec.baseline_step import baseline_step
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.spec_step import speculative_cycle
from jaxspec.state import BaselineState, SpecState, on_host, progress, read_progress

PRIOR_WEIGHT = 2.0  # observations a position's prior (its shallower neighbour, or `prior` for c_1) counts for
POOL_DECAY = 0.5  # weight the pooled counts keep at each new generation
BAND_GRID = 101  # flat acceptances the stay band is evaluated at


@dataclasses.dataclass(frozen=True)
class PerCallPolicy:
    steps: tuple[int, ...] | None = None  # the K set, 0 (plain decoding) included; None: 0..K
    prior: float = 0.7  # c_1 before any observation: about what EAGLE-3 drafters accept at the first position
    # cycles a call runs at its K before the rule may leave it; doubled for the next call of the same K each time the
    # host, weighing every position, keeps the K the call's test left (its flat-acceptance band is an approximation)
    min_cycles: int = 4
    window: int = 32  # the call's most recent cycles its estimate reads (also the pool's cap, in observations)
    margin: float = 0.03  # the fraction of T(K) another K must save beyond the switch's price
    # the K whose loop goes on with plain decoding in its call where a call costs more than a plain step (see above)
    plain_tails: tuple[int, ...] = (1,)
    # the longest block of plain steps between the draft's catch-ups in a plain call (blocks start at FIRST_BLOCK and
    # double; each catch-up observes c_1: `probe_loop`); 0: plain decoding runs to the end without them
    probe_every: int = 32
    costs: tuple[tuple[int, float], ...] | None = None  # ((K, seconds per cycle), ...); None: measured on the device
    switch_s: float | None = None  # the price of one more call; None: the measured table's (0 with given costs)

    def resolve_steps(self, k_max: int) -> tuple[int, ...]:
        steps = tuple(sorted(set(self.steps if self.steps is not None else range(k_max + 1))))
        if k_max < 1 or any(s < 0 or s > k_max for s in steps) or max(steps) < 1:
            raise ValueError(f"adaptive steps {list(steps)} must lie in 0..{k_max} and include a K >= 1")
        return steps

    def resolve_tails(self, k_max: int) -> tuple[int, ...]:
        """The K of the set whose loops carry a plain tail (none where plain decoding is not in the set)."""
        steps = self.resolve_steps(k_max)
        return tuple(sorted(set(self.plain_tails) & set(steps) - {0})) if 0 in steps else ()

    def validate(self, k_max: int) -> "PerCallPolicy":
        steps = self.resolve_steps(k_max)
        if any(k < 1 or k > k_max for k in self.plain_tails):
            raise ValueError(f"adaptive plain_tails {list(self.plain_tails)} must lie in 1..{k_max}")
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"adaptive prior must be in [0, 1], got {self.prior}")
        if self.min_cycles < 1 or self.window < 1:
            raise ValueError("adaptive min_cycles and window must be >= 1")
        if self.probe_every < 0:
            raise ValueError(f"adaptive probe_every must be >= 0, got {self.probe_every}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"adaptive margin must be in [0, 1), got {self.margin}")
        if self.costs is not None:
            given = dict(self.costs)
            if sorted(given) != list(steps):
                raise ValueError(f"adaptive costs name K = {sorted(given)}, the K set is {list(steps)}")
            if not all(0.0 < float(v) < float("inf") for v in given.values()):
                raise ValueError("adaptive costs must be positive finite times")
        if self.switch_s is not None and not 0.0 <= self.switch_s < float("inf"):
            raise ValueError(f"adaptive switch_s must be a finite time >= 0, got {self.switch_s}")
        return self

    def compiled(self, k_max: int) -> tuple:
        """What the loop programs bake in: (K set, window, K that may carry a plain tail). The band, the minimum and
        the call's limit are arguments; which tails are built follows the cost table (`built_tails`)."""
        return (self.resolve_steps(k_max), self.window, self.resolve_tails(k_max))

    def built_tails(self, k_max: int, costs_N, switch_s: float) -> tuple[int, ...]:
        """The K of `resolve_tails` whose loops are built with their plain tail under the cost table `costs_N`
        (seconds per cycle of each K of the set) and the price of one more call `switch_s`: all of them where a call
        costs more than a plain step (`call_outweighs_step`), else none. The tail saves one call at a switch to
        plain decoding and costs its loop's build a plain step's target forward; where a call is cheaper than a step
        the saving is below a step a switch."""
        tails = self.resolve_tails(k_max)
        return tails if tails and call_outweighs_step(costs_N, self.resolve_steps(k_max), switch_s) else ()


def call_outweighs_step(costs_N, steps: tuple[int, ...], switch_s: float) -> bool:
    """Whether one more call costs more than a plain step under the cost table `costs_N` (seconds per cycle of each K
    of `steps`; False without plain decoding in the set): a small model's regime, where the rule avoids calls (a
    plain tail, wide stay bands); at depth a call is a fraction of a step."""
    return 0 in steps and switch_s > float(costs_N[steps.index(0)])


# What a call's leaving test reads besides the state, one float32 array (one transfer a call; an argument, so one
# program serves any band): the band of mean drafts accepted a cycle within which K stays the host's choice (low,
# high), the cycles the call runs before it may leave, the cycles it may run at most, and the mean at or below which
# a loop that left goes on with plain decoding where it carries a plain tail (`plain_high`).
RULE_LOW, RULE_HIGH, RULE_MIN_CYCLES, RULE_LIMIT, RULE_PLAIN_HIGH = range(5)
RULE_FIELDS = 5


def rule_array(low: float, high: float, min_cycles: int, limit: int, plain_high: float = -np.inf) -> np.ndarray:
    """The leaving test's inputs (a limit beyond float32's exact integers only ever compares as larger)."""
    return np.array([low, high, min_cycles, limit, plain_high], np.float32)


# --- the rule (on the host) ----------------------------------------------------------------------------------
def window_counts(log_BC, first, last, k: int, j_max: int, window: int):
    """(hits_BJ, trials_BJ): position counts over cycles [max(first, last - window), last) of the acceptance log
    (-1 where a row ran no cycle), all of them at K = k."""
    lo = max(int(first), int(last) - window, 0)
    a_BWJ = np.asarray(log_BC)[:, lo:int(last), None]
    j_J = np.arange(1, j_max + 1)
    seen_BWJ = (a_BWJ >= 0) & (a_BWJ >= j_J - 1) & (j_J <= k)
    hits_BJ = np.sum(seen_BWJ & (a_BWJ >= j_J), axis=1).astype(np.float32)
    return hits_BJ, np.sum(seen_BWJ, axis=1).astype(np.float32)


def acceptance_BJ(hits_BJ, trials_BJ, pool_hits_J, pool_trials_J, prior):
    """c_j per row: its counts plus the pool's, shrunk towards c_{j-1} (c_1 towards `prior`)."""
    rates, below = [], np.zeros(hits_BJ.shape[:1], np.float32) + prior
    for j in range(hits_BJ.shape[1]):
        below = (hits_BJ[:, j] + pool_hits_J[j] + PRIOR_WEIGHT * below) / (
            trials_BJ[:, j] + pool_trials_J[j] + PRIOR_WEIGHT)
        rates.append(below)
    return np.stack(rates, axis=1)


def expected_tokens_BN(c_BJ, steps: tuple[int, ...]):
    """E[tokens | K] per row for each K of `steps`."""
    reach_BJ = np.cumsum(np.cumprod(c_BJ, axis=1), axis=1)
    return np.stack([1.0 + (reach_BJ[:, k - 1] if k > 0 else 0.0 * reach_BJ[:, 0]) for k in steps], axis=1)


def finish_times_N(c_BJ, remaining_B, live_B, cost_N, steps: tuple[int, ...]):
    """T(K) for each K of `steps`: t(K) times the cycles the slowest live row needs for the tokens it still wants."""
    e_BN = expected_tokens_BN(c_BJ, steps)
    cycles_BN = np.where(live_B[:, None], remaining_B[:, None].astype(np.float32) / e_BN, 0.0)
    return np.max(cycles_BN, axis=0) * cost_N


def observed_GN(trials_GJ, steps: tuple[int, ...]):
    """For each row of position counts (observations of draft position j, summed over the batch and the pool) and
    each K of `steps`: whether every position 1..K has been observed at least once (K = 0 always)."""
    seen_GJ = np.cumprod(np.asarray(trials_GJ) >= 1.0, axis=1).astype(bool)
    return np.stack([seen_GJ[:, k - 1] if k > 0 else np.ones(seen_GJ.shape[0], bool) for k in steps], axis=1)


def fastest_G(times_GN, margin: float, seen_GN=None):
    """Index of the K to run for each row of times (columns in increasing K): the smallest K whose time is within
    `margin` of the fastest and whose every position has been observed (`seen_GN`, from `observed_GN`; None: all),
    else the fastest. Near a tie the smaller K is the safer estimate: plain decoding's time is known, a K's is
    estimated from few cycles, and a plain call goes back to a K only where its probes see the draft right; a deeper
    position is observed only when the ones before it were accepted, so its estimate rests on fewer cycles and on
    the pool's counts from other prompts, whose acceptance at depth differs the most, and one K too deep lost more
    than one K too shallow where the two were close. A depth nobody has observed is different: it expects what
    the position above it accepts, and the smaller K would keep it unobserved (the call's test cannot leave upwards
    where the host's own choice stays), so the fastest is taken and its cycles observe it (docs/performance.md,
    "Adaptive speculation by call")."""
    times_GN = np.asarray(times_GN)
    within_GN = times_GN <= (1.0 + margin) * times_GN.min(axis=1, keepdims=True)
    pick_GN = within_GN if seen_GN is None else within_GN & np.asarray(seen_GN)
    return np.where(pick_GN.any(axis=1), np.argmax(pick_GN, axis=1), np.argmin(times_GN, axis=1))


def better_k(times_N, current: int | None, switch_s, margin: float, seen_N=None):
    """(index of the K to run, whether leaving `current` for it pays its switch): `fastest_G`'s."""
    best = int(fastest_G(np.asarray(times_N)[None], margin,
                         None if seen_N is None else np.asarray(seen_N)[None])[0])
    if current is None:
        return best, True
    return best, bool(best != current and times_N[best] + switch_s < (1.0 - margin) * times_N[current])


def stay_band(k: int, remaining_B, live_B, cost_N, steps: tuple[int, ...], switch_s: float, margin: float,
              pool_hits_J, pool_trials_J, prior: float, observed: int):
    """(low, high, plain_high): the mean drafts accepted a cycle at K within which the host keeps K, for windows of
    `observed` cycles at a flat acceptance c (a cycle of K then accepts sum_{j<=K} c^j on average, and position j is
    observed c^(j-1) times a cycle and accepted c^j times): each c's expected window goes through the host's own
    estimate (`acceptance_BJ`, with the pool and the prior) and choice (`better_k`), so the loop leaves where the
    host would choose another K. (-inf, inf) where no c leaves K, or where no c keeps it (the host chose K on counts
    the flat model does not reach). `plain_high`: the highest mean up to which every c from 0 leaves K for plain
    decoding (-inf where c = 0 does not), so a loop with a plain tail goes plain only where the host would."""
    j_max = max(steps)
    c_G = np.linspace(0.0, 1.0, BAND_GRID)
    j_J = np.arange(1, j_max + 1)
    drafted_J = (j_J <= k).astype(np.float64)
    trials_GJ = observed * c_G[:, None] ** (j_J - 1)[None] * drafted_J
    hits_GJ = observed * c_G[:, None] ** j_J[None] * drafted_J
    est_GJ = acceptance_BJ(hits_GJ, trials_GJ, pool_hits_J, pool_trials_J, prior)
    e_GN = expected_tokens_BN(est_GJ, steps)
    slowest = float(np.max(np.where(live_B, remaining_B, 0)))
    times_GN = slowest / e_GN * np.asarray(cost_N, np.float64)[None]
    current = steps.index(k)
    best_G = fastest_G(times_GN, margin, observed_GN(trials_GJ + np.asarray(pool_trials_J)[None], steps))
    leave_G = (best_G != current) & (times_GN[np.arange(len(c_G)), best_G] + switch_s
                                     < (1.0 - margin) * times_GN[:, current])
    if leave_G.all() or not leave_G.any():
        return -np.inf, np.inf, -np.inf
    mean_accepted_G = np.cumsum(c_G[:, None] ** j_J[None], axis=1)[:, k - 1]
    plain_G = leave_G & (best_G == steps.index(0)) if 0 in steps else np.zeros_like(leave_G)
    plain_run = int(np.argmin(plain_G)) if not plain_G.all() else len(c_G)  # the c from 0 that all go plain
    plain_high = float(mean_accepted_G[plain_run - 1]) if plain_run else -np.inf
    return float(mean_accepted_G[~leave_G].min()), float(mean_accepted_G[~leave_G].max()), plain_high


def plain_leave_remaining(cost_N, steps: tuple[int, ...], switch_s: float, margin: float, pool_hits_J, pool_trials_J,
                          prior: float, observed: int) -> np.ndarray:
    """[BAND_GRID]: for a plain call's probe that observed c_1 = c (the grid of `stay_band`) in `observed` entries a
    row, the fewest tokens the slowest live row must still want for the host to leave plain decoding for a K (inf
    where none pays at that c). The host's own estimate (`acceptance_BJ`: the deeper positions follow c_1 and the
    pool) and choice (`fastest_G`, the switch priced as `better_k` prices it): T(K) = t(K) R / E[K] scales with the
    tokens R still wanted, so leaving pays where R (t(0) (1 - margin) - t(K) / E[K]) exceeds the switch."""
    j_max = max(steps)
    c_G = np.linspace(0.0, 1.0, BAND_GRID)
    trials_GJ = np.zeros((BAND_GRID, j_max))
    trials_GJ[:, 0] = observed
    hits_GJ = trials_GJ * c_G[:, None]
    est_GJ = acceptance_BJ(hits_GJ, trials_GJ, pool_hits_J, pool_trials_J, prior)
    per_token_GN = np.asarray(cost_N, np.float64)[None] / expected_tokens_BN(est_GJ, steps)
    best_G = fastest_G(per_token_GN, margin, observed_GN(trials_GJ + np.asarray(pool_trials_J)[None], steps))
    gain_G = (1.0 - margin) * per_token_GN[:, steps.index(0)] - per_token_GN[np.arange(BAND_GRID), best_G]
    with np.errstate(divide="ignore"):
        need_G = np.where(gain_G > 0, max(float(switch_s), 0.0) / np.maximum(gain_G, 1e-30), np.inf)
    return np.where((best_G != steps.index(0)) & (gain_G > 0), np.maximum(need_G, 1.0), np.inf)


# --- the programs ---------------------------------------------------------------------------------------------
def window_column(log_BC, c, start):
    """Sum and count of the cycles the acceptance log holds in column c, zero where c is before the call's first
    cycle `start` or off the log."""
    n_log = log_BC.shape[1]
    col_B = jax.lax.dynamic_index_in_dim(log_BC, jnp.clip(c, 0, n_log - 1), axis=1, keepdims=False)
    seen_B = (col_B >= 0) & (c >= start) & (c < n_log)
    return jnp.sum(jnp.where(seen_B, col_B, 0)).astype(jnp.float32), jnp.sum(seen_B).astype(jnp.float32)


def window_test(state: SpecState, total, seen, start, rule_F):
    """The K loop's go flag after a cycle: rows still live, the rule's limit of cycles not reached since the call's
    first cycle `start`, and either fewer cycles than its minimum or the window's mean drafts accepted (`total` over
    `seen` row-cycles) inside its band."""
    ran_f = (state.cycles - start).astype(jnp.float32)
    mean = total / jnp.maximum(seen, 1.0)
    inside = (mean >= rule_F[RULE_LOW]) & (mean <= rule_F[RULE_HIGH])
    return jnp.any(~state.done) & (ran_f < rule_F[RULE_LIMIT]) & ((ran_f < rule_F[RULE_MIN_CYCLES]) | inside)


def spec_loop(w: SpecWeights, state: SpecState, sp: dict, rule_F, *, cfg: SpecConfig, k: int,
              window: int, greedy: bool, max_new_tokens: int, drafter=None,
              plain_tail: bool = False) -> tuple[SpecState, jax.Array]:
    """Fixed-K cycles until the batch is done, the rule's limit of cycles ran, or (after its minimum) the mean drafts
    accepted a cycle over the call's last `window` cycles leaves the rule's band (`rule_array`, `stay_band`).
    `plain_tail`: where the test left with that mean at or below the rule's `plain_high`, plain decode steps follow
    to the end of the batch in the same call (the state's target side and outputs are then plain decoding's; its
    draft side is stale, as that tail runs to the end). Returns the state and its `call_summary`.

    The window's sum and count ride in the loop's carry, updated by the cycle's own column and the one leaving the
    window, and the body computes the loop's go flag: on a GPU the predicate runs as its own kernel every cycle, and
    a reduction over the whole log there (or the full rule, a few dozen small operations) costs a measurable share
    of a small model's cycle (docs/performance.md, "Adaptive speculation by call")."""
    start = state.cycles

    def column(log_BC, c):
        return window_column(log_BC, c, start)

    def go(s, total, seen):
        return window_test(s, total, seen, start, rule_F)

    def cycle(carry):
        s, total, seen, _ = carry
        c = s.cycles
        s = speculative_cycle(w, s, sp, cfg=cfg, k=k, greedy=greedy, max_new_tokens=max_new_tokens,
                              drafter=drafter)
        new_total, new_seen = column(s.accepted_log, c)
        old_total, old_seen = column(s.accepted_log, c - window)
        total, seen = total + new_total - old_total, seen + new_seen - old_seen
        return s, total, seen, go(s, total, seen)

    zero = jnp.zeros((), jnp.float32)
    carry = (state, zero, zero, go(state, zero, zero))
    state, total, seen, _ = jax.lax.while_loop(lambda carry: carry[3], cycle, carry)
    plain_from_B, plain_steps = state.generated, jnp.zeros((), jnp.int32)
    if plain_tail:
        # the loop ended on its band (not done, not at its limit), with a mean low enough for plain decoding
        ran_f = (state.cycles - start).astype(jnp.float32)
        left = jnp.any(~state.done) & (ran_f < rule_F[RULE_LIMIT]) & ~window_test(state, total, seen, start, rule_F)
        go_plain = left & (total / jnp.maximum(seen, 1.0) <= rule_F[RULE_PLAIN_HIGH])
        step = lambda s: baseline_step(w, s, sp, cfg=cfg, greedy=greedy, max_new_tokens=max_new_tokens)  # noqa: E731
        plain = jax.lax.while_loop(lambda s: go_plain & jnp.any(~s.done), step, to_plain(state))
        state = state.replace(target_cache=plain.target_cache, pending=plain.pending, done=plain.done,
                              generated=plain.generated, out_tokens=plain.out_tokens, key=plain.key)
        plain_steps = plain.steps
    return state, call_summary(state, plain_steps, plain_from_B)


def call_summary(state: SpecState, plain_steps=None, plain_from_B=None) -> jax.Array:
    """What the host reads after a call, as one int32 array in host memory (`on_host`): whether every row is done
    (first, so that the host's test after a generation's last call reads one number), the cycles run, the plain
    steps a tail ran (0 without one), the tokens each row had when they began (`plain_from_B`; the state's own where
    None), the acceptance log, then the state's `progress` (tokens emitted and done per row, the token buffer). On a
    GPU each array read back costs its own transfer and wait (docs/performance.md, "Adaptive speculation by call")."""
    plain_steps = jnp.zeros((), jnp.int32) if plain_steps is None else plain_steps
    plain_from_B = state.generated if plain_from_B is None else plain_from_B
    return on_host(jnp.concatenate([jnp.all(state.done).astype(jnp.int32)[None],
                                    state.cycles.astype(jnp.int32)[None], plain_steps.astype(jnp.int32)[None],
                                    plain_from_B.astype(jnp.int32), state.accepted_log.reshape(-1),
                                    progress(state)]))


class CallRead:
    """What every call's summary starts with (whether every row is done, the cycles the state has run, the plain
    steps the call ran) and ends with (the state's `progress`), read back on the host; each field cut where it is
    read."""

    def __init__(self, summary, b: int, progress_at: int):
        self.raw, self.b, self._progress = np.asarray(summary), b, progress_at

    @property
    def all_done(self) -> bool:
        return bool(self.raw[0])

    @property
    def cycles(self) -> int:
        return int(self.raw[1])

    @property
    def plain_steps(self) -> int:  # plain decode steps the call ran (a K loop's: after its cycles; 0: none)
        return int(self.raw[2])

    @property
    def done_B(self) -> np.ndarray:
        return self.raw[self._progress + self.b:self._progress + 2 * self.b].astype(bool)

    @property
    def generated_B(self) -> np.ndarray:
        return read_progress(self.raw[self._progress:], self.b)[0]

    def tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(generated_B, out_tokens_BN), cut from the progress in one pass."""
        generated_B, out_tokens_BN, _ = read_progress(self.raw[self._progress:], self.b)
        return generated_B, out_tokens_BN


class CallSummary(CallRead):
    """`call_summary` read back on the host (numpy): one array, each field cut from it where it is read. After a
    generation's last call the host reads whether every row is done and ends the decode; the rest is cut once the
    tokens are out. On a GPU each operation the host runs there costs several times what it costs warm (the host
    thread has waited through the device's loop), so they are kept out of the decode's time."""

    def __init__(self, summary, b: int, c: int):
        super().__init__(summary, b, 3 + b + b * c)
        self.c = c

    @property
    def plain_from_B(self) -> np.ndarray:  # tokens each row had when the call's plain steps began
        return self.raw[3:3 + self.b]

    @property
    def log_BC(self) -> np.ndarray:
        return self.raw[3 + self.b:self._progress].reshape(self.b, self.c)

    @property
    def out_tokens_BN(self) -> np.ndarray:
        return read_progress(self.raw[self._progress:], self.b)[1]


def read_summary(summary, state: SpecState) -> CallSummary:
    """`call_summary` read back on the host, `state` (the call's output) giving its shapes."""
    return CallSummary(summary, *state.accepted_log.shape)


def plain_loop(w: SpecWeights, state: BaselineState, sp: dict, limit, *, cfg: SpecConfig, greedy: bool,
               max_new_tokens: int) -> tuple[BaselineState, jax.Array]:
    """Plain decode steps until the batch is done or `limit` steps ran. Returns the state and its
    `plain_summary`."""
    start = state.steps
    step = lambda s: baseline_step(w, s, sp, cfg=cfg, greedy=greedy, max_new_tokens=max_new_tokens)  # noqa: E731
    state = jax.lax.while_loop(lambda s: jnp.any(~s.done) & (s.steps - start < limit), step, state)
    return state, plain_summary(state)


def plain_summary(state: BaselineState) -> jax.Array:
    """What the host reads after a plain call, as one int32 array in host memory (`on_host`): the steps run, then
    the state's `progress`."""
    return on_host(jnp.concatenate([state.steps.astype(jnp.int32)[None], progress(state)]))


def read_plain_summary(summary, b: int):
    """`plain_summary` read back on the host for `b` rows: (steps, generated_B, out_tokens_BN) as numpy."""
    summary = np.asarray(summary)
    generated_B, out_tokens_BN, _ = read_progress(summary[1:], b)
    return int(summary[0]), generated_B, out_tokens_BN


# steps of a plain call's first block: the blocks double from it to the catch-up's width, so a text that turns
# predictable soon after the draft lost it gets speculation back within a few steps, and a drafter that never
# matches pays a few more catch-ups a call
FIRST_BLOCK = 8
# leaving tables a plain call reads, one per block from its first, each priced for its block's observations (every
# later block reads the last: a block past it observes more, so it leaves no sooner than the host would): the host
# weighs a block's c_1 counts against the pool's, so a longer block at the same c_1 takes it back sooner
PROBE_TABLES = 3
# What a plain call's leaving test reads besides the state (`probe_loop`), one float32 array: per block (PROBE_TABLES)
# and per c_1 of the band's grid the tokens the slowest live row must still want for the host to leave
# (`plain_leave_remaining`), then the steps the call runs before its first test, the steps it may run at most, and
# the steps of its first block.
PROBE_MIN_STEPS = PROBE_TABLES * BAND_GRID
PROBE_LIMIT, PROBE_FIRST_BLOCK = PROBE_MIN_STEPS + 1, PROBE_MIN_STEPS + 2


def probe_observations(width: int) -> tuple[int, ...]:
    """The c_1 observations a row has in each of a plain call's first PROBE_TABLES blocks (they double from
    FIRST_BLOCK up to `width`), one per leaving table."""
    return tuple(min(FIRST_BLOCK << i, width) for i in range(PROBE_TABLES))


def probe_array(need_G, min_steps: int, limit: int, first_block: int) -> np.ndarray:
    """The leaving test's inputs: `need_G` one table a block ([PROBE_TABLES, BAND_GRID]) or one for every block."""
    need_SG = np.broadcast_to(np.asarray(need_G, np.float32), (PROBE_TABLES, BAND_GRID))
    return np.concatenate([need_SG.reshape(-1), np.array([min_steps, limit, first_block], np.float32)])


def plain_to_the_end(limit: int) -> np.ndarray:
    """A plain call that never leaves and never catches up before its end: one block of at most `limit` steps (its
    one catch-up, at the end, sees only the block's first entries; the draft is left behind, as nothing drafts
    after it). The cost table's plain rounds run it too."""
    return probe_array(np.full(BAND_GRID, np.inf), 0, limit, limit)


def probe_loop(w: SpecWeights, state: SpecState, sp: dict, probe_F, *, cfg: SpecConfig, greedy: bool,
               max_new_tokens: int, width: int) -> tuple[SpecState, jax.Array]:
    """Plain decode steps in blocks (the first of `probe_array`'s steps, doubling up to `width`), each followed by
    the draft's catch-up over the block (`jaxspec.adaptive.catch_up`: the draft cache written, c_1 observed at
    every entry), until the batch is done, the limit of steps ran, or (after the minimum) a block's mean c_1 over
    the batch is one at which the host would leave plain decoding for the tokens the slowest live row still wants
    (the block's own table: `probe_observations`). The state is then as a speculative cycle expects it (but after
    a block longer than `width`: `plain_to_the_end`). Returns the state and its `probe_summary` (the last block's
    counts)."""
    b = state.pending.shape[0]
    start = state.cycles
    aux = len(cfg.target.aux_layer_ids) * cfg.target.hidden_size
    empty = empty_backlog(b, width, aux, state.draft_hidden.dtype)
    none_B1 = jnp.zeros((b, 1), jnp.float32)
    grid = BAND_GRID - 1

    def block(carry):
        s, _, _, _, size, index = carry
        first = s.cycles

        def more(c):
            in_block = (c[0].cycles - first).astype(jnp.float32) < size
            return jnp.any(~c[0].done) & in_block & ((c[0].cycles - start).astype(jnp.float32) < probe_F[PROBE_LIMIT])

        def step(c):
            return plain_decode(w, cfg, c[0], c[1], sp, greedy=greedy, max_new_tokens=max_new_tokens)

        s, backlog = jax.lax.while_loop(more, step, (s, empty))
        # counts from zero with no discount (ema 0): the block's own observations
        s, _, (hits_B1, trials_B1) = catch_up(w, cfg, s, backlog, (none_B1, none_B1), sp, greedy=greedy, ema=0.0)
        mean = jnp.sum(hits_B1) / jnp.maximum(jnp.sum(trials_B1), 1.0)
        slowest = jnp.max(jnp.where(s.done, 0, max_new_tokens - s.generated)).astype(jnp.float32)
        ran = (s.cycles - start).astype(jnp.float32)
        leave = ((ran >= probe_F[PROBE_MIN_STEPS]) & (jnp.sum(trials_B1) > 0)
                 & (slowest >= probe_F[index * BAND_GRID + jnp.round(mean * grid).astype(jnp.int32)]))
        go = jnp.any(~s.done) & (ran < probe_F[PROBE_LIMIT]) & ~leave
        return s, hits_B1[:, 0], trials_B1[:, 0], go, jnp.minimum(2 * size, cap), jnp.minimum(index + 1, last)

    zero_B = jnp.zeros((b,), jnp.float32)
    go = jnp.any(~state.done) & (probe_F[PROBE_LIMIT] > 0)
    cap = jnp.maximum(probe_F[PROBE_FIRST_BLOCK], width)  # a first block past the width is the whole call
    last = PROBE_TABLES - 1
    carry = (state, zero_B, zero_B, go, jnp.minimum(probe_F[PROBE_FIRST_BLOCK], cap), jnp.zeros((), jnp.int32))
    state, hits_B, trials_B, *_ = jax.lax.while_loop(lambda c: c[3], block, carry)
    return state, probe_summary(state, state.cycles - start, hits_B, trials_B)


def probe_summary(state: SpecState, steps, hits_B, trials_B) -> jax.Array:
    """What the host reads after a plain call with probes, as one int32 array in host memory (`on_host`): whether
    every row is done, the cycles the state has run (plain steps count as cycles that accepted nothing), the plain
    steps the call ran, the last block's c_1 counts per row (float32, their bits), then the state's `progress`."""
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return on_host(jnp.concatenate([jnp.all(state.done).astype(jnp.int32)[None],
                                    state.cycles.astype(jnp.int32)[None], steps.astype(jnp.int32)[None],
                                    bits(hits_B), bits(trials_B), progress(state)]))


class ProbeSummary(CallRead):
    """`probe_summary` read back on the host (numpy) for `b` rows."""

    def __init__(self, summary, b: int):
        super().__init__(summary, b, 3 + 2 * b)

    @property
    def c1_hits_B(self) -> np.ndarray:
        return self.raw[3:3 + self.b].view(np.float32)

    @property
    def c1_trials_B(self) -> np.ndarray:
        return self.raw[3 + self.b:3 + 2 * self.b].view(np.float32)


def to_plain(state: SpecState) -> BaselineState:
    """The speculative state as plain decoding's: the same committed cache, pending token and outputs."""
    return BaselineState(target_cache=state.target_cache, pending=state.pending, done=state.done,
                         generated=state.generated, out_tokens=state.out_tokens, steps=jnp.zeros((), jnp.int32),
                         key=state.key)


# --- what the host keeps between calls ------------------------------------------------------------------------
class Pool:
    """Position counts over the batch from earlier calls and generations (the prior of the next choice)."""

    def __init__(self, j_max: int, cap: float):
        self.hits, self.trials, self.cap = np.zeros(j_max, np.float32), np.zeros(j_max, np.float32), cap

    def new_generation(self) -> None:
        self.hits *= POOL_DECAY
        self.trials *= POOL_DECAY

    def add(self, hits_BJ, trials_BJ) -> None:
        self.hits += np.asarray(hits_BJ).sum(0)
        self.trials += np.asarray(trials_BJ).sum(0)
        over = np.maximum(self.trials / self.cap, 1.0)  # at most `cap` observations a position
        self.hits /= over
        self.trials /= over
