"""OpenAI request bodies -> validated generation requests; every refusal names the field (HTTP 400).

Fields the engine does not implement (n > 1, logprobs, echo, penalties, logit_bias, best_of, suffix, the legacy
functions, a response_format other than text, other servers' sampling extensions such as stop_token_ids, min_tokens
or guided decoding, a tool_choice that would force a call, parallel_tool_calls false) are refused when set to
anything but their neutral value, rather than silently ignored: nothing constrains what the model samples, so a call
cannot be forced. Unknown fields are ignored, as the OpenAI clients send extras.

Chat messages and tools go into the checkpoint's chat template (jinja, as transformers renders it), so they are
checked here for the shapes the OpenAI API gives them and passed on as given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets

from jaxspec.chat_template_flags import RESERVED_TEMPLATE_KWARGS, reserved_key
from jaxspec.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096  # a conversation longer than any context; past it, a body is a flood
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("auto", "none")  # "required" and a named function would need constrained decoding
# top-k travels as an int32 (generate's --top-k has the same bound); any k >= the vocabulary keeps every token
TOP_K_MAX = 2 ** 31 - 1
# what other OpenAI-compatible servers take beyond the API (vLLM's, SGLang's) to change or constrain the sampled
# tokens: refused when set, like the API's own such fields, since ignoring them would answer another request
CONSTRAINTS = ("stop_token_ids", "ignore_eos", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "regex", "json_schema", "ebnf")


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
    tools: list[dict] | None = None  # chat: the functions the model may call (None: no tools, or tool_choice none)
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # chat: chat_template_kwargs

    @property
    def tool_names(self) -> frozenset[str] | None:
        return None if self.tools is None else frozenset(t["function"]["name"] for t in self.tools)


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
    for name in ("logprobs", "top_logprobs", "echo", "logit_bias", "suffix", "functions", "function_call",
                 *CONSTRAINTS):
        if body.get(name) not in (None, False, {}, [], ""):
            raise BadRequest(f"'{name}' is not supported", name)
    if _number(body, "repetition_penalty") not in (None, 1):
        raise BadRequest("'repetition_penalty' is not supported (only 1)", "repetition_penalty")
    if _typed(body, "min_tokens", (int,), "an integer") not in (None, 0):
        raise BadRequest("'min_tokens' is not supported (only 0)", "min_tokens")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise BadRequest("'response_format' is not supported (only {\"type\": \"text\"}): nothing constrains what "
                         "the model samples", "response_format")


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
    if not 0 <= top_k <= TOP_K_MAX:
        raise BadRequest(f"'top_k' must be in [0, {TOP_K_MAX}] (or -1 for off), got {top_k}", "top_k")
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


def _has_lone_surrogate(value) -> bool:
    """Whether any string in `value` (nested lists and objects, keys too) holds a UTF-16 surrogate on its own: JSON's
    \\ud800 escape decodes to one, and no tokenizer can encode it. A walk with its own stack: bodies may nest as
    deep as the JSON decoder allows."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _unicode_only(body: dict) -> None:
    for name, value in body.items():
        if _has_lone_surrogate(name) or _has_lone_surrogate(value):
            field = None if _has_lone_surrogate(name) else name
            what = "a field name" if field is None else f"'{field}'"
            raise BadRequest(f"{what} holds text that is not valid Unicode (a lone UTF-16 surrogate such as "
                             "\\ud800)", field)


def _json_object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _unicode_only(body)
    return body


def parse_completion(body) -> GenerationRequest:
    body = _json_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if len(prompt) == 0:
        raise BadRequest("'prompt' is empty", "prompt")
    if body.get("tools") not in (None, []):
        raise BadRequest("'tools' is for /v1/chat/completions (the chat template declares them)", "tools")
    return _common(body, prompt, "max_tokens", DEFAULT_COMPLETION_TOKENS)


def _message_text(content, where: str, allow_none: bool = False) -> str | None:
    if content is None and allow_none:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'{where}.content' must be a string or a list of text parts", "messages")


def _string(value, where: str, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"'{where}' must be a string, got {type(value).__name__}", param)
    return value


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant turn's earlier calls, as the template writes them back: id, type, function name + arguments."""
    if not isinstance(calls, list):
        raise BadRequest(f"'{where}' must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise BadRequest(f"'{at}' must be an object with a 'function' object", "messages")
        if c.get("type", "function") != "function":
            raise BadRequest(f"'{at}.type' must be 'function'", "messages")
        fn = c["function"]
        out.append({"id": _string(c.get("id"), f"{at}.id", "messages"), "type": "function",
                    "function": {"name": _string(fn.get("name"), f"{at}.function.name", "messages"),
                                 "arguments": _string(fn.get("arguments"), f"{at}.function.arguments", "messages")}})
    return out


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"'{where}' must be an object with a string 'role'", "messages")
    role = m["role"]
    calls = m.get("tool_calls")
    out = {"role": role, "content": _message_text(m.get("content"), where, allow_none=role == "assistant")}
    if m.get("name") is not None:  # Kimi's templates write it in the role's place
        out["name"] = _string(m["name"], f"{where}.name", "messages")
    if role == "assistant":
        if calls not in (None, []):
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        elif out["content"] is None:
            raise BadRequest(f"'{where}' has neither content nor tool_calls", "messages")
        if m.get("reasoning_content") is not None:  # what this server returned as the turn's reasoning
            out["reasoning_content"] = _string(m["reasoning_content"], f"{where}.reasoning_content", "messages")
    elif calls is not None:
        raise BadRequest(f"'{where}.tool_calls' is only for assistant messages", "messages")
    if role == "tool":
        out["tool_call_id"] = _string(m.get("tool_call_id"), f"{where}.tool_call_id", "messages")
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    seen = set()
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise BadRequest(f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise BadRequest(f"'tools[{j}].function.name' must be 1-64 letters, digits, '_' or '-'", "tools")
        if name in seen:
            raise BadRequest(f"'tools' declares the function {name!r} twice", "tools")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadRequest(f"'tools[{j}].function.description' must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"'tools[{j}].function.parameters' must be a JSON Schema object", "tools")
    return tools


def _tool_choice(body: dict) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return choice
    if choice == "required" or isinstance(choice, dict):
        raise BadRequest(f"'tool_choice' {json.dumps(choice)[:100]} is not supported: nothing constrains what the model "
                         "samples, so a call cannot be forced; use 'auto' (the model decides) or 'none'", "tool_choice")
    raise BadRequest("'tool_choice' must be 'auto' or 'none'", "tool_choice")


def _template_kwargs(body: dict) -> dict:
    kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object") or {}
    for key in kwargs:
        if reserved_key(key):
            raise BadRequest(f"'chat_template_kwargs' may not set {key!r} (the server sets "
                             f"{', '.join(RESERVED_TEMPLATE_KWARGS)}; keys are template variable names)",
                             "chat_template_kwargs")
    return kwargs


def parse_chat(body) -> GenerationRequest:
    body = _json_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' holds {len(messages)} messages, over the {MAX_MESSAGES} a request may", "messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    tools = _tools(body)
    if _tool_choice(body) == "none":
        tools = None  # neither declared to the model nor parsed out of its answer
    parallel = _typed(body, "parallel_tool_calls", (bool,), "a boolean")
    if parallel is False:
        raise BadRequest("'parallel_tool_calls' false is not supported: nothing stops the model from calling several "
                         "functions in one turn", "parallel_tool_calls")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    gen = _common(body, clean, field, None)
    return dataclasses.replace(gen, tools=tools, template_kwargs=_template_kwargs(body))
