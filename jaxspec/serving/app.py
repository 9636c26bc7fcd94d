"""The OpenAI-compatible HTTP API (Starlette): /v1/completions, /v1/chat/completions (both streamed as
server-sent events or not), /v1/models, /health, /metrics.

Handlers run on the event loop; the device runs in the scheduler's thread, which hands tokens back through
`loop.call_soon_threadsafe`. Text is decoded per request (UTF-8 safe, special tokens kept as text) and cut at stop
strings here; a stop string or a client that goes away cancels the request, which frees its slot before the next
device step. A chat completion's text is then split into reasoning, content and tool calls (assistant_output.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxspec.serving.assistant_output import AssistantOutputParser, Content, Reasoning, collect
from jaxspec.serving.kimi_tool_calls import ToolCall
from jaxspec.serving.kimi_tool_declaration import InvalidToolSchema
from jaxspec.serving.metrics import Metrics
from jaxspec.serving.protocol import BadRequest, GenerationRequest, parse_chat, parse_completion
from jaxspec.serving.reasoning import prompt_opens_reasoning
from jaxspec.serving.scheduler import Failed, Finished, QueueFull, Request, Scheduler, ShuttingDown, Tokens
from jaxspec.serving.stop import StopMatcher
from jaxspec.tokenizer import StreamDecoder, Tokenizer, TokenizerError

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
# A request body's limit: a chat of a full 256k-token context is a few MB of JSON
MAX_BODY_BYTES = 32 * 2 ** 20
BODY_IDLE_S = 30.0  # the longest a request's body may go without a byte before the request is refused (408)
log = logging.getLogger("jaxspec.serve")


@dataclasses.dataclass
class Service:
    scheduler: Scheduler
    tokenizer: Tokenizer
    metrics: Metrics
    model_name: str
    shutdown_timeout_s: float = 30.0
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # --chat-template-kwargs / --thinking

    @property
    def engine(self):
        return self.scheduler.engine

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids as `python -m jaxspec.generate` makes them (a BOS first where the tokenizer asks for one)."""
        if isinstance(prompt, list):
            vocab = self.engine.cfg.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"'prompt' holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
            return list(prompt)
        ids = self.tokenizer.encode(prompt)
        bos = self.tokenizer.token_id("bos_token")
        if self.tokenizer.config.get("add_bos_token") and bos is not None:
            ids = [bos] + ids
        return ids

    def chat_prompt(self, gen: GenerationRequest) -> tuple[list[int], str]:
        """(token ids, rendered text) of a chat request: the server's template kwargs, the request's over them."""
        if not self.tokenizer.chat_template:
            raise BadRequest(f"the model {self.model_name!r} has no chat template: use /v1/completions, or start the "
                             "server with --chat-template FILE", "messages")
        try:
            text = self.tokenizer.apply_chat_template(gen.prompt, tools=gen.tools,
                                                      **{**self.template_kwargs, **gen.template_kwargs})
        except InvalidToolSchema as e:
            raise BadRequest(str(e), "tools") from None
        except TokenizerError as e:
            raise BadRequest(str(e), "chat_template_kwargs" if gen.template_kwargs else "messages") from None
        return self.encode(text), text


class _Text:
    """A request's tokens -> text increments: UTF-8 safe, EOS left out of the text, cut at stop strings."""

    def __init__(self, service: Service, stops: tuple[str, ...]):
        self.decoder = StreamDecoder(service.tokenizer)
        self.stopper = StopMatcher(stops)
        self.eos = service.scheduler.eos_ids
        self.tokens = 0

    def push(self, ids: list[int]) -> tuple[str, bool]:
        mark = (self.decoder.mark(), self.stopper.held)
        out, stopped = self._push(ids)
        if not stopped or len(ids) == 1:
            self.tokens += len(ids)
            return out, stopped
        # A device step hands over several tokens at once. Where a stop string completes among them, they are
        # pushed again one at a time, so that the text ends at the first token that completes one (as generated
        # token by token, whatever K or the step's length) and usage counts the tokens up to it, not those decoded
        # past it that the client never sees.
        self.decoder.rewind(mark[0])
        self.stopper.held = mark[1]
        pieces = []
        for n, t in enumerate(ids, 1):
            piece, stopped = self._push([t])
            pieces.append(piece)
            if stopped:
                break
        self.tokens += n
        return "".join(pieces), stopped

    def _push(self, ids: list[int]) -> tuple[str, bool]:
        return self.stopper.push(self.decoder.push([t for t in ids if t not in self.eos]))

    def finish(self) -> tuple[str, bool]:
        out, stopped = self.stopper.push(self.decoder.flush())
        return (out, True) if stopped else (out + self.stopper.flush(), False)


class _GenerationFailed(Exception):
    pass


class _EventStream(StreamingResponse):
    """Server-sent events that run `closed()` however the response ends: finished, failed, or the client gone
    (then the response task is cancelled, possibly before the event generator ever started)."""

    def __init__(self, events, closed):
        super().__init__(events, media_type="text/event-stream")
        self.closed = closed

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.closed()


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _not_served(service, model) -> JSONResponse:
    return _error(404, f"model {model!r} is not served here (this server serves {service.model_name!r})",
                  "invalid_request_error", "model")


class BodyTooLarge(Exception):
    pass


class BodyStalled(Exception):
    pass


async def _json_body(request: HTTPRequest):
    """The request's JSON, read up to MAX_BODY_BYTES (a longer body is refused before it is all read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes, over the {MAX_BODY_BYTES} this server takes")
    raw = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:  # a client that stops sending mid-body (a Content-Length it never fills) would hold its connection
            chunk = await asyncio.wait_for(chunks.__anext__(), BODY_IDLE_S)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyStalled(f"no byte of the request body for {BODY_IDLE_S:g} s after {len(raw)} bytes") from None
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the request body is over the {MAX_BODY_BYTES} bytes this server takes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers past Python's digit limit
        raise BadRequest(f"the request body is not valid JSON ({e})"[:400]) from None
    except RecursionError:  # the decoder recurses per nesting level
        raise BadRequest("the request body is nested too deeply") from None


def _submit(service: Service, gen: GenerationRequest, prompt_ids: list[int]):
    engine = service.engine
    room = engine.max_new_tokens(len(prompt_ids))
    if room < 1 or (gen.max_tokens is not None and gen.max_tokens > room):
        asked = gen.max_tokens or 1
        raise BadRequest(f"the prompt's {len(prompt_ids)} tokens + {asked} new tokens (+{engine.k + 1} verify "
                         f"positions) exceed the context of {engine.max_context} tokens", "prompt")
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(event):
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, event)

    request = Request(prompt_ids, gen.max_tokens or room, gen.sampling, gen.seed, deliver)
    service.scheduler.submit(request)
    return request, queue


async def _pieces(service: Service, request: Request, queue: asyncio.Queue, text: _Text):
    """Yield (text increment, finish reason or None) until the request ends."""
    while True:
        event = await queue.get()
        if isinstance(event, Tokens):
            out, stopped = text.push(event.ids)
            if stopped:
                service.scheduler.cancel(request)
                yield out, "stop"
                return
            if out:
                yield out, None
        elif isinstance(event, Finished):
            out, _ = text.finish()
            yield out, event.reason
            return
        else:
            assert isinstance(event, Failed)
            raise _GenerationFailed(event.message)


def _usage(prompt_ids, text: _Text) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": text.tokens,
            "total_tokens": len(prompt_ids) + text.tokens}


def _chat_deltas(deltas) -> list[dict]:
    """Parsed deltas -> OpenAI stream deltas: a tool call as its id and name, then its arguments piece by piece."""
    out = []
    for d in deltas:
        if isinstance(d, Content):
            out.append({"content": d.text})
        elif isinstance(d, Reasoning):
            out.append({"reasoning_content": d.text})
        else:
            assert isinstance(d, ToolCall)
            head = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
            out += [{"tool_calls": [{"index": d.index, "function": {"arguments": p}}]} for p in d.argument_pieces]
    return out


def _chat_reason(reason: str, parser: AssistantOutputParser) -> str:
    return "tool_calls" if reason == "stop" and parser.calls else reason


def _chat_message(parser: AssistantOutputParser, deltas) -> dict:
    m = collect(parser, deltas)
    message = {"role": "assistant", "content": m.content if m.content or not m.tool_calls else None}
    if m.reasoning:
        message["reasoning_content"] = m.reasoning
    if m.tool_calls:
        message["tool_calls"] = [c.as_openai() for c in m.tool_calls]
    return message


def _completion_choice(text: str, reason) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


async def _generate(service: Service, http: HTTPRequest, gen: GenerationRequest, prompt_ids: list[int], chat: bool,
                    parser: AssistantOutputParser | None = None):
    """`parser` (chat): splits the text into reasoning, content and tool calls."""
    request, queue = _submit(service, gen, prompt_ids)
    text = _Text(service, gen.stop)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    head = {"id": rid, "object": ("chat.completion" if chat else "text_completion"), "created": created,
            "model": service.model_name}

    if gen.stream:
        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        def sse(choices, **extra) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

        outcome = {"value": "cancelled"}  # what the stream ended as; a client that went away leaves it

        async def events():
            try:
                if chat:  # the role first, as OpenAI's streams open
                    yield sse([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
                async for piece, reason in _pieces(service, request, queue, text):
                    if not chat:
                        yield sse([_completion_choice(piece, reason)])
                        continue
                    deltas = parser.push(piece) + (parser.finish() if reason is not None else [])
                    for body in _chat_deltas(deltas):
                        yield sse([{"index": 0, "delta": body, "logprobs": None, "finish_reason": None}])
                    if reason is not None:
                        service.metrics.malformed(parser.malformed)
                        yield sse([{"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": _chat_reason(reason, parser)}])
                if gen.include_usage:
                    yield sse([], usage=_usage(prompt_ids, text))
                yield "data: [DONE]\n\n"
                outcome["value"] = "completed"
            except _GenerationFailed as e:
                outcome["value"] = "failed"
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'code': 500}})}\n\n"

        def closed():
            service.scheduler.cancel(request)
            service.metrics.request_done(outcome["value"])

        return _EventStream(events(), closed)

    async def collect():
        parts, final = [], None
        async for piece, reason in _pieces(service, request, queue, text):
            parts.append(piece)
            final = reason
        return "".join(parts), final

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                service.metrics.request_done("cancelled")
                return Response(status_code=499)
        content, reason = task.result()
    except _GenerationFailed as e:
        service.metrics.request_done("failed")
        return _error(500, str(e), "server_error")
    finally:
        service.scheduler.cancel(request)
    service.metrics.request_done("completed")
    if chat:
        deltas = parser.push(content) + parser.finish()
        service.metrics.malformed(parser.malformed)
        choice = {"index": 0, "message": _chat_message(parser, deltas), "logprobs": None,
                  "finish_reason": _chat_reason(reason, parser)}
    else:
        choice = _completion_choice(content, reason)
    return JSONResponse({**head, "choices": [choice], "usage": _usage(prompt_ids, text)})


def _endpoint(service: Service, chat: bool):
    async def handle(http: HTTPRequest):
        try:
            body = await _json_body(http)
            gen = (parse_chat if chat else parse_completion)(body)
            model = body.get("model")
            if model is not None and model != service.model_name:
                service.metrics.request_done("rejected")
                return _not_served(service, model)
            # tokenizing and rendering take time in the prompt's length (a body may hold megabytes of text): off the
            # event loop, which serves every other stream, and where the tokenizer lets go of the GIL, beside it
            if not chat:
                return await _generate(service, http, gen, await asyncio.to_thread(service.encode, gen.prompt), chat)
            prompt_ids, prompt_text = await asyncio.to_thread(service.chat_prompt, gen)
            parser = AssistantOutputParser(gen.tool_names, in_reasoning=prompt_opens_reasoning(prompt_text))
            return await _generate(service, http, gen, prompt_ids, chat, parser)
        except BadRequest as e:
            service.metrics.request_done("rejected")
            return _error(400, str(e), "invalid_request_error", e.param)
        except QueueFull as e:
            service.metrics.request_done("rejected")
            return _error(429, f"server overloaded: {e}; retry later", "rate_limit_error")
        except ShuttingDown as e:
            service.metrics.request_done("rejected")
            return _error(503, str(e), "server_error")
        except BodyTooLarge as e:
            service.metrics.request_done("rejected")
            return _error(413, str(e), "invalid_request_error", "body")
        except BodyStalled as e:
            service.metrics.request_done("rejected")
            return _error(408, str(e), "invalid_request_error", "body")
        except ClientDisconnect:  # gone before its request was read: nobody to answer
            service.metrics.request_done("rejected")
            log.warning("%s: the client disconnected before its request was read", http.url.path)
            return Response(status_code=400)
        except Exception as e:  # a bug: the client still gets a JSON error, the log the traceback
            log.exception("%s failed", http.url.path)
            service.metrics.request_done("failed")
            return _error(500, f"internal error: {type(e).__name__}", "server_error")

    return handle


def create_app(service: Service) -> Starlette:
    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "jaxspec",
                "max_model_len": service.engine.max_context}

    async def models(_):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):  # what the OpenAI clients' models.retrieve(id) reads
        name = request.path_params["name"]
        if name != service.model_name:
            return _not_served(service, name)
        return JSONResponse(model_card())

    async def http_error(_request, e: HTTPException):  # an unknown path or method: the API's JSON error, not text
        return _error(e.status_code, e.detail, "invalid_request_error")

    async def health(_):
        if service.scheduler.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, 503)

    async def metrics(_):
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if not service.scheduler.alive:
            service.scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.scheduler.stop, service.shutdown_timeout_s)

    routes = [
        Route("/v1/completions", _endpoint(service, chat=False), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(service, chat=True), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
