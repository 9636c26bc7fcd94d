"""Adaptive speculation: every cycle of the on-device loop picks its draft length K from a small compiled set
(K = 0 is a plain decode step) by the expected tokens per second, so speculation is used only where it pays.

The model. Let c_j be the conditional acceptance rate of draft position j (the probability that draft j is
accepted given drafts 1..j-1 were), estimated per sequence, and t(K) the device time of one cycle that drafts K
tokens (t(0): a plain decode step). A cycle of K drafts yields the accepted prefix plus the target's own token:

    E[tokens | K] = 1 + sum_{j=1..K} prod_{i<=j} c_i

and the batch's throughput is sum_b E_b[tokens | K] / t(K) over the live sequences b. (The decisions do not cut
the sum at the tokens a sequence still wants: near the end that would favour a smaller K for a cycle or two, and a
change of K costs more than they save. The report's expected tokens are cut.) Each cycle takes the K of
the compiled set that maximises it; one K serves the whole batch (one program), so a row whose drafts are
rejected rides along with rows that accept and the choice is the batch's total, not any row's best.

The estimates. Each position j keeps discounted counts of its observations and of the accepted ones (each new
observation weighs 1, older ones are discounted by 1 - `ema`): a cycle that accepted n of K drafts observes
positions 1..min(n+1, K) (accepted up to n, rejected at n+1; later ones are not observed). c_j is hits / trials
shrunk towards c_{j-1} (c_1 towards `prior`) with the weight of PRIOR_WEIGHT observations, so a depth never tried
expects what the shallower positions accept, and its own evidence takes over as it comes. A plain step observes
position 1 for free (below). Exploration: now and then (first after `explore_every` cycles) the choice is made with
optimistic deeper rates (c_j for j >= 2 raised to c_1), so a depth that looked bad once is tried again when the
first position says it could pay; each exploration whose outcome leaves the rule's choice as it was doubles the
gap to the next one (up to `explore_every` x EXPLORE_BACKOFF), and a change of the rule's own choice resets it.
When c_1 itself says speculation cannot pay, the optimistic choice is the rule's and nothing is tried (with the
probe; without it, the smallest K >= 1 is tried at the backed-off gaps). An exploration runs a single cycle.

Plain steps and the draft (position algebra; L = committed target length, x_L = the pending token). A plain
step runs the target over x_L at position L only: it emits y = x_{L+1} and the target feature f_L, and L
advances by one. The draft is not run: (y, f_L) is appended to a backlog, which is exactly the draft entry at
position L (token x_{t+1} paired with feature f_t, as in the cycle's extend). Before the next speculative cycle,
or before a plain step finds the backlog's `backlog` entries full, one draft forward over the backlog (positions
L-n .. L-1) writes the draft cache and leaves draft_logits / draft_hidden at position L-1: the state a cycle
expects. On GPU that forward over a few tokens costs about one draft step, so plain stretches pay a draft step
every `backlog` tokens instead of every token. The catch-up is one conditional ahead of the switch (before a
speculative run that finds a backlog, or a plain run that finds it full), so the cycles of a run have none.

A branch's first run. On a GPU the first run of a branch in a call makes the host update the branch's command
buffers (a millisecond or more, several cycles of a small model: docs/performance.md). The rule therefore compares the
time each K needs for the tokens the live rows still want, sum_b remaining_b / rate(K), and adds the measured
price of a first run (`jaxspec.adaptive_costs.Measured.first_run_s`) to each branch not yet run in the generation:
a short generation keeps a K that is nearly as good instead of paying for a new one, a long one switches.

Runs. A choice of K runs for at least `stretch` cycles and then for as long as the rule keeps it (the time it
needs for the wanted tokens within `hysteresis` of the best K's, no exploration due): each cycle's outcome updates the
estimates and the rule is re-evaluated at the end of the cycle's own work, so a run costs the host one read per
cycle, as fixed-K generation does, and a change of K a few more (the switch, the catch-up's conditional, the outer
loop's predicate).

The catch-up forward also gives free observations of c_1: the draft's prediction made at position t-1 (the
carried draft_logits for the first entry, the backlog forward's own outputs after) is compared with the token the
target emitted at t: equality of the draft's argmax when greedy; when sampling, the unbiased estimate
min(1, q(y) / p(y)) of the acceptance probability sum_v min(p_v, q_v), since y was drawn from p.

A drafter plug (`Engine(drafter=...)`) that is not the EAGLE-3 draft makes the probe measure the wrong drafter:
`probe=False` turns it off, and then an exploring cycle that would run a plain step runs the smallest K >= 1
instead, which observes c_1 from the plug itself (at the price of that cycle, at the backed-off exploration gaps).

Losslessness does not depend on K: each cycle emits tokens distributed as the target's (a plain step by plain
decoding, a speculative cycle by the acceptance rule), from fresh randomness, whatever K it ran with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import processed_probs_by_rows, sample
from jaxspec.spec_step import commit, draft_logits_in_target_vocab, speculative_cycle_accepting
from jaxspec.state import SpecState
from model.decoder import forward
from model.eagle3 import draft_forward, draft_to_target_ids, held_as_head
from model.shard_local import held_whole

DEFAULT_STEPS = (0, 1, 2, 3, 4, 6, 8)
SCHEDULE_SLOTS = 64  # longest forced schedule (a fixed shape, so any schedule runs in the same program)
PRIOR_WEIGHT = 1.0  # observations the prior (and a deeper position's shallower neighbour) counts for
# observations of c_1 at the prior a sequence starts with, discounted like real ones: one early rejection must not
# send a fresh sequence to plain steps (with the prior's weight alone, one halves the estimate), and after about
# 1 / ema real observations they weigh little
PRIOR_START = 3.0
EXPLORE_BACKOFF = 16  # the gap between explorations grows up to explore_every x this while they confirm the rule
SAMPLED_PROBE = 8  # backlog entries a sampled catch-up observes, the most recent (`catch_up`)


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    steps: tuple[int, ...] | None = None  # the compiled K set; None: DEFAULT_STEPS up to the engine's K, and K
    # starting estimate of c_1 (deeper positions follow it), about what EAGLE-3 drafters accept at the first
    # position: a fresh sequence speculates where that would pay and learns from real cycles, instead of running
    # plain steps that observe nothing until the backlog's catch-up
    prior: float = 0.7
    ema: float = 0.125  # weight of one observation in the moving average
    explore_every: int = 32  # cycles between optimistic choices (while the rule's choice changes)
    # plain steps the draft may lag before it catches up; None: 8 with the probe on an accelerator (each catch-up
    # brings fresh observations of c_1, so a plain stretch is reconsidered soon), 32 without (a catch-up only keeps
    # the draft cache current, at about one draft step's cost) and on a CPU, where a catch-up costs most of a plain
    # step whatever its width (so a short backlog makes plain runs measurably dearer than plain decoding:
    # docs/performance.md, "On a CPU") and speculation pays only near full acceptance anyway
    backlog: int | None = None
    stretch: int = 8  # cycles a choice of K runs at least before the rule may leave it
    # a K in use is kept while the time it needs for the tokens still wanted is within this fraction of the best
    # K's: each change of K costs the host a few reads (the switch, the catch-up's conditional, the outer loop's
    # predicate)
    hysteresis: float = 0.03
    costs: tuple[tuple[int, float], ...] | None = None  # ((K, seconds per cycle), ...); None: measured on the device
    schedule: tuple[int, ...] = ()  # K of each cycle, repeated (benchmarks and tests); () lets the rule choose
    probe: bool = True  # observe c_1 from the EAGLE-3 draft during catch-up (off for drafter plugs, see below)

    def resolve_steps(self, k_max: int) -> tuple[int, ...]:
        steps = self.steps if self.steps is not None else {s for s in DEFAULT_STEPS if s <= k_max} | {k_max}
        steps = tuple(sorted(set(steps)))
        if k_max < 1 or any(s < 0 or s > k_max for s in steps) or max(steps) < 1:
            raise ValueError(f"adaptive steps {list(steps)} must lie in 0..{k_max} and include a K >= 1")
        return steps

    def validate(self, k_max: int) -> "AdaptivePolicy":
        steps = self.resolve_steps(k_max)
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"adaptive prior must be in [0, 1], got {self.prior}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"adaptive ema must be in (0, 1], got {self.ema}")
        if self.explore_every < 1 or self.stretch < 1 or self.backlog_width < 1:
            raise ValueError("adaptive explore_every, stretch and backlog must be >= 1")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"adaptive hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.costs is not None:
            given = dict(self.costs)
            if sorted(given) != list(steps):
                raise ValueError(f"adaptive costs name K = {sorted(given)}, the compiled steps are K = {list(steps)}")
            if not all(0.0 < float(v) < float("inf") for v in given.values()):
                raise ValueError("adaptive costs must be positive finite times")
        if len(self.schedule) > SCHEDULE_SLOTS:
            raise ValueError(f"adaptive schedule is longer than {SCHEDULE_SLOTS} cycles")
        if any(s not in steps for s in self.schedule):
            raise ValueError(f"adaptive schedule {list(self.schedule)} names a K outside the steps {list(steps)}")
        return self

    @property
    def backlog_width(self) -> int:
        return self.backlog_on(jax.default_backend())

    def backlog_on(self, backend: str) -> int:
        """The backlog's width on `backend` ("cpu", "gpu", ...): see `backlog`."""
        if self.backlog is not None:
            return self.backlog
        return 8 if self.probe and backend != "cpu" else 32

    def compiled(self, k_max: int) -> tuple:
        """What the programs bake in (costs, prior and schedule are data in the state)."""
        return (self.resolve_steps(k_max), self.ema, self.explore_every, self.backlog_width, self.probe, self.stretch,
                self.hysteresis)


@struct.dataclass
class Backlog:
    """Plain decode steps the draft has not run over yet: entry i is the draft's input at position L - n + i."""
    tokens_BW: jax.Array  # [B, W] int32: the token the target emitted at that step
    aux_BWX: jax.Array  # [B, W, 3H]: the target's aux feature at that step's position
    p_BW: jax.Array  # [B, W] float32: the target's probability of that token (sampling; 1 when greedy)
    count_B: jax.Array  # [B] int32: entries in use


def empty_backlog(b: int, width: int, aux_width: int, dtype) -> Backlog:
    """A backlog of `width` entries a row for `b` rows, none in use (`aux_width`: the target's aux feature width)."""
    return Backlog(jnp.zeros((b, width), jnp.int32), jnp.zeros((b, width, aux_width), dtype),
                   jnp.ones((b, width), jnp.float32), jnp.zeros((b,), jnp.int32))


@struct.dataclass
class AdaptiveState:
    spec: SpecState  # out_tokens sized for the largest K of the set
    backlog: Backlog
    hits_BJ: jax.Array  # [B, Kmax] float32: discounted count of drafts accepted at position j (j = 1..Kmax)
    trials_BJ: jax.Array  # [B, Kmax] float32: discounted count of position j's observations
    prior: jax.Array  # [] float32: the estimate of c_1 before any observation
    cost_N: jax.Array  # [N] float32: t(K) for each K of the set, seconds per cycle
    first_run_s: jax.Array  # [] float32: the price of a branch's first run in a call (its command buffers' update)
    used_N: jax.Array  # [N] bool: branches that ran in this generation
    explore_next: jax.Array  # [] int32: the cycle of the next optimistic choice
    explore_gap: jax.Array  # [] int32: cycles between optimistic choices now
    last_rule: jax.Array  # [] int32: the rule's choice at the previous cycle
    run_branch: jax.Array  # [] int32: the branch of a run the last call's budget cut (the next call resumes it); -1
    run_held: jax.Array  # [] int32: cycles that run has run so far
    schedule_P: jax.Array  # [SCHEDULE_SLOTS] int32: branch forced at cycle c (entry c % schedule_len); -1: the rule
    schedule_len: jax.Array  # [] int32
    k_log: jax.Array  # [C] int32: K each cycle ran, -1 where no cycle ran
    expected_tokens: jax.Array  # [] float32: sum over cycles of the model's E[tokens | K] for the batch
    expected_s: jax.Array  # [] float32: sum over cycles of t(K)

    # what the engine's loop, streaming and results read, as on a SpecState
    @property
    def done(self):
        return self.spec.done

    @property
    def generated(self):
        return self.spec.generated

    @property
    def out_tokens(self):
        return self.spec.out_tokens

    @property
    def accepted_log(self):
        return self.spec.accepted_log

    @property
    def cycles(self):
        return self.spec.cycles


def forced_schedule(steps: tuple[int, ...], schedule: tuple[int, ...]) -> dict:
    """The state fields that force K = schedule[c % len] at cycle c (empty: the rule chooses)."""
    index = {k: i for i, k in enumerate(steps)}
    sched = [index[k] for k in schedule] or [-1]
    return dict(schedule_P=jnp.asarray(sched + [-1] * (SCHEDULE_SLOTS - len(sched)), jnp.int32),
                schedule_len=jnp.int32(len(sched)))


def init_adaptive_state(spec: SpecState, aux_width: int, steps: tuple[int, ...], policy: AdaptivePolicy,
                        cost_N, first_run_s: float = 0.0) -> AdaptiveState:
    """Wrap a prefilled SpecState (its out_tokens sized for max(steps)); `cost_N` seconds per cycle per K in steps,
    `first_run_s` the price of a branch's first run in a call."""
    b = spec.pending.shape[0]
    return AdaptiveState(
        spec=spec,
        backlog=empty_backlog(b, policy.backlog_width, aux_width, spec.draft_hidden.dtype),
        hits_BJ=jnp.zeros((b, max(steps)), jnp.float32).at[:, 0].set(PRIOR_START * policy.prior),
        trials_BJ=jnp.zeros((b, max(steps)), jnp.float32).at[:, 0].set(PRIOR_START),
        prior=jnp.float32(policy.prior),
        cost_N=jnp.asarray(cost_N, jnp.float32),
        first_run_s=jnp.float32(first_run_s),
        used_N=jnp.zeros((len(steps),), bool),
        explore_next=jnp.int32(policy.explore_every - 1),
        explore_gap=jnp.int32(policy.explore_every),
        last_rule=jnp.int32(-1),
        run_branch=jnp.int32(-1),
        run_held=jnp.int32(0),
        **forced_schedule(steps, policy.schedule),
        k_log=jnp.full((spec.accepted_log.shape[1],), -1, jnp.int32),
        expected_tokens=jnp.float32(0),
        expected_s=jnp.float32(0),
    )


# --- the rule ---------------------------------------------------------------------------------------------

def acceptance_rates(hits_BJ, trials_BJ, prior):
    """c_j [B, J]: each position's discounted accepted / observed counts, shrunk towards the position before it
    (position 1 towards `prior`) with the weight of PRIOR_WEIGHT observations, so a depth never tried yet is
    expected to accept like the shallower ones instead of sitting at a fixed prior."""
    rates, base = [], jnp.broadcast_to(jnp.asarray(prior, jnp.float32), hits_BJ.shape[:1])
    for j in range(hits_BJ.shape[1]):
        base = (hits_BJ[:, j] + PRIOR_WEIGHT * base) / (trials_BJ[:, j] + PRIOR_WEIGHT)
        rates.append(base)
    return jnp.stack(rates, axis=1)


def expected_tokens(accept_BJ, steps: tuple[int, ...], remaining_B=None):
    """E[tokens | K] [B, N] for each K of `steps`: 1 + sum_{j<=K, j<remaining} prod_{i<=j} c_i (remaining_B None:
    no cut). Unrolled over j (a handful of positions) into elementwise work that fuses, since the rule runs inside
    every cycle."""
    reach_B = jnp.ones(accept_BJ.shape[:1], jnp.float32)
    gains = [jnp.ones_like(reach_B)]  # E[tokens | K = 0]
    for j in range(1, accept_BJ.shape[1] + 1):
        reach_B = reach_B * accept_BJ[:, j - 1]
        if remaining_B is not None:
            reach_B = reach_B * (j < remaining_B)
        gains.append(gains[-1] + reach_B)
    return jnp.stack([gains[k] for k in steps], axis=1)


def throughput(accept_BJ, cost_N, live_B, remaining_B, steps: tuple[int, ...]):
    """(the live rows' expected tokens per second for each K [N], E[tokens | K] [B, N]); remaining_B as for
    `expected_tokens`."""
    gain_BN = expected_tokens(accept_BJ, steps, remaining_B)
    return jnp.sum(jnp.where(live_B[:, None], gain_BN, 0.0), axis=0) / cost_N, gain_BN


def priced_choice(rate_N, work, used_N, first_run_s, current=None, hysteresis: float = 0.0):
    """The branch that finishes `work` tokens soonest at the rates `rate_N` (tokens per second), a branch not yet
    run in this generation paying `first_run_s` once (the first branch is paid by any program). With `current`,
    whether that branch stays: its time within `hysteresis` of the best. Returns (branch, stays or None)."""
    price_N = jnp.where(jnp.any(used_N) & ~used_N, first_run_s, 0.0)
    time_N = work / jnp.maximum(rate_N, 1e-30) + price_N
    best = jnp.argmin(time_N).astype(jnp.int32)
    if current is None:
        return best, None
    return best, time_N[current] <= (1.0 + hysteresis) * time_N[best]


def optimistic(accept_BJ):
    """Deeper rates raised to the first position's (which plain steps keep fresh)."""
    return jnp.concatenate([accept_BJ[:, :1], jnp.maximum(accept_BJ[:, 1:], accept_BJ[:, :1])], axis=1)


def next_exploration(cycle, exploring, confirmed, changed, gap, explore_next, explore_every: int):
    """(cycle of the next optimistic choice, the gap now): an exploration whose outcome left the rule's choice as it
    was (`confirmed`) doubles the gap, up to explore_every x EXPLORE_BACKOFF; a change of the rule's own choice
    (`changed`) resets it to explore_every."""
    gap = jnp.where(changed, explore_every, gap)
    gap = jnp.where(exploring & confirmed, jnp.minimum(2 * gap, explore_every * EXPLORE_BACKOFF), gap)
    return jnp.where(exploring | changed, cycle + gap, explore_next), gap


def _observe(hits_BJ, trials_BJ, observed_BJ, value_BJ, ema):
    """One observation per observed position, older ones discounted by (1 - ema)."""
    keep = 1.0 - ema
    return (jnp.where(observed_BJ, keep * hits_BJ + value_BJ, hits_BJ),
            jnp.where(observed_BJ, keep * trials_BJ + 1.0, trials_BJ))


# --- the branches -----------------------------------------------------------------------------------------

def catch_up(w: SpecWeights, cfg: SpecConfig, spec: SpecState, backlog: Backlog, est, sp, *, greedy: bool,
             ema: float, probe: bool = True):
    """The draft over the backlog (positions L-n .. L-1), its state at L-1, and the free observations of c_1.
    `est` = (hits_BJ, trials_BJ), the counts behind the acceptance estimates."""
    n_B = backlog.count_B
    width = backlog.tokens_BW.shape[1]
    positions_BW = (spec.target_cache.lengths - n_B)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    ext = draft_forward(w.draft, cfg.draft, w.target.embed, w.target.lm_head, backlog.tokens_BW, backlog.aux_BWX,
                        positions_BW, spec.draft_cache)
    has_B = n_B > 0
    last = jnp.clip(n_B - 1, 0, width - 1)[:, None, None]
    logits_BVd = jnp.where(has_B[:, None], jnp.take_along_axis(ext.logits, last, axis=1)[:, 0], spec.draft_logits)
    hidden_BH = jnp.where(has_B[:, None], jnp.take_along_axis(ext.hidden, last, axis=1)[:, 0].astype(
        spec.draft_hidden.dtype), spec.draft_hidden)
    carried_BVd = spec.draft_logits
    spec = spec.replace(draft_cache=ext.cache, draft_logits=logits_BVd, draft_hidden=hidden_BH)
    backlog = backlog.replace(count_B=jnp.zeros_like(n_B))
    if not probe:
        return spec, backlog, est
    # entry i's token was predicted at position L-n+i-1: by the carried logits for i = 0, by this forward after
    pred_BWVd = jnp.concatenate([carried_BVd[:, None], ext.logits[:, :-1]], axis=1)
    if greedy:
        idx_BX = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], backlog.tokens_BW.shape)
        guess_BW = draft_to_target_ids(w.draft, jnp.argmax(pred_BWVd, axis=-1).astype(jnp.int32))
        obs_BX = (guess_BW == backlog.tokens_BW).astype(jnp.float32)
    else:
        # the draft's processed distribution (a sort over the vocabulary for top-k / top-p) at the most recent
        # entries only: they carry most of the discounted weight, and probing every entry of a long backlog would
        # add as many sorts as the plain steps themselves made
        idx_BX = n_B[:, None] - SAMPLED_PROBE + jnp.arange(min(width, SAMPLED_PROBE), dtype=jnp.int32)[None]
        at_BX = jnp.clip(idx_BX, 0, width - 1)
        pred_BXVd = jnp.take_along_axis(pred_BWVd, at_BX[..., None], axis=1)
        tok_BX = jnp.take_along_axis(backlog.tokens_BW, at_BX, axis=1)
        q_BXV = processed_probs_by_rows(
            draft_logits_in_target_vocab(w.draft, cfg.draft, held_as_head(pred_BXVd, w.draft)), **sp)
        q_y = jnp.take_along_axis(q_BXV, tok_BX[..., None], axis=-1)[..., 0]
        obs_BX = held_whole(jnp.minimum(1.0, q_y / jnp.take_along_axis(backlog.p_BW, at_BX, axis=1)))
    return spec, backlog, probe_observe(est, obs_BX, idx_BX, n_B, ema)


def probe_observe(est, obs_BX, idx_BX, n_B, ema: float):
    """c_1's counts after a catch-up over n_B entries that observed `obs_BX` at backlog entries `idx_BX`, the most
    recent ones (entries outside 0..n_B-1 are not observations), in order, as if observed one at a time: an
    observation at entry i is discounted by the n_B - 1 - i observations after it, and the counts before by all of
    them (as `_observe` would, cycle by cycle)."""
    keep = 1.0 - ema
    used_BX = (idx_BX >= 0) & (idx_BX < n_B[:, None])
    weight_BX = jnp.where(used_BX, keep ** jnp.maximum(n_B[:, None] - 1 - idx_BX, 0).astype(jnp.float32), 0.0)
    decay_B = keep ** jnp.sum(used_BX, axis=1).astype(jnp.float32)
    hits_BJ, trials_BJ = est
    hits_BJ = hits_BJ.at[:, 0].set(decay_B * hits_BJ[:, 0] + jnp.sum(weight_BX * obs_BX, axis=1))
    trials_BJ = trials_BJ.at[:, 0].set(decay_B * trials_BJ[:, 0] + jnp.sum(weight_BX, axis=1))
    return hits_BJ, trials_BJ


def plain_decode(w: SpecWeights, cfg: SpecConfig, spec: SpecState, backlog: Backlog, sp, *, greedy: bool,
                 max_new_tokens: int):
    """The target over the pending token alone (as plain decoding), its draft input appended to the backlog."""
    key, k_tok = jax.random.split(spec.key)
    lengths_B = spec.target_cache.lengths
    out = forward(w.target, cfg.target, spec.pending[:, None], lengths_B[:, None], spec.target_cache)
    logits_BV = out.logits[:, 0]
    b = logits_BV.shape[0]
    if greedy:
        tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        p_tok_B = jnp.ones((b,), jnp.float32)
    else:
        p_BV = processed_probs_by_rows(logits_BV, **sp)
        tok_B = held_whole(sample(k_tok, p_BV))
        p_tok_B = held_whole(jnp.take_along_axis(p_BV, tok_B[:, None], axis=1)[:, 0])
    live_B = ~spec.done
    slot_B = jnp.where(live_B, backlog.count_B, backlog.tokens_BW.shape[1])  # finished rows write nothing
    rows = jnp.arange(b)
    backlog = Backlog(
        tokens_BW=backlog.tokens_BW.at[rows, slot_B].set(tok_B, mode="drop"),
        aux_BWX=backlog.aux_BWX.at[rows, slot_B].set(out.aux_hidden[:, 0].astype(backlog.aux_BWX.dtype), mode="drop"),
        p_BW=backlog.p_BW.at[rows, slot_B].set(p_tok_B, mode="drop"),
        count_B=backlog.count_B + live_B.astype(jnp.int32),
    )
    spec = commit(spec, cfg, key, jnp.zeros((b,), jnp.int32), tok_B[:, None], out.cache, spec.draft_cache,
                  spec.draft_logits, spec.draft_hidden, max_new_tokens)
    return spec, backlog


def plain_step(w: SpecWeights, cfg: SpecConfig, spec: SpecState, backlog: Backlog, est, sp, *, greedy: bool,
               max_new_tokens: int, ema: float, probe: bool = True):
    """K = 0 with room in the backlog: `plain_decode` alone."""
    spec, backlog = plain_decode(w, cfg, spec, backlog, sp, greedy=greedy, max_new_tokens=max_new_tokens)
    return spec, backlog, est


def speculative_step(w: SpecWeights, cfg: SpecConfig, spec: SpecState, backlog: Backlog, est, sp, *, k: int,
                     greedy: bool, max_new_tokens: int, ema: float, probe: bool = True, drafter=None):
    """K >= 1: one speculative cycle of K drafts (the draft already caught up), its outcome observed."""
    live_B = ~spec.done
    spec, accepted_B, _ = speculative_cycle_accepting(w, spec, sp, cfg=cfg, k=k, greedy=greedy,
                                                      max_new_tokens=max_new_tokens, drafter=drafter)
    hits_BJ, trials_BJ = est
    j_J = jnp.arange(1, hits_BJ.shape[1] + 1)[None]
    observed_BJ = live_B[:, None] & (j_J <= jnp.minimum(accepted_B + 1, k)[:, None])
    est = _observe(hits_BJ, trials_BJ, observed_BJ, (j_J <= accepted_B[:, None]).astype(jnp.float32), ema)
    return spec, backlog, est


def run_choice(step, keep_going, budget, spec: SpecState, backlog: Backlog, est):
    """`step` (one cycle of one K) repeated while `keep_going(spec, backlog, est, cycles run)` holds and fewer than
    `budget` cycles ran; at least once. The flag is computed at the end of each cycle, inside the cycle's own
    work, so the loop's predicate is a read of one value, as in fixed-K generation. Returns the state and whether
    the run would have gone on (it ended on the budget)."""
    def body(carry):
        s, bl, e, i, _ = carry
        s, bl, e = step(s, bl, e)
        return s, bl, e, i + 1, keep_going(s, bl, e, i + 1)

    spec, backlog, est, _, more = jax.lax.while_loop(lambda c: c[4] & (c[3] < budget), body,
                                                     (spec, backlog, est, jnp.int32(0), jnp.bool_(True)))
    return spec, backlog, est, more


def adaptive_cycle(w: SpecWeights, state: AdaptiveState, sp: dict, *, cfg: SpecConfig, steps: tuple[int, ...],
                   greedy: bool, max_new_tokens: int, ema: float, explore_every: int, stretch: int = 1,
                   hysteresis: float = 0.0, probe: bool = True, drafter=None, budget=None) -> AdaptiveState:
    """Choose K (the rule, an optimistic choice when exploration is due, or the schedule) and run it for at least
    `stretch` cycles, then for as long as the rule keeps it: until another K would finish the tokens still wanted
    sooner by more than `hysteresis` (a branch not yet run paying its first run), an exploration that would try
    another K falls due, the schedule names another K, or (K = 0) the backlog is full. At most `budget` cycles
    (None: `stretch`, one call of streaming); explorations and a schedule that switches K run a single cycle.

    A change of K costs the host a few reads (the loop's predicate, the catch-up's conditional, the switch's
    branch), so a run of one K pays them once, not per cycle; within it each cycle costs the one predicate read of
    fixed-K generation, and the estimates still learn from every cycle.

    Exploration backs off: each optimistic choice whose outcome leaves the rule's choice unchanged doubles the gap
    to the next one (up to explore_every x EXPLORE_BACKOFF cycles), and a change of the rule's own choice resets
    it, so a stretch where speculation cannot pay spends ever less on trying it."""
    spec = state.spec
    live_B = ~spec.done
    remaining_B = max_new_tokens - spec.generated
    accept_BJ = acceptance_rates(state.hits_BJ, state.trials_BJ, state.prior)

    def decide(accept, s: SpecState, used_N, current=None):
        """The rule over the tokens the live rows still want, a branch's first run priced. A cycle's tokens are
        not cut at the sequence's end: near it a cut makes a smaller K look better, and a change of K costs more
        than the last cycles could save (on a GPU a branch's first run in a call costs the host an update of its
        command buffers, several cycles of a small model)."""
        live = ~s.done
        rate_N, _ = throughput(accept, state.cost_N, live, None, steps)
        work = jnp.sum(jnp.where(live, max_new_tokens - s.generated, 0)).astype(jnp.float32)
        return priced_choice(rate_N, work, used_N, state.first_run_s, current, hysteresis)

    rule, _ = decide(accept_BJ, spec, state.used_N)
    hopeful, _ = decide(optimistic(accept_BJ), spec, state.used_N)
    if not probe:  # nothing observes c_1 during plain stretches: explore with the cheapest speculative K
        hopeful = jnp.maximum(hopeful, sum(1 for k in steps if k == 0))
    # a run the last call's budget cut (streaming's calls, the cost measurement's) goes on as the device loop's
    # would have: no new decision, no exploration bookkeeping
    resume = state.run_branch >= 0
    exploring = (spec.cycles >= state.explore_next) & ~resume
    choice = jnp.where(exploring, hopeful, rule)
    forced = state.schedule_P[spec.cycles % state.schedule_len]
    choice = jnp.where(forced >= 0, forced, choice)
    choice = jnp.where(resume, state.run_branch, choice)
    budget = jnp.int32(stretch) if budget is None else budget
    # one cycle for: a schedule that switches K (it names each cycle's K) and an exploration (a trial, not a
    # decision)
    single = ((forced >= 0) & (state.schedule_len > 1)) | ((forced < 0) & exploring & (hopeful != rule))
    single = single & ~resume
    budget = jnp.where(single, jnp.minimum(budget, 1), budget)
    held = jnp.where(resume, state.run_held, 0)
    k_chosen = jnp.asarray(steps, jnp.int32)[choice]
    width = state.backlog.tokens_BW.shape[1]

    used_N = state.used_N.at[choice].set(True)  # what the run's own decisions see

    def verdict(s: SpecState, e):
        """(the chosen K stays by the rule, no due exploration would try another K) under the counts `e`."""
        accept = acceptance_rates(*e, state.prior)
        return decide(accept, s, used_N, current=choice)[1], decide(optimistic(accept), s, used_N)[0] == choice

    def keep_going(s: SpecState, bl: Backlog, e, ran, plain_verdict=None):
        live = ~s.done
        stays, trial_free = verdict(s, e) if plain_verdict is None else plain_verdict
        kept = (held + ran < stretch) | stays
        # an exploration that falls due ends the run only when it would try another K
        no_trial = (s.cycles < state.explore_next) | trial_free
        forced_next = state.schedule_P[s.cycles % state.schedule_len]
        agrees = jnp.where(forced_next >= 0, forced_next == choice, kept & no_trial)
        # K = 0 appends to the backlog
        room = True if plain_verdict is None else jnp.all(bl.count_B + live.astype(jnp.int32) <= width)
        return jnp.any(live) & ~single & agrees & room

    def run(step, k: int, s: SpecState, bl: Backlog, e):
        if k > 0:
            return run_choice(step, keep_going, budget, s, bl, e)
        # A plain step observes nothing: the counts stay as the catch-up before the run left them, so the verdict
        # at the run's start stands and each cycle checks only the counters (the backlog's room, the batch's end,
        # a due exploration, the schedule)
        return run_choice(step, functools.partial(keep_going, plain_verdict=verdict(s, e)), budget, s, bl, e)

    common = dict(greedy=greedy, max_new_tokens=max_new_tokens, ema=ema, probe=probe)
    cycle_fns = [functools.partial(plain_step, w, cfg, **common) if k == 0 else
                 functools.partial(speculative_step, w, cfg, k=k, drafter=drafter, **common) for k in steps]
    cycle_fns = [lambda s, bl, e, f=f: f(s, bl, e, sp) for f in cycle_fns]
    # The draft catches up before a speculative run that finds a backlog, or a plain run that finds it full: one
    # conditional ahead of the switch, so the program holds one copy of the catch-up (each copy is a draft forward
    # to compile) and the cycles of a run have no conditional (on a GPU each one costs the host a read).
    queued_B = state.backlog.count_B  # (`pending` is the state's name for the token the target has not run yet)
    needs = jnp.where(k_chosen == 0, jnp.any(queued_B >= width), jnp.any(queued_B > 0))
    flush = functools.partial(catch_up, w, cfg, greedy=greedy, ema=ema, probe=probe)
    spec, backlog, est = jax.lax.cond(needs, lambda *a: flush(*a, sp), lambda s, bl, e: (s, bl, e), spec,
                                      state.backlog, (state.hits_BJ, state.trials_BJ))
    branches = [functools.partial(run, f, k) for f, k in zip(cycle_fns, steps)]
    new_spec, backlog, (hits_BJ, trials_BJ), more = jax.lax.switch(choice, branches, spec, backlog, est)

    # an exploration is confirmed when what it observed leaves the rule where it was
    rule_after, _ = decide(acceptance_rates(hits_BJ, trials_BJ, state.prior), new_spec, used_N)
    explore_next, gap = next_exploration(spec.cycles, exploring, (hopeful == rule) | (rule_after == rule),
                                         rule != state.last_rule, state.explore_gap, state.explore_next,
                                         explore_every)
    ran = new_spec.cycles - spec.cycles  # 0 on a finished batch: no token, count or log changes
    col_C = jnp.arange(state.k_log.shape[0])
    in_run_C = (col_C >= spec.cycles) & (col_C < new_spec.cycles)
    gain_BN = expected_tokens(accept_BJ, steps, remaining_B)  # the report's: what the cycles can still emit
    gain = jnp.sum(jnp.where(live_B, jnp.take(gain_BN, choice, axis=1), 0.0))
    fresh = (ran > 0) & ~resume
    return state.replace(
        spec=new_spec, backlog=backlog, hits_BJ=hits_BJ, trials_BJ=trials_BJ,
        explore_next=jnp.where(fresh, explore_next, state.explore_next),
        explore_gap=jnp.where(fresh, gap, state.explore_gap),
        last_rule=jnp.where(fresh, rule, state.last_rule),
        run_branch=jnp.where(more, choice, -1),
        used_N=jnp.where(ran > 0, used_N, state.used_N),
        run_held=held + ran,
        k_log=jnp.where(in_run_C, k_chosen, state.k_log),
        expected_tokens=state.expected_tokens + ran * gain,
        expected_s=state.expected_s + ran * state.cost_N[choice],
    )


def adaptive_loop(w: SpecWeights, state: AdaptiveState, sp: dict, limit, **cycle_kw) -> AdaptiveState:
    """Runs of one K on device until every sequence is done or `limit` cycles ran (the cost measurement's stop)."""
    start = state.spec.cycles

    def body(s):
        return adaptive_cycle(w, s, sp, budget=limit - (s.spec.cycles - start), **cycle_kw)

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.spec.cycles - start < limit), body, state)
