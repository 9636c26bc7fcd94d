"""`python -m bench.labs.moe_block_lab`: one Kimi-K2.5 MoE block (router, routed INT4 experts, bf16 shared expert:
`model.moe.moe`, what a decoder layer calls) under variants of how its parts are launched, against its bytes.

Variants: `default` (the engine's: one CUDA graph, XLA's CONCURRENT scheduling) and `streamN` (the shared expert as
a call XLA places on GPU stream N, `model.moe.shared_expert`). Per token count: each variant's output against the
default's (relative error), the time of one call as the difference of two chain lengths
(bench.moe_layer.per_call_ms) in round-robin rounds (median reported), and the floor: router + shared expert + the
unique routed experts + x in and out at 4.3 TB/s. Writes moe-block-lab-<platform>-<date>.json to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms  # noqa: E402
from bench.moe_layer import _moe_block, _rel_err, chain_pair, moe_block_bytes, per_call_ms  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.timing import summarize_rounds  # noqa: E402
from bench.step import random_model  # noqa: E402
from model.moe import MoEWeights  # noqa: E402
from model.router import route  # noqa: E402


def shared_stream_of(variant: str) -> int | None:
    """`default` -> None, `streamN` -> N; anything else is an error naming the variant."""
    if variant == "default":
        return None
    m = re.fullmatch(r"stream([1-9][0-9]*)", variant)
    if not m:
        raise ValueError(f"unknown --variants entry {variant!r}: 'default' or 'streamN' (N >= 1)")
    return int(m.group(1))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", default=["default", "stream1"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="synchronised runs per chain length")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.rounds < 1 or args.iters < 1:
        p.error("--tokens, --rounds and --iters must be >= 1")
    for v in args.variants:
        try:
            shared_stream_of(v)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    cfg, w = random_model(2, args.tiny)  # layer 0 dense, layer 1 the MoE block
    layer = next(lw.mlp for lw in w.layers if isinstance(lw.mlp, MoEWeights))
    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  date=now.isoformat(timespec="seconds"), xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[])
    for t in args.tokens:
        x_TH = jax.random.normal(jax.random.PRNGKey(t), (t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
        weights_TK, ids_TK = route(x_TH, layer.router, layer.router_bias, cfg)
        unique = int(np.unique(np.asarray(ids_TK)).size)
        floor = floor_ms(moe_block_bytes(layer, unique, x_TH), HBM_TBS)
        call = (x_TH, layer, ids_TK, weights_TK)
        fns = {v: functools.partial(_moe_block, cfg=cfg, shared_stream=shared_stream_of(v)) for v in args.variants}
        outs = {v: jax.jit(fn)(*call) for v, fn in fns.items()}
        rows = [dict(variant=v, tokens=t, unique_experts=unique, floor_ms=floor,
                     rel_err=_rel_err(out, outs[args.variants[0]])) for v, out in outs.items()]
        chains = {v: chain_pair(fn) for v, fn in fns.items()}
        for r in range(args.rounds):  # round-robin, so a drifting machine moves every variant alike
            for row in rows:
                row.setdefault("round_ms", []).append(per_call_ms(chains[row["variant"]], call, args.iters)["ms"])
                log(f"T={t} round {r} {row['variant']:10s} {row['round_ms'][-1] * 1e3:8.1f} us")
        for row in rows:
            log(f"T={t} {row['variant']:10s} {summarize_rounds(row, floor)}  rel_err vs {args.variants[0]} "
                f"{row['rel_err']:.1e}  rounds " + " ".join(f"{m * 1e3:.1f}" for m in row["round_ms"]))
        result["rows"] += rows
    path = write_json(result, Path(args.out), f"moe-block-lab-{dev.platform}-{now.strftime('%Y%m%d-%H%M')}")
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
