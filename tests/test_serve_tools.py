"""Tool calls and thinking end to end: `serve`'s app, scheduler and parsers over an engine whose output is forced
to recorded K2.5 answers (tests/forced_engine.py), Kimi-K2.5's chat template, the real `openai` client; every
response and stream chunk validated against the openai package's own types."""

import importlib
import json

import httpx
import pytest

from jaxspec.serving.background import BackgroundServer
from jaxspec.tokenizer import load_tokenizer
from tests.forced_engine import FINAL_ANSWER, TOOL_CALL_ANSWER, WEATHER_TOOL, forced_service
from tests.kimi_chat_templates import KIMI_K25
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer


class _OnFirstUse:
    """A module imported on first use (`openai` takes 1.7 s): every xdist worker collects this file, one runs it."""

    def __init__(self, module: str):
        self.module = module

    def __getattr__(self, name):
        return getattr(importlib.import_module(self.module), name)


openai = _OnFirstUse("openai")
chat_types = _OnFirstUse("openai.types.chat")

MODEL = "kimi-k2.5-forced"
TWO_CALLS = ("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
             '{"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|>')
MALFORMED = ("A tool is needed.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.delete_all:0<|tool_call_argument_begin|>"
             "{}<|tool_call_end|><|tool_calls_section_end|>")
ANSWERS = {"weather": TOOL_CALL_ANSWER, "two": TWO_CALLS, "malformed": MALFORMED}


def answer_for(prompt: str) -> str:
    if "## Return of" in prompt:
        return FINAL_ANSWER
    last_user = prompt.rsplit("<|im_user|>user<|im_middle|>", 1)[1].split("<|im_end|>")[0]
    return ANSWERS[last_user]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("k25")
    write_kimi_tokenizer(d, KIMI_K25)
    tok = load_tokenizer(d)
    service = forced_service(tok, answer_for, (tok.special_tokens["<|im_end|>"],))
    with BackgroundServer(service) as background:
        yield dict(service=service, base=background.base_url, tok=tok)


def post(server, body):
    return httpx.post(server["base"] + "/chat/completions", json={"model": MODEL, **body}, timeout=60)


def stream_chunks(server, body):
    """The raw SSE chunks, each validated as a ChatCompletionChunk."""
    chunks = []
    with httpx.stream("POST", server["base"] + "/chat/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(chat_types.ChatCompletionChunk.model_validate(json.loads(line[6:])))
    return chunks


def ask(text, **kw):
    return {"messages": [{"role": "user", "content": text}], "tools": [WEATHER_TOOL], **kw}


def test_tool_call_whole_through_the_openai_client(server):
    raw = post(server, ask("weather"))
    assert raw.status_code == 200
    chat_types.ChatCompletion.model_validate(raw.json())
    c = openai.OpenAI(base_url=server["base"], api_key="none", max_retries=0)
    r = c.chat.completions.create(model=MODEL, **ask("weather"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "The user asks for the weather in Paris; get_weather gives it."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("functions.get_weather:0", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_streamed_in_pieces(server):
    chunks = stream_chunks(server, ask("weather"))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user asks for the weather in Paris; get_weather gives it."
    assert sum(1 for d in deltas if d.model_extra.get("reasoning_content")) > 1  # streamed, not at the end
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id == "functions.get_weather:0" and calls[0].function.name == "get_weather"
    pieces = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert {tc.index for tc in calls} == {0}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_openai_client_assembles_the_stream(server):
    c = openai.OpenAI(base_url=server["base"], api_key="none", max_retries=0)
    with c.chat.completions.stream(model=MODEL, **ask("two")) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(t.id, json.loads(t.function.arguments)) for t in calls] == [
        ("functions.get_weather:0", {"city": "Paris"}), ("functions.get_weather:1", {"city": "Zürich"})]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_result_round_trip(server):
    c = openai.OpenAI(base_url=server["base"], api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "weather"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL]).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, cloudy"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is 18 °C and cloudy in Paris."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    prompt = server["service"].engine.prompts[-1]
    assert ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n"
            "18 C, cloudy<|im_end|>") in prompt
    assert "<think>The user asks for the weather in Paris; get_weather gives it.</think>" in prompt


def _malformed_count(server):
    text = httpx.get(server["base"].replace("/v1", "/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("jaxspec_malformed_tool_calls"))


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_call_returns_as_content_and_is_counted(server, stream):
    before = _malformed_count(server)
    if stream:
        chunks = stream_chunks(server, ask("malformed"))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        reason = chunks[-1].choices[0].finish_reason
        assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    else:
        r = post(server, ask("malformed"))
        msg = chat_types.ChatCompletion.model_validate(r.json()).choices[0]
        content, reason = msg.message.content, msg.finish_reason
        assert msg.message.tool_calls is None
    assert content == ("Sure.<|tool_call_begin|>functions.delete_all:0<|tool_call_argument_begin|>{}"
                       "<|tool_call_end|>")
    assert reason == "stop" and _malformed_count(server) == before + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut", ["max_tokens", "stop"])
def test_a_cut_inside_the_section_is_well_formed(server, stream, cut):
    tok = server["tok"]
    ids = tok.encode(TOOL_CALL_ANSWER)
    inside = ids.index(tok.special_tokens["<|tool_call_argument_begin|>"]) + 2  # into the arguments
    kw = {"max_tokens": inside} if cut == "max_tokens" else {"stop": ['"Paris"']}
    body = ask("weather", **kw)
    if stream:
        chunks = stream_chunks(server, body)
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = post(server, body)
        choice = chat_types.ChatCompletion.model_validate(r.json()).choices[0]
        content, reason = choice.message.content, choice.finish_reason
        assert choice.message.tool_calls is None
    assert content.startswith("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{")
    assert reason == ("length" if cut == "max_tokens" else "stop")


def test_thinking_off_and_tool_choice_none(server):
    r = post(server, ask("weather", chat_template_kwargs={"thinking": False}, tool_choice="none"))
    choice = chat_types.ChatCompletion.model_validate(r.json()).choices[0]
    prompt = server["service"].engine.prompts[-1]
    assert prompt.endswith("<think></think>") and "tool_declare" not in prompt
    # not in reasoning, tools off: the forced answer is all content, markers included
    assert choice.message.content == TOOL_CALL_ANSWER and choice.finish_reason == "stop"
    assert choice.message.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "weather"}], "tool_choice": "required", "tools": [WEATHER_TOOL]},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "weather"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "weather"}], "chat_template_kwargs": {"tools": 1}},
     "chat_template_kwargs"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, field):
    r = post(server, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_body_nested_too_deeply_is_400(server):
    """JSON nested past the decoder's recursion limit (untrusted input) is a bad request, not a server error."""
    depth = 100_000
    body = b'{"model": "%s", "messages": ' % MODEL.encode() + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(server["base"] + "/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
