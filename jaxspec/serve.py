"""`python -m jaxspec.serve`: an OpenAI-compatible HTTP server with continuous batching, every slot speculating.

The embedded pair is the default model, so the command works on a fresh install. Flags follow
`python -m jaxspec.generate` (and SGLang / vLLM where they have a name for the thing). Every user error prints
one line `error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from jaxspec.chat_template_flags import add_chat_template_flags, chat_template_kwargs
from jaxspec.defaults import default_dtype
from jaxspec.cli_common import (DEFAULT_MODEL_DIR, OneLineParser, UsageError, add_model_flags, eos_ids, find_draft,
                                 parse_mesh, require_checkpoint_dir, run_with_exit_codes, with_moe_kernel)

# A server admits a prompt longer than this a chunk per device step. Smaller chunks cut how long running streams
# wait and lengthen a long prompt's time to its first token (docs/serving.md; bench.admission_gaps).
SERVE_PREFILL_CHUNK = 256


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m jaxspec.serve", description=__doc__.split("\n")[0])
    add_model_flags(p)
    p.add_argument("--served-model-name", default="jaxspec", help="the model id clients send and /v1/models lists")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="batch slots: requests decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot beyond which 429 is returned")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + generated tokens per request (default: the model's, capped at 4096); every slot "
                        "holds a cache this long unless --cache-pages pages it")
    p.add_argument("--cycles-per-step", type=int, default=4,
                   help="cycles the device runs between host interactions (admission, token delivery)")
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft tokens per cycle (0 = no speculation; default 4 with a drafter)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose K per device loop, 0..--speculative-num-steps, from the measured acceptance and loop "
                        "times (jaxspec/serving/adaptive_k.py; default: on wherever K >= 1); "
                        "--no-speculative-adaptive: every loop drafts --speculative-num-steps")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branching (only 1: chain)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tokens verified per cycle incl. the root (chain: num-steps + 1)")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a jinja chat template file, replacing the checkpoint's (needed where it has none)")
    add_chat_template_flags(p)
    p.add_argument("--mesh", type=str, default=None, help="device count (8) or data x model shape (2x4)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="activation dtype (default: float32 on CPU, bfloat16 on GPU, as generate)")
    p.add_argument("--prefill-chunk", type=int, default=SERVE_PREFILL_CHUNK,
                   help="prompt positions per prefill step, a power of two >= 16: a longer prompt is admitted one "
                        "chunk between device steps, so running streams keep emitting (default %(default)s)")
    p.add_argument("--prefix-cache-tokens", type=int, default=None,
                   help="prompt tokens the prefix cache holds, in pages of 64: a prompt that starts as an earlier one "
                        "did prefills only the rest (default: --max-context's worth; 0 = off)")
    p.add_argument("--cache-pages", type=int, default=None,
                   help="page the caches: this many pages of 64 positions shared by the slots, a request taking "
                        "pages as its sequence grows (waiting, or preempted and resumed, while they are short); "
                        "default: unpaged, every slot holding --max-context")
    p.add_argument("--warmup-buckets", type=str, default="16,32,64",
                   help="prompt buckets whose prefill is compiled before serving (comma-separated; others compile "
                        "on first use)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are ended")
    return p


def _check(a) -> tuple[int, list[int]]:
    """Validate flag values; return (K, warm-up buckets)."""
    if a.speculative_eagle_topk != 1:
        raise UsageError(f"--speculative-eagle-topk {a.speculative_eagle_topk}: only 1 (chain drafting) is supported")
    for flag, value in (("--max-batch", a.max_batch), ("--cycles-per-step", a.cycles_per_step)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}")
    if not 0 < a.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {a.port}")
    if a.max_context is not None and a.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {a.max_context}")
    if a.cache_pages is not None and a.cache_pages < 1:
        raise UsageError(f"--cache-pages must be >= 1, got {a.cache_pages}")
    if a.prefix_cache_tokens is not None and a.prefix_cache_tokens < 0:
        raise UsageError(f"--prefix-cache-tokens must be >= 0, got {a.prefix_cache_tokens}")
    if not (a.shutdown_timeout >= 0 and math.isfinite(a.shutdown_timeout)):
        raise UsageError(f"--shutdown-timeout must be a finite number >= 0, got {a.shutdown_timeout}")
    from jaxspec.prefill import MIN_BUCKET, prompt_bucket, valid_chunk

    if not valid_chunk(a.prefill_chunk):
        raise UsageError(f"--prefill-chunk must be a power of two >= {MIN_BUCKET}, got {a.prefill_chunk}")
    try:
        buckets = sorted({prompt_bucket(int(b)) for b in a.warmup_buckets.split(",") if b.strip()})
    except ValueError:
        raise UsageError(f"--warmup-buckets {a.warmup_buckets!r}: expected comma-separated integers") from None
    k = a.speculative_num_steps
    if k is None:
        k = a.speculative_num_draft_tokens - 1 if a.speculative_num_draft_tokens else 4
    if k < 0:
        raise UsageError(f"--speculative-num-steps must be >= 0, got {k}")
    if a.speculative_num_draft_tokens is not None and a.speculative_num_draft_tokens != k + 1:
        raise UsageError(f"--speculative-num-draft-tokens {a.speculative_num_draft_tokens} must equal "
                         f"--speculative-num-steps + 1 = {k + 1} for chain drafting (topk 1)")
    if a.speculative_adaptive and k < 1:
        raise UsageError("--speculative-adaptive needs --speculative-num-steps >= 1 (the largest K it may choose)")
    if a.speculative_adaptive is None:  # the default wherever there is a K to choose
        a.speculative_adaptive = k >= 1
    chat_template_kwargs(a)  # refused before anything loads
    return k, buckets


def build_service(a, k: int, buckets: list[int], log=print):
    """Load the pair, compile the programs and return the app's Service (not yet started)."""
    import jax
    import jax.numpy as jnp

    from convert.checkpoint import load_draft, load_target, read_metadata
    from jaxspec.models import SpecConfig, SpecWeights, check_draft_fits
    from jaxspec.serving.adaptive_k import BatchAdaptiveK
    from jaxspec.serving.app import Service
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Scheduler
    from jaxspec.serving.slot_engine import SlotEngine
    from jaxspec.tokenizer import load_tokenizer

    mesh = parse_mesh(a.mesh)
    model_dir = a.model or DEFAULT_MODEL_DIR / "target"
    require_checkpoint_dir("--model", model_dir)
    read_metadata(model_dir, "target")
    draft_dir = find_draft(model_dir, a.draft) if k > 0 else None
    if k > 0 and draft_dir is None:
        raise UsageError(f"no drafter found beside {model_dir} (pass --draft DIR, or --speculative-num-steps 0)")
    if draft_dir is not None:
        require_checkpoint_dir("--draft", draft_dir)
    template = None
    if a.chat_template is not None:
        try:
            template = a.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {a.chat_template}: cannot read ({e.__class__.__name__}: {e})") from None
    dtype = jnp.dtype(a.dtype or default_dtype(jax.default_backend()))
    log(f"loading target {model_dir}")
    cfg, tw = load_target(model_dir, mesh=mesh, dtype=dtype)
    cfg = with_moe_kernel(cfg, a.moe_kernel)
    dcfg = dw = None
    if draft_dir is not None:
        log(f"loading drafter {draft_dir}")
        dcfg, dw = load_draft(draft_dir, mesh=mesh, dtype=dtype)
        cfg = check_draft_fits(cfg, dcfg, dw)
    tokenizer = load_tokenizer(model_dir)
    if template is not None:
        tokenizer.chat_template = template
    max_context = a.max_context or min(cfg.max_position_embeddings, 4096)
    if max_context > cfg.max_position_embeddings:
        raise UsageError(f"--max-context {max_context} exceeds the model's {cfg.max_position_embeddings} positions")
    prefix_tokens = max_context if a.prefix_cache_tokens is None else a.prefix_cache_tokens
    kw = {"prefill_chunk": a.prefill_chunk, "prefix_cache_tokens": prefix_tokens, "cache_pages": a.cache_pages}
    try:
        engine = SlotEngine(SpecConfig(cfg, dcfg, eos_ids(model_dir, cfg, tokenizer)), SpecWeights(tw, dw),
                            num_steps=k, max_batch=a.max_batch, max_context=max_context,
                            cycles_per_step=a.cycles_per_step, mesh=mesh,
                            choose_k=BatchAdaptiveK(k) if a.speculative_adaptive else None, **kw)
    except ValueError as e:
        if "cache_pages" not in str(e):
            raise
        raise UsageError(f"--cache-pages {a.cache_pages}: {e}") from None
    del tw  # the engine runs its own layout of these weights (jaxspec.sharded.weights_to_run); free the loaded one
    log(f"compiling (slots {a.max_batch}, context {max_context}, K {k}, prompt buckets {buckets}, prefix cache "
        f"{engine.prefix.num_pages} pages of {engine.prefix.page_size})")
    engine.warm_up([b for b in buckets if b <= max_context])
    log(f"compiled in {engine.compile_s:.1f} s")
    metrics = Metrics(a.max_batch)
    return Service(Scheduler(engine, metrics, a.max_queue), tokenizer, metrics, a.served_model_name,
                   a.shutdown_timeout, chat_template_kwargs(a))


def run(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    k, buckets = _check(a)
    import uvicorn

    from jaxspec.compile_cache import enable as enable_compile_cache
    from jaxspec.serving.app import create_app

    enable_compile_cache()  # before anything compiles: JAX settles its cache at the first compilation

    def log(msg):
        print(f"[jaxspec] {msg}", file=sys.stderr, flush=True)

    service = build_service(a, k, buckets, log)
    log(f"serving {a.served_model_name!r} on http://{a.host}:{a.port}/v1")
    # uvicorn turns SIGTERM / SIGINT into a graceful shutdown: stop accepting, let open responses finish (up to
    # the timeout), then the app's lifespan ends the scheduler
    uvicorn.run(create_app(service), host=a.host, port=a.port, log_level="warning",
                timeout_graceful_shutdown=a.shutdown_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    from convert.safetensors_reader import CheckpointError
    from jaxspec.tokenizer import TokenizerError
    from model.config import ConfigError

    return run_with_exit_codes(lambda: run(argv), (CheckpointError, ConfigError, TokenizerError))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
