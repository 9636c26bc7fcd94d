"""`python -m jaxspec.serve` against the real `openai` client on loopback: the embedded pair in float32, one server
(in a thread of this process, its target cache paged) shared by every test; the last test shuts it down the way
SIGTERM does.

Greedy outputs are compared with `Engine.generate` on each prompt alone (one budget, so one compile; a smaller
max_tokens gives a prefix of it)."""

import asyncio
import copy
import importlib
import json
import logging
import socket
import threading

import httpx
import pytest

from bench.serve_load import LevelProcess, run_level, summarize
from jaxspec.engine import Engine
from jaxspec.serve import _check, build_parser, build_service
from jaxspec.serving.app import Service, create_app
from jaxspec.serving.background import BackgroundServer

MAX_BATCH, MAX_QUEUE, CONTEXT, K = 4, 32, 128, 3
SOLO_TOKENS = 12  # the reference budget; requests ask for at most this many
PROMPTS = ["def fibonacci(n):\n", "import numpy as np\n", "class Stack:\n", "for i in range("]
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


class _OnFirstUse:
    """`openai` imported on first use (1.7 s): every xdist worker collects this file, one of them runs it."""

    def __getattr__(self, name):
        return getattr(importlib.import_module("openai"), name)


openai = _OnFirstUse()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("serve") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = build_parser().parse_args([
        "--dtype", "float32", "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-context",
        str(CONTEXT), "--speculative-num-steps", str(K), "--warmup-buckets", "16", "--chat-template", str(template),
        "--cache-pages", str(MAX_BATCH * CONTEXT // 64),  # paged: every test runs on the paged cache
        "--no-speculative-adaptive"])  # a fixed K: a seeded request repeats exactly whatever the batch
    service = build_service(args, *_check(args), log=lambda msg: None)
    background = BackgroundServer(service).start()
    yield dict(service=service, background=background, base=background.base_url)
    background.stop()


@pytest.fixture(scope="module")
def solo(server):
    """prompt text -> greedy tokens from Engine.generate alone (float32, same K), on the weights the server loaded
    (the library's programs, not the server's; loading the checkpoint again would show nothing more)."""
    service = server["service"]
    engine = Engine(service.engine.cfg, service.engine.weights, num_steps=K)
    return {p: engine.generate([service.encode(p)], SOLO_TOKENS).tokens[0] for p in PROMPTS}


def expected(server, solo_tokens, max_tokens):
    """The text and finish reason a request with `max_tokens` must produce."""
    eos = server["service"].scheduler.eos_ids
    toks = solo_tokens[:max_tokens]
    reason = "stop" if toks and toks[-1] in eos else "length"
    return server["service"].tokenizer.decode([t for t in toks if t not in eos]), reason


def client(server, **kw):
    return openai.OpenAI(base_url=server["base"], api_key="none", max_retries=0, **kw)


def aclient(server):
    return openai.AsyncOpenAI(base_url=server["base"], api_key="none", max_retries=0, timeout=120)


def test_models_and_health(server):
    ids = [m.id for m in client(server).models.list()]
    assert ids == ["jaxspec"]
    assert client(server).models.retrieve("jaxspec").id == "jaxspec"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4")
    assert httpx.get(server["base"].replace("/v1", "/health")).json() == {"status": "ok"}
    # an unknown path or a wrong method: the API's JSON error, as every other refusal
    for r, status in ((httpx.get(server["base"] + "/no-such-route"), 404),
                      (httpx.get(server["base"] + "/completions"), 405)):
        assert r.status_code == status and r.json()["error"]["code"] == status


def test_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    """A prompt of megabytes takes its tokenizer seconds: on the event loop that would hold every other stream."""
    service, seen = server["service"], []

    def encode(prompt, real=service.encode):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("elsewhere")
        return real(prompt)

    monkeypatch.setattr(service, "encode", encode)
    client(server).completions.create(model="jaxspec", prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert seen == ["elsewhere"]


def test_completion_equals_solo_generate(server, solo):
    prompt = PROMPTS[0]
    r = client(server).completions.create(model="jaxspec", prompt=prompt, max_tokens=SOLO_TOKENS, temperature=0)
    text, reason = expected(server, solo[prompt], SOLO_TOKENS)
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(server["service"].encode(prompt))
    assert r.usage.completion_tokens == len(solo[prompt])


def test_streamed_completion_equals_solo(server, solo):
    prompt = PROMPTS[1]
    stream = client(server).completions.create(model="jaxspec", prompt=prompt, max_tokens=SOLO_TOKENS, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert (text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]) == \
        expected(server, solo[prompt], SOLO_TOKENS)
    assert chunks[-1].usage.completion_tokens == len(solo[prompt])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(server, solo, stream):
    prompt = PROMPTS[2]
    full, _ = expected(server, solo[prompt], SOLO_TOKENS)
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a piece in the middle of the output
    assert stop.strip()
    kw = dict(model="jaxspec", prompt=prompt, max_tokens=SOLO_TOKENS, temperature=0, stop=[stop, "never-seen"])
    if stream:
        chunks = list(client(server).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage, chunks = chunks[-1].usage, [c.choices[0] for c in chunks if c.choices]
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        r = client(server).completions.create(**kw)
        usage, text, reason = r.usage, r.choices[0].text, r.choices[0].finish_reason
    assert text == full[: full.index(stop)] and reason == "stop"
    # usage counts the tokens up to the one that completed the stop string, not the rest of its device step
    decode = server["service"].tokenizer.decode
    assert usage.completion_tokens == next(n for n in range(1, SOLO_TOKENS + 1) if stop in decode(solo[prompt][:n]))


def test_chat_uses_the_template(server, solo):
    c = client(server)
    messages = [{"role": "user", "content": "fibonacci"}]
    r = c.chat.completions.create(model="jaxspec", messages=messages, max_tokens=8, temperature=0)
    rendered = server["service"].tokenizer.apply_chat_template(messages)
    same = c.completions.create(model="jaxspec", prompt=rendered, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text and r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="jaxspec", messages=messages, max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == same.choices[0].text
    assert chunks[0].choices[0].delta.role == "assistant"


def test_chat_without_a_template_is_a_clear_400(server):
    plain = copy.copy(server["service"].tokenizer)
    plain.chat_template = None
    service = Service(server["service"].scheduler, plain, server["service"].metrics, "jaxspec")
    transport = httpx.ASGITransport(app=create_app(service))  # no lifespan: the shared scheduler keeps running

    async def ask():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0, http_client=http)
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                await c.chat.completions.create(model="jaxspec", messages=[{"role": "user", "content": "hi"}])

    asyncio.run(ask())


def test_32_concurrent_streams_each_equal_their_solo_output(server, solo):
    jobs = [(PROMPTS[i % len(PROMPTS)], 1 + (5 * i) % SOLO_TOKENS) for i in range(32)]

    async def one(c, prompt, n):
        stream = await c.completions.create(model="jaxspec", prompt=prompt, max_tokens=n, temperature=0, stream=True)
        pieces, ids = [], set()
        async for chunk in stream:
            ids.add(chunk.id)
            pieces.append(chunk.choices[0])
        return "".join(p.text for p in pieces), pieces[-1].finish_reason, ids

    async def run():
        async with aclient(server) as c:  # closed inside the loop that opened it
            return await asyncio.gather(*(one(c, p, n) for p, n in jobs))

    results = asyncio.run(run())
    assert len(results) == 32
    for (prompt, n), (text, reason, ids) in zip(jobs, results):
        assert (text, reason) == expected(server, solo[prompt], n), (prompt, n)
        assert len(ids) == 1
    assert len({next(iter(r[2])) for r in results}) == 32


def test_seeded_sampling_is_reproducible_whatever_the_batch(server):
    kw = dict(model="jaxspec", prompt=PROMPTS[3], max_tokens=10, temperature=0.8, top_p=0.95, seed=1234,
              extra_body={"top_k": 50})
    alone = client(server).completions.create(**kw).choices[0].text

    async def crowded():
        async with aclient(server) as c:
            others = [c.completions.create(model="jaxspec", prompt=p, max_tokens=SOLO_TOKENS, temperature=t, seed=i)
                      for i, (p, t) in enumerate(zip(PROMPTS, [0, 1.0, 0.7]))]
            results = await asyncio.gather(c.completions.create(**kw), *others)
        return results[0].choices[0].text

    assert asyncio.run(crowded()) == alone
    other_seed = client(server).completions.create(**{**kw, "seed": 99}).choices[0].text
    assert isinstance(other_seed, str)


def _metric(server, name):
    text = httpx.get(server["base"].replace("/v1", "/metrics")).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    return values.get(name, 0.0)


def test_client_disconnect_frees_the_slot(server, solo):
    cancelled = _metric(server, 'jaxspec_requests_total{outcome="cancelled"}')
    with httpx.stream("POST", server["base"] + "/completions",
                      json={"prompt": PROMPTS[0], "max_tokens": CONTEXT - 32, "temperature": 0, "stream": True},
                      timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # leaving the block closes the connection mid-stream
    for _ in range(400):  # bounded: the server notices the closed connection at its next write
        if (_metric(server, 'jaxspec_requests_total{outcome="cancelled"}') > cancelled
                and _metric(server, "jaxspec_active_slots") == 0):
            break
        threading.Event().wait(0.05)
    assert _metric(server, "jaxspec_active_slots") == 0
    assert _metric(server, 'jaxspec_requests_total{outcome="cancelled"}') == cancelled + 1
    r = client(server).completions.create(model="jaxspec", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == expected(server, solo[PROMPTS[0]], 4)[0]


def test_overload_gets_429_and_the_server_recovers(server, solo, monkeypatch):
    """More requests at once than slots + queue: the excess is refused with 429; the accepted ones are dropped by
    their clients once every request has its answer (a dropped request leaves the queue without a prefill, and its
    place in the queue at once: dropped earlier, it would let a later request in), and the server serves on.

    The engine thread is held in its first prefill until every client has its answer, so the queue fills however
    fast the machine drains it (on a loaded machine the requests can otherwise arrive slower than they are served);
    the rest are sent once that first request is in the prefill, so they find the queue's whole room however slowly
    the engine thread took it (a burst that arrived first filled the queue with the first request in it)."""
    engine, release, entered = server["service"].engine, threading.Event(), threading.Event()
    prefill = engine.prefill

    def held_prefill(*args, **kw):
        entered.set()
        release.wait(timeout=120)
        return prefill(*args, **kw)

    monkeypatch.setattr(engine, "prefill", held_prefill)

    async def one(c, i):
        try:
            return await c.completions.create(model="jaxspec", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8,
                                              temperature=0, stream=True)
        except openai.RateLimitError:
            return None

    async def run():
        async with aclient(server) as c:
            first = asyncio.ensure_future(one(c, 0))
            assert await asyncio.to_thread(entered.wait, 60), "the first request never reached the prefill"
            rest = await asyncio.gather(*(one(c, i) for i in range(1, MAX_BATCH + MAX_QUEUE + 8)))
            streams = [await first, *rest]
            await asyncio.gather(*(s.close() for s in streams if s is not None))
        return [429 if s is None else 200 for s in streams]

    try:
        statuses = asyncio.run(run())
    finally:
        release.set()
    # one request in the held prefill, MAX_QUEUE waiting, the rest refused
    assert statuses.count(200) == MAX_QUEUE + 1 and statuses.count(429) == MAX_BATCH + 7
    for _ in range(400):  # bounded: the dropped requests leave the queue and their slots
        if _metric(server, "jaxspec_queue_length") == 0 and _metric(server, "jaxspec_active_slots") == 0:
            break
        threading.Event().wait(0.05)
    r = client(server).completions.create(model="jaxspec", prompt=PROMPTS[3], max_tokens=6, temperature=0)
    assert r.choices[0].text == expected(server, solo[PROMPTS[3]], 6)[0]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 1.5}, "top_k"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [7] * CONTEXT}, "prompt"),
    ({"prompt": "x", "max_tokens": CONTEXT}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
])
def test_bad_requests_are_400_naming_the_field(server, body, field):
    r = httpx.post(server["base"] + "/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_bad_json_unknown_model_and_the_server_survives(server, solo):
    r = httpx.post(server["base"] + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model="jaxspec", messages=[{"content": "no role"}])
    r = client(server).completions.create(model="jaxspec", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert r.choices[0].text == expected(server, solo[PROMPTS[1]], 8)[0]


@pytest.mark.parametrize("path, raw, status, field", [
    ("/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),  # past int's digit limit
    ("/completions", b'{"prompt": "\\ud800 x"}', 400, "prompt"),  # a lone surrogate no tokenizer encodes
    ("/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages"),
    ("/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 5000}).encode(), 400,
     "messages"),
])
def test_hostile_bodies_get_a_json_4xx_naming_what_is_wrong(server, path, raw, status, field):
    r = httpx.post(server["base"] + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == field, r.text[:300]


def _raw_request(server, head: bytes, body: bytes) -> bytes:
    """Send a request by hand (headers as given) and read the whole answer."""
    host, port = server["base"].split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_a_body_declared_over_the_limit_is_413_before_it_is_read(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % (64 * 2 ** 20))
    answer = _raw_request(server, head, b'{"prompt": "' + b"x" * 1000)  # the rest never comes
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["param"] == "body", answer[:300]


def test_a_body_streamed_past_the_limit_is_refused_as_it_is_read():
    """Without a Content-Length the body is read until it passes the limit, and no further."""
    from starlette.requests import Request as HTTPRequest

    from jaxspec.serving.app import MAX_BODY_BYTES, BodyTooLarge, _json_body

    received = []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b" " * 2 ** 20, "more_body": True}

    request = HTTPRequest({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(BodyTooLarge):
        asyncio.run(_json_body(request))
    assert len(received) == MAX_BODY_BYTES // 2 ** 20 + 1


def test_a_body_that_stops_coming_is_refused(monkeypatch):
    """A Content-Length the client never fills: the read gives up after BODY_IDLE_S without a byte (408), rather
    than holding the connection for as long as the client likes."""
    from starlette.requests import Request as HTTPRequest

    from jaxspec.serving import app

    sent = iter([{"type": "http.request", "body": b'{"prompt": ', "more_body": True}])

    async def receive():
        try:
            return next(sent)
        except StopIteration:
            await asyncio.sleep(3600)  # the rest never comes

    monkeypatch.setattr(app, "BODY_IDLE_S", 0.05)
    request = HTTPRequest({"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}, receive)
    with pytest.raises(app.BodyStalled, match="after 11 bytes"):
        asyncio.run(app._json_body(request))


def test_a_client_that_leaves_mid_body_is_one_log_line(server, caplog):
    host, port = server["base"].split("//")[1].split("/")[0].split(":")
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "')
        for _ in range(200):  # bounded: the server notices the closed connection within a few polls
            if any("disconnected" in r.getMessage() for r in caplog.records):
                break
            threading.Event().wait(0.05)
    lines = [r for r in caplog.records if "disconnected before its request" in r.getMessage()]
    assert [r.getMessage() for r in lines] == ["/v1/completions: the client disconnected before its request was read"]
    assert lines[0].exc_info is None  # a line, no traceback
    assert not [r for r in caplog.records if r.exc_info and "ClientDisconnect" in repr(r.exc_info[1])]
    assert httpx.get(server["base"].replace("/v1", "/health")).status_code == 200


def test_metrics_report_the_work(server):
    assert _metric(server, 'jaxspec_requests_total{outcome="completed"}') >= 40
    assert _metric(server, 'jaxspec_requests_total{outcome="cancelled"}') >= MAX_QUEUE
    assert _metric(server, 'jaxspec_requests_total{outcome="rejected"}') >= 1
    assert _metric(server, "jaxspec_generation_tokens_total") > 0
    assert _metric(server, "jaxspec_cycles_total") > 0
    assert 1.0 <= _metric(server, "jaxspec_mean_acceptance_length") <= K + 1
    assert _metric(server, "jaxspec_queue_length") == 0
    # every request, finished, cancelled or disconnected, gave its cache pages back
    assert _metric(server, "jaxspec_cache_pages") == MAX_BATCH * CONTEXT // 64
    assert _metric(server, "jaxspec_cache_pages_in_use") == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server):
    """The server's default prefix cache (--max-context's worth): the same long prompt again restores its whole
    pages instead of prefilling them, and answers the same."""
    ids = [(7 + 13 * i) % 200 + 1 for i in range(100)]
    ask = lambda: client(server).completions.create(model="jaxspec", prompt=ids, max_tokens=6, temperature=0)  # noqa: E731
    first = ask()
    hits, restored = _metric(server, "jaxspec_prefix_cache_hits_total"), _metric(server, "jaxspec_prefix_cache_hit_tokens_total")
    again = ask()
    assert again.choices[0].text == first.choices[0].text
    assert _metric(server, "jaxspec_prefix_cache_hits_total") == hits + 1
    assert _metric(server, "jaxspec_prefix_cache_hit_tokens_total") == restored + 64  # one whole page of 64
    assert _metric(server, "jaxspec_prefix_cache_pages") == CONTEXT // 64


def test_bench_load_generator_against_the_server(server, solo, tmp_path):
    """bench.serve_load's load generator at a small level: every greedy output equals its solo output."""
    texts = {p: expected(server, solo[p], 6)[0] for p in PROMPTS}
    results, wall = asyncio.run(run_level(server["base"], "jaxspec", 4, 1, 6, prompts=PROMPTS))
    row = summarize(4, results, wall, texts)
    assert (row["sent"], row["completed"], row["failed"], row["equal_to_solo"]) == (4, 4, 0, 4)
    assert row["tokens"] == sum(len(solo[p][:6]) for p in PROMPTS) and row["ttft_ms"]["50"] > 0
    # --client-process: the same level from another process gives the same outputs; a failed request comes back
    # as a failure with its client's exception named
    with LevelProcess() as drive:
        results, wall = drive(server["base"], "jaxspec", 4, 1, 6, prompts=PROMPTS)
        (failed,), _ = drive(server["base"], "no-such-model", 1, 1, 2, prompts=PROMPTS)
    assert summarize(4, results, wall, texts)["equal_to_solo"] == 4
    assert isinstance(failed[1], RuntimeError) and str(failed[1]).startswith("NotFoundError")


def test_shutdown_finishes_the_request_in_flight(server, solo):
    """What uvicorn does on SIGTERM (should_exit): stop accepting, let the open stream finish, then end the engine."""
    prompt = PROMPTS[2]
    stream = client(server).completions.create(model="jaxspec", prompt=prompt, max_tokens=SOLO_TOKENS, temperature=0,
                                               stream=True)
    first = next(iter(stream))
    server["background"].request_stop()
    rest = list(stream)
    pieces = [first.choices[0]] + [c.choices[0] for c in rest]
    assert ("".join(p.text for p in pieces), pieces[-1].finish_reason) == expected(server, solo[prompt], SOLO_TOKENS)
    server["background"].stop()
    assert not server["background"].thread.is_alive() and not server["service"].scheduler.alive
