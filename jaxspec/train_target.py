"""Train the embedded default target: a scaled-down Kimi-K2.5 on the running Python's stdlib sources.

    python -m jaxspec.train_target --out out/train              # default: ~5 minutes on one H200
    python -m jaxspec.train_target --preset smoke --steps 20 --max-files 40 --out /tmp/smoke

Writes OUT/tokenizer.json (trained here unless --tokenizer is given), OUT/target/ (config.json with
INT4 experts + weights), OUT/target_metrics.json and OUT/target_loss.png, all at the end of the run; OUT must be
new or an empty directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cli_common import OneLineParser, UsageError, require_at_least
from jaxspec.training.artifacts import save_model_dir
from jaxspec.training.casting import compute_copy
from jaxspec.training.corpus import split_sources, stdlib_root
from jaxspec.training.inputs import (cli as run_cli, load_tokenizer, read_corpus, require_finite, require_new_output,
                                     require_splits)
from jaxspec.training.int4_experts import quantize_experts
from jaxspec.training.plots import plot_curves
from jaxspec.training.progress import Progress
from jaxspec.training.schedule import BudgetedSchedule
from jaxspec.training.target_config import INT4_GROUP_SIZE, mini_k25_config
from jaxspec.training.target_init import count_params, init_target_for_training
from jaxspec.training.optimizer import AdamWSpec
from jaxspec.training.target_step import TargetState, eval_nll_sum, train_step
from jaxspec.training.tokenizer import encode_files, train_tokenizer
from jaxspec.training.windows import random_windows, tiled_windows
from model.config import text_config_from_dict


def parse_args(argv=None):
    p = OneLineParser(prog="python -m jaxspec.train_target", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/train", help="output directory")
    p.add_argument("--preset", default="default", choices=["default", "smoke"])
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--corpus-root", default=None, help="directory of *.py files (default: this Python's stdlib)")
    p.add_argument("--held-out-percent", type=float, default=5.0, help="test split (perplexity, acceptance prompts)")
    p.add_argument("--val-percent", type=float, default=2.5, help="validation split (picks the step that ships)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files (smoke runs)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None)
    budget.add_argument("--time-budget", type=float, default=None, help="seconds of training after compilation")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-gamma", type=float, default=1e-3, help="router-bias step of aux-loss-free balancing")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=128, help="validation windows per periodic evaluation")
    p.add_argument("--final-eval-windows", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_at_least(args, 1, "steps", "batch", "max_files", "eval_every", "eval_windows", "final_eval_windows",
                     "log_every")
    require_at_least(args, 0, "warmup")
    require_at_least(args, 2, "seq_len")  # a window predicts its tokens 1.. from 0..
    require_at_least(args, 1, "vocab_size")
    require_finite(args, "time_budget", low_open=True)
    require_finite(args, "lr", "weight_decay", "bias_gamma")
    require_splits(args)
    if args.steps is None and args.time_budget is None:
        args.time_budget = 300.0
    return args


def held_out_nll(weights, cfg, windows_NT, batch: int) -> float:
    """Mean next-token NLL over windows (a multiple of `batch`, so one shape compiles)."""
    total, count = 0.0, 0.0
    for i in range(0, len(windows_NT), batch):
        s, c = eval_nll_sum(weights, jnp.asarray(windows_NT[i : i + batch]), cfg=cfg)
        total += float(s)
        count += float(c)
    return total / max(count, 1.0)


def windows_for_eval(stream, seq: int, max_windows: int, batch: int, what: str):
    """Whole batches of tiled windows (-> windows, batch)."""
    windows = tiled_windows(stream, seq, max_windows)
    if len(windows) == 0:
        raise UsageError(f"--seq-len {seq}: the {what} files hold fewer tokens; raise its percent or --max-files")
    batch = min(batch, len(windows))
    return windows[: len(windows) // batch * batch], batch


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    require_new_output("--out", out)
    progress = Progress("target", every=args.log_every)
    timings = {}

    t = time.perf_counter()
    train_files, held_files, val_files = split_sources(
        read_corpus(args.corpus_root, args.max_files), args.held_out_percent, args.val_percent)
    if not train_files:
        raise UsageError(f"--corpus-root {args.corpus_root or stdlib_root()}: no file falls in the training split "
                         f"(--held-out-percent, --val-percent, --max-files)")
    tok = load_tokenizer("--tokenizer", args.tokenizer) if args.tokenizer else train_tokenizer(train_files,
                                                                                              args.vocab_size)
    timings["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    train_stream, held_stream = encode_files(tok, train_files), encode_files(tok, held_files)
    val_stream = encode_files(tok, val_files)
    timings["encode_s"] = time.perf_counter() - t
    held_bytes = sum(len(f.text.encode()) for f in held_files)
    progress.log(f"corpus {args.corpus_root or 'stdlib'}: {len(train_files)} train files ({len(train_stream)} tokens), "
                 f"{len(val_files)} validation ({len(val_stream)}), {len(held_files)} held-out ({len(held_stream)}); "
                 f"vocab {tok.get_vocab_size()}; tokenizer {timings['tokenizer_s']:.1f}s, encoding {timings['encode_s']:.1f}s")

    config = mini_k25_config(tok.get_vocab_size(), args.preset, int4_experts=False)
    cfg = text_config_from_dict(config)
    weights = init_target_for_training(cfg, args.seed)
    opt = AdamWSpec(weight_decay=args.weight_decay)
    state = TargetState(weights, opt.build(weights).init(weights))
    progress.log(f"target: {count_params(weights) / 1e6:.2f}M parameters, layers {cfg.num_hidden_layers}, "
                 f"experts {cfg.n_routed_experts} top-{cfg.num_experts_per_tok}, aux layers {cfg.eagle_aux_layers}")

    seq = args.seq_len
    if len(train_stream) < seq:
        raise UsageError(f"--seq-len {seq}: the training files hold {len(train_stream)} tokens, fewer than one window")
    held_windows, eval_batch = windows_for_eval(held_stream, seq, args.final_eval_windows, args.batch, "held-out")
    validated_apart = len(val_stream) >= seq
    if validated_apart:
        val_windows, _ = windows_for_eval(val_stream, seq, args.eval_windows, eval_batch, "validation")
    else:
        progress.log("no validation windows: periodic evaluation (and the choice of step) falls back to held-out")
        val_windows = held_windows[: max(eval_batch, args.eval_windows // eval_batch * eval_batch)]
    schedule = BudgetedSchedule(args.lr, args.warmup, steps=args.steps, seconds=args.time_budget)
    rng = np.random.default_rng(args.seed)
    curves = {"train_step": [], "train_loss": [], "eval_step": [], "eval_loss": [], "imbalance": []}
    best = (math.inf, 0, None)  # (validation loss, step, weights on device)
    pending = []
    step = 0
    t_train = time.perf_counter()
    while not schedule.done(step):
        tokens = jnp.asarray(random_windows(train_stream, args.batch, seq, rng))
        state, metrics = train_step(state, tokens, schedule.lr(step), cfg=cfg, opt=opt, gamma=args.bias_gamma)
        step += 1
        pending.append((step, metrics))
        if step == 1:
            jax.block_until_ready(metrics["loss"])
            timings["compile_s"] = time.perf_counter() - t_train
            progress.log(f"first step (compilation) {timings['compile_s']:.1f}s")
            schedule.start()
        timing = schedule.total_steps is None
        if timing:
            jax.block_until_ready(metrics["loss"])
        schedule.observe(step, synced=timing)
        if step % args.log_every == 0 or schedule.done(step):
            for s, m in pending:
                curves["train_step"].append(s)
                curves["train_loss"].append(float(m["loss"]))
                curves["imbalance"].append(float(m["imbalance"]))
            pending = []
            last = {k: float(v) for k, v in metrics.items()}
            progress.update(step, schedule.total_steps, {**last, "lr": schedule.lr(step),
                                                         "s/step": (time.perf_counter() - t_train) / step})
        if (step % args.eval_every == 0 or schedule.done(step)) and schedule.total_steps is not None:
            loss = held_out_nll(state.weights, cfg, val_windows, eval_batch)
            curves["eval_step"].append(step)
            curves["eval_loss"].append(loss)
            if loss < best[0]:  # keep the best validation step: a small corpus is memorized fast
                best = (loss, step, jax.tree_util.tree_map(jnp.copy, state.weights))
            progress.log(f"step {step}: validation loss {loss:.4f} (ppl {math.exp(loss):.2f})")
    jax.block_until_ready(state.weights)
    timings["train_s"] = time.perf_counter() - t_train
    timings["steps"] = step
    timings["tokens"] = step * args.batch * seq
    progress.close()

    t = time.perf_counter()
    chosen_step, final = (best[1], best[2]) if best[2] is not None else (step, state.weights)
    nll_bf16 = held_out_nll(final, cfg, held_windows, eval_batch)
    if not math.isfinite(nll_bf16):  # a diverged run's weights are no model: nothing ships, nothing is written
        raise SystemExit(f"error: training diverged (held-out loss {nll_bf16} at step {chosen_step}); nothing was "
                         f"written to {out} (try a lower --lr)")
    quantized = quantize_experts(jax.device_get(compute_copy(final)), INT4_GROUP_SIZE)
    config_int4 = mini_k25_config(tok.get_vocab_size(), args.preset, int4_experts=True)
    cfg_int4 = text_config_from_dict(config_int4)
    quantized = jax.tree_util.tree_map(jnp.asarray, quantized)
    nll_int4 = held_out_nll(quantized, cfg_int4, held_windows, eval_batch)
    timings["final_eval_s"] = time.perf_counter() - t
    tokens_per_byte = len(held_stream) / max(held_bytes, 1)
    report = {
        "config": config_int4,
        "parameters": count_params(weights),
        "chosen_step": chosen_step,
        "validation_loss_at_chosen_step": best[0] if math.isfinite(best[0]) else None,  # None: never validated
        "held_out": {
            # False: no validation windows, so the step was chosen on (a part of) these same windows, and their
            # figures read a little better than truly unseen text would
            "independent_of_step_choice": validated_apart,
            "windows": int(len(held_windows)),
            "tokens": int(held_windows.size),
            "nll_bf16": nll_bf16,
            "ppl_bf16": math.exp(nll_bf16),
            "nll_int4_experts": nll_int4,
            "ppl_int4_experts": math.exp(nll_int4),
            "bits_per_byte_int4_experts": nll_int4 / math.log(2) * tokens_per_byte,
        },
        "corpus": {"root": args.corpus_root or str(stdlib_root()), "train_files": len(train_files),
                   "validation_files": len(val_files), "held_out_files": len(held_files),
                   "train_tokens": int(len(train_stream)), "validation_tokens": int(len(val_stream)),
                   "held_out_tokens": int(len(held_stream))},
        "timings": timings,
        "args": vars(args),
        "curves": curves,
        "device": str(jax.devices()[0]),
    }
    chosen_on = "best validation loss" if validated_apart else "best loss on the held-out windows themselves"
    progress.log(f"shipping step {chosen_step} of {step} ({chosen_on}); held-out perplexity: bf16 experts "
                 f"{math.exp(nll_bf16):.3f}, INT4 experts {math.exp(nll_int4):.3f} "
                 f"({report['held_out']['bits_per_byte_int4_experts']:.3f} bits/byte); trained in {timings['train_s']:.0f}s")

    # every output is written only now: a run stopped earlier leaves no tokenizer.json that would pass for a result
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    save_model_dir(out / "target", config_int4, quantized)
    (out / "target_metrics.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_curves(out / "target_loss.png", "target: next-token loss",
                {"train": (curves["train_step"], curves["train_loss"]),
                 "validation": (curves["eval_step"], curves["eval_loss"])})
    return report


def cli(argv=None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
