"""`python -m jaxspec.generate`: text generation with EAGLE-3 speculative decoding, streamed, with statistics.

Flags follow SGLang's names where one exists. Text goes to stdout, progress and statistics to stderr;
`--json` prints one JSON document (schema: JSON_SCHEMA below) and nothing else on
stdout. Every user error prints one line `error: ...` and exits with status 2 (as `python -m convert` does);
output into a pipe whose reader has left (`| head`) ends quietly with status 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from convert.json_input import parse_json
from jaxspec.chat_template_flags import add_chat_template_flags, chat_template_kwargs
from jaxspec.cli_common import (DEFAULT_MODEL_DIR, OneLineParser, UsageError, add_model_flags, eos_ids, find_draft,
                                 parse_mesh, require_at_least, require_checkpoint_dir, run_with_exit_codes,
                                 with_moe_kernel)
from jaxspec.defaults import ADAPTIVE_KINDS, DEFAULT_NUM_STEPS, default_adaptive_kind, default_dtype
from jaxspec.generate_display import ChatDisplay, echo_prompt, format_speedup
from jaxspec.speculation_verdict import speculation_verdict
from jaxspec.speedup import DEFAULT_ROUNDS, measure_speedup

# The embedded model's tokenizer (byte-level BPE on Python sources) joins a newline with the indentation after it
# and the last space with the next word ("\n   ", " with"), so a prompt that ends at a word reads to the model
# like its training text; one ending in a bare newline or in indentation does not.
DEFAULT_PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path."""\n    with'
SEED_RANGE = (-(2**63), 2**63)  # what jax.random.key takes
TOP_K_MAX = 2**31 - 1  # top-k travels as an int32; any k >= the vocabulary keeps everything

JSON_SCHEMA = {
    "model": "str: target checkpoint directory",
    "draft": "str | null: drafter checkpoint directory (null without speculation)",
    "speculative_num_steps": "int: draft tokens per cycle K (0 = no speculation)",
    "dtype": "str: activation dtype",
    "moe_kernel": "str: the routed-experts kernel asked for (--moe-kernel; auto: the measured default)",
    "devices": "int: devices in the mesh",
    "sampling": {"temperature": "float", "top_p": "float", "top_k": "int", "seed": "int"},
    "results": [{
        "prompt": "str", "prompt_tokens": "int", "tokens": "[int]: generated token ids",
        "text": "str: decoded generated tokens", "accepted_per_cycle": "[int]: drafts accepted per cycle",
        "reasoning_content": "str | null: --chat: the thinking (<think> ... </think>), apart from the answer",
        "content": "str | null: --chat: the answer without thinking and tool calls",
        "tool_calls": "null, or --chat: [{id, type: 'function', function: {name, arguments: str (JSON)}}]: the "
                      "calls the model made to --tools' functions (malformed ones stay in content)",
    }],
    "timings": {
        "compile_s": "float: ahead-of-time compilation of prefill and decode programs",
        "prefill_ms": "float", "decode_s": "float",
        "decode_tokens_per_s": "float | null: tokens after the first / decode_s (null where decode_s is 0)",
        "cycles": "int: speculative cycles (or decode steps)", "ms_per_cycle": "float | null: null without a cycle",
    },
    "acceptance": {
        "mean_acceptance_length": "float | null: accepted drafts + 1 per cycle",
        "histogram": "[int]: cycles that accepted 0..K drafts",
        "per_position": "[float | null]: P(draft i accepted), i = 1..K (null where no cycle drafted)",
    },
    "adaptive": "null, or when K was chosen adaptively (--speculative-adaptive; the default): {kind: "
                "'per_call' | 'per_cycle' (--speculative-adaptive-kind), calls: int: the decode's device calls "
                "(per_call; null per_cycle), steps: "
                "[int]: the compiled K set, costs_ms: {K: float} | null: t(K) per cycle, first_run_ms: float | null: "
                "the price of a branch's first run in a call (both null where cost_source is 'none': nothing was left "
                "to decode after the prefill's token, so nothing was timed), cost_source: 'measured' | 'cached' | "
                "'given' | 'none', measure_s: float, k_per_cycle: [int], k_histogram: {K: int}, "
                "expected_tokens_per_s: float | null: the model's E[tokens] / t over the cycles run (null without a "
                "cycle), achieved_tokens_per_s: float | null}",
    "baseline": "null, or with --baseline (jaxspec/speedup.py): {decode_tokens_per_s, decode_s, steps, "
                "speculative_decode_tokens_per_s, speculative_decode_s, speculative_cycles, speedup, speedup_min, "
                "speedup_max, rounds, mode: 'stream' | 'device loop'}: medians over interleaved rounds of both runs, "
                "speedup_min/max the rounds' extremes (a speedup is null where a plain run decoded no token after "
                "the prefill's)",
    "speculation": {  # null without speculation (K = 0)
        "paid": "bool | null: whether speculation paid, where the figures decide it (jaxspec/speculation_verdict.py)",
        "reason": "str | null: the line printed where it did not pay, with the figures that decided it",
        "figures": "adaptive: {cycles, plain_cycles, drafting_cycles, first_drafts, first_drafts_accepted, "
                   "per_position_acceptance: [float | null]: c_j measured over the drafted cycles, estimate: [float] "
                   "| null: the rule's c_j at the end, cost_in_plain_steps: {K: t(K) / t(0)} | null, "
                   "expected_tokens_per_cycle: {K: float} | null, speedup: float | null}; fixed K: {k, cycles, "
                   "mean_acceptance_length, speedup, ms_per_cycle, ms_per_plain_step, "
                   "cycle_cost_in_plain_steps: the --baseline rounds' medians} (null where not measured)",
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m jaxspec.generate", description=__doc__.split("\n")[0])
    add_model_flags(p)
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help=f"draft tokens per cycle (0 = no speculation; default {DEFAULT_NUM_STEPS})")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branching (only 1: chain)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose K up to --speculative-num-steps (0 = plain decoding) by expected tokens per second "
                        "from the measured acceptance and cycle costs (default: on); "
                        "--no-speculative-adaptive: a fixed K")
    p.add_argument("--speculative-adaptive-kind", choices=ADAPTIVE_KINDS, default=None,
                   help="how adaptive speculation changes K: per_call (between calls of fixed-K programs; plain "
                        "decoding goes back to drafting where the draft, caught up every 32 plain steps, predicts "
                        "well again) or per_cycle (one program that can change K every cycle) (default: per_call)")
    p.add_argument("--speculative-adaptive-costs", type=str, default=None, metavar="JSON",
                   help='ms per cycle for each K of the adaptive set, inline (\'{"0": 9.5, "1": 11, "2": 12, '
                        '"3": 13, "4": 14.5}\') or a JSON file (default: measured on the device at start-up)')
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tokens verified per cycle incl. the root (chain: num-steps + 1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", type=str, default=None)
    src.add_argument("--prompt-file", type=Path, default=None)
    src.add_argument("--batch-file", type=Path, default=None, help="one prompt per line, generated as one batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the model's chat template")
    add_chat_template_flags(p)
    p.add_argument("--tools", type=Path, default=None, metavar="FILE",
                   help="--chat: a JSON file of OpenAI tools (a list of {type: function, function: {name, ...}}), "
                        "declared to the model; its calls print as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON document (schema: jaxspec.generate.JSON_SCHEMA)")
    p.add_argument("--baseline", action="store_true",
                   help="also time decoding without speculation on the same target: both timed alike, in "
                        "interleaved rounds; prints the median speedup and its range")
    p.add_argument("--baseline-rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"rounds of each run --baseline times (default {DEFAULT_ROUNDS})")
    p.add_argument("--mesh", type=str, default=None, help="device count (8) or data x model shape (2x4)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="activation dtype (default: float32 on CPU, where XLA has no fast bf16 matmul; bfloat16 on "
                        "GPU and TPU)")
    p.add_argument("--max-context", type=int, default=None, help="cap on prompt + new tokens (default: the model's)")
    p.add_argument("--verify-weights", action="store_true",
                   help="check every weight file's SHA-256 against the checkpoint's manifest before loading "
                        "(default: only that each file is there with its recorded size)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt positions per prefill step, a power of two >= 16 (default 512; longer prompts run in "
                        "chunks, so attention needs chunk x context of scores, not prompt x context)")
    return p


def _status(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[jaxspec] {msg}", file=sys.stderr, flush=True)


def _check_flags(a) -> int:
    """Validate flag values; return K."""
    if a.speculative_eagle_topk != 1:
        raise UsageError(f"--speculative-eagle-topk {a.speculative_eagle_topk}: only 1 (chain drafting) is supported")
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.temperature < 0 or not math.isfinite(a.temperature):
        raise UsageError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if not 0.0 < a.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if not 0 <= a.top_k <= TOP_K_MAX:
        raise UsageError(f"--top-k must be in [0, {TOP_K_MAX}], got {a.top_k}")
    if not SEED_RANGE[0] <= a.seed < SEED_RANGE[1]:
        raise UsageError(f"--seed must be in [-2**63, 2**63), got {a.seed}")
    if a.prefill_chunk is not None:
        from jaxspec.prefill import MIN_BUCKET, valid_chunk

        if not valid_chunk(a.prefill_chunk):
            raise UsageError(f"--prefill-chunk must be a power of two >= {MIN_BUCKET}, got {a.prefill_chunk}")
    k = a.speculative_num_steps
    if k is None:
        k = a.speculative_num_draft_tokens - 1 if a.speculative_num_draft_tokens else DEFAULT_NUM_STEPS
    if k < 0:
        raise UsageError(f"--speculative-num-steps must be >= 0, got {k}" if a.speculative_num_steps is not None else
                         f"--speculative-num-draft-tokens must be >= 1, got {a.speculative_num_draft_tokens}")
    if a.speculative_adaptive and k < 1:
        raise UsageError("--speculative-adaptive needs --speculative-num-steps >= 1 (the largest K it may choose)")
    if a.speculative_adaptive_kind is not None and (a.speculative_adaptive is False or k < 1):
        raise UsageError("--speculative-adaptive-kind needs adaptive speculation (not --no-speculative-adaptive, "
                         "and --speculative-num-steps >= 1)")
    if a.speculative_adaptive_costs is not None and (a.speculative_adaptive is False or k < 1):
        raise UsageError("--speculative-adaptive-costs needs adaptive speculation (not --no-speculative-adaptive, "
                         "and --speculative-num-steps >= 1)")
    if a.speculative_num_draft_tokens is not None and a.speculative_num_draft_tokens != k + 1:
        raise UsageError(
            f"--speculative-num-draft-tokens {a.speculative_num_draft_tokens} must equal --speculative-num-steps + 1 "
            f"= {k + 1} for chain drafting (topk 1)"
        )
    if a.baseline and k == 0:
        raise UsageError("--baseline compares speculative decoding with plain decoding: it needs "
                         "--speculative-num-steps >= 1 (with 0 the run is already the baseline)")
    if a.baseline_rounds < 1:
        raise UsageError(f"--baseline-rounds must be >= 1, got {a.baseline_rounds}")
    if a.baseline and a.max_new_tokens < 2:  # the first token comes out of the prefill: no decoding to time
        raise UsageError(f"--baseline needs --max-new-tokens >= 2 (it times decoding after the prefill's token), "
                         f"got {a.max_new_tokens}")
    require_at_least(a, 2, "max_context")  # the engine would read 0 as "no cap"
    if not a.chat and (a.chat_template_kwargs is not None or a.thinking is not None or a.tools is not None):
        raise UsageError("--chat-template-kwargs, --thinking and --tools shape a chat prompt: they need --chat")
    chat_template_kwargs(a)
    _read_tools(a)
    return k


def _read_tools(a) -> list[dict] | None:
    if a.tools is None:
        return None
    from jaxspec.serving.protocol import BadRequest, parse_chat

    try:
        tools = parse_json(a.tools.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"--tools {a.tools}: cannot read a JSON document ({e.__class__.__name__}: {e})") from None
    try:  # the server's checks, so both take the same tools
        return parse_chat({"messages": [{"role": "user", "content": ""}], "tools": tools}).tools
    except BadRequest as e:
        raise UsageError(f"--tools {a.tools}: {e}") from None


def _read_prompts(a) -> tuple[list[str], bool]:
    """(prompts, batch?)"""
    if a.prompt is not None:
        return [a.prompt], False
    for flag, path in (("--prompt-file", a.prompt_file), ("--batch-file", a.batch_file)):
        if path is not None:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{flag} {path}: cannot read ({e.__class__.__name__}: {e})") from None
            if flag == "--batch-file":
                # lines end at "\n" only (read_text made CRLF "\n"): str.splitlines() also splits at form feeds,
                # vertical tabs and U+2028, which sit inside lines of source code and text
                prompts = [line for line in text.split("\n") if line.strip()]
                if not prompts:
                    raise UsageError(f"--batch-file {path}: no prompts in it")
                return prompts, True
            if not text:
                raise UsageError(f"--prompt-file {path}: the file is empty")
            return [text], False
    if sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty():  # `<&-` leaves no stdin at all
        try:
            data = sys.stdin.buffer.read()
        except OSError as e:
            raise UsageError(f"stdin: cannot read the prompt ({e.strerror or e})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"stdin: the prompt is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
        if text.strip():
            return [text], False
    return [DEFAULT_PROMPT], False


def run(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    k = _check_flags(a)
    from jaxspec.distributed import initialize_from_env

    process = initialize_from_env()  # multi-host: JAXSPEC_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
    if process is not None and process.process_id != 0:
        sys.stdout = open(os.devnull, "w")  # every process runs the program; process 0 speaks for the job
        sys.stderr = open(os.devnull, "w")
    quiet = a.json
    mesh = parse_mesh(a.mesh)
    prompts_text, batch = _read_prompts(a)

    import jax
    import jax.numpy as jnp

    from convert.checkpoint import load_draft, load_target, read_metadata
    from jaxspec.adaptive import AdaptivePolicy
    from jaxspec.adaptive_calls import PerCallPolicy
    from jaxspec.adaptive_costs import CostTableError, parse_costs
    from jaxspec.compile_cache import enable as enable_compile_cache
    from jaxspec.engine import Engine
    from jaxspec.models import SpecConfig, SpecWeights, check_draft_fits
    from jaxspec.sampling import SamplingParams
    from jaxspec.serving.assistant_output import parse_assistant
    from jaxspec.serving.kimi_tool_declaration import InvalidToolSchema
    from jaxspec.serving.reasoning import prompt_opens_reasoning
    from jaxspec.tokenizer import StreamDecoder, load_tokenizer

    enable_compile_cache()  # before anything compiles: JAX settles its cache at the first compilation
    adaptive = k > 0 and a.speculative_adaptive is not False  # the default wherever there is a K to choose
    policy = None
    if adaptive:
        a.speculative_adaptive_kind = a.speculative_adaptive_kind or default_adaptive_kind(jax.default_backend())
        Policy = PerCallPolicy if a.speculative_adaptive_kind == "per_call" else AdaptivePolicy
        policy = Policy()
        if a.speculative_adaptive_costs is not None:
            try:
                policy = Policy(costs=parse_costs(a.speculative_adaptive_costs, policy.resolve_steps(k)))
            except CostTableError as e:
                raise UsageError(str(e)) from None
    model_dir = a.model or DEFAULT_MODEL_DIR / "target"
    require_checkpoint_dir("--model", model_dir)
    read_metadata(model_dir, "target")  # a broken target is the first thing to report
    draft_dir = find_draft(model_dir, a.draft) if k > 0 else None
    if k > 0 and draft_dir is None:
        raise UsageError(f"no drafter found beside {model_dir} (pass --draft DIR, or --speculative-num-steps 0)")
    if draft_dir is not None:
        require_checkpoint_dir("--draft", draft_dir)
    a.dtype = a.dtype or default_dtype(jax.default_backend())
    dtype = jnp.dtype(a.dtype)

    t0 = time.perf_counter()
    _status(f"loading target {model_dir}", quiet)
    verify = "full" if a.verify_weights else "sizes"
    cfg, tw = load_target(model_dir, mesh=mesh, dtype=dtype, verify=verify)
    cfg = with_moe_kernel(cfg, a.moe_kernel)
    dcfg = dw = None
    if draft_dir is not None:
        _status(f"loading drafter {draft_dir}", quiet)
        dcfg, dw = load_draft(draft_dir, mesh=mesh, dtype=dtype, verify=verify)
        cfg = check_draft_fits(cfg, dcfg, dw)
    if a.max_context is not None and a.max_context > cfg.max_position_embeddings:
        # a cap, as the server takes it: it never lifts the model's own limit (positions it has no rotary range for)
        raise UsageError(f"--max-context {a.max_context} exceeds the model's {cfg.max_position_embeddings} positions")
    tokenizer = load_tokenizer(model_dir)
    eos = eos_ids(model_dir, cfg, tokenizer)
    _status(f"loaded in {time.perf_counter() - t0:.1f} s", quiet)

    tools = _read_tools(a)
    if a.chat:
        kwargs = chat_template_kwargs(a)
        try:
            prompts_text = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=tools, **kwargs)
                            for p in prompts_text]
        except InvalidToolSchema as e:  # K2.5's template declares the tools in TypeScript: it reads the schemas
            raise UsageError(f"--tools {a.tools}: {e}") from None
    prompts = [tokenizer.encode(p) for p in prompts_text]
    bos = tokenizer.token_id("bos_token")
    if tokenizer.config.get("add_bos_token") and bos is not None:  # the embedded model saw <|bos|> at file starts
        prompts = [[bos] + p for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise UsageError("a prompt encodes to zero tokens")
    engine_kw = {"mesh": mesh} if mesh is not None else {}
    if a.prefill_chunk is not None:
        engine_kw["prefill_chunk"] = a.prefill_chunk
    engine = Engine(SpecConfig(cfg, dcfg, eos), SpecWeights(tw, dw), num_steps=k, max_context=a.max_context,
                    adaptive=policy, **engine_kw)
    del tw  # the engine runs its own layout of these weights (jaxspec.sharded.weights_to_run); free the loaded one
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p)
    _status("compiling (ahead of time, once per shape)", quiet)

    stream = not (a.json or batch)
    if stream:
        echo_prompt(prompts_text[0], sys.stdout)
        decoder = StreamDecoder(tokenizer)
        parser = _chat_parser(a, tools, prompts_text[0])
        display = ChatDisplay(sys.stdout, sys.stderr)
        result = None
        for event in engine.stream(prompts, a.max_new_tokens, sampling, seed=a.seed):
            if isinstance(event, list):
                if parser is None:
                    sys.stdout.write(decoder.push(event[0]))
                else:  # the end-of-turn token is not part of the answer
                    display.write(parser.push(decoder.push([t for t in event[0] if t not in eos])))
                sys.stdout.flush()
            else:
                result = event
        if parser is None:
            sys.stdout.write(decoder.flush())
        else:
            display.write(parser.push(decoder.flush()) + parser.finish())
            display.end()
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        result = engine.generate(prompts, a.max_new_tokens, sampling, seed=a.seed)

    baseline = None
    if a.baseline:
        _status(f"timing speculative and plain decoding alike, {a.baseline_rounds} interleaved rounds", quiet)
        baseline = measure_speedup(engine, prompts, a.max_new_tokens, sampling, a.seed, streamed=stream,
                                   rounds=a.baseline_rounds)

    texts = [tokenizer.decode(t) for t in result.tokens]
    chats = [None] * len(texts)
    if a.chat:  # the answer without its end-of-turn token, split into thinking, answer and tool calls
        chats = [parse_assistant(tokenizer.decode([i for i in t if i not in eos]), _tool_names(tools),
                                 prompt_opens_reasoning(p)) for t, p in zip(result.tokens, prompts_text)]
    report = _report(a, model_dir, draft_dir, k, mesh, prompts_text, prompts, texts, result, baseline, stream, chats)
    if a.json:  # NaN / Infinity (a rate with no time, an average of no cycle) are not JSON: null says "none"
        print(json.dumps(_json_safe(report), ensure_ascii=False, allow_nan=False))
    else:
        if batch:
            for i, text in enumerate(texts):
                print(f"=== [{i}] {prompts_text[i]!r}")
                if chats[i] is None:
                    print(text)
                else:
                    display = ChatDisplay(sys.stdout, sys.stderr)
                    display.write(parse_assistant_deltas(chats[i]))
                    display.end()
                    print()
        _print_stats(report, k)
    return 0


def _json_safe(x):
    """`x` with every non-finite float as None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _tool_names(tools) -> frozenset[str] | None:
    return None if tools is None else frozenset(t["function"]["name"] for t in tools)


def _chat_parser(a, tools, prompt_text: str):
    from jaxspec.serving.assistant_output import AssistantOutputParser
    from jaxspec.serving.reasoning import prompt_opens_reasoning

    return AssistantOutputParser(_tool_names(tools), prompt_opens_reasoning(prompt_text)) if a.chat else None


def parse_assistant_deltas(m) -> list:
    """A parsed answer as the deltas ChatDisplay writes: thinking, answer, then the calls. Empty text is left out,
    as the streaming parser leaves it out: ChatDisplay starts a dimmed block or a new line for every delta."""
    from jaxspec.serving.assistant_output import Content, Reasoning

    text = [d for d in (Reasoning(m.reasoning), Content(m.content)) if d.text]
    return [*text, *m.tool_calls]


def _report(a, model_dir, draft_dir, k, mesh, prompts_text, prompts, texts, result, baseline, stream, chats) -> dict:
    stats = result.stats
    ms_cycle = 1000 * result.decode_s / result.cycles if result.cycles else None
    out = {
        "model": str(model_dir),
        "draft": None if draft_dir is None else str(draft_dir),
        "speculative_num_steps": k,
        "dtype": a.dtype,
        "moe_kernel": a.moe_kernel,
        "devices": 1 if mesh is None else int(mesh.devices.size),
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed},
        "results": [
            {"prompt": pt, "prompt_tokens": len(p), "tokens": toks, "text": txt, "accepted_per_cycle": acc,
             "reasoning_content": None if chat is None else chat.reasoning,
             "content": None if chat is None else chat.content,
             "tool_calls": None if chat is None else [c.as_openai() for c in chat.tool_calls]}
            for pt, p, toks, txt, acc, chat in zip(prompts_text, prompts, result.tokens, texts, result.accepted, chats)
        ],
        "timings": {
            "compile_s": result.compile_s,
            "prefill_ms": 1000 * result.prefill_s,
            "decode_s": result.decode_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "cycles": result.cycles,
            "ms_per_cycle": ms_cycle,
        },
        "acceptance": {
            "mean_acceptance_length": None if k == 0 or not stats.cycles else stats.mean_acceptance_length,
            "histogram": stats.histogram(k) if k else [],
            "per_position": stats.per_position_acceptance(k) if k else [],
        },
        "adaptive": None,
        "baseline": None,
        "speculation": None,
    }
    if result.adaptive is not None:
        ad = result.adaptive
        timed = ad.cost_source != "none"  # "none": nothing left to decode; the policy's table is a placeholder
        out["adaptive"] = {
            "kind": a.speculative_adaptive_kind,
            "calls": ad.calls if a.speculative_adaptive_kind == "per_call" else None,
            "steps": list(ad.steps),
            "costs_ms": {str(k_): 1000 * c for k_, c in zip(ad.steps, ad.costs_s)} if timed else None,
            "first_run_ms": 1000 * ad.first_run_s if timed else None,
            "cost_source": ad.cost_source,
            "measure_s": ad.measure_s,
            "k_per_cycle": ad.k_per_cycle,
            "k_histogram": {str(k_): n for k_, n in ad.k_histogram.items()},
            "expected_tokens_per_s": ad.expected_tokens_per_s,
            "achieved_tokens_per_s": result.decode_tokens_per_s,
        }
    if baseline is not None:
        out["baseline"] = baseline.as_dict()
    verdict = speculation_verdict(result, k, out["baseline"])
    if verdict is not None:
        out["speculation"] = verdict.as_dict()
    return out


def _print_stats(r: dict, k: int) -> None:
    t, acc = r["timings"], r["acceptance"]
    lines = [
        f"prompt tokens: {', '.join(str(x['prompt_tokens']) for x in r['results'])}",
        f"prefill: {t['prefill_ms']:.1f} ms   compile: {t['compile_s']:.1f} s (not counted below)",
        f"decode: {t['decode_tokens_per_s']:.1f} tok/s over {t['decode_s']:.3f} s, {t['cycles']} "
        + (f"cycles, {t['ms_per_cycle']:.2f} ms/cycle" if t["ms_per_cycle"] is not None else "cycles"),
    ]
    ad = r["adaptive"]
    if ad:
        hist = ", ".join(f"K={k_}: {n}" for k_, n in ad["k_histogram"].items())
        if ad["costs_ms"] is None:
            lines.append(f"adaptive: cycles per K {{{hist}}}; no cost table (nothing was left to decode after the "
                         "prefill's token)")
        else:
            costs = ", ".join(f"{k_}: {ms:.2f}" for k_, ms in ad["costs_ms"].items())
            rates = (f"expected {ad['expected_tokens_per_s']:.1f} tok/s, achieved {ad['achieved_tokens_per_s']:.1f}"
                     if math.isfinite(ad["expected_tokens_per_s"]) else "no cycle ran")
            lines.append(f"adaptive: cycles per K {{{hist}}}; cost table ms/cycle {{{costs}}} ({ad['cost_source']}); "
                         f"{rates}")
    if k and acc["mean_acceptance_length"] is not None:
        lines.append(
            f"speculation: K={k}{' (largest)' if ad else ''}, "
            f"mean acceptance length {acc['mean_acceptance_length']:.2f} "
            f"(histogram of accepted drafts 0..{k}: {acc['histogram']})"
        )
    if r["baseline"]:
        lines.append(format_speedup(r["baseline"]))
    if r["speculation"] and r["speculation"]["reason"]:
        lines.append(r["speculation"]["reason"])
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from convert.errors import CheckpointError
    from jaxspec.engine import PromptTooLong
    from jaxspec.tokenizer import TokenizerError
    from model.config import ConfigError

    def closed_pipe_ends_quietly() -> int:
        try:
            return run(argv)
        except BrokenPipeError:
            # stdout's reader left (`| head -c 20`): stop quietly; point stdout at /dev/null so that the
            # interpreter's own flush at exit does not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return run_with_exit_codes(closed_pipe_ends_quietly, (CheckpointError, ConfigError, TokenizerError, PromptTooLong))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
