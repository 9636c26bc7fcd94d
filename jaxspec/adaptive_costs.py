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

import hashlib
import json
import os
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

COST_CACHE_ENV = "JAXSPEC_COST_CACHE"
MEASURE_CYCLES = 16  # cycles per timed call: two backlog catch-ups of the plain branch at the default backlog
MEASURE_REPEATS = 3

_MEMORY: dict[str, tuple[float, ...]] = {}


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
        table = json.loads(source)
    except json.JSONDecodeError as e:
        raise CostTableError(f"{flag}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
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
    try:
        jaxlib = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        jaxlib = "unknown"
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
    return f"{dev.platform}-{dev.device_kind}-jaxlib{jaxlib}-{digest}".replace(" ", "_").replace("/", "_")


def disk_dir(environ=os.environ) -> Path | None:
    """Where measured tables are kept on disk; None off a GPU or when the user turned it off."""
    if jax.default_backend() != "gpu":
        return None
    chosen = environ.get(COST_CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off") else Path(chosen).expanduser()
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxspec" / "adaptive-costs"


def cached(key: str) -> tuple[float, ...] | None:
    if key in _MEMORY:
        return _MEMORY[key]
    folder = disk_dir()
    if folder is None:
        return None
    try:
        doc = json.loads((folder / f"{key}.json").read_text())
        costs = tuple(float(x) for x in doc["costs_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not costs or not all(0 < c < float("inf") for c in costs):
        return None
    _MEMORY[key] = costs
    return costs


def remember(key: str, costs: tuple[float, ...], steps: tuple[int, ...]) -> None:
    _MEMORY[key] = costs
    folder = disk_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"steps": list(steps), "costs_s": list(costs)}))
        tmp.replace(folder / f"{key}.json")
    except OSError:  # a read-only home: the table still serves this process
        pass


def measure(run_forced: Callable, state, n_branches: int, cycles: int = MEASURE_CYCLES,
            repeats: int = MEASURE_REPEATS) -> tuple[float, ...] | None:
    """Seconds per cycle of each branch: `run_forced(state_copy, branch, cycles)` runs up to `cycles` cycles of
    that branch on a copy of `state` (donated) and returns (the state after, cycles it ran); a warm-up call, then
    the median of `repeats` synchronised calls, each divided by the cycles it ran. None if no cycle is left to run."""
    costs = []
    for branch in range(n_branches):
        times = []
        for rep in range(repeats + 1):
            copy = jax.tree.map(jnp.copy, state)
            jax.block_until_ready(copy)
            t0 = time.perf_counter()
            out, ran = run_forced(copy, branch, cycles)
            jax.block_until_ready(out.generated)
            wall = time.perf_counter() - t0
            if ran < 1:
                return None
            if rep:
                times.append(wall / ran)
        costs.append(statistics.median(times))
    return tuple(costs)
