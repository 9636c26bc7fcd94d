"""Kimi-K2.5's tool declaration: a request's OpenAI `tools` written as a TypeScript namespace, the text its chat
template shows the model as `tools_ts_str` (the format the model was trained on; the template's `tools | tojson`
branch is only its fallback).

The format, as Moonshot's `tool_declaration_ts.py` (shipped with the K2.5 checkpoint, called from its
tokenization_kimi.py) writes it; this is our own implementation of that output:

    # Tools

    ## functions
    namespace functions {
    // the function's description, one `// ` line per line
    type NAME = (_: {
      // a parameter's description
      // maxLength: 8, pattern: ^a        <- the type's constraints, sorted by name
      // Default: "x"                     <- `default`, JSON (numbers and booleans as Python writes them)
      required_param: string,
      optional_param?: number
    }) => any;
    }

- Object members: required ones first, then optional ones, each group sorted by name; `additionalProperties`
  adds `[k: string]: T` (true: any, false: never, a schema: its type); an object without members is `{}`.
- Scalars: `integer` is written `number`; any other type name is written as given. Constraints shown: strings'
  maxLength / minLength / pattern, numbers' maximum / minimum, arrays' maxItems / minItems; no others.
- `Array<T>`; an item with a description or constraints gets them as comments inside `Array<\\n ... \\n>`; an array
  without `items` is `Array<any>`.
- `enum`: the values joined by ` | `, strings in double quotes (not escaped), others as Python writes them
  (`True`, `None`). A `type` beside `enum` is checked against the values.
- `anyOf`: the members joined by ` | `. A `type` list: `string | number | boolean | null | {} | Array<any>`.
  `oneOf` and `allOf` are not read: beside a `type` they are ignored, alone the schema is unsupported (below).
- `$ref`: `#/$defs/NAME` is written `NAME` and every `$defs` entry (registered by the object schemas that carry
  them) becomes `interface NAME {...}` before the function's type; `#` (the parameters themselves) makes the
  parameters `interface parameters {...}` (members in their given order) and the type `(_: parameters)`.
  `definitions` / `#/definitions/...` are not read.
- A schema `true` or `{}` is `any`, `false` is `null`.

What the reference gives up on, so tokenization_kimi.py leaves `tools_ts_str` unset and the template writes JSON:
schemas without `type`, `enum`, `anyOf` or `$ref` (e.g. only a description, or `oneOf`), other `$ref` forms or
unknown names, enum values that contradict their `type`, a `type` list naming an unknown type, tuple `items`.
These raise UnsupportedToolSchema. Input that is not JSON Schema where the encoder reads it (a schema that is
neither an object nor a boolean; `properties` / `$defs` not objects; `required`, `enum`, `anyOf` not lists;
`type` neither a string nor a list of strings; a non-string `description` or `$ref`; nesting deeper than
MAX_SCHEMA_DEPTH) raises InvalidToolSchema: the reference either crashes there (and falls back to JSON) or writes
garbage (`required: "ab"` read letter by letter), and the request is refused instead.

Not pinned down: the checkpoint's own copy of the encoder was not reachable from here; this follows a public copy
of it (kept in another project, "copied from kimi-k2.5-hf-tokenizer") and the peers that port it (SGLang's
Rust renderer and its recorded outputs, tinker-cookbook's K2.5 renderer). Enum values and constraints that are
JSON arrays or objects are written as Python writes them, which is what the reference does but was not seen in
any recorded output.
"""

from __future__ import annotations

import dataclasses
import json

INDENT = "  "
MEMBER_SEPARATOR = ",\n"
MAX_SCHEMA_DEPTH = 64  # deeper nesting is refused rather than recursed into (untrusted input)
SHOWN_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                     "integer": ("maximum", "minimum")}
ARRAY_CONSTRAINTS = ("maxItems", "minItems")
TYPE_LIST_MEMBERS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                     "null": "null", "object": "{}", "array": "Array<any>"}
ENUM_VALUE_KINDS = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}
SELF_INTERFACE = "parameters"  # the name `$ref: "#"` gives the parameters object
DEFS_PREFIX = "#/$defs/"


class InvalidToolSchema(ValueError):
    """A tool's schema is not JSON Schema where the declaration reads it: the request is refused (400, `tools`)."""


class UnsupportedToolSchema(ValueError):
    """Valid JSON Schema the declaration format does not cover: Kimi's tokenizer then sets no `tools_ts_str` and
    the template declares the tools as JSON."""


# --- the schema, parsed ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Node:
    description: str
    constraints: dict

    def comments(self, indent: str) -> str:
        """The comment lines written above a member of this type (each ending in a newline)."""
        out = ""
        if self.description:
            out += _comment(self.description, indent) + "\n"
        if self.constraints:
            out += indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())) + "\n"
        return out


@dataclasses.dataclass
class _Scalar(_Node):
    name: str

    def render(self, indent: str) -> str:
        return "number" if self.name == "integer" else self.name


@dataclasses.dataclass
class _Member:
    name: str
    type: _Node
    optional: bool
    default: object  # None: no default (a JSON null default is not shown either)

    def render(self, indent: str) -> str:
        out = self.type.comments(indent)
        if self.default is not None:
            shown = (repr(self.default) if isinstance(self.default, (int, float, bool))
                     else json.dumps(self.default, ensure_ascii=False))
            out += f"{indent}// Default: {shown}\n"
        return out + f"{indent}{self.name}{'?' if self.optional else ''}: {self.type.render(indent)}"


@dataclasses.dataclass
class _Object(_Node):
    members: list  # of _Member, in the schema's order
    additional: object  # None (absent), True, False or a _Node

    def render(self, indent: str) -> str:
        inner = indent + INDENT
        ordered = (sorted((m for m in self.members if not m.optional), key=lambda m: m.name)
                   + sorted((m for m in self.members if m.optional), key=lambda m: m.name))
        lines = [m.render(inner) for m in ordered]
        if self.additional is not None:
            value = {True: "any", False: "never"}.get(self.additional) if isinstance(self.additional, bool) \
                else self.additional.render(inner)
            lines.append(f"{inner}[k: string]: {value}")
        if not lines:
            return "{}"
        return "{\n" + MEMBER_SEPARATOR.join(lines) + "\n" + indent + "}"


@dataclasses.dataclass
class _Array(_Node):
    item: _Node

    def render(self, indent: str) -> str:
        comments = self.item.comments(indent + INDENT)
        if not comments:
            return f"Array<{self.item.render(indent)}>"
        return f"Array<\n{comments}{indent + INDENT}{self.item.render(indent + INDENT)}\n{indent}>"


@dataclasses.dataclass
class _Enum(_Node):
    values: list

    def render(self, indent: str) -> str:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)


@dataclasses.dataclass
class _Union(_Node):
    members: list  # _Node (anyOf) or written type names (a `type` list)

    def render(self, indent: str) -> str:
        return " | ".join(m if isinstance(m, str) else m.render(indent) for m in self.members)


@dataclasses.dataclass
class _Ref(_Node):
    name: str

    def render(self, indent: str) -> str:
        return self.name


def _comment(text: str, indent: str) -> str:
    # blank lines stay blank (no indent, no `//`), as the reference writes them
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


# --- parsing --------------------------------------------------------------------------------------------------

class _Parser:
    """One function's schemas: `$defs` registered in the order the object schemas carrying them are read (a
    `$ref` resolves only to a definition registered before it), and whether `#` was referenced."""

    def __init__(self):
        self.definitions: dict[str, object] = {}
        self.self_referenced = False

    def schema(self, s, where: str, depth: int) -> _Node:
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidToolSchema(f"'{where}': schemas nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(s, bool):
            return _Scalar("", {}, "any" if s else "null")
        if not isinstance(s, dict):
            raise InvalidToolSchema(f"'{where}' must be a JSON Schema (an object or a boolean), "
                                    f"got {type(s).__name__}")
        description = s.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidToolSchema(f"'{where}.description' must be a string, got {type(description).__name__}")
        description = description or ""
        # the reference's precedence: $ref, anyOf, enum, type
        if "$ref" in s:
            return _Ref(description, {}, self.reference(s["$ref"], f"{where}.$ref"))
        if "anyOf" in s:
            members = s["anyOf"]
            if not isinstance(members, list):
                raise InvalidToolSchema(f"'{where}.anyOf' must be a list of schemas")
            return _Union(description, {}, [self.schema(m, f"{where}.anyOf[{i}]", depth + 1)
                                            for i, m in enumerate(members)])
        if "enum" in s:
            return self.enum(s, description, where)
        if "type" in s:
            kind = _type(s["type"], f"{where}.type")
            if isinstance(kind, list):
                unknown = [k for k in kind if k not in TYPE_LIST_MEMBERS]
                if unknown:
                    raise UnsupportedToolSchema(f"'{where}.type' lists {unknown[0]!r}, which a type list cannot name")
                return _Union(description, {}, [TYPE_LIST_MEMBERS[k] for k in kind])
            if kind == "object":
                return self.object(s, where, depth)
            if kind == "array":
                return self.array(s, description, where, depth)
            shown = SHOWN_CONSTRAINTS.get(kind, ())
            return _Scalar(description, {k: v for k, v in s.items() if k in shown}, kind)
        if not s:
            return _Scalar("", {}, "any")
        raise UnsupportedToolSchema(f"'{where}' has none of type, enum, anyOf, $ref")

    def reference(self, ref, where: str) -> str:
        if not isinstance(ref, str):
            raise InvalidToolSchema(f"'{where}' must be a string, got {type(ref).__name__}")
        if ref == "#":
            self.self_referenced = True
            return SELF_INTERFACE
        if not ref.startswith(DEFS_PREFIX):
            raise UnsupportedToolSchema(f"'{where}' {ref[:100]!r}: only '#' and '{DEFS_PREFIX}NAME' are read")
        name = ref.split("/")[-1]
        if name not in self.definitions:
            raise UnsupportedToolSchema(f"'{where}' {ref[:100]!r}: no such definition (before this point)")
        return name

    def enum(self, s: dict, description: str, where: str) -> _Enum:
        values = s["enum"]
        if not isinstance(values, list):
            raise InvalidToolSchema(f"'{where}.enum' must be a list")
        if "type" in s:
            kind = _type(s["type"], f"{where}.type")
            if isinstance(kind, list):  # one type, or one type and null (the first that is not null)
                if not (len(kind) == 1 or len(kind) == 2 and "null" in kind):
                    raise UnsupportedToolSchema(f"'{where}.type' {kind}: an enum takes one type (or it and null)")
                kind = kind[1] if kind[0] == "null" and len(kind) == 2 else kind[0]
            wanted = ENUM_VALUE_KINDS.get(kind)
            wrong = [v for v in values if v is not None and wanted and not isinstance(v, wanted)]
            if wrong:
                raise UnsupportedToolSchema(f"'{where}.enum' value {wrong[0]!r} is not of its type {kind!r}")
        return _Enum(description, {}, values)

    def object(self, s: dict, where: str, depth: int) -> _Object:
        description = s.get("description") or ""
        if not isinstance(description, str):
            raise InvalidToolSchema(f"'{where}.description' must be a string, got {type(description).__name__}")
        definitions = s.get("$defs")
        if definitions is not None and not isinstance(definitions, dict):
            raise InvalidToolSchema(f"'{where}.$defs' must be an object of schemas")
        self.definitions.update(definitions or {})
        additional = s.get("additionalProperties")
        if isinstance(additional, dict):
            additional = self.schema(additional, f"{where}.additionalProperties", depth + 1)
        elif additional is not None and not isinstance(additional, bool):
            raise InvalidToolSchema(f"'{where}.additionalProperties' must be a schema (an object or a boolean)")
        members = []
        if "properties" in s:
            properties, required = s["properties"], s.get("required", [])
            if not isinstance(properties, dict):
                raise InvalidToolSchema(f"'{where}.properties' must be an object of schemas")
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise InvalidToolSchema(f"'{where}.required' must be a list of property names")
            for name, prop in properties.items():
                node = self.schema(prop, f"{where}.properties.{name}", depth + 1)
                default = prop.get("default") if isinstance(prop, dict) else None
                members.append(_Member(name, node, name not in required, default))
        return _Object(description, {}, members, additional)

    def array(self, s: dict, description: str, where: str, depth: int) -> _Array:
        items = s.get("items")
        if not items:  # absent, {}, false, ...: the reference writes Array<any>
            item = _Scalar("", {}, "any")
        elif isinstance(items, list):
            raise UnsupportedToolSchema(f"'{where}.items' is a list (tuple validation)")
        else:
            item = self.schema(items, f"{where}.items", depth + 1)
        return _Array(description, {k: v for k, v in s.items() if k in ARRAY_CONSTRAINTS}, item)


def _type(kind, where: str):
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return kind
    raise InvalidToolSchema(f"'{where}' must be a type name or a list of them")


# --- the declaration ------------------------------------------------------------------------------------------

def function_declaration(function: dict, where: str = "function") -> str:
    """One function: its `$defs` interfaces, its description as comments, `type NAME = (_: PARAMS) => any;`."""
    parser = _Parser()
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidToolSchema(f"'{where}.parameters' must be a JSON Schema object")
    # the parameters are read as an object whatever their `type` says
    root = parser.object(parameters, f"{where}.parameters", 0) if parameters else _Object("", {}, [], None)
    interfaces = []
    self_interface = parser.self_referenced  # as the reference decides it: before the definitions are read
    if self_interface:
        body = MEMBER_SEPARATOR.join(m.render(INDENT) for m in root.members)
        interfaces.append(f"interface {SELF_INTERFACE} {{" + (f"\n{body}\n" if body else "") + "}")
    # the definitions registered so far; any registered while reading them are resolvable but not declared
    for name, schema in list(parser.definitions.items()):
        at = f"{where}.parameters.$defs.{name}"
        node = parser.schema(schema, at, 1)
        if not isinstance(schema, dict):
            raise UnsupportedToolSchema(f"'{at}' is a boolean schema: an interface needs an object")
        description = f"{_comment(node.description, '')}\n" if node.description else ""
        interfaces.append(f"{description}interface {name} {node.render('')}")
    name = function.get("name", "function")
    params = SELF_INTERFACE if self_interface else root.render("")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidToolSchema(f"'{where}.description' must be a string")
    parts = ["\n".join(interfaces), _comment(description, "") if description else "",
             f"type {name} = (_: {params}) => any;"]
    return "\n".join(p for p in parts if p)


def tools_declaration(tools: list) -> str:
    """The `tools_ts_str` for a request's tools ("" for none). Tools other than functions are skipped, as the
    reference skips them."""
    functions = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise InvalidToolSchema(f"'tools[{i}]' must be an object")
        if tool.get("type") == "function" and tool.get("function"):
            if not isinstance(tool["function"], dict):
                raise InvalidToolSchema(f"'tools[{i}].function' must be an object")
            functions.append(function_declaration(tool["function"], f"tools[{i}].function"))
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
