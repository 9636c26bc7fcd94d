"""OpenAI request bodies -> validated generation requests; every refusal names the field (HTTP 400).

Fields the engine does not implement (n > 1, logprobs, echo, penalties, logit_bias, best_of, suffix, tools) are
refused when set to anything but their neutral value, rather than silently ignored. Unknown fields are ignored,
as the OpenAI clients send extras.
"""

from __future__ import annotations

import dataclasses
import math
import secrets

from jaxspec.sampling import SamplingParams

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    max_tokens: int | None  # None: as many as the context allows
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def _typed(body: dict, name: str, kinds: tuple, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise BadRequest(f"'{name}' must be {what}, got {type(v).__name__}", name)
    return v


def _number(body, name, what="a number"):
    v = _typed(body, name, (int, float), what)
    if v is not None and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be finite, got {v}", name)
    return v


def _neutral(body: dict) -> None:
    n = _typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of not in (None, 1):
        raise BadRequest(f"'best_of' must be 1, got {best_of}", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name) not in (None, 0):
            raise BadRequest(f"'{name}' is not supported (only 0)", name)
    for name in ("logprobs", "top_logprobs", "echo", "logit_bias", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, {}, [], ""):
            raise BadRequest(f"'{name}' is not supported", name)


def _sampling(body: dict) -> tuple[SamplingParams, int]:
    temperature = _number(body, "temperature")
    temperature = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    if temperature < 0:
        raise BadRequest(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _typed(body, "top_k", (int,), "an integer")
    top_k = 0 if top_k in (None, -1) else top_k  # -1 is vLLM's "off"
    if top_k < 0:
        raise BadRequest(f"'top_k' must be >= 0 (or -1 for off), got {top_k}", "top_k")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is None:
        seed = secrets.randbits(31)
    elif not 0 <= seed < 2 ** 63:
        raise BadRequest(f"'seed' must be in [0, 2**63), got {seed}", "seed")
    return SamplingParams(temperature, top_k, top_p), seed % 2 ** 32


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _common(body: dict, prompt, max_tokens_field: str, default_max_tokens: int | None) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _neutral(body)
    max_tokens = _typed(body, max_tokens_field, (int,), "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens < 1:
        raise BadRequest(f"'{max_tokens_field}' must be >= 1, got {max_tokens}", max_tokens_field)
    sampling, seed = _sampling(body)
    stream = _typed(body, "stream", (bool,), "a boolean") or False
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean", "stream_options")
    return GenerationRequest(prompt, max_tokens, sampling, seed, _stop(body), stream, include_usage)


def parse_completion(body) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if len(prompt) == 0:
        raise BadRequest("'prompt' is empty", "prompt")
    return _common(body, prompt, "max_tokens", DEFAULT_COMPLETION_TOKENS)


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts", "messages")


def parse_chat(body) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", "messages")
        clean.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _common(body, clean, field, None)
