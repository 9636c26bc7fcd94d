"""Kimi-K2.5's TypeScript tool declaration (`tools_ts_str`): the encoder on schemas that each exercise one rule of
the format, against declarations written out by hand from Moonshot's tool_declaration_ts.py (two of them are
also SGLang's recorded outputs); the K2.5 template through the server's request path declares tools in
TypeScript while a template without `tools_ts_str` keeps JSON; schemas the format does not cover fall back to
JSON; schemas that are not JSON Schema are a 400 naming `tools`."""

import json
import re

import httpx
import pytest

from jaxspec.serving.background import BackgroundServer
from jaxspec.serving.kimi_tool_declaration import (MAX_SCHEMA_DEPTH, InvalidToolSchema, UnsupportedToolSchema,
                                                   tools_declaration)
from jaxspec.tokenizer import load_tokenizer, sorted_keys
from tests.forced_engine import forced_service
from tests.kimi_chat_templates import KIMI_K2_THINKING, KIMI_K25
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer

HEAD = "# Tools\n\n## functions\nnamespace functions {\n"
TAIL = "\n}\n"


def declare(name, parameters=None, description=None):
    fn = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def obj(properties, required=(), **extra):
    return {"type": "object", "properties": properties, "required": list(required), **extra}


CASES = {
    # SGLang's recorded outputs (its Rust port's tests): nested objects, `?` on optional members, integer as number
    "nested object": (
        [declare("create_user", obj({"user": obj({"name": {"type": "string"}, "age": {"type": "integer"}},
                                                 ["name"])}, ["user"]), "Create a new user record.")],
        "// Create a new user record.\n"
        "type create_user = (_: {\n"
        "  user: {\n"
        "    name: string,\n"
        "    age?: number\n"
        "  }\n"
        "}) => any;"),
    "enum as a union of literals": (
        [declare("set_status", obj({"status": {"enum": ["active", "paused", "done"]}}, ["status"]))],
        'type set_status = (_: {\n  status: "active" | "paused" | "done"\n}) => any;'),
    # required members first, then optional ones, each sorted by name; descriptions (a blank line stays blank),
    # the shown constraints sorted (format / exclusiveMaximum are not shown), defaults as JSON or Python numbers
    "members, comments, constraints, defaults": (
        [declare("search", obj({
            "query": {"type": "string", "description": "What to look for", "minLength": 1, "maxLength": 200,
                      "format": "text"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10, "exclusiveMaximum": 99},
            "engine": {"type": "string", "pattern": "^[a-z]+$"},
            "safe": {"type": "boolean", "default": True},
            "lang": {"type": "string", "default": "en"},
            "ratio": {"type": "number", "default": 0.5},
            "filters": {"type": "object", "default": {"site": "é"}},
            "hint": {"type": "string", "default": None},
        }, ["query", "engine"]), "Search the web.\n\nReturns links.")],
        "// Search the web.\n"
        "\n"
        "// Returns links.\n"
        "type search = (_: {\n"
        "  // pattern: ^[a-z]+$\n"
        "  engine: string,\n"
        "  // What to look for\n"
        "  // maxLength: 200, minLength: 1\n"
        "  query: string,\n"
        '  // Default: {"site": "é"}\n'
        "  filters?: {},\n"
        "  hint?: string,\n"
        '  // Default: "en"\n'
        "  lang?: string,\n"
        "  // maximum: 50, minimum: 1\n"
        "  // Default: 10\n"
        "  limit?: number,\n"
        "  // Default: 0.5\n"
        "  ratio?: number,\n"
        "  // Default: True\n"
        "  safe?: boolean\n"
        "}) => any;"),
    # Array<T> inline; an item with comments opens the brackets; no items: Array<any>; additionalProperties
    "arrays and additional properties": (
        [declare("plan", obj({
            "steps": {"type": "array", "minItems": 1, "maxItems": 9,
                      "items": obj({"title": {"type": "string"}, "hours": {"type": "number"}}, ["title"])},
            "tags": {"type": "array", "items": {"type": "string", "description": "one tag", "maxLength": 20}},
            "anything": {"type": "array"},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
            "open": {"type": "object", "additionalProperties": True},
        }, ["steps"]))],
        "type plan = (_: {\n"
        "  // maxItems: 9, minItems: 1\n"
        "  steps: Array<{\n"
        "    title: string,\n"
        "    hours?: number\n"
        "  }>,\n"
        "  anything?: Array<any>,\n"
        "  closed?: {\n"
        "    a?: string,\n"
        "    [k: string]: never\n"
        "  },\n"
        "  extra?: {\n"
        "    [k: string]: number\n"
        "  },\n"
        "  open?: {\n"
        "    [k: string]: any\n"
        "  },\n"
        "  tags?: Array<\n"
        "    // one tag\n"
        "    // maxLength: 20\n"
        "    string\n"
        "  >\n"
        "}) => any;"),
    # enums of other values as Python writes them, anyOf members, a type list, boolean schemas and {}
    "unions": (
        [declare("configure", obj({
            "mode": {"type": "string", "enum": ["fast", "slow"], "description": "How"},
            "level": {"type": ["null", "number"], "enum": [1, 2.5, None]},
            "flag": {"enum": [True, False]},
            "value": {"anyOf": [{"type": "string"}, obj({"x": {"type": "number"}}, ["x"]), {"type": "null"}]},
            "loose": {"type": ["string", "integer", "array", "object"], "description": "Anything simple"},
            "yes": True,
            "no": False,
            "empty": {},
            "date": {"type": "date"},
        }, ["mode", "level", "flag", "value"]))],
        "type configure = (_: {\n"
        "  flag: True | False,\n"
        "  level: 1 | 2.5 | None,\n"
        "  // How\n"
        '  mode: "fast" | "slow",\n'
        "  value: string | {\n"
        "    x: number\n"
        "  } | null,\n"
        "  date?: date,\n"
        "  empty?: any,\n"
        "  // Anything simple\n"
        "  loose?: string | number | Array<any> | {},\n"
        "  no?: null,\n"
        "  yes?: any\n"
        "}) => any;"),
    # $defs become interfaces (in their order, with their description) before the function's type; $ref is the name
    "definitions": (
        [declare("order", {
            "type": "object",
            "$defs": {"Size": {"enum": ["S", "M"]},
                      "Item": obj({"sku": {"type": "string"}, "qty": {"type": "integer"}}, ["sku"],
                                  description="A line item")},
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                           "size": {"$ref": "#/$defs/Size", "description": "Shirt size"}},
            "required": ["items"]}, "Place an order.")],
        'interface Size "S" | "M"\n'
        "// A line item\n"
        "interface Item {\n"
        "  sku: string,\n"
        "  qty?: number\n"
        "}\n"
        "// Place an order.\n"
        "type order = (_: {\n"
        "  items: Array<Item>,\n"
        "  // Shirt size\n"
        "  size?: Size\n"
        "}) => any;"),
    # `$ref: "#"`: the parameters become `interface parameters`, members in their given order (not required-first)
    "self reference": (
        [declare("tree", obj({"children": {"type": "array", "items": {"$ref": "#"}}, "value": {"type": "string"}},
                             ["value"]))],
        "interface parameters {\n"
        "  children?: Array<parameters>,\n"
        "  value: string\n"
        "}\n"
        "type tree = (_: parameters) => any;"),
    # several functions one after the other; no parameters, or no members: {}
    "several functions": (
        [declare("now"), declare("ping", obj({}), "Ping.")],
        "type now = (_: {}) => any;\n"
        "// Ping.\n"
        "type ping = (_: {}) => any;"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_declaration_is_the_reference_text(name):
    tools, body = CASES[name]
    assert tools_declaration(tools) == HEAD + body + TAIL


def test_no_functions_no_declaration():
    assert tools_declaration([]) == ""
    assert tools_declaration([{"type": "retrieval"}]) == ""  # other tool types are skipped, as the reference does


def prop(schema):
    return [declare("f", obj({"p": schema}))]


UNSUPPORTED = {  # valid JSON Schema the reference does not encode (tokenization_kimi.py then leaves JSON)
    "only a description": prop({"description": "free form"}),
    "oneOf without a type": prop({"oneOf": [{"type": "string"}, {"type": "integer"}]}),
    "#/definitions ref": [declare("f", {"type": "object", "definitions": {"A": {"type": "string"}},
                                        "properties": {"p": {"$ref": "#/definitions/A"}}})],
    "unknown definition": prop({"$ref": "#/$defs/Missing"}),
    "enum value against its type": prop({"type": "string", "enum": ["a", 1]}),
    "enum with two types": prop({"type": ["string", "integer"], "enum": ["a", 1]}),
    "type list with an unknown type": prop({"type": ["string", "date"]}),
    "tuple items": prop({"type": "array", "items": [{"type": "string"}]}),
    "boolean definition": [declare("f", {"type": "object", "$defs": {"B": True}, "properties": {}})],
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_schemas_beyond_the_format_are_unsupported(name):
    with pytest.raises(UnsupportedToolSchema):
        tools_declaration(UNSUPPORTED[name])


def nested(depth):
    s = {"type": "string"}
    for _ in range(depth):
        s = obj({"p": s})
    return s


INVALID = {  # not JSON Schema where the encoder reads it: refused, with where
    "a string as a schema": (prop("string"), "tools[0].function.parameters.properties.p"),
    "properties a list": (prop({"type": "object", "properties": [{"type": "string"}]}), ".properties.p.properties"),
    "required a string": (prop({"type": "object", "properties": {"city": {"type": "string"}}, "required": "city"}),
                          ".properties.p.required"),
    "enum a string": (prop({"enum": "abc"}), ".properties.p.enum"),
    "type a number": (prop({"type": 5}), ".properties.p.type"),
    "anyOf an object": (prop({"anyOf": {"type": "string"}}), ".properties.p.anyOf"),
    "description a number": (prop({"type": "string", "description": 5}), ".properties.p.description"),
    "$ref a number": (prop({"$ref": 5}), ".properties.p.$ref"),
    "additionalProperties a string": (prop({"type": "object", "additionalProperties": "yes"}),
                                      ".properties.p.additionalProperties"),
    "$defs a list": ([declare("f", {"type": "object", "$defs": [], "properties": {}})], ".parameters.$defs"),
    "nested too deep": ([declare("f", nested(MAX_SCHEMA_DEPTH + 1))], "nested deeper"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_schemas_that_are_not_json_schema_are_invalid(name):
    tools, where = INVALID[name]
    with pytest.raises(InvalidToolSchema, match=re.escape(where)):
        tools_declaration(tools)


def test_nesting_up_to_the_limit_is_declared():
    text = tools_declaration([declare("f", nested(MAX_SCHEMA_DEPTH))])  # the parameters, then 64 levels below
    assert text.count("p?: {") == MAX_SCHEMA_DEPTH - 1 and text.count("p?: string") == 1


# --- through the server ---------------------------------------------------------------------------------------
WEATHER = declare("get_weather", {"properties": {"unit": {"enum": ["C", "F"]}, "city": {"type": "string"}},
                                  "type": "object", "required": ["city"]}, "Weather in a city")
WEATHER_TS = (HEAD + "// Weather in a city\ntype get_weather = (_: {\n  city: string,\n"
              '  unit?: "C" | "F"\n}) => any;' + TAIL)


@pytest.fixture(scope="module", params=["kimi-k2.5", "kimi-k2-thinking"])
def server(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_kimi_tokenizer(d, {"kimi-k2.5": KIMI_K25, "kimi-k2-thinking": KIMI_K2_THINKING}[request.param])
    tok = load_tokenizer(d)
    service = forced_service(tok, lambda prompt: "Done.</think>ok", (tok.special_tokens["<|im_end|>"],))
    with BackgroundServer(service) as background:
        yield dict(name=request.param, service=service, base=background.base_url)


def chat(server, tools, **kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw}
    return httpx.post(server["base"] + "/chat/completions", json=body, timeout=60)


def declared(server) -> str:
    prompt = server["service"].engine.prompts[-1]
    return prompt.split("<|im_system|>tool_declare<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]


def test_the_request_path_declares_tools_as_the_template_asks(server):
    r = chat(server, [WEATHER])
    assert r.status_code == 200, r.text
    if server["name"] == "kimi-k2.5":  # the template reads tools_ts_str: TypeScript
        assert declared(server) == WEATHER_TS
    else:  # no tools_ts_str in the template: JSON as before, the tools as given (keys unsorted)
        assert declared(server) == json.dumps([WEATHER], ensure_ascii=False)


def test_unsupported_schema_falls_back_to_sorted_json(server):
    tools = [declare("note", {"type": "object", "properties": {"text": {"description": "free form"}}})]
    r = chat(server, tools)
    assert r.status_code == 200, r.text
    if server["name"] == "kimi-k2.5":  # as tokenization_kimi.py: its JSON branch, the tools' keys sorted
        assert declared(server) == json.dumps(sorted_keys(tools), ensure_ascii=False, separators=(",", ":"))
        assert declared(server).startswith('[{"function":{"name":"note"')
    else:
        assert declared(server) == json.dumps(tools, ensure_ascii=False)


def test_a_request_cannot_set_the_declaration(server):
    r = chat(server, [WEATHER], chat_template_kwargs={"tools_ts_str": "type rm = () => any;"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


@pytest.mark.parametrize("name", ["a string as a schema", "required a string", "type a number", "nested too deep"])
def test_malformed_schema_is_400_naming_tools(server, name):
    tools, _ = INVALID[name]
    r = chat(server, tools)
    if server["name"] == "kimi-k2.5":
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools" and "tools[0].function" in error["message"]
    else:  # a template that declares JSON does not read the schemas: unchanged
        assert r.status_code == 200, r.text
