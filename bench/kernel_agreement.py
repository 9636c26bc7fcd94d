"""`python -m bench.kernel_agreement`: do the engine's GPU kernels compute the step the plain XLA path computes?

The CPU tests hold each kernel to its reference in interpret mode; this checks the whole step on the device, where
the kernels really run. On a Kimi-K2.5-shaped model of N layers (random weights, bf16 and INT4 experts) and a
random latent cache, per batch, context and T, one step's logits under:
- `plain`: XLA everywhere (`Kernels(moe="off", mla="off", router="off")`), the reference;
- `engine`: the engine's dispatch (every kernel where it applies);
- `router`, `experts`, `attention`: one kernel family on, the rest plain, to say which one a difference comes from;
- `experts_grouped`: the routed experts under `Kernels(moe="grouped")` (moe_grouped for verify), the rest plain;
- `attention_paged`: `attention` over the same cache laid out as the server's paged cache (model.kv_cache: pool
  pages in scrambled order, one block table), which the attention kernels read through the table where they apply
  and the plain path gathers (bench.paged_attention's layout).
Each against `plain`: the logits' relative error (all rows, and the worst row), argmax agreement, and how many
(layer, token) expert choices differ. Random weights give near-ties between the 8th and 9th expert: two paths
whose router logits differ in the last bits pick different experts there, and that token's logits then move by
several percent. So rows are split by whether their routes agree: `same_route_max_rel_err` (rows routed alike,
which must agree to rounding) and `rows_rerouted` (rows where some layer picked another expert for the token or
for an earlier token of its sequence). bf16 experts of 4 K2.5 layers take ~100 GB: run them with `--layers 2`.
Writes kernel-agreement-<platform>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.paged_attention import page_pool, scrambled_pages  # noqa: E402
from bench.report import fmt, run_stamp, write_report  # noqa: E402
from bench.step import bench_config, draw_weights, random_cache, step_inputs  # noqa: E402
from model.decoder import forward, fuse_attention_inputs  # noqa: E402
from model.config import Kernels  # noqa: E402
from model.kv_cache import LatentCache, round_capacity  # noqa: E402

# which kernel families a variant turns on
VARIANTS = {
    "plain": (),
    "engine": ("router", "experts", "attention"),
    "router": ("router",),
    "experts": ("experts",),
    "attention": ("attention",),
    "experts_grouped": ("experts_grouped",),
    "attention_paged": ("attention",),
}
CHECKED = tuple(v for v in VARIANTS if v != "plain")  # each compared with "plain"
PAGED = ("attention_paged",)  # variants run over the cache in pages


def kernel_families(on: tuple[str, ...]) -> Kernels:
    """The kernel config of a variant: each family in `on` takes the engine's own rule ("auto"; the routed experts
    "grouped" under experts_grouped), the others the plain XLA path ("off")."""
    moe = "grouped" if "experts_grouped" in on else "auto" if "experts" in on else "off"
    return Kernels(router="auto" if "router" in on else "off", moe=moe, mla="auto" if "attention" in on else "off")


def paged_copy(cache: LatentCache, held_positions: int, seed: int) -> LatentCache:
    """`cache` as a paged cache: each sequence's pages of its first `held_positions` positions in a pool per layer,
    in scrambled order, under one block table (bench.paged_attention's layout; the rest of the table holds none)."""
    pages_BM, held = scrambled_pages(cache.batch, cache.capacity, held_positions, seed)
    pools = lambda caches: tuple(page_pool(x, pages_BM, held) for x in caches)  # noqa: E731
    return LatentCache(latent=pools(cache.latent), k_rope=pools(cache.k_rope), lengths=cache.lengths,
                       pages_BM=pages_BM)


def step_logits(w, cfg, tokens_BT, positions_BT, cache, on: tuple[str, ...]):
    """One step's float32 logits [B, T, V] and each MoE layer's expert ids [L, B*T, K], traced under `on`."""
    cfg = cfg.replace(kernels=kernel_families(on))

    def step(w, tokens_BT, positions_BT, cache):
        out = forward(w, cfg, tokens_BT, positions_BT, cache)
        return out.logits.astype(jnp.float32), jnp.stack(out.expert_ids)

    logits, ids = jax.jit(step)(w, tokens_BT, positions_BT, cache)
    return np.asarray(logits), np.asarray(ids)


def compare(logits, ids, ref_logits, ref_ids) -> dict:
    """`logits` [B, T, V] / `ids` [L, B*T, K] against the reference's: relative errors overall and per row (one
    row a token), argmax agreement, expert choices that differ (as sets), and the rows split by route. A token
    is "rerouted" when some layer chose other experts for it or for an earlier token of its sequence in this step
    (whose cache entries it attends to in the layers after)."""
    b, t, v = logits.shape
    rows, ref_rows = logits.reshape(-1, v), ref_logits.reshape(-1, v)
    row_err = np.linalg.norm(rows - ref_rows, axis=-1) / np.maximum(np.linalg.norm(ref_rows, axis=-1), 1e-30)
    differs_LX = np.any(np.sort(ids, -1) != np.sort(ref_ids, -1), axis=-1)  # [L, B*T], rows b-major as the logits
    rerouted = np.maximum.accumulate(differs_LX.any(axis=0).reshape(b, t), axis=1).reshape(-1)
    same = row_err[~rerouted]
    return dict(
        rel_err=float(np.linalg.norm(rows - ref_rows) / np.linalg.norm(ref_rows)),
        max_row_rel_err=float(row_err.max()),
        argmax_agree=float(np.mean(rows.argmax(-1) == ref_rows.argmax(-1))),
        choices_differ=int(differs_LX.sum()), choices=int(differs_LX.size),
        rows=int(rows.shape[0]), rows_rerouted=int(rerouted.sum()),
        same_route_max_rel_err=float(same.max()) if same.size else None,
        rerouted_max_rel_err=float(row_err[rerouted].max()) if rerouted.any() else None,
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--experts", nargs="+", choices=["bf16", "int4"], default=["bf16", "int4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--variants", nargs="+", choices=CHECKED, default=list(CHECKED))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if min(args.batches + args.contexts + args.tokens + [args.layers]) < 1:
        p.error("--layers, --batches, --contexts and --tokens must be positive")
    return args


def markdown(res: dict) -> str:
    lines = [f"{res['device']}, jax {res['jax']}, {res['date']}: {res['layers']} layers, random weights and latent "
             "cache; each variant's step against the plain XLA path's (`python -m bench.kernel_agreement`).", "",
             "| experts | B | context | T | variant | rel. err | worst row | argmax agree | expert choices differing | "
             "rows rerouted | worst row routed alike | worst rerouted row |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    err = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    for r in res["rows"]:
        lines.append(f"| {r['experts']} | {r['batch']} | {r['context']} | {r['tokens']} | {r['variant']} | "
                     f"{err(r['rel_err'])} | {err(r['max_row_rel_err'])} | {fmt(r['argmax_agree'], 3)} | "
                     f"{r['choices_differ']} / {r['choices']} | {r['rows_rerouted']} / {r['rows']} | "
                     f"{err(r['same_route_max_rel_err'])} | {err(r['rerouted_max_rel_err'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    stamp = run_stamp()
    res = dict(**stamp.fields, layers=args.layers, rows=[])
    cfg = bench_config(args.layers, args.tiny)
    stem = f"kernel-agreement-{stamp.suffix}"

    # saved after every row: a run cut short by its time limit keeps what it measured
    save = lambda: write_report(res, Path(args.out), stem, markdown)  # noqa: E731
    for experts in args.experts:
        w = fuse_attention_inputs(draw_weights(cfg, args.tiny, experts))  # the layout the engines run
        for b in args.batches:
            for c in args.contexts:
                key = jax.random.PRNGKey(1000 * b + c)
                cache = random_cache(cfg, b, round_capacity(c + 16), c, key)
                paged = paged_copy(cache, c + 16, seed=1000 * b + c) if set(args.variants) & set(PAGED) else None
                for t in args.tokens:
                    tokens_BT, positions_BT = step_inputs(cfg, b, t, c, jax.random.fold_in(key, t))
                    ref = step_logits(w, cfg, tokens_BT, positions_BT, cache, VARIANTS["plain"])
                    for v in args.variants:
                        on = paged if v in PAGED else cache
                        row = dict(experts=experts, batch=b, context=c, tokens=t, variant=v,
                                   **compare(*step_logits(w, cfg, tokens_BT, positions_BT, on, VARIANTS[v]), *ref))
                        res["rows"].append(row)
                        save()
                        log(f"{experts} B={b} ctx={c} T={t} {v:15s}: rel_err {row['rel_err']:.2e}, worst row "
                            f"{row['max_row_rel_err']:.2e}, argmax {row['argmax_agree']:.3f}, choices differing "
                            f"{row['choices_differ']}/{row['choices']}, rows rerouted {row['rows_rerouted']}/{row['rows']}"
                            f", worst row routed alike {row['same_route_max_rel_err']}")
                del cache, paged
        del w
    log(f"wrote {save()} and .md")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
