"""Kimi's chat protocol without a model: the real templates rendered with tools, tool results and thinking on/off
equal transformers' own rendering; the parsers on recorded K2-format outputs, whole and split anywhere; the
request fields' validation."""

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from jaxspec.serving.assistant_output import (ARGUMENTS_NOT_JSON, MARKERS_OUT_OF_ORDER, UNCLOSED_SECTION,
                                              UNKNOWN_FUNCTION, AssistantOutputParser, collect, parse_assistant)
from jaxspec.serving.kimi_tool_declaration import tools_declaration
from jaxspec.serving.protocol import BadRequest, parse_chat
from jaxspec.serving.reasoning import prompt_opens_reasoning
from jaxspec.tokenizer import StreamDecoder, load_tokenizer, sorted_keys
from tests.kimi_chat_templates import TEMPLATES
from tests.kimi_tokenizer_fixture import SPECIAL_OFFSETS, write_kimi_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city (°C)",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi"}],
    "system + history": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
                         {"role": "user", "content": "Weather in Paris?"}],
    "tool round trip": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": CALL["id"], "content": '{"c": 18}'}],
    "two calls, answer, next turn": [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            CALL, {"id": "functions.get_time:1", "type": "function",
                   "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "18"},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"},
        {"role": "assistant", "content": "18 °C at noon.", "reasoning_content": "both back"},
        {"role": "user", "content": "Thanks"}],
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tok(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_kimi_tokenizer(d, TEMPLATES[request.param])
    return load_tokenizer(d)


def transformers_render(tok, messages, tools, **kwargs):
    """transformers' own apply_chat_template rendering (its environment, its message handling); for K2.5's
    template, with the tools as its tokenization_kimi.py hands them over (keys sorted, `tools_ts_str` set)."""
    specials = {"bos_token": "[BOS]", "eos_token": "[EOS]"}
    if tools and "tools_ts_str" in tok.chat_template:
        tools = sorted_keys(tools)
        kwargs = {**kwargs, "tools_ts_str": tools_declaration(tools)}
    out = render_jinja_template([messages], tools=tools, chat_template=tok.chat_template, add_generation_prompt=True,
                                **specials, **kwargs)
    return out[0][0]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"thinking": True}, {"thinking": False}], ids=["default", "on", "off"])
def test_rendering_equals_transformers(tok, name, tools, kwargs):
    body = {"messages": CONVERSATIONS[name], "tools": tools, "chat_template_kwargs": kwargs}
    gen = parse_chat(body)  # what the server renders: the request as the protocol hands it on
    ours = tok.apply_chat_template(gen.prompt, tools=gen.tools, **gen.template_kwargs)
    assert ours == transformers_render(tok, CONVERSATIONS[name], tools, **kwargs)
    if tools and "tools_ts_str" in tok.chat_template:  # K2.5: its TypeScript declaration, not JSON
        assert "type get_weather = (_: {\n  city: string\n}) => any;" in ours and '"name"' not in ours
    elif tools:
        assert '"name":"get_weather"' in ours.replace(": ", ":").replace(", ", ",")
    if "tool round trip" == name:
        assert "## Return of functions.get_weather:0\n" in ours and '{"c": 18}<|im_end|>' in ours
        assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}' in ours


def test_k25_thinking_switch(tmp_path):
    write_kimi_tokenizer(tmp_path, TEMPLATES["kimi-k2.5"])
    tok = load_tokenizer(tmp_path)
    messages = CONVERSATIONS["tool round trip"]
    on, off = (tok.apply_chat_template(messages, thinking=t) for t in (True, False))
    assert on.endswith("<|im_assistant|>assistant<|im_middle|><think>") and prompt_opens_reasoning(on)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>") and not prompt_opens_reasoning(off)
    assert "<think>call it</think>" in on and "<think>call it</think>" not in off  # the turn's own reasoning


def test_markers_are_single_special_tokens(tok):
    text = tok.apply_chat_template(CONVERSATIONS["tool round trip"], tools=TOOLS)
    ids = tok.encode(text)
    base = len(tok.special_tokens) and min(tok.special_tokens.values())
    for offset, name in SPECIAL_OFFSETS.items():
        assert tok.special_tokens[name] == base + offset
    for name in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_system|>", "<|im_middle|>"):
        assert tok.special_tokens[name] in ids, name
    assert tok.decode(ids) == text  # the server decodes specials back to text, so the parser sees the markers


# --- the parsers ----------------------------------------------------------------------------------------------
NAMES = frozenset({"get_weather", "get_time"})
ONE = ("Paris weather needed.</think>Let me check."
       "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
       '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
SEVERAL = ("<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|>"
           '{"city": "Zürich 中文"}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
           "{}<|tool_call_end|>\n<|tool_calls_section_end|>")
RECORDED = {  # output, starts in reasoning, (reasoning, content, [(id, name, arguments)], malformed)
    "one call after thinking": (ONE, True, ("Paris weather needed.", "Let me check.",
                                            [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')], [])),
    "several calls": (SEVERAL, False, ("", "", [("functions.get_weather:0", "get_weather", '{"city": "Zürich 中文"}'),
                                               ("functions.get_time:1", "get_time", "{}")], [])),
    "thinking ended by the section": (
        "<think>need time<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", False,
        ("need time", "", [("functions.get_time:0", "get_time", "{}")], [])),
    "unknown function": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>", False,
        ("", "<|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{}<|tool_call_end|>", [],
         [UNKNOWN_FUNCTION])),
    "arguments not JSON": (
        "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{city: x}"
        "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>", False,
        ("", "ok<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{city: x}<|tool_call_end|>",
         [("functions.get_time:1", "get_time", "{}")], [ARGUMENTS_NOT_JSON])),
    "unclosed section": (
        "a<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Pa', False,
        ("", 'a<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Pa', [],
         [UNCLOSED_SECTION])),
    "markers out of order": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_end|>x"
        "<|tool_calls_section_end|>", False,
        ("", "<|tool_call_begin|>functions.get_time:0<|tool_call_end|>x", [],
         [MARKERS_OUT_OF_ORDER, MARKERS_OUT_OF_ORDER])),
    "no tools in the request: markers are text": (ONE, True, None),
}


def _summary(m):
    return m.reasoning, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.malformed


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parser_on_recorded_outputs_whole_and_split_anywhere(name):
    text, in_reasoning, want = RECORDED[name]
    tools = None if want is None else NAMES
    whole = parse_assistant(text, tools, in_reasoning)
    if want is None:
        reasoning, content = text.split("</think>")
        want = (reasoning, content, [], [])
    assert _summary(whole) == want
    for cut in range(len(text) + 1):  # one boundary anywhere
        p = AssistantOutputParser(tools, in_reasoning)
        assert _summary(collect(p, p.push(text[:cut]) + p.push(text[cut:]) + p.finish())) == want, cut
    p = AssistantOutputParser(tools, in_reasoning)  # every character its own piece
    deltas = [d for ch in text for d in p.push(ch)] + p.finish()
    assert _summary(collect(p, deltas)) == want
    calls = [d for d in deltas if hasattr(d, "argument_pieces")]
    assert [c.arguments for c in calls] == [a for _, _, a in want[2]]
    assert all(len(c.argument_pieces) == len(c.arguments) for c in calls)  # the pieces as they arrived


@pytest.mark.parametrize("name", ["one call after thinking", "several calls", "unclosed section"])
def test_parser_over_the_token_stream(tmp_path, name):
    """Token by token through the server's decoder (multi-byte characters split across tokens: every byte
    boundary the decoder may see): the same result as the whole text."""
    write_kimi_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    text, in_reasoning, want = RECORDED[name]
    ids = tok.encode(text)
    assert len(ids) > text.count("<|")  # markers are one token each, the rest several
    dec, p = StreamDecoder(tok), AssistantOutputParser(NAMES, in_reasoning)
    deltas = [d for i in ids for d in p.push(dec.push([i]))] + p.push(dec.flush()) + p.finish()
    assert _summary(collect(p, deltas)) == want


# --- request validation ---------------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "tools": {"a": 1}}, "tools"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"messages": USER, "tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice"),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": USER, "chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
])
def test_bad_chat_fields_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse_chat(body)
    assert e.value.param == param


def test_tool_choice_none_and_auto():
    auto = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True})
    assert auto.tool_names == NAMES and auto.tools == TOOLS
    none = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert none.tools is None and none.tool_names is None
    assert json.dumps(parse_chat({"messages": USER, "tools": []}).tools) == "null"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_arguments_with_non_json_numbers_return_as_content(constant):
    """Python's json.loads takes NaN and Infinity, but they are not JSON: a client's JSON.parse (JavaScript, Go,
    ...) fails on such arguments, so the call is malformed, not a call to run."""
    raw = (f'<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{{"offset": {constant}}}'
           "<|tool_call_end|>")
    m = parse_assistant(f"<|tool_calls_section_begin|>{raw}<|tool_calls_section_end|>", NAMES)
    assert _summary(m) == ("", raw, [], [ARGUMENTS_NOT_JSON])


@pytest.mark.parametrize("in_reasoning", [False, True], ids=["answer", "after thinking"])
def test_a_think_tag_inside_the_answer_is_text(in_reasoning):
    """`<think>` opens the reasoning only as the model's first words (K2-Thinking writes it itself): an answer that
    mentions the tag keeps it, and the rest of the answer does not vanish into reasoning_content."""
    answer = "Strip everything between <think> and </think> first.<think>"
    text = ("Thought.</think>" if in_reasoning else "") + answer
    want = ("Thought." if in_reasoning else "", answer, [], [])
    assert _summary(parse_assistant(text, NAMES, in_reasoning)) == want
    for cut in range(len(text) + 1):
        p = AssistantOutputParser(NAMES, in_reasoning)
        assert _summary(collect(p, p.push(text[:cut]) + p.push(text[cut:]) + p.finish())) == want, cut
    # the model's own opening, after nothing or whitespace, still opens it
    assert _summary(parse_assistant("\n<think>r</think>a <think>", NAMES)) == ("r", "\na <think>", [], [])
