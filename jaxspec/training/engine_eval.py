"""Held-out evaluation of a shipped pair through the real engine (jaxspec.engine.Engine).

    python -m jaxspec.training.engine_eval jaxspec/default_model --json /tmp/default_model_eval.json

Prompts are taken from held-out stdlib files (same hash split as training) at random offsets; the
engine generates greedily with chain drafting (K draft tokens per cycle), and the baseline (no draft)
must produce the same tokens. Also reports the target's held-out perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from convert.checkpoint import load_draft, load_target
from jaxspec.engine import Engine
from jaxspec.models import SpecConfig, SpecWeights, check_draft_fits
from jaxspec.training.corpus import read_sources, split_sources
from jaxspec.training.target_step import eval_nll_sum
from jaxspec.training.tokenizer import encode_file_list, encode_files
from jaxspec.training.windows import file_prompts, tiled_windows


def load_pair(model_dir: str | Path, dtype=jnp.bfloat16):
    model_dir = Path(model_dir).absolute()  # orbax refuses relative paths
    tcfg, tw = load_target(model_dir / "target", dtype=dtype)
    dcfg, dw = load_draft(model_dir / "draft", dtype=dtype)
    tcfg = check_draft_fits(tcfg, dcfg, dw)
    cfg = SpecConfig(target=tcfg, draft=dcfg, eos_ids=tuple(tcfg.eos_token_id))
    return cfg, SpecWeights(target=tw, draft=dw), Tokenizer.from_file(str(model_dir / "target" / "tokenizer.json"))


def held_out_perplexity(cfg, weights, tok, held_files, seq_len: int, max_windows: int, batch: int) -> dict:
    windows = tiled_windows(encode_files(tok, held_files), seq_len, max_windows)
    batch = min(batch, len(windows))
    windows = windows[: len(windows) // batch * batch]
    total = count = 0.0
    for i in range(0, len(windows), batch):
        s, c = eval_nll_sum(weights.target, jnp.asarray(windows[i : i + batch]), cfg=cfg.target,
                            dtype=weights.target.embed.dtype)
        total, count = total + float(s), count + float(c)
    nll = total / count
    return {"windows": int(len(windows)), "seq_len": seq_len, "tokens": int(count), "nll": nll, "ppl": math.exp(nll)}


def engine_acceptance(cfg, weights, prompts: list[list[int]], k: int, max_new_tokens: int, batch: int) -> dict:
    engine = Engine(cfg, weights, num_steps=k)
    accepted, spec_tokens, base_tokens = [], [], []
    spec_s = base_s = 0.0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        spec = engine.generate(chunk, max_new_tokens)
        base = engine.generate(chunk, max_new_tokens, speculative=False)
        accepted += spec.accepted
        spec_tokens += spec.tokens
        base_tokens += base.tokens
        spec_s += spec.decode_s
        base_s += base.decode_s
    lossless = sum(a == b for a, b in zip(spec_tokens, base_tokens))
    flat = np.asarray([a for row in accepted for a in row])
    return {
        "K": k,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "cycles": int(flat.size),
        "mean_acceptance_length": float(flat.mean() + 1.0),
        "per_position_acceptance": [float((flat >= i).mean()) for i in range(1, k + 1)],
        "conditional_acceptance": [float((flat >= i).sum() / max((flat >= i - 1).sum(), 1)) for i in range(1, k + 1)],
        "histogram_accepted": np.bincount(flat, minlength=k + 1).tolist(),
        "greedy_lossless_sequences": f"{lossless}/{len(prompts)}",
        "decode_s_speculative": spec_s,
        "decode_s_baseline": base_s,
        "sample_output": spec_tokens[0],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=str(Path(__file__).resolve().parents[1] / "default_model"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--corpus-root", default=None, help="directory of *.py files (default: this Python's stdlib)")
    p.add_argument("--held-out-percent", type=float, default=5.0)
    p.add_argument("--ppl-windows", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and activations")
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    cfg, weights, tok = load_pair(args.model_dir, jnp.dtype(args.dtype))
    _, held_files, _ = split_sources(read_sources(args.corpus_root, max_files=args.max_files), args.held_out_percent)
    t = time.perf_counter()
    ppl = None
    if not args.skip_perplexity:
        ppl = held_out_perplexity(cfg, weights, tok, held_files, args.seq_len, args.ppl_windows, args.batch)
        print(f"held-out perplexity {ppl['ppl']:.3f} over {ppl['tokens']} tokens ({time.perf_counter() - t:.0f}s)")
    rng = np.random.default_rng(args.seed)
    prompts = file_prompts(encode_file_list(tok, held_files), args.prompts, args.prompt_len, rng).tolist()
    t = time.perf_counter()
    acc = engine_acceptance(cfg, weights, prompts, args.k, args.max_new_tokens, args.batch)
    print(f"engine, greedy chain K={args.k}: mean acceptance length {acc['mean_acceptance_length']:.3f}, "
          f"per position {' '.join(f'{a:.3f}' for a in acc['per_position_acceptance'])}, lossless "
          f"{acc['greedy_lossless_sequences']} ({time.perf_counter() - t:.0f}s)")
    report = {"model_dir": str(args.model_dir), "corpus_root": args.corpus_root or "stdlib",
              "held_out_files": len(held_files), "held_out_perplexity": ppl, "engine_acceptance": acc,
              "held_out_split": f"sha1(relative path) < {args.held_out_percent}% of stdlib *.py files",
              "prompt_len": args.prompt_len, "seed": args.seed, "dtype": args.dtype}
    report["engine_acceptance"]["sample_text"] = tok.decode(acc.pop("sample_output"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
