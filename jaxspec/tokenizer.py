"""Tokenizers a checkpoint may carry: Kimi's tiktoken.model (+ tokenizer_config.json special tokens) or a
HF tokenizers `tokenizer.json`; chat templates rendered with jinja2; UTF-8-safe streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

from convert.json_input import parse_json
from jaxspec.serving.kimi_tool_declaration import InvalidToolSchema, UnsupportedToolSchema, tools_declaration

# Kimi K2's pre-tokenizer split pattern (tokenization_kimi.py): Han runs, cased words, 1-3 digit numbers,
# punctuation runs, newlines, spaces.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL = 256
# where a checkpoint keeps its chat template, in the order they are read (then tokenizer_config.json's entry)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# the variable Kimi-K2.5's tokenizer code fills with the tools as TypeScript (kimi_tool_declaration.py) for its
# template, which declares `tools | tojson` only when it is unset
TOOLS_TS_VARIABLE = "tools_ts_str"


class TokenizerError(ValueError):
    pass


def _token_content(tok) -> str:
    return tok["content"] if isinstance(tok, dict) else str(tok)


class Tokenizer:
    """encode / decode / chat template over one of the two backends."""

    def __init__(self, encode, decode, specials: dict[str, int], config: dict, chat_template: str | None, name: str,
                 chat_template_origin: str | None = None):
        self._encode, self._decode = encode, decode
        self.special_tokens = specials
        self.config = config
        self.chat_template = chat_template
        self.chat_template_origin = chat_template_origin or name  # the file (and key) the template was read from
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))

    def token_id(self, name_key: str) -> int | None:
        """Id of the token named by tokenizer_config.json's `bos_token` / `eos_token` / ... ."""
        tok = self.config.get(name_key)
        if tok is None:
            return None
        return self.special_tokens.get(_token_content(tok))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            **template_kwargs) -> str:
        """Render as transformers' apply_chat_template does (same jinja settings, `tools` passed as given or None,
        extra keyword arguments as template variables: Kimi-K2.5's `thinking`).

        A template that reads `tools_ts_str` (Kimi-K2.5's) is rendered as its tokenizer code renders it: the tools
        with every object's keys sorted, and `tools_ts_str` their TypeScript declaration, left unset where the
        declaration does not cover a schema (the template then writes JSON). A tool schema that is not JSON
        Schema raises kimi_tool_declaration.InvalidToolSchema."""
        if not self.chat_template:
            where = Path(self.name).parent
            raise TokenizerError(f"{where}: the checkpoint has no chat template (looked for {CHAT_TEMPLATE_FILES[0]}, "
                                 f"{CHAT_TEMPLATE_FILES[1]} and 'chat_template' in tokenizer_config.json)")
        # transformers' environment: trim/lstrip blocks and loop controls (Kimi's templates `break`)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                          extensions=[jinja2.ext.loopcontrols])

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' filter: no HTML escaping, and the separators Kimi-K2.5's tool declaration asks for
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        specials = {k: _token_content(self.config[k]) for k in ("bos_token", "eos_token") if self.config.get(k)}
        try:
            parsed = env.parse(self.chat_template)
            if tools and TOOLS_TS_VARIABLE in jinja2.meta.find_undeclared_variables(parsed):
                tools, template_kwargs = _with_typescript_tools(tools, template_kwargs)
            return env.from_string(parsed).render(
                **{**specials, **template_kwargs}, messages=messages, tools=tools,
                add_generation_prompt=add_generation_prompt)
        except InvalidToolSchema:
            raise  # the request's fault, not the template's
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{self.chat_template_origin}: chat template has a syntax error at line {e.lineno}: "
                                 f"{e.message}") from None
        except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError,
                RecursionError, MemoryError) as e:
            if isinstance(e, TokenizerError):
                raise
            # a template is data from the checkpoint: its failures (sandbox refusals, range(10**9), bad operands)
            # are the checkpoint's, reported in one line
            msg = str(e).splitlines()[0] if str(e) else ""
            raise TokenizerError(f"{self.chat_template_origin}: chat template failed ({type(e).__name__}: {msg})"[:400]) from None


def _with_typescript_tools(tools: list[dict], template_kwargs: dict) -> tuple[list[dict], dict]:
    """(tools, template variables) as Kimi-K2.5's tokenization_kimi.py passes them to its template."""
    try:
        tools = sorted_keys(tools)
    except RecursionError:
        raise InvalidToolSchema("'tools' are nested too deeply") from None
    try:
        return tools, {**template_kwargs, TOOLS_TS_VARIABLE: tools_declaration(tools)}
    except UnsupportedToolSchema:
        return tools, template_kwargs  # as the reference: no declaration, the template's JSON branch


def sorted_keys(value):
    """`value` with every object's keys in sorted order, as Kimi's tokenization_kimi.py hands tools to its
    template (the same tools in any key order then render the same prompt; `$defs` are declared in this order)."""
    if isinstance(value, dict):
        return {k: sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


def _read_json(path: Path) -> dict:
    try:
        doc = parse_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path}: must be a JSON object, not {type(doc).__name__}")
    return doc


def _chat_template(directory: Path, config: dict) -> tuple[str | None, str]:
    """(template, where it came from)."""
    for name in CHAT_TEMPLATE_FILES:
        p = directory / name
        if p.exists():
            if p.suffix == ".json":
                tpl, where = _read_json(p).get("chat_template"), f"{p}: 'chat_template'"
            else:
                try:
                    tpl, where = p.read_text(encoding="utf-8"), str(p)
                except UnicodeDecodeError as e:
                    raise TokenizerError(f"{p}: not valid UTF-8 ({e})") from None
            break
    else:
        tpl, where = config.get("chat_template"), f"{directory / 'tokenizer_config.json'}: 'chat_template'"
        if isinstance(tpl, list):  # named templates: take "default"
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if tpl is not None and not isinstance(tpl, str):
        raise TokenizerError(f"{where} must be a string, got {type(tpl).__name__}")
    return tpl, where


def load_tiktoken_tokenizer(directory: Path) -> Tokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    model_file = directory / "tiktoken.model"
    try:
        ranks = load_tiktoken_bpe(str(model_file))
    except Exception as e:  # noqa: BLE001 - tiktoken raises bare ValueErrors / binascii errors
        raise TokenizerError(f"{model_file}: not a tiktoken BPE file ({e})") from None
    config = _read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").exists() else {}
    named = {int(i): _token_content(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    template, origin = _chat_template(directory, config)
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_NUM_RESERVED_SPECIAL + 2)}
    enc = tiktoken.Encoding(name=str(model_file), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(
        encode=lambda text: enc.encode(text, allowed_special="all"),
        decode=enc.decode,
        specials=specials,
        config=config,
        chat_template=template,
        chat_template_origin=origin,
        name=str(model_file),
    )


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        raise TokenizerError(f"{path}: not a tokenizers file ({e})") from None
    config = _read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").exists() else {}
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    template, origin = _chat_template(directory, config)
    return Tokenizer(
        encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        specials=specials,
        config=config,
        chat_template=template,
        chat_template_origin=origin,
        name=str(path),
    )


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer stored beside a checkpoint: tiktoken.model first (Kimi), else tokenizer.json."""
    directory = Path(directory)
    for candidate in (directory, directory.parent):
        if (candidate / "tiktoken.model").exists():
            return load_tiktoken_tokenizer(candidate)
        if (candidate / "tokenizer.json").exists():
            return load_hf_tokenizer(candidate)
    raise TokenizerError(f"{directory}: no tokenizer (tiktoken.model or tokenizer.json) in it or its parent")


class StreamDecoder:
    """Turn a growing token list into text increments that never split a UTF-8 character.

    Each push decodes only the tokens after the last emitted piece, with that piece's tokens before them as context
    (a tokenizer may render a token by its neighbour, as sentencepiece drops the leading space of a decode's first
    token): a generation of n tokens costs O(n) decoding, where decoding the whole list at every push cost O(n^2),
    seconds of the server's event loop for each answer of thousands of tokens. A piece is emitted once its text
    ends on a whole character (an incomplete multi-byte character decodes to U+FFFD at the end: it waits for its next
    token)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.context = 0  # first token decoded with the next piece: the last emitted piece's
        self.read = 0  # tokens whose text is emitted
        self.emitted = 0  # characters emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The rest of the text, an incomplete last character included (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        head = self.tokenizer.decode(self.ids[self.context:self.read])
        text = self.tokenizer.decode(self.ids[self.context:])
        if text.startswith(head):
            if not final and (len(text) <= len(head) or text.endswith("\ufffd")):
                return ""
            out = text[len(head):]
        else:  # a decoder whose output is no prefix of a longer decode's: the whole text
            whole = self.tokenizer.decode(self.ids)
            stable = len(whole) if final else len(whole.rstrip("\ufffd"))
            out = whole[self.emitted:stable] if stable > self.emitted else ""
        self.context, self.read = self.read, len(self.ids)
        self.emitted += len(out)
        return out

    def mark(self) -> tuple[int, int, int, int]:
        """Where the decoder stands, for `rewind`."""
        return len(self.ids), self.context, self.read, self.emitted

    def rewind(self, mark: tuple[int, int, int, int]) -> None:
        """Back to `mark`, forgetting the tokens pushed since (a caller that pushes them again one at a time)."""
        n, self.context, self.read, self.emitted = mark
        del self.ids[n:]
