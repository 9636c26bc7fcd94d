"""The cost table t(K) of adaptive speculation: seconds per cycle of each compiled K, measured on the running device
(a few timed calls of the compiled loop with K forced) or given by the user, kept per device and shape.

Measured tables are kept in memory for the process; on a GPU also on disk (one small JSON file per key) under
$JAXSPEC_COST_CACHE, by default ~/.cache/jaxspec/adaptive-costs ($XDG_CACHE_HOME is honoured;
JAXSPEC_COST_CACHE=off keeps them in memory only). On a CPU nothing is written and no directory is created: CPU
timings move with whatever else the machine runs, so each process measures its own.

Costs are device time per cycle inside the on-device loop. Streaming adds a host round trip per cycle that is the
same for every K (and pipelining hides most of it), so the loop's costs favour K = 0 at least as much as the
stream's would. The table is measured at the prompt's context length; the key holds the cache capacity bucket.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from convert.json_input import parse_json

COST_CACHE_ENV = "JAXSPEC_COST_CACHE"
# cycles of the two timed calls whose difference gives t(K): what one call costs beyond its cycles (launching
# the loop, moving its state) cancels; 32 cycles apart, the plain branch's difference holds a whole number of
# catch-ups of either default backlog (8 or 32 entries)
MEASURE_CYCLES = (16, 48)
MEASURE_REPEATS = 3
# On a small model a round over the branches takes tens of milliseconds, and the median of three slopes still moves
# t(K + 1) / t(K) by several percent between processes: as much as the expected tokens of neighbouring K can differ,
# so the noise, not the device, chose between them (docs/performance.md, "Adaptive speculation by call"). Where rounds
# are that cheap, more of them, within MEASURE_BUDGET_S (the warm-up calls price a round).
MEASURE_BUDGET_S = 1.0
MEASURE_REPEATS_MAX = 9
# A cycle that drafts more does more work, so a K priced well below a smaller K is noise, and such noise can sit on
# the median of every round: an H200 table of the embedded pair once priced K = 2 below K = 1 and K = 4 below K = 3
# and ran K = 2 where K = 3 and 4 were far faster, where tables measured in other processes followed the whole
# calls' costs (docs/performance.md, "The cost table against whole calls"). Such a table is measured again, at most
# MEASURE_ATTEMPTS times, and the one that falls least stands.
MAX_FALL = 0.05
MEASURE_ATTEMPTS = 3
# a CPU has no command buffers and its calls' fixed cost is small, while a difference of two calls adds their
# noise (a shared machine's load moves each call): the short call runs no cycle, so t(K) is the long call's time
# per cycle less the call's own cost, and three rounds over the branches, the fastest standing (`measure`), keep
# one slow moment from pricing one K alone
CPU_MEASURE_CYCLES = (0, 24)
CPU_MEASURE_REPEATS = 3


class Measured(NamedTuple):
    costs_s: tuple[float, ...]  # t(K) per cycle of each branch
    # what a branch's first run in a call costs beyond its cycles: on a GPU the host updates the branch's command
    # buffers then (a millisecond or more: docs/performance.md). Taken as a call's fixed cost (the intercept
    # of the timed calls), which also holds the call's launch: an upper bound. 0 on a CPU, which has no command
    # buffers and whose intercepts are noise.
    first_run_s: float = 0.0


_MEMORY: dict[str, Measured] = {}


class CostTableError(ValueError):
    pass


def parse_costs(text: str, steps: tuple[int, ...], flag: str = "--speculative-adaptive-costs") -> tuple:
    """A table given as inline JSON or a JSON file: {"0": ms, "1": ms, ...} over exactly the compiled K set, in
    milliseconds per cycle. Returns ((K, seconds), ...); CostTableError naming the flag otherwise."""
    source = text
    if not text.lstrip().startswith(("{", "[")):
        try:
            source = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CostTableError(f"{flag} {text}: neither inline JSON nor a readable file ({e.__class__.__name__})") \
                from None
    try:
        table = parse_json(source)
    except json.JSONDecodeError as e:
        raise CostTableError(f"{flag}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise CostTableError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(table, dict):
        raise CostTableError(f"{flag}: expected a JSON object {{\"K\": ms per cycle}}")
    out = {}
    for key, value in table.items():
        try:
            k = int(key)
        except ValueError:
            raise CostTableError(f"{flag}: key {key!r} is not a draft length K") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise CostTableError(f"{flag}: K={k}: {value!r} is not a positive number of milliseconds")
        out[k] = float(value) / 1000.0
    if sorted(out) != list(steps):
        raise CostTableError(f"{flag}: gives K = {sorted(out)}, the compiled set is K = {list(steps)}")
    return tuple(sorted(out.items()))


def cost_key(*parts) -> str:
    """A stable key: the device, jaxlib and a digest of everything that shapes the programs (`parts`)."""
    dev = jax.devices()[0]
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
    return f"{dev.platform}-{dev.device_kind}-jaxlib{_jaxlib_version()}-{digest}".replace(" ", "_").replace("/", "_")


@functools.cache
def _jaxlib_version() -> str:
    """Read once a process: a generation asks for a key while its prefill runs, and each read of the installed
    packages' metadata goes to the disk."""
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return "unknown"


def disk_dir(environ=os.environ) -> Path | None:
    """Where measured tables are kept on disk; None off a GPU or when the user turned it off."""
    if jax.default_backend() != "gpu":
        return None
    chosen = environ.get(COST_CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off") else Path(chosen).expanduser()
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxspec" / "adaptive-costs"


def cached(key: str) -> Measured | None:
    if key in _MEMORY:
        return _MEMORY[key]
    folder = disk_dir()
    if folder is None:
        return None
    try:
        doc = json.loads((folder / f"{key}.json").read_text())
        costs = tuple(float(x) for x in doc["costs_s"])
        first_run = float(doc.get("first_run_s", 0.0))  # tables kept before it was measured price it at 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not costs or not all(0 < c < float("inf") for c in costs) or not 0 <= first_run < float("inf"):
        return None
    _MEMORY[key] = Measured(costs, first_run)
    return _MEMORY[key]


def remember(key: str, measured: Measured, steps: tuple[int, ...]) -> None:
    _MEMORY[key] = measured
    folder = disk_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"steps": list(steps), "costs_s": list(measured.costs_s),
                                   "first_run_s": measured.first_run_s}))
        tmp.replace(folder / f"{key}.json")
    except OSError:  # a read-only home: the table still serves this process
        pass


def timed_call(run_forced: Callable, state, branch: int, n: int) -> tuple[float, int]:
    """(seconds, cycles run) of `run_forced(a copy of state, branch, n)`, the copy made and the result waited for
    outside the timing."""
    copy = jax.tree.map(jnp.copy, state)
    jax.block_until_ready(copy)
    t0 = time.perf_counter()
    out, ran = run_forced(copy, branch, n)
    jax.block_until_ready(out.generated)
    return time.perf_counter() - t0, ran


def measure(run_forced: Callable, state, n_branches: int, cycles: tuple[int, int] | None = None,
            repeats: int | None = None, first_run: bool | None = None) -> Measured | None:
    """Seconds per cycle of each branch: `run_forced(state_copy, branch, n)` runs up to n cycles of that branch on
    a copy of `state` (donated) and returns (the state after, cycles it ran). After a long warm-up call of each
    branch, each repeat is a round over the branches that times a short and a long call of each (a short call of
    0 cycles times the call alone); t(K) is the median (on a CPU the least) over repeats of (long - short) / (their
    cycle difference), the slope, so a call's fixed cost is not spread over its cycles (it is several cycles' worth
    on a GPU), and the table is made non-decreasing in K (`nondecreasing`; `n_branches` are the compiled set in
    increasing K). Where the generation ends before the long call's cycles, the long call's time per cycle stands
    in. None if no cycle is left to run. The first-run price is the median over branches and repeats of the short
    call's time beyond its cycles (`first_run`; None: off a CPU). `repeats` None: 3 on a CPU; elsewhere 3, or more
    (up to MEASURE_REPEATS_MAX) where that many rounds fit in MEASURE_BUDGET_S."""
    on_cpu = jax.default_backend() == "cpu"
    first_run = not on_cpu if first_run is None else first_run
    short, long = cycles or (CPU_MEASURE_CYCLES if on_cpu else MEASURE_CYCLES)

    def timed(branch, n):
        return timed_call(run_forced, state, branch, n)

    # the warm-up is a long call: it runs every path of the branch (a plain stretch's catch-up comes only after
    # `backlog` steps), and a path's first run is slow on XLA:CPU (it priced K = 0 at 1.5-2x its cost)
    warm_s = 0.0
    for branch in range(n_branches):
        t_long, ran = timed(branch, long)
        if ran < 1:
            return None
        warm_s += t_long
    if not repeats:  # a round times a short and a long call of every branch: at most twice the warm-up's long calls
        repeats = CPU_MEASURE_REPEATS if on_cpu else \
            min(MEASURE_REPEATS_MAX, max(MEASURE_REPEATS, int(MEASURE_BUDGET_S / max(2 * warm_s, 1e-9))))

    def rounds():
        slopes, intercepts = [[] for _ in range(n_branches)], []
        for _ in range(repeats):  # rounds over the branches: drift in the machine's speed falls on every K alike
            for branch in range(n_branches):
                (t_short, ran_short), (t_long, ran_long) = timed(branch, short), timed(branch, long)
                slope = (t_long - t_short) / (ran_long - ran_short) if ran_long > ran_short else 0.0
                slopes[branch].append(slope if slope > 0 else t_long / ran_long)
                intercepts.append(max(0.0, t_short - ran_short * slopes[branch][-1]))
        # a CPU's noise is the machine's other load, which only adds time: the fastest round is the closest to the
        # program's own cost, and its ratios t(K) / t(0) move less between measurements than the median's
        # (`python -m bench.labs.cost_table_spread`)
        return [(min if on_cpu else statistics.median)(s) for s in slopes], statistics.median(intercepts)

    # off a CPU, a table whose cost falls with K by more than MAX_FALL is measured again (the least fall stands)
    attempts = [rounds()]
    while not on_cpu and falls(attempts[-1][0]) > MAX_FALL and len(attempts) < MEASURE_ATTEMPTS:
        attempts.append(rounds())
    costs, intercept = min(attempts, key=lambda a: falls(a[0]))
    return Measured(nondecreasing(costs), intercept if first_run else 0.0)


def falls(costs) -> float:
    """The largest fraction by which a K's cost lies below a smaller K's: 0 for a non-decreasing table."""
    top, fall = 0.0, 0.0
    for c in costs:
        top = max(top, c)
        fall = max(fall, 1.0 - c / top if top > 0 else 0.0)
    return fall


def nondecreasing(costs) -> tuple[float, ...]:
    """The closest non-decreasing sequence (least squares, pool-adjacent-violators): a cycle that drafts more does
    strictly more work, so a table in which t(K) falls with K holds noise (a loaded 2-core CPU priced K = 3 below
    K = 2), and each run of violators is replaced by its mean."""
    blocks = []  # [sum, count] of pooled neighbours
    for c in costs:
        blocks.append([float(c), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return tuple(total / n for total, n in blocks for _ in range(n))
