"""`python -m bench.prefill_consistency`: which side moves when a prompt is prefilled in one call or in chunks.

The peer comparison (bench/peer_hf.py) found the first step's logits of jaxspec and HF transformers 7% apart
(relative) after a batch-8, 1k-token prompt prefilled in one call on the H200, and 0.8% apart after the same
prompt in 128-token chunks (bench/results/README.md). This prefills the same prompt both ways on each side and
compares the first step's logits: each side against itself (one call vs chunks) and across.
Writes prefill-consistency-<device>-<date>.json to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.moe_layer import _rel_err as rel_err  # noqa: E402
from bench.peer_hf import build_hf_model, hf_cache_kwargs, prefill_both  # noqa: E402
from bench.report import run_stamp, write_json  # noqa: E402
from bench.step import PATH_KERNELS, bench_config, draw_weights, make_step  # noqa: E402
from model.decoder import forward  # noqa: E402
from model.kv_cache import init_latent_cache, round_capacity  # noqa: E402


def main(argv=None) -> dict:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunks", type=int, nargs=2, default=[1024, 128], help="the two prefill chunk sizes")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if min(args.chunks + [args.batch, args.context]) < 1:
        p.error("--batch, --context and --chunks must be positive")
    stamp = run_stamp()
    cfg = bench_config(args.layers, args.tiny)
    w = draw_weights(cfg, args.tiny, "bf16")
    torch_dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = build_hf_model(cfg, w, torch_dev)
    step_fn = make_step(cfg, PATH_KERNELS["reference"])  # the plain path on both prefills: only the chunking differs
    plain = cfg.replace(kernels=PATH_KERNELS["reference"])
    prefill_fn = jax.jit(lambda w, t, p, c: forward(w, plain, t, p, c).cache)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(args.batch, args.context))
    token_BT = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(args.batch, 1))
    pos_BT = np.full((args.batch, 1), args.context)
    logits = {}
    for chunk in args.chunks:
        jcache, hcache = prefill_both(prefill_fn, w, cfg, hf, prompt,
                                      init_latent_cache(cfg, args.batch, round_capacity(args.context + 16)),
                                      chunk, torch_dev)
        logits[("jaxspec", chunk)] = np.asarray(step_fn(w, jnp.asarray(token_BT, jnp.int32),
                                                        jnp.asarray(pos_BT, jnp.int32), jcache)[0], np.float32)
        with torch.no_grad():
            out = hf(input_ids=torch.as_tensor(token_BT, device=torch_dev), position_ids=torch.as_tensor(pos_BT, device=torch_dev),
                     **hf_cache_kwargs(hf, hcache))
        logits[("hf", chunk)] = out.logits.float().cpu().numpy()
    a, b = args.chunks
    res = dict(**stamp.fields, torch=torch.__version__,
               batch=args.batch, context=args.context, chunks=args.chunks, rel_err={
                   f"jaxspec chunk {a} vs chunk {b}": rel_err(logits["jaxspec", a], logits["jaxspec", b]),
                   f"hf chunk {a} vs chunk {b}": rel_err(logits["hf", a], logits["hf", b]),
                   f"jaxspec vs hf, chunk {a}": rel_err(logits["jaxspec", a], logits["hf", a]),
                   f"jaxspec vs hf, chunk {b}": rel_err(logits["jaxspec", b], logits["hf", b]),
               })
    print(res, flush=True)
    write_json(res, Path(args.out), f"prefill-consistency-{stamp.suffix}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
