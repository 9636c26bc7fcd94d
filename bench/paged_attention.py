"""`python -m bench.paged_attention`: MLA layers' decode and verify step over a paged cache, read three ways.

A step runs N layers (--layers) of `model.attention_mla.mla` at Kimi K2.5's MLA dims (hidden 7168, 64 heads,
q-LoRA 1536, latent 512, rope 64, nope 128, v 128), each over its own cache as the target's layers are, with one
set of random bf16 weights (input projections fused as the engine runs them): each layer's projections, cache
write, attention and o_proj, the residual stream carried from one layer to the next. N layers in one program keep
the host's dispatch of a call out of what is compared. Per batch, context and T (1: decode, 4: verify), over one
random cache laid out as each layout holds it:
- `contiguous_xla` / `contiguous_kernel`: the unpaged cache [B, S, C], XLA's absorbed attention / the Pallas decode
  kernels (model/kernels/mla_decode.py);
- `paged_gather_xla` / `paged_gather_kernel`: a paged cache (model.kv_cache: 64-position pages of a shared pool in
  scrambled order, one block table for every layer) whose pages each layer gathers into a contiguous copy
  (`read_pages`) that XLA's attention / the kernels then read: how a paged cache was read before the kernels read
  pages;
- `paged_kernel`: the same paged cache read by the kernels through the block table (`mla` with `Kernels(mla="on")`;
  `kernel_reads_pages` says whether the dispatch took that path on this backend).
Each sequence holds the pages of its context and the next 16 positions; the table's other entries hold no page.
Per row: the median, min and max of device-synchronised steps after warm-up (bench.timing.median_ms, the caches
donated and fed back) and the median per layer, the program's compile time (`compile_steps`: most of a shape's
layouts compile side by side), the first call's output's relative error
against `contiguous_xla`, for a paged kernel row whether its output equals `contiguous_kernel`'s bit for bit (the
kernels read the same blocks in the same order), and whether the engine's own dispatch (`Kernels()`) takes the
kernels at this shape. Writes paged-attention-<platform>-<date>.json and .md to --out, after every row; shapes
not started within --budget-s are listed as skipped. `--tiny`: small dims (a CPU smoke run; off a GPU the kernels
run in Pallas' interpret mode and the dispatch never reads pages).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.report import fmt, run_stamp, write_report  # noqa: E402
from bench.step import TINY_DIMS, random_cache  # noqa: E402
from bench.timing import median_ms  # noqa: E402
from jaxspec.serving.prefix_pages import PAGE_TOKENS  # noqa: E402
from model import attention_mla  # noqa: E402
from model.attention_mla import MLAWeights, fuse_input_projections  # noqa: E402
from model.config import Kernels  # noqa: E402
from model.configs import known_config  # noqa: E402
from model.kernels.dispatch import mla_kernel_applies  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402
from model.rope import cos_sin, target_rope_tables  # noqa: E402

# name -> (paged cache, the attention path given to mla, Kernels.mla)
LAYOUTS = {
    "contiguous_xla": (False, "absorbed", "off"),
    "contiguous_kernel": (False, "absorbed_kernel", "off"),
    "paged_gather_xla": (True, "absorbed", "off"),
    # `mla` hands the pages to the kernels only when its dispatch picks them; with a path named outright it gathers
    "paged_gather_kernel": (True, "absorbed_kernel", "off"),
    "paged_kernel": (True, "absorbed", "on"),
}
REFERENCE = "contiguous_xla"
HEADROOM = 16  # positions past the context that a sequence holds pages for (and the capacity rounds up from)


def layer_config(tiny: bool):
    cfg = known_config("kimi-k2.5")
    return cfg.replace(**TINY_DIMS) if tiny else cfg


def random_mla_weights(cfg, key, dtype=jnp.bfloat16) -> MLAWeights:
    """One layer's MLA weights at `cfg`'s dims: normals scaled by their fan-in, norm weights 1; the input
    projections fused (`fuse_input_projections`) as the engine runs them."""
    h, n, q = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank
    dn, r, dv, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    keys = iter(jax.random.split(key, 8))

    def normal(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    w = MLAWeights(q_a_proj=normal((q, h), h), q_a_norm=jnp.ones((q,), dtype), q_b_proj=normal((n, dn + r, q), q),
                   kv_a_proj=normal((c + r, h), h), kv_a_norm=jnp.ones((c,), dtype), w_uk=normal((n, c, dn), c),
                   w_uv=normal((n, dv, c), c), o_proj=normal((h, n, dv), n * dv))
    return fuse_input_projections(w)


def scrambled_pages(batch: int, capacity: int, held_positions: int, seed: int):
    """A block table [B, capacity / PAGE_TOKENS] whose sequences hold the pages of their first `held_positions`
    positions, in random pool order; its other entries hold none (the pool's size). -> (pages_BM, pages held each)."""
    m = capacity // PAGE_TOKENS
    held = min(m, -(-held_positions // PAGE_TOKENS))
    pages_BM = np.full((batch, m), batch * held, np.int32)
    pages_BM[:, :held] = np.random.default_rng(seed).permutation(batch * held).reshape(batch, held)
    return jnp.asarray(pages_BM), held


def page_pool(cache_BSX, pages_BM, held: int):
    """The pool [B * held, PAGE_TOKENS, X] holding each sequence's first `held` pages of `cache_BSX` where its table
    names them."""
    b, _, x = cache_BSX.shape
    pages_BMPX = cache_BSX[:, : held * PAGE_TOKENS].reshape(b * held, PAGE_TOKENS, x)
    return jnp.zeros((b * held, PAGE_TOKENS, x), cache_BSX.dtype).at[pages_BM[:, :held].reshape(-1)].set(pages_BMPX)


def layers_step(cfg, layout: str, layers: int):
    """Jitted step of `layers` MLA layers under `layout`, each over its own cache (caches donated), the residual
    stream carried from one to the next: (w, x, positions, latents, k_ropes, pages) -> (x out [B, T, H], latents,
    k_ropes). One jitted layer called per layer, as the decoder does: traced once, inlined by XLA."""
    paged, path, mla_kernels = LAYOUTS[layout]
    cfg = cfg.replace(kernels=Kernels(mla=mla_kernels))
    inv_freq, multiplier = target_rope_tables(cfg)

    @jax.jit
    def layer(w, x_BTH, cos, sin, positions_BT, latent, k_rope, pages_BM):
        return attention_mla.mla(x_BTH, w, cfg, cos, sin, positions_BT, latent, k_rope, path,
                                 pages_BM=pages_BM if paged else None)

    def step(w, x_BTH, positions_BT, latents, k_ropes, pages_BM):
        cos, sin = cos_sin(positions_BT, inv_freq, multiplier)
        latents_out, k_ropes_out = [], []
        for latent, k_rope in zip(latents, k_ropes):
            out_BTH, latent, k_rope = layer(w, x_BTH, cos, sin, positions_BT, latent, k_rope, pages_BM)
            x_BTH = x_BTH + out_BTH
            latents_out.append(latent)
            k_ropes_out.append(k_rope)
        return x_BTH, tuple(latents_out), tuple(k_ropes_out)

    return jax.jit(step, donate_argnums=(3, 4))


def compile_steps(cfg, layouts, layers: int, args_for) -> dict:
    """Each layout's `layers_step` compiled for the arguments `args_for(layout)` gives: {layout: (compiled step,
    its compile's seconds)}. The first layout compiles alone, the others then side by side in threads (XLA's
    compiler leaves the interpreter free), so a shape costs about two compiles, not five. The first one autotunes
    the GEMMs every layout shares (the projections) and the others reuse its choices: autotuning side by side
    would time candidates on a busy GPU and could pick different kernels for the layouts."""
    lowered = {layout: layers_step(cfg, layout, layers).lower(*args_for(layout)) for layout in layouts}

    def build(layout):
        t0 = time.perf_counter()
        return lowered[layout].compile(), time.perf_counter() - t0

    first, *rest = layouts
    steps = {first: build(first)}
    with concurrent.futures.ThreadPoolExecutor(max(1, len(rest))) as pool:
        steps.update(zip(rest, pool.map(build, rest)))
    return steps


def time_layout(step, w, x_BTH, positions_BT, caches, pages_BM, warmup: int, iters: int) -> tuple[dict, np.ndarray]:
    """(the compiled `step`'s timings, its first call's output). `caches`: (latents, k_ropes) in its layout,
    copied here (the step donates them)."""
    holder = {"caches": jax.tree.map(jnp.copy, caches)}
    out, *holder["caches"] = step(w, x_BTH, positions_BT, *holder["caches"], pages_BM)
    out = np.asarray(out, np.float32)

    def run():
        y, *holder["caches"] = step(w, x_BTH, positions_BT, *holder["caches"], pages_BM)
        return y

    stats = median_ms(run, warmup=warmup, iters=iters)
    del holder
    return stats, out


def rel_err(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke run)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS),
                   help=f"{REFERENCE} (every row's reference) runs whatever this says")
    p.add_argument("--layers", type=int, default=4, help="MLA layers a step runs, each over its own cache")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=90.0, help="start no new shape after this many seconds")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if min(args.batches + args.contexts + args.tokens + [args.iters, args.layers]) < 1:
        p.error("--batches, --contexts, --tokens, --layers and --iters must be positive")
    return args


def markdown(res: dict) -> str:
    lines = [f"{res['device']}, jax {res['jax']}, {res['date']}: steps of {res['args']['layers']} MLA layers "
             f"(`mla`) at {'tiny' if res['tiny'] else 'K2.5'} dims, pages of {res['page_tokens']} positions "
             "(`python -m bench.paged_attention`). ms: a step's median over synchronised calls (min-max), and per "
             "layer; x: the row's median over paged_gather_kernel's (how the kernels read a paged cache before), and "
             "over contiguous_kernel's.",
             "", "| B | context | T | layout | ms | min-max | ms a layer | x gather+kernel | x contiguous kernel | "
             "rel. err vs XLA contiguous | = contiguous kernel | reads pages | engine takes kernels |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_shape = {}
    for r in res["rows"]:
        by_shape.setdefault((r["batch"], r["context"], r["tokens"]), {})[r["layout"]] = r
    for (b, c, t), rows in by_shape.items():
        for layout, r in rows.items():
            ratio = lambda base: fmt(r["median_ms"] / rows[base]["median_ms"], 2) if base in rows else "-"  # noqa: E731
            yes_no = lambda v: {True: "yes", False: "no"}.get(v, "-")  # noqa: E731
            lines.append(f"| {b} | {c} | {t} | {layout} | {fmt(r['median_ms'])} | {fmt(r['min_ms'])}-"
                         f"{fmt(r['max_ms'])} | {fmt(r['layer_ms'])} | {ratio('paged_gather_kernel')} | "
                         f"{ratio('contiguous_kernel')} | "
                         f"{r['rel_err']:.1e} | {yes_no(r['equals_contiguous_kernel'])} | "
                         f"{yes_no(r['kernel_reads_pages'])} | {yes_no(r['engine_kernel'])} |")
    if res["skipped"]:
        lines += ["", f"Not run (past --budget-s): {', '.join(f'B={b} ctx={c} T={t}' for b, c, t in res['skipped'])}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    start = time.perf_counter()
    stamp = run_stamp()
    cfg = layer_config(args.tiny)
    res = dict(**stamp.fields, xla_flags=os.environ.get("XLA_FLAGS", ""), tiny=args.tiny,
               page_tokens=PAGE_TOKENS,
               dims=dict(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                         kv_lora_rank=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim, nope=cfg.qk_nope_head_dim,
                         v=cfg.v_head_dim),
               args=vars(args), rows=[], skipped=[])
    stem = f"paged-attention-{stamp.suffix}"
    save = lambda: write_report(res, Path(args.out), stem, markdown)  # noqa: E731
    w = jax.block_until_ready(random_mla_weights(cfg, jax.random.PRNGKey(0)))
    # the references first: contiguous_xla for every row's error, contiguous_kernel for the paged rows' equality
    layouts = [REFERENCE] + [v for v in args.layouts if v != REFERENCE]
    for b in args.batches:
        for c in args.contexts:
            capacity = round_capacity(c + HEADROOM)
            key = jax.random.PRNGKey(1000 * b + c)
            cache = random_cache(cfg.replace(num_hidden_layers=args.layers), b, capacity, c, key)
            contiguous = (cache.latent, cache.k_rope)
            pages_BM, held = scrambled_pages(b, capacity, c + HEADROOM, seed=1000 * b + c)
            pools = jax.tree.map(lambda x: page_pool(x, pages_BM, held), contiguous)
            for t in args.tokens:
                if time.perf_counter() - start > args.budget_s:
                    res["skipped"].append((b, c, t))
                    continue
                x_BTH = jax.random.normal(jax.random.fold_in(key, t), (b, t, cfg.hidden_size)).astype(jnp.bfloat16)
                positions_BT = jnp.broadcast_to(c + jnp.arange(t, dtype=jnp.int32), (b, t))
                engine_kernel = mla_kernel_applies(Kernels(), b, t, capacity, cfg)
                caches_of = lambda layout: pools if LAYOUTS[layout][0] else contiguous  # noqa: E731
                steps = compile_steps(cfg, layouts, args.layers,
                                      lambda layout: (w, x_BTH, positions_BT, *caches_of(layout), pages_BM))
                ref = kernel_out = None
                for layout in layouts:
                    paged = LAYOUTS[layout][0]
                    step, compile_s = steps.pop(layout)
                    stats, out = time_layout(step, w, x_BTH, positions_BT, caches_of(layout), pages_BM,
                                             args.warmup, args.iters)
                    del step
                    ref = out if layout == REFERENCE else ref
                    kernel_out = out if layout == "contiguous_kernel" else kernel_out
                    reads = equal = None
                    if layout == "paged_kernel":  # the module's own dispatch, as `mla` asks it
                        reads = attention_mla.mla_kernel_applies(Kernels(mla="on"), b, t, capacity, cfg,
                                                                 page_tokens=PAGE_TOKENS)
                    if paged and layout.endswith("_kernel") and kernel_out is not None:
                        equal = bool(np.array_equal(out, kernel_out))
                    row = dict(batch=b, context=c, tokens=t, capacity=capacity, pages_held=held, layout=layout,
                               **stats, layer_ms=stats["median_ms"] / args.layers, compile_s=compile_s,
                               rel_err=rel_err(out, ref), equals_contiguous_kernel=equal,
                               kernel_reads_pages=reads, engine_kernel=engine_kernel)
                    res["rows"].append(row)
                    save()
                    log(f"B={b:3d} ctx={c:6d} T={t} {layout:20s} {row['median_ms']:8.3f} ms "
                        f"({row['min_ms']:.3f}-{row['max_ms']:.3f}), {row['layer_ms']:.3f} ms a layer, compile "
                        f"{row['compile_s']:.1f} s, rel_err {row['rel_err']:.1e}")
            del cache, contiguous, pools
    path = save()
    log(markdown(res))
    log(f"wrote {path} and .md ({time.perf_counter() - start:.0f} s)")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
