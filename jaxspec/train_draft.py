"""Train an EAGLE-3 draft on a target's hidden states (training-time test over several draft steps).

    python -m jaxspec.train_draft --target out/train/target --tokenizer out/train/tokenizer.json --out out/train/draft
    python -m jaxspec.train_draft ... --ckpt-dir out/draft_ckpt     # orbax checkpoints; rerun to resume

Data: windows of the corpus plus the target's own greedy continuations of training prompts (the
sequences a greedy engine verifies). Evaluation: greedy continuations of prompts from validation files
(during training) and held-out files (the final report), on which chain acceptance per depth is exact for
a greedy chain engine (the draft's inputs are the accepted tokens and its own features, as in the engine). The draft vocabulary is the most frequent target tokens.
Writes OUT/config.json (LlamaForCausalLMEagle3) + weights, OUT/../draft_metrics.json, OUT/../draft_loss.png and
OUT/../draft_acceptance.png; OUT must be new or an empty directory (a resumed run writes it as a fresh one does, at
the end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cli_common import OneLineParser, UsageError, require_at_least
from jaxspec.training.artifacts import save_model_dir
from jaxspec.training.casting import compute_copy
from jaxspec.training.corpus import split_sources
from jaxspec.training.draft_config import eagle3_config
from jaxspec.training.draft_init import init_draft_for_training
from jaxspec.training.draft_step import DraftState, draft_eval, draft_train_step
from jaxspec.training.draft_vocab import coverage, d2t_offsets, frequent_token_ids
from jaxspec.training.greedy_rollout import greedy_continue
from jaxspec.training.inputs import (cli as run_cli, load_target, load_tokenizer, read_corpus, require_finite,
                                     require_new_output, require_splits)
from jaxspec.training.optimizer import AdamWSpec
from jaxspec.training.orbax_resume import DraftCheckpoints
from jaxspec.training.plots import plot_curves
from jaxspec.training.progress import Progress
from jaxspec.training.schedule import BudgetedSchedule
from jaxspec.training.target_init import count_params
from jaxspec.training.tokenizer import encode_file_list, encode_files
from jaxspec.training.windows import file_prompts, random_windows
from model.eagle3 import draft_config_from_dict


def parse_args(argv=None):
    p = OneLineParser(prog="python -m jaxspec.train_draft", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="out/train/target", help="trained target directory (config.json + weights)")
    p.add_argument("--tokenizer", default="out/train/tokenizer.json")
    p.add_argument("--out", default="out/train/draft")
    p.add_argument("--preset", default="default", choices=["default", "smoke"])
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--corpus-root", default=None, help="directory of *.py files (default: this Python's stdlib)")
    p.add_argument("--held-out-percent", type=float, default=5.0)
    p.add_argument("--val-percent", type=float, default=2.5)
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ttt-steps", type=int, default=5, help="draft steps unrolled per position (training-time test)")
    p.add_argument("--eval-depth", type=int, default=4, help="chain length K whose acceptance is reported")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None)
    budget.add_argument("--time-budget", type=float, default=None, help="seconds of training after compilation")
    budget.add_argument("--finish-by", type=float, default=None,
                        help="unix time by which everything (final evaluation and saving included) must be done")
    p.add_argument("--reserve", type=float, default=30.0, help="seconds kept for the end when --finish-by is given")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--generated-fraction", type=float, default=0.5, help="share of each batch from target rollouts")
    p.add_argument("--rollouts", type=int, default=8192, help="greedy continuations of training prompts")
    p.add_argument("--rollout-batch", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--eval-prompts", type=int, default=64, help="validation / held-out prompts continued by the target")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoints (resumed from when present)")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_at_least(args, 1, "draft_vocab_size", "max_files", "batch", "ttt_steps", "eval_depth", "steps", "rollouts",
                     "rollout_batch", "prompt_len", "eval_prompts", "eval_every", "log_every", "ckpt_every")
    require_at_least(args, 0, "warmup")
    if args.prompt_len >= args.seq_len:  # the target continues each prompt within the window
        raise UsageError(f"--prompt-len {args.prompt_len} must be below --seq-len {args.seq_len}")
    require_finite(args, "time_budget", low_open=True)
    require_finite(args, "finish_by", "reserve", "lr", "weight_decay")
    require_finite(args, "generated_fraction", high=1.0)
    require_splits(args)
    if args.steps is None and args.time_budget is None:
        args.time_budget = 180.0 if args.finish_by is None else 1.0  # replaced by the deadline after compiling
    args.eval_depth = min(args.eval_depth, args.ttt_steps)
    return args


def rollouts(target_w, cfg, prompts_BT, total_len: int, batch: int) -> np.ndarray:
    """Greedy continuations in batches of exactly `batch` rows (the last padded), so one shape compiles."""
    out = []
    for i in range(0, len(prompts_BT), batch):
        chunk = prompts_BT[i : i + batch]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), axis=0)])
        got = greedy_continue(target_w, jnp.asarray(padded), cfg=cfg, total_len=total_len)
        out.append(np.asarray(got)[: len(chunk)])
    return np.concatenate(out)


def mixed_batch(train_stream, pool_NT, batch: int, seq: int, generated_fraction: float, prompt_len: int,
                rng: np.random.Generator):
    """(tokens [B, T], root mask [B, T]): rollout rows count chains rooted in the generated part only."""
    n_gen = int(round(batch * generated_fraction)) if len(pool_NT) else 0
    rows = [random_windows(train_stream, batch - n_gen, seq, rng)]
    mask = [np.ones((batch - n_gen, seq), bool)]
    if n_gen:
        rows.append(pool_NT[rng.integers(0, len(pool_NT), size=n_gen)])
        mask.append(np.broadcast_to(np.arange(seq) >= prompt_len - 1, (n_gen, seq)))
    return np.concatenate(rows).astype(np.int32), np.concatenate(mask)


def evaluate(draft_w, target_w, eval_NT, eval_mask_NT, batch, ids, in_vocab, cfg, target_cfg, steps):
    """Held-out loss and per-depth chain acceptance, root-weighted over all evaluation rows."""
    losses, accepts, roots = [], [], []
    for i in range(0, len(eval_NT), batch):
        loss, acc, n = draft_eval(draft_w, target_w, jnp.asarray(eval_NT[i : i + batch]),
                                  jnp.asarray(eval_mask_NT[i : i + batch]), ids, in_vocab,
                                  cfg=cfg, target_cfg=target_cfg, steps=steps)
        losses.append(float(loss))
        accepts.append(np.asarray(acc) * float(n))
        roots.append(float(n))
    accept = np.sum(accepts, axis=0) / max(sum(roots), 1.0)
    return float(np.mean(losses)), accept


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    require_new_output("--out", out)
    progress = Progress("draft", every=args.log_every)
    timings = {}

    target_cfg, target_w = load_target("--target", args.target)
    tok = load_tokenizer("--tokenizer", args.tokenizer)
    if tok.get_vocab_size() != target_cfg.vocab_size:  # its ids would name other tokens than the target's
        raise UsageError(f"--tokenizer {args.tokenizer}: a vocabulary of {tok.get_vocab_size()} tokens, the target "
                         f"{args.target} has {target_cfg.vocab_size} (give the tokenizer train_target wrote with it)")
    train_files, held_files, val_files = split_sources(
        read_corpus(args.corpus_root, args.max_files), args.held_out_percent, args.val_percent)
    val_files = val_files or held_files  # tiny smoke corpora may have no validation file
    t = time.perf_counter()
    train_stream = encode_files(tok, train_files)
    held_file_tokens, val_file_tokens = encode_file_list(tok, held_files), encode_file_list(tok, val_files)
    timings["encode_s"] = time.perf_counter() - t
    if len(train_stream) < args.seq_len:
        raise UsageError(f"--seq-len {args.seq_len}: the training files hold {len(train_stream)} tokens, fewer than "
                         f"one window")
    for split, file_tokens in (("held-out", held_file_tokens), ("validation", val_file_tokens)):
        if not any(len(f) >= args.prompt_len for f in file_tokens):  # its evaluation prompts come from one file each
            raise UsageError(f"--prompt-len {args.prompt_len}: no {split} file holds that many tokens; raise "
                             f"--held-out-percent / --val-percent or --max-files")

    ids_np = frequent_token_ids(train_stream, target_cfg.vocab_size, args.draft_vocab_size or
                                eagle3_config(target_cfg, args.preset)["draft_vocab_size"])
    config = eagle3_config(target_cfg, args.preset, draft_vocab_size=len(ids_np))
    cfg = draft_config_from_dict(config)
    draft_ids = jnp.asarray(ids_np)
    in_vocab = jnp.zeros((target_cfg.vocab_size,), bool).at[draft_ids].set(True)
    progress.log(f"draft vocab {len(ids_np)} of {target_cfg.vocab_size}: covers {coverage(train_stream, ids_np, target_cfg.vocab_size):.1%} "
                 f"of training tokens; encoding {timings['encode_s']:.1f}s")

    seq, p_len = args.seq_len, args.prompt_len
    rng = np.random.default_rng(args.seed)
    t = time.perf_counter()
    train_prompts = random_windows(train_stream, args.rollouts, p_len, rng) if args.generated_fraction > 0 else None
    pool = rollouts(target_w, target_cfg, train_prompts, seq, args.rollout_batch) if train_prompts is not None else np.zeros((0, seq), np.int32)
    eval_batch = min(args.batch, args.eval_prompts)
    n_eval = args.eval_prompts // eval_batch * eval_batch  # whole batches: one compiled shape
    test_NT, val_NT = (rollouts(target_w, target_cfg, file_prompts(f, n_eval, p_len, rng), seq, args.rollout_batch)
                       for f in (held_file_tokens, val_file_tokens))
    eval_mask = np.broadcast_to(np.arange(seq) >= p_len - 1, test_NT.shape)
    timings["rollouts_s"] = time.perf_counter() - t
    progress.log(f"target rollouts: {len(pool)} training + {len(val_NT)} validation + {len(test_NT)} held-out sequences of {seq} tokens "
                 f"(prompt {p_len}) in {timings['rollouts_s']:.1f}s")

    weights = init_draft_for_training(cfg, target_w, ids_np, args.seed + 1)
    opt = AdamWSpec(weight_decay=args.weight_decay)
    state = DraftState(weights, opt.build(weights).init(weights))
    progress.log(f"draft: {count_params(weights) / 1e6:.2f}M parameters, {args.ttt_steps} training-time-test steps")

    ckpts = DraftCheckpoints(args.ckpt_dir, run_key={"draft_ids": ids_np.tolist()}) if args.ckpt_dir else None
    start_step = 0
    curves = {"train_step": [], "train_loss": [], "eval_step": [], "eval_loss": [], "eval_accept": []}
    if ckpts is not None and ckpts.latest_step() is not None:
        start_step, state, saved_curves, budget = ckpts.restore(state)
        curves = saved_curves or curves
        progress.log(f"resumed from {args.ckpt_dir} at step {start_step}")
        if budget is not None:
            args.steps, args.time_budget = budget, None
    schedule = BudgetedSchedule(args.lr, args.warmup, steps=args.steps, seconds=args.time_budget)
    step_args = dict(cfg=cfg, target_cfg=target_cfg, opt=opt, steps=args.ttt_steps)

    def run_eval(step, split="validation"):
        seqs = val_NT if split == "validation" else test_NT
        loss, accept = evaluate(compute_copy(state.weights), target_w, seqs, eval_mask, eval_batch, draft_ids,
                                in_vocab, cfg, target_cfg, args.ttt_steps)
        k = args.eval_depth
        mean_len = 1.0 + float(accept[:k].sum())
        if split == "validation":
            curves["eval_step"].append(step)
            curves["eval_loss"].append(loss)
            curves["eval_accept"].append(accept.tolist())
        progress.log(f"step {step}: {split} loss {loss:.4f}, chain acceptance by depth "
                     f"{' '.join(f'{a:.3f}' for a in accept)}, mean acceptance length at K={k}: {mean_len:.3f}")
        return accept, mean_len

    step = start_step
    pending = []
    t_train = time.perf_counter()
    while not schedule.done(step):
        rng_step = np.random.default_rng([args.seed, step])  # resumable: the data depends on the step only
        tokens, roots = mixed_batch(train_stream, pool, args.batch, seq, args.generated_fraction, p_len, rng_step)
        state, metrics = draft_train_step(state, target_w, jnp.asarray(tokens), jnp.asarray(roots), draft_ids,
                                          in_vocab, schedule.lr(step), **step_args)
        step += 1
        pending.append((step, metrics["loss"]))
        if step == start_step + 1:
            jax.block_until_ready(metrics["loss"])
            timings["compile_s"] = time.perf_counter() - t_train
            progress.log(f"first step (compilation) {timings['compile_s']:.1f}s")
            schedule.start(None if args.finish_by is None else args.finish_by - time.time() - args.reserve)
        timing = schedule.total_steps is None
        if timing:
            jax.block_until_ready(metrics["loss"])
        schedule.observe(step - start_step, synced=timing)
        if step % args.log_every == 0 or schedule.done(step):
            curves["train_step"] += [s for s, _ in pending]
            curves["train_loss"] += [float(v) for _, v in pending]
            pending = []
            progress.update(step, schedule.total_steps, {
                "loss": float(metrics["loss"]), "accept": [float(a) for a in metrics["accept"]],
                "lr": schedule.lr(step), "s/step": (time.perf_counter() - t_train) / (step - start_step)})
        if args.finish_by is not None and time.time() > args.finish_by - args.reserve / 2:
            progress.log(f"deadline: stopping at step {step} of {schedule.total_steps}")
            break
        if schedule.total_steps is not None and (step % args.eval_every == 0 or schedule.done(step)):
            run_eval(step)
        if ckpts is not None and (step % args.ckpt_every == 0 or schedule.done(step)):
            ckpts.save(step, state, curves, schedule.total_steps)
    jax.block_until_ready(state.weights)
    timings["train_s"] = time.perf_counter() - t_train
    timings["steps"] = step
    progress.close()
    if ckpts is not None:
        ckpts.close()

    if not curves["eval_step"] or curves["eval_step"][-1] != step:
        run_eval(step)
    accept, mean_len = run_eval(step, "held-out")
    shipped = compute_copy(state.weights).replace(d2t=jnp.asarray(d2t_offsets(ids_np), jnp.int32))
    save_model_dir(out, config, shipped)
    report = {
        "config": config,
        "parameters": count_params(state.weights),
        "held_out": {
            "sequences": int(len(test_NT)), "prompt_len": p_len, "seq_len": seq,
            "chain_acceptance_by_depth": [float(a) for a in accept],
            "eval_depth": args.eval_depth,
            "mean_acceptance_length": mean_len,
            "method": "teacher-forced on the target's greedy continuations (exact for a greedy chain engine)",
        },
        "draft_vocab_coverage": coverage(train_stream, ids_np, target_cfg.vocab_size),
        "timings": timings,
        "args": vars(args),
        "curves": curves,
        "device": str(jax.devices()[0]),
    }
    (out.parent / "draft_metrics.json").write_text(json.dumps(report, indent=1) + "\n")
    acc_steps = curves["eval_step"]
    acc_series = {f"depth {k + 1}": (acc_steps, [a[k] for a in curves["eval_accept"]]) for k in range(args.eval_depth)}
    plot_curves(out.parent / "draft_loss.png", "draft: training-time-test loss",
                {"train": (curves["train_step"], curves["train_loss"]), "validation": (acc_steps, curves["eval_loss"])})
    plot_curves(out.parent / "draft_acceptance.png", "draft: validation chain acceptance by depth", acc_series,
                ylabel="acceptance")
    progress.log(f"mean acceptance length at K={args.eval_depth}: {mean_len:.3f}; saved {out}")
    return report


def cli(argv=None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
