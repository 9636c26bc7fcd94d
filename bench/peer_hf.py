"""`python -m bench.peer_hf`: the PyTorch peer side by side with jaxspec on the same bf16 weights.

HF transformers `DeepseekV3ForCausalLM` (eager PyTorch, bf16, experts in bf16) is built on the GPU and
its parameters are replaced by the very arrays jaxspec reads (shared through DLPack, no copy where the
layouts agree), N = 2 layers (one dense, one MoE) + the real lm_head. For each context and batch both prefill
the same random prompt into their own caches (in chunks, so a 32k prompt fits), then run decode/verify steps
of T tokens after it; the ratio jaxspec / peer is measured in one process. A logits comparison after the same
prompt checks that both really compute the same model.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, step_bytes, unique_experts_per_layer  # noqa: E402
from bench.report import fmt, run_stamp, write_report  # noqa: E402
from bench.step import PATH_KERNELS, bench_config, draw_weights, make_step, step_inputs  # noqa: E402
from bench.timing import median_ms  # noqa: E402
from model.decoder import forward  # noqa: E402
from model.kv_cache import init_latent_cache, round_capacity  # noqa: E402
from model.moe import MoEWeights  # noqa: E402


def hf_config(cfg):
    from transformers import DeepseekV3Config

    y = cfg.rope_scaling
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group, topk_group=cfg.topk_group, num_experts_per_tok=cfg.num_experts_per_tok,
        first_k_dense_replace=cfg.first_k_dense_replace, norm_topk_prob=cfg.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        rope_scaling=dict(type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings,
                          beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim),
        tie_word_embeddings=False, attention_bias=False,
    )


def hf_tensors(w, cfg) -> dict:
    """HF parameter / buffer name -> torch tensor viewing (or built from) jaxspec's arrays."""
    import torch

    t = lambda a: torch.from_dlpack(a)  # noqa: E731
    n, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    out = {"model.embed_tokens.weight": t(w.embed), "model.norm.weight": t(w.final_norm), "lm_head.weight": t(w.lm_head)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        a = lw.attn
        out.update({
            p + "input_layernorm.weight": t(lw.input_norm),
            p + "post_attention_layernorm.weight": t(lw.post_attention_norm),
            p + "self_attn.q_a_proj.weight": t(a.q_a_proj),
            p + "self_attn.q_a_layernorm.weight": t(a.q_a_norm),
            p + "self_attn.q_b_proj.weight": t(a.q_b_proj).reshape(-1, a.q_b_proj.shape[-1]),
            p + "self_attn.kv_a_proj_with_mqa.weight": t(a.kv_a_proj),
            p + "self_attn.kv_a_layernorm.weight": t(a.kv_a_norm),
            # per head: k_nope rows then v rows
            p + "self_attn.kv_b_proj.weight": torch.cat([t(a.w_uk).transpose(1, 2), t(a.w_uv)], dim=1).reshape(n * (dn + dv), -1),
            p + "self_attn.o_proj.weight": t(a.o_proj).reshape(a.o_proj.shape[0], -1),
        })
        if isinstance(lw.mlp, MoEWeights):
            m = lw.mlp
            out.update({
                p + "mlp.gate.weight": t(m.router),
                p + "mlp.gate.e_score_correction_bias": t(m.router_bias),
                p + "mlp.shared_experts.gate_proj.weight": t(m.shared.gate),
                p + "mlp.shared_experts.up_proj.weight": t(m.shared.up),
                p + "mlp.shared_experts.down_proj.weight": t(m.shared.down),
                p + "mlp.experts.gate_up_proj": torch.cat([t(m.experts.gate), t(m.experts.up)], dim=1),
                p + "mlp.experts.down_proj": t(m.experts.down),
            })
            for e in range(m.experts.num_experts):  # older transformers: one module per expert
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = lambda e=e, m=m: t(m.experts.gate)[e]
                out[p + f"mlp.experts.{e}.up_proj.weight"] = lambda e=e, m=m: t(m.experts.up)[e]
                out[p + f"mlp.experts.{e}.down_proj.weight"] = lambda e=e, m=m: t(m.experts.down)[e]
        else:
            out.update({p + f"mlp.{k}_proj.weight": t(getattr(lw.mlp, k)) for k in ("gate", "up", "down")})
    return out


def hf_cache_kwargs(model, cache) -> dict:
    """The KV-cache arguments of a HF forward under the name this transformers takes: `cache` in 5.x, where the old
    `past_key_values` warns and goes away in 5.40; `past_key_values` before."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def hf_returned_cache(out):
    """The cache a HF forward returned (`cache` in 5.x, `past_key_values` before)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def build_hf_model(cfg, w, device: str):
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(hf_config(cfg)).eval()
    torch.set_default_dtype(torch.float32)
    src = hf_tensors(w, cfg)
    missing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name not in src:
            if "rotary" not in name and "inv_freq" not in name:
                missing.append(name)
            continue
        new = src[name]() if callable(src[name]) else src[name]
        if tuple(new.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: jaxspec {tuple(new.shape)} vs HF {tuple(tensor.shape)}")
        tensor.data = new.to(tensor.dtype)
    if missing:
        raise ValueError(f"HF tensors with no jaxspec source: {missing[:8]}")
    if device == "cuda":
        torch.cuda.empty_cache()
    return model


def time_torch(fn, warmup=3, iters=10) -> dict:
    """`bench.timing.median_ms` with a CUDA synchronize as the wait: both sides timed the same way."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return median_ms(fn, warmup=warmup, iters=iters, wait=lambda _: sync())


def time_jax_step(w, cfg, step_fn, prompt_cache, batch, tokens, context, key, iters):
    tokens_BT, positions_BT = step_inputs(cfg, batch, tokens, context, key)
    cache = jax.tree_util.tree_map(jnp.copy, prompt_cache)
    logits, cache, ids = step_fn(w, tokens_BT, positions_BT, cache)
    holder = {"cache": cache}

    def run():  # rewrites the same T cache slots each call: every call reads the same context
        out, holder["cache"], _ = step_fn(w, tokens_BT, positions_BT, holder["cache"])
        return out

    stats = median_ms(run, warmup=3, iters=iters)
    unique = unique_experts_per_layer(np.asarray(ids))
    total = step_bytes(w, cfg, batch, tokens, context, unique)["total"]
    return dict(stats, bytes=total, floor_ms_4p3=floor_ms(total, HBM_TBS), tokens_BT=np.asarray(tokens_BT))


def time_row(row, args, w, cfg, step_fn, prompt_cache, hf, hf_cache, torch_dev, compiled_holder, log):
    """jaxspec's step and the peer's (eager, and compiled where it works) on the same prompt; fills `row`."""
    import torch

    b, t, ctx = row["batch"], row["tokens"], row["context"]
    j = time_jax_step(w, cfg, step_fn, prompt_cache, b, t, ctx, jax.random.PRNGKey(t), args.iters)
    toks = j.pop("tokens_BT")
    row.update(jaxspec_ms=j["median_ms"], jaxspec_queued_ms=j["queued_mean_ms"], floor_ms_4p3=j["floor_ms_4p3"],
               bytes=j["bytes"])
    if hf is None:
        return
    ids = torch.as_tensor(np.array(toks), device=torch_dev, dtype=torch.long)  # a copy: jax's host arrays are read-only
    pos = torch.as_tensor(ctx + np.arange(t), device=torch_dev)[None].expand(b, t)

    def hf_step(model=hf):
        with torch.no_grad():
            o = model(input_ids=ids, position_ids=pos, **hf_cache_kwargs(model, hf_cache))
        if hasattr(hf_cache, "crop"):
            hf_cache.crop(-t)  # drop the T tokens just written (negative = remove)
        return o.logits

    h = time_torch(hf_step, iters=args.iters)
    row.update(hf_eager_ms=h["median_ms"], jaxspec_speedup=h["median_ms"] / j["median_ms"],
               hf_eager_queued_ms=h["queued_mean_ms"], jaxspec_speedup_queued=h["queued_mean_ms"] / j["queued_mean_ms"])
    if args.compile and ctx <= args.compile_max_context:  # "torch.compile too if it works": failures recorded
        try:
            if "model" not in compiled_holder:
                compiled_holder["model"] = torch.compile(hf)
            c = time_torch(functools.partial(hf_step, model=compiled_holder["model"]), iters=args.iters)
            row.update(hf_compiled_ms=c["median_ms"], jaxspec_speedup_compiled=c["median_ms"] / j["median_ms"],
                       hf_compiled_queued_ms=c["queued_mean_ms"],
                       jaxspec_speedup_compiled_queued=c["queued_mean_ms"] / j["queued_mean_ms"])
        except Exception as e:
            row["hf_compile_error"] = f"{type(e).__name__}: {e}"[:500]
            log(f"torch.compile failed at B={b} context={ctx} T={t}: {row['hf_compile_error'][:200]}")
    if t == 1:  # same prompt, same token: the two models must agree
        hf_logits = hf_step().float().cpu().numpy()
        jcache = jax.tree_util.tree_map(jnp.copy, prompt_cache)
        jl = np.asarray(step_fn(w, jnp.asarray(toks), jnp.asarray(pos.cpu().numpy(), jnp.int32), jcache)[0])
        row["logits_rel_err"] = float(np.linalg.norm(jl - hf_logits) / np.linalg.norm(hf_logits))
        row["argmax_agree"] = float(np.mean(jl.argmax(-1) == hf_logits.argmax(-1)))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--prefill-scores-gb", type=float, default=4.0,
                   help="both prompts are prefilled in chunks whose attention scores stay under this size")
    p.add_argument("--prefill-max-chunk", type=int, default=1024, choices=[16, 32, 64, 128, 256, 512, 1024],
                   help="at most this many prompt tokens per prefill call")
    p.add_argument("--compile-max-context", type=int, default=4096,
                   help="torch.compile only at contexts up to this (each new shape recompiles)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reference", action="store_true", help="jaxspec side on the plain XLA MoE path")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile peer")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    for flag, values in (("--contexts", args.contexts), ("--batches", args.batches), ("--tokens", args.tokens)):
        if min(values) < 1:
            p.error(f"{flag} must be positive, got {values}")
    if args.prefill_scores_gb <= 0:
        p.error(f"--prefill-scores-gb must be positive, got {args.prefill_scores_gb}")
    return args


def prefill_chunk(batch: int, heads: int, context: int, scores_gb: float, max_chunk: int = 1024) -> int:
    """Prompt tokens per prefill call: a power of two (16..max_chunk) whose f32 scores [B, heads, chunk, context]
    stay under `scores_gb` (a 32k prompt in one call would need hundreds of GB on either side)."""
    chunk = max_chunk
    while chunk > 16 and batch * heads * chunk * context * 4 > scores_gb * 1e9:
        chunk //= 2
    return chunk


def prefill_both(prefill_fn, w, cfg, hf, prompt, cache, chunk: int, torch_dev: str):
    """The same prompt through jaxspec (latent cache, the plain XLA MoE path) and the HF model (its own cache
    type), chunk by chunk."""
    import torch

    hf_cache = None
    for start in range(0, prompt.shape[1], chunk):
        piece = prompt[:, start:start + chunk]
        positions = np.broadcast_to(np.arange(start, start + piece.shape[1]), piece.shape)
        cache = prefill_fn(w, jnp.asarray(piece, jnp.int32), jnp.asarray(positions, jnp.int32), cache)
        if hf is not None:
            with torch.no_grad():
                hf_cache = hf_returned_cache(hf(input_ids=torch.as_tensor(piece, device=torch_dev),
                                                **hf_cache_kwargs(hf, hf_cache)))
    return cache, hf_cache


def main(argv=None) -> dict:
    import torch
    import transformers

    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    stamp = run_stamp()
    dev = stamp.device
    res = dict(**stamp.fields, torch=torch.__version__, transformers=transformers.__version__,
               layers=args.layers, contexts=args.contexts, rows=[], errors=[])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"peer-hf-{stamp.suffix}"

    def save():
        res["markdown"] = markdown(res)
        write_report(res, out_dir, stem, lambda r: r["markdown"])

    cfg = bench_config(args.layers, args.tiny)
    w = draw_weights(cfg, args.tiny, "bf16")
    on_gpu = dev.platform == "gpu"
    # the engine's own dispatch (model.kernels): the bf16 kernels on GPU; --reference for the XLA path
    use_kernel = on_gpu and not args.reference
    res["moe_path"] = "pallas kernel (bf16 variants, model.kernels dispatch)" if use_kernel else "plain XLA reference"
    step_fn = make_step(cfg, PATH_KERNELS["kernel" if use_kernel else "reference"])
    plain = cfg.replace(kernels=PATH_KERNELS["reference"])  # the plain XLA MoE path for the prompt
    prefill_fn = jax.jit(lambda w, t, p, c: forward(w, plain, t, p, c).cache)
    torch_dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = None
    try:
        hf = build_hf_model(cfg, w, torch_dev)
    except Exception as e:
        res["errors"].append(f"build HF model: {type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    rng = np.random.default_rng(0)
    compiled_holder = {}
    for ctx in args.contexts:
        for b in args.batches:
            try:
                prompt = rng.integers(0, cfg.vocab_size, size=(b, ctx))
                chunk = prefill_chunk(b, cfg.num_attention_heads, ctx, args.prefill_scores_gb, args.prefill_max_chunk)
                with jax.default_device(dev):
                    prompt_cache, hf_cache = prefill_both(prefill_fn, w, cfg, hf, prompt,
                                                          init_latent_cache(cfg, b, round_capacity(ctx + 16)),
                                                          chunk, torch_dev)
            except Exception as e:  # e.g. out of memory at B=8, 32k: the other shapes still run
                res["errors"].append(f"prefill B={b} context={ctx}: {type(e).__name__}: {e}"[:2000])
                traceback.print_exc()
                continue
            for t in args.tokens:
                row = dict(batch=b, tokens=t, context=ctx, prefill_chunk=chunk)
                try:
                    time_row(row, args, w, cfg, step_fn, prompt_cache, hf, hf_cache, torch_dev, compiled_holder, log)
                    log(f"peer B={b} context={ctx} T={t}: {row}")
                except Exception as e:
                    res["errors"].append(f"B={b} context={ctx} T={t}: {type(e).__name__}: {e}"[:2000])
                    traceback.print_exc()
                res["rows"].append(row)
                save()
            del prompt_cache, hf_cache
    save()
    return res


def markdown(res: dict) -> str:
    lines = [f"{res['device']}: jax {res['jax']} ({res.get('moe_path')}) vs torch {res['torch']} + transformers "
             f"{res['transformers']} eager; {res['layers']} layers + lm_head, bf16 experts, {res['date']}. Both sides prefill "
             "the same prompt (in chunks) into their own caches, then time steps of T tokens after it.",
             "", "Synchronised: median of single steps, each waited for. Queued: mean per step with 10 steps "
             "launched back to back and one wait (both sides timed the same way).", "",
             "| B | context | T | jaxspec ms | HF eager ms | speedup | HF compiled ms | speedup vs compiled | "
             "jaxspec queued ms | HF eager queued | speedup queued | HF compiled queued | speedup vs compiled queued | "
             "floor 4.3 (ms) | jaxspec x floor | logits rel. err | argmax agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r.get('context', '-')} | {r['tokens']} | {fmt(r.get('jaxspec_ms'))} | {fmt(r.get('hf_eager_ms'))} | "
                     f"{fmt(r.get('jaxspec_speedup'), 2)} | {fmt(r.get('hf_compiled_ms'))} | "
                     f"{fmt(r.get('jaxspec_speedup_compiled'), 2)} | {fmt(r.get('jaxspec_queued_ms'))} | "
                     f"{fmt(r.get('hf_eager_queued_ms'))} | {fmt(r.get('jaxspec_speedup_queued'), 2)} | "
                     f"{fmt(r.get('hf_compiled_queued_ms'))} | {fmt(r.get('jaxspec_speedup_compiled_queued'), 2)} | "
                     f"{fmt(r.get('floor_ms_4p3'))} | "
                     f"{fmt(r.get('jaxspec_ms') and r['jaxspec_ms'] / r['floor_ms_4p3'], 2)} | {fmt(r.get('logits_rel_err'), 4)} | "
                     f"{fmt(r.get('argmax_agree'), 2)} |")
    compile_errors = [f"B={r['batch']} context={r.get('context')} T={r['tokens']}: {r['hf_compile_error']}" for r in res["rows"]
                      if r.get("hf_compile_error")]
    if compile_errors:
        lines += ["", "torch.compile did not run:"] + [f"- {e[:400]}" for e in compile_errors]
    if res.get("errors"):
        lines += ["", "Errors:"] + [f"- {e[:400]}" for e in res["errors"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
