"""`python -m bench.labs.graph_mode_check`: does XLA's CONCURRENT scheduling of a step's CUDA graph give the same tokens
as XLA's default (LHS), and how much faster is it? (The engine sets CONCURRENT: `jaxspec.xla_flags`.)

`--xla_gpu_command_buffer_scheduling_mode` orders the kernels XLA records into a step's CUDA graph: LHS (the default)
as the latency-hiding scheduler ordered them, CONCURRENT with edges only where kernels share buffers, so independent
kernels may overlap (run 15 measured every B=1 1k row 4-8% faster, once, on one machine). Before the engine sets
it, the same inputs must give the same outputs. Each mode runs in its own process (XLA reads XLA_FLAGS once), in
the order of --modes (default LHS, CONCURRENT, LHS: A/B/A, so a drifting machine shows), on a Kimi-K2.5-shaped
model of --layers layers (INT4 experts, random weights from a fixed key, the same in every process):
- --steps greedy decode steps in one jitted device loop, each fed the previous step's argmax, from the same
  random cache: the generated tokens must be identical;
- one verify step of --verify-tokens tokens: its logits are compared bit for bit (max |difference| reported);
- timings as `bench.step` takes them: the decode and verify steps synchronised (median) and queued back to back
  (mean), and the greedy loop's time per step.
Each process also runs the greedy loop a second time from a fresh cache (`tokens_repeat_equal`): a mode whose own
repeats differ is nondeterministic within one executable. Across processes XLA's autotuner picks GEMM
algorithms by timing them, so two processes of the same mode may compile different kernels (run 16: LHS against
LHS differed from the tenth token); so by default (`--autotune-cache shared`) every process points at one fresh
`--xla_gpu_per_fusion_autotune_cache_dir` and uses the first one's choices.
Writes graph-mode-check-<platform>-<date>.json to --out; exits 1 when a mode's tokens differ from the first mode's.
On a CPU the flag changes nothing (there is no CUDA graph), which is what the tests run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.labs.xla_flag_sets import SCHEDULING_MODES as MODES  # noqa: E402
from bench.labs.xla_flag_sets import flags_of  # noqa: E402
from jaxspec.xla_flags import AUTOTUNE_CACHE_ENV, AUTOTUNE_CACHE_FLAG  # noqa: E402
from jaxspec.xla_flags import SCHEDULING_FLAG as FLAG  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["LHS", "CONCURRENT", "LHS"], metavar="MODE[+SET...]",
                   help=f"scheduling modes ({', '.join(MODES)}), each optionally with named XLA flag sets on top "
                        "(bench/labs/xla_flag_sets.py), e.g. CONCURRENT+exclusive-lock")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps in the device loop")
    p.add_argument("--verify-tokens", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--autotune-cache", choices=("own", "shared"), default="shared",
                   help="shared (default): one fresh autotune cache directory for all processes, so only the modes "
                        "differ; own: each process autotunes for itself (the engine's autotune cache off), which "
                        "shows the autotuner's own run-to-run differences")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per mode's process")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: the JSON path one mode's process writes
    args = p.parse_args(argv)
    for spec in args.modes:
        try:
            _mode_flags(spec)
        except (KeyError, ValueError) as e:
            p.error(f"--modes {spec}: {e.args[0]}")
    for flag, v in (("--layers", args.layers), ("--steps", args.steps), ("--verify-tokens", args.verify_tokens),
                    ("--iters", args.iters), ("--context", args.context)):
        if v < 1:
            p.error(f"{flag} must be >= 1, not {v}")
    return args


def _mode_flags(spec: str) -> list[str]:
    """"MODE" or "MODE+SET+..." -> the flag sets' flags, then the scheduling mode's flag."""
    mode, *sets = spec.split("+")
    if mode not in MODES:
        raise ValueError(f"the scheduling mode must be one of {', '.join(MODES)}, not {mode!r}")
    return flags_of(sets).split() + [f"{FLAG}={mode}"]


def _with_mode(xla_flags: str, mode: str, autotune_cache_dir: str | None = None) -> str:
    """XLA_FLAGS with the scheduling mode (and flag sets) of `mode` and the autotune cache directory
    `autotune_cache_dir` (or none), earlier settings of either flag (the engine's, from importing bench) removed."""
    kept = [f for f in xla_flags.split() if not f.startswith((FLAG + "=", AUTOTUNE_CACHE_FLAG + "="))]
    if autotune_cache_dir is not None:
        kept.append(f"{AUTOTUNE_CACHE_FLAG}={autotune_cache_dir}")
    return " ".join(kept + _mode_flags(mode))


def run_one_mode(args) -> dict:
    """This process's mode (from XLA_FLAGS): tokens, the verify logits' digest, timings. Saves the logits beside."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.step import make_step, random_cache, random_model, step_inputs
    from bench.timing import median_ms
    from model.decoder import forward
    from model.config import Kernels
    from model.kv_cache import round_capacity

    cfg, w = random_model(args.layers, args.tiny)
    key = jax.random.PRNGKey(11)
    capacity = round_capacity(args.context + args.steps + args.verify_tokens + 16)
    fresh_cache = lambda: random_cache(cfg, 1, capacity, args.context, key)  # noqa: E731

    def greedy(w, first_B1, cache):
        def body(i, carry):
            toks_B1, c, out_tokens = carry
            positions = jnp.full_like(toks_B1, args.context) + i
            out = forward(w, cfg, toks_B1, positions, c)
            nxt = jnp.argmax(out.logits[:, -1], axis=-1).astype(toks_B1.dtype)[:, None]
            return nxt, out.cache, out_tokens.at[i].set(nxt[0, 0])

        _, cache, greedy_tokens = jax.lax.fori_loop(0, args.steps, body,
                                                    (first_B1, cache, jnp.zeros((args.steps,), jnp.int32)))
        return greedy_tokens, cache

    greedy_jit = jax.jit(greedy, donate_argnums=(2,))
    first_B1, _ = step_inputs(cfg, 1, 1, args.context, key)
    greedy_tokens, _ = greedy_jit(w, first_B1, fresh_cache())
    tokens = [int(t) for t in np.asarray(greedy_tokens)]
    repeat_tokens, _ = greedy_jit(w, first_B1, fresh_cache())  # same executable, same inputs
    tokens_repeat = [int(t) for t in np.asarray(repeat_tokens)]
    holder = {"cache": fresh_cache()}

    def loop_call():
        toks, holder["cache"] = greedy_jit(w, first_B1, holder["cache"])
        return toks

    loop = median_ms(loop_call, warmup=1, iters=max(3, args.iters // 2))

    step_fn = make_step(cfg, Kernels())
    rows = {}
    for t in (1, args.verify_tokens):
        toks_BT, pos_BT = step_inputs(cfg, 1, t, args.context, jax.random.PRNGKey(100 + t))
        logits, cache, _ = step_fn(w, toks_BT, pos_BT, fresh_cache())
        holder["cache"] = cache

        def run():
            out, holder["cache"], _ = step_fn(w, toks_BT, pos_BT, holder["cache"])
            return out

        stats = median_ms(run, warmup=3, iters=args.iters)
        logits_np = np.asarray(logits, np.float32)
        rows[t] = dict(sync_ms=stats["median_ms"], queued_ms=stats["queued_mean_ms"],
                       logits_sha256=hashlib.sha256(logits_np.tobytes()).hexdigest())
        np.save(Path(args.child).with_suffix(f".T{t}.npy"), logits_np)
    return dict(xla_flags=os.environ.get("XLA_FLAGS", ""), device=jax.devices()[0].device_kind, jax=jax.__version__,
                tokens=tokens, tokens_repeat_equal=tokens_repeat == tokens,
                loop_ms_per_step=loop["median_ms"] / args.steps, decode=rows[1],
                verify=rows[args.verify_tokens])


def _child_argv(args, path: Path) -> list[str]:
    argv = [sys.executable, "-m", "bench.labs.graph_mode_check", "--child", str(path), "--layers", str(args.layers),
            "--context", str(args.context), "--steps", str(args.steps), "--verify-tokens", str(args.verify_tokens),
            "--iters", str(args.iters)]
    return argv + (["--tiny"] if args.tiny else [])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(run_one_mode(args)))
        return {}
    import numpy as np

    from bench.report import write_json

    log = lambda *a: print(*a, flush=True)  # noqa: E731
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(date=now.isoformat(timespec="seconds"), layers=args.layers, context=args.context, steps=args.steps,
                  verify_tokens=args.verify_tokens, tiny=args.tiny, autotune_cache=args.autotune_cache, runs=[])
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        cache_dir = None
        if args.autotune_cache == "shared":
            cache_dir = Path(tmp) / "autotune"
            cache_dir.mkdir()
        for i, mode in enumerate(args.modes):
            path = Path(tmp) / f"mode{i}.json"
            env = {**os.environ, AUTOTUNE_CACHE_ENV: "off",  # the child's flags are all set here
                   "XLA_FLAGS": _with_mode(os.environ.get("XLA_FLAGS", ""), mode, cache_dir and str(cache_dir))}
            proc = subprocess.run(_child_argv(args, path), env=env, capture_output=True, text=True,
                                  timeout=args.timeout_s)
            if proc.returncode != 0 or not path.exists():
                raise SystemExit(f"graph_mode_check: the {mode} process failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-3000:]}")
            run = dict(mode=mode, **json.loads(path.read_text()))
            logits = {t: np.load(path.with_suffix(f".T{t}.npy")) for t in (1, args.verify_tokens)}
            if first is None:
                first = (run, logits)
            run["tokens_equal_first"] = run["tokens"] == first[0]["tokens"]
            for name, t in (("decode", 1), ("verify", args.verify_tokens)):
                run[name]["logits_max_abs_diff_first"] = float(np.max(np.abs(logits[t] - first[1][t])))
                run[name]["logits_identical_first"] = run[name]["logits_sha256"] == first[0][name]["logits_sha256"]
            result["runs"].append(run)
            log(f"{mode:24s} decode {run['decode']['sync_ms']:.3f} ms synchronised, {run['decode']['queued_ms']:.3f} "
                f"queued; verify T={args.verify_tokens} {run['verify']['sync_ms']:.3f} / {run['verify']['queued_ms']:.3f}; "
                f"greedy loop {run['loop_ms_per_step']:.3f} ms/step; tokens equal to {args.modes[0]}'s: "
                f"{run['tokens_equal_first']}, to its own repeat: {run['tokens_repeat_equal']}; logits max |diff| "
                f"decode {run['decode']['logits_max_abs_diff_first']:.3g}, "
                f"verify {run['verify']['logits_max_abs_diff_first']:.3g}")
    result["device"] = result["runs"][0]["device"]
    result["jax"] = result["runs"][0]["jax"]
    result["all_tokens_equal"] = all(r["tokens_equal_first"] and r["tokens_repeat_equal"] for r in result["runs"])
    platform = "cpu" if result["device"].lower().startswith("cpu") else "gpu"
    path = write_json(result, Path(args.out), f"graph-mode-check-{platform}-{now.strftime('%Y%m%d-%H%M')}")
    log(f"wrote {path}")
    if not result["all_tokens_equal"]:
        log("the modes generated different tokens")
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
