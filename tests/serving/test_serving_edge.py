"""The server's edge against a hostile or careless client, on the tiny random model
over loopback: one request cannot fail the others' (range-checked seed, a row that fails at admission
fails alone), large bodies cannot block or bloat the server (413, parsing and tokenization off the event
loop, counts checked before work), cross-site requests are refused (JSON only, Host checked, optional API
key), shutdown drains as docs/serving.md says, an impossible prompt count is a 400 not a 429, and types are
strict (no coercion that ``generate`` would refuse)."""

import json
import logging
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from serving_fixtures import (  # noqa: F401  (fixtures)
    BASE,
    PROMPTS,
    assert_openai_error,
    client,
    compose_serve,
    loaded,
    offline,
    one_thread,
    server,
    start_server,
    stats,
    wait_for,
)

from mars.serving.config import ServeConfig
from mars.serving.scheduler import Job
from mars.serving.server import build_state


def slow_steps(monkeypatch, srv, seconds):
    """Each engine step takes at least ``seconds`` longer (so that requests are surely in flight when the
    test acts; outputs do not change)."""
    engine = srv.state.loop.engine
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)


def post(srv, body, path="/v1/completions", **kw):
    return httpx.post(srv.url + path, json={"model": "tiny-random", **body}, timeout=60, **kw)


# ------------------------------------------------------------------------------------------------------
# one request must not fail everyone's
# ------------------------------------------------------------------------------------------------------
def test_an_out_of_range_seed_is_a_400_and_the_requests_in_flight_finish(loaded, server, monkeypatch):
    ref_stream, _ = offline(loaded, server, PROMPTS[0], 100)
    ref_plain, _ = offline(loaded, server, PROMPTS[1], 100)
    slow_steps(monkeypatch, server, 0.03)  # 100 tokens take 3 s: both are surely in flight
    c = client(server)
    stream = iter(c.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=100, stream=True))
    pieces = [next(stream).choices[0].text]
    plain = {}
    worker = threading.Thread(
        target=lambda: plain.setdefault(
            "r", c.completions.create(model="tiny-random", prompt=PROMPTS[1], max_tokens=100)
        )
    )
    worker.start()
    assert wait_for(lambda: stats(server)["running"] == 2)
    for seed in (2**64, -(2**63) - 1):  # one past either end of what torch.Generator.manual_seed takes
        for stream_it in (False, True):
            r = post(server, {"prompt": "x", "temperature": 0.5, "seed": seed, "max_tokens": 8, "stream": stream_it})
            err = assert_openai_error(r, 400, "seed")
            assert str(2**64 - 1) in err["message"] and str(seed) in err["message"]
    assert stats(server)["running"] == 2  # nobody failed
    pieces += [ch.choices[0].text for ch in stream]
    worker.join(60)
    assert "".join(pieces) == ref_stream
    assert plain["r"].choices[0].text == ref_plain
    for seed in (2**64 - 1, -(2**63)):  # the ends themselves are served
        r = post(server, {"prompt": "x", "temperature": 0.5, "seed": seed, "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_a_row_that_fails_at_admission_fails_alone_and_the_batch_goes_on(loaded, server, monkeypatch):
    """Jobs straight into the engine loop (past the HTTP checks): a sampler seed that torch refuses fails
    its own job at admission; the other rows of the batch decode on."""
    loop, tok = server.state.loop, loaded.tokenizer
    events: dict[str, list] = {}

    def job(prompt, n, **kw):
        j = Job(prompt_ids=tok(prompt)["input_ids"], max_new_tokens=n, **kw)
        events[j.id] = []
        j.sink = events[j.id].append  # called on the loop thread
        return j

    def done(j):
        return any(e.done for e in events[j.id])

    slow_steps(monkeypatch, server, 0.03)
    running = job(PROMPTS[0], 60)
    loop.submit([running])
    assert wait_for(lambda: len(events[running.id]) > 0)
    bad, good = job(PROMPTS[1], 8, temperature=0.5, seed=2**64), job(PROMPTS[2], 20)
    loop.submit([bad, good])
    assert wait_for(lambda: all(done(j) for j in (running, bad, good)), timeout=60)
    final = {j.id: next(e for e in events[j.id] if e.done) for j in (running, bad, good)}
    assert final[bad.id].status == 400 and "seed" in final[bad.id].error
    assert final[running.id].error is None and final[good.id].error is None
    assert final[running.id].final_text == offline(loaded, server, PROMPTS[0], 60)[0]
    assert final[good.id].final_text == offline(loaded, server, PROMPTS[2], 20)[0]
    assert loop.engine_failures == 0


# ------------------------------------------------------------------------------------------------------
# a draft model that cannot draft for this target
# ------------------------------------------------------------------------------------------------------
def test_a_draft_model_with_another_vocabulary_is_refused_at_startup_naming_both_tokenizers(loaded, tmp_path):
    """Its tokenizer holds the target's first 64 tokens at the same ids and nothing more: every shared id
    agrees, yet the target's other ids would index past the draft's embedding on every verify request."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from mars.models import build_tiny_random

    kept = {token: index for token, index in loaded.tokenizer.get_vocab().items() if index < 64}
    unk = loaded.tokenizer.convert_ids_to_tokens(0)
    small = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(kept, unk_token=unk)), unk_token=unk)
    build_tiny_random(vocab_size=64).save_pretrained(tmp_path)
    small.save_pretrained(tmp_path)
    sc = ServeConfig.from_cfg(compose_serve(BASE + ["decoding.draft_source=model", f"decoding.draft_model={tmp_path}"]))
    with pytest.raises(ValueError, match="does not share the target's tokenizer") as refused:
        build_state(sc, loaded)
    message = str(refused.value)
    assert repr(loaded.tokenizer.name_or_path) in message and repr(str(tmp_path)) in message
    assert f"{loaded.tokenizer.convert_ids_to_tokens(64)!r} as id 64" in message and "lacks it" in message


# ------------------------------------------------------------------------------------------------------
# large bodies
# ------------------------------------------------------------------------------------------------------
def test_a_body_over_the_limit_gets_413_and_the_limit_is_configurable(loaded):
    srv = start_server(loaded, "max_body_bytes=65536")
    try:
        url, headers = srv.url + "/v1/completions", {"content-type": "application/json"}
        big = json.dumps({"model": "tiny-random", "prompt": "word " * 20_000}).encode()  # ~100 kB
        err = assert_openai_error(httpx.post(url, content=big, headers=headers), 413, None, "request_too_large")
        assert "65536" in err["message"] and "max_body_bytes" in err["message"]

        def chunked():  # no Content-Length: refused once the read passes the limit
            for i in range(0, len(big), 16_384):
                yield big[i : i + 16_384]

        assert_openai_error(httpx.post(url, content=chunked(), headers=headers), 413, None, "request_too_large")
        small = {"model": "tiny-random", "prompt": "word " * 100, "max_tokens": 2}
        assert httpx.post(url, json=small).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


class Captured(logging.Handler):
    """The records of the named loggers at INFO and above, uvicorn's included (they do not reach the root)."""

    def __init__(self, *names):
        super().__init__(logging.INFO)
        self.records, self.loggers = [], [logging.getLogger(n) for n in names]

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.levels = [logger.level for logger in self.loggers]
        for logger in self.loggers:
            logger.addHandler(self)
            logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        for logger, level in zip(self.loggers, self.levels):
            logger.removeHandler(self)
            logger.setLevel(level)

    def faults(self):
        """ERROR records and any record carrying a traceback."""
        return [r for r in self.records if r.levelno >= logging.ERROR or r.exc_info]

    def lines(self, text):
        return [r.getMessage() for r in self.records if text in r.getMessage()]


def open_partial_body(srv, sent=b'{"prompt": "hal', declared=200):
    """A POST whose body stops short of its Content-Length (the client still connected)."""
    conn = socket.create_connection((srv.host, srv.port), timeout=10)
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    conn.sendall(f"{head}Content-Length: {declared}\r\n\r\n".encode() + sent)
    return conn


def test_a_client_that_aborts_mid_body_is_one_info_line_not_a_server_error(server):
    with Captured("uvicorn", "mars") as logs:
        for _ in range(3):
            open_partial_body(server).close()
        assert wait_for(lambda: len(logs.lines("while sending its request body")) == 3, timeout=5)
    assert logs.faults() == []
    assert all(r.levelno == logging.INFO for r in logs.records if "request body" in r.getMessage())
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_shutdown_with_slow_bodies_open_ends_within_the_grace_and_logs_one_line(loaded):
    srv = start_server(loaded, "shutdown_grace_s=3")
    with Captured("uvicorn", "mars") as logs:
        slow = [open_partial_body(srv) for _ in range(5)]
        assert wait_for(lambda: srv.state.in_flight == 5, timeout=5)
        t0 = time.monotonic()
        srv.stop(timeout=30)
        took = time.monotonic() - t0
        answers = [conn.recv(200) for conn in slow]  # each was answered before its connection closed
        for conn in slow:
            conn.close()
    assert not srv.thread.is_alive() and took < 3 + 2, took
    assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers
    assert logs.lines("draining") == [
        "draining: new requests and the 5 still sending their bodies get 503, 0 open request(s) get 3.0 s to finish"
    ]
    assert logs.faults() == []


def test_a_20_mb_prompt_is_refused_by_the_default_limit(server):
    body = json.dumps({"model": "tiny-random", "prompt": "x" * 20_000_000}).encode()
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 413, None, "request_too_large")
    assert time.monotonic() - t0 < 10
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


class SlowTokenizer:
    """The server's tokenizer, taking ``delay`` seconds longer for a text that holds ``marker`` (as a
    megabyte-sized prompt would): records when such a call starts and ends."""

    def __init__(self, tokenizer, marker, delay):
        self.tokenizer, self.marker, self.delay = tokenizer, marker, delay
        self.started = threading.Event()
        self.finished = threading.Event()

    def __call__(self, text, *args, **kw):
        if self.marker in text:
            self.started.set()
            time.sleep(self.delay)
            self.finished.set()
        return self.tokenizer(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_the_event_loop_answers_while_a_prompt_is_tokenized(server, monkeypatch):
    slow = SlowTokenizer(server.state.tokenizer, "SLOW-PROMPT", delay=2.0)
    monkeypatch.setattr(server.state, "tokenizer", slow)
    result = {}
    sender = threading.Thread(
        target=lambda: result.setdefault("r", post(server, {"prompt": "SLOW-PROMPT " * 10, "max_tokens": 2}))
    )
    sender.start()
    assert slow.started.wait(10)
    t0 = time.monotonic()
    health = httpx.get(server.url + "/health", timeout=10)
    waited = time.monotonic() - t0
    assert health.status_code == 200 and not slow.finished.is_set(), "the health check waited for the tokenizer"
    assert waited < 1.0
    sender.join(30)
    assert result["r"].status_code == 200


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(server, monkeypatch):
    spy = SlowTokenizer(server.state.tokenizer, "word", delay=0.0)
    monkeypatch.setattr(server.state, "tokenizer", spy)
    err = assert_openai_error(post(server, {"prompt": "word " * 20_000}), 400, "prompt", "context_length_exceeded")
    assert "100000 characters" in err["message"] and "512 tokens" in err["message"]
    chat = {"messages": [{"role": "user", "content": "word " * 20_000}]}
    assert_openai_error(post(server, chat, path="/v1/chat/completions"), 400, "messages", "context_length_exceeded")
    assert not spy.started.is_set()
    assert post(server, {"prompt": "word " * 50, "max_tokens": 2}).status_code == 200  # short ones are tokenized
    assert spy.started.is_set()


# ------------------------------------------------------------------------------------------------------
# cross-site requests
# ------------------------------------------------------------------------------------------------------
def test_posts_must_be_json_so_a_cross_site_page_cannot_send_them(server):
    url = server.url + "/v1/completions"
    body = json.dumps({"model": "tiny-random", "prompt": "hi", "max_tokens": 2})
    evil = "http://evil.example"
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {"origin": evil} | ({"content-type": ctype} if ctype else {})
        r = httpx.post(url, content=body, headers=headers)
        err = assert_openai_error(r, 415, None, "unsupported_media_type")
        assert "application/json" in err["message"]
    chat = json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(server.url + "/v1/chat/completions", content=chat, headers={"content-type": "text/plain"})
    assert_openai_error(r, 415, None, "unsupported_media_type")
    ok = httpx.post(url, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    # a preflight is never granted, so a browser will not send the JSON version cross-site either
    pre = httpx.options(
        url, headers={"origin": evil, "access-control-request-method": "POST", "access-control-request-headers": "x"}
    )
    assert "access-control-allow-origin" not in pre.headers


def test_a_foreign_host_header_is_refused_against_dns_rebinding(server):
    port = server.port
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        r = post(server, {"prompt": "hi", "max_tokens": 2}, headers={"host": host})
        err = assert_openai_error(r, 400, None, "invalid_host")
        assert "allowed_hosts" in err["message"]
        assert_openai_error(httpx.get(server.url + "/stats", headers={"host": host}), 400, None, "invalid_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert post(server, {"prompt": "hi", "max_tokens": 2}, headers={"host": host}).status_code == 200, host


def test_allowed_hosts_adds_names(loaded):
    srv = start_server(loaded, "allowed_hosts=[mars.example.org,'*.lab.example']")
    try:
        for host, status in (("mars.example.org", 200), ("gpu1.lab.example:80", 200), ("evil.example", 400)):
            assert httpx.get(srv.url + "/stats", headers={"host": host}).status_code == status, host
    finally:
        srv.stop()


def test_an_api_key_guards_the_v1_routes_as_vllm_does(loaded, monkeypatch):
    monkeypatch.setenv("MARS_API_KEY", "s3cret-key")
    srv = start_server(loaded)
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-key"}):
            r = post(srv, body, headers=headers)
            assert_openai_error(r, 401, None, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert post(srv, body, headers={"authorization": "Bearer s3cret-key"}).status_code == 200
        assert_openai_error(httpx.get(srv.url + "/v1/models"), 401, None, "invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            client(srv).models.list()
        good = client(srv, api_key="s3cret-key")
        assert [m.id for m in good.models.list().data] == ["tiny-random"]  # the route refused above, now open
        for route in ("/health", "/metrics", "/stats", "/"):  # open, as vLLM leaves health and metrics
            assert httpx.get(srv.url + route).status_code == 200, route
        assert stats(srv)["api_key_required"] is True
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------------
# shutdown as docs/serving.md describes it
# ------------------------------------------------------------------------------------------------------
def sse_events(response):
    """The data of each server-sent event of a streamed response, in order."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            out.append(line[5:].strip())
    return out


def test_sigterm_drains_new_requests_get_503_and_cut_requests_end_with_an_error(loaded, monkeypatch):
    srv = start_server(loaded, "shutdown_grace_s=1")
    slow_steps(monkeypatch, srv, 0.02)  # 400 tokens would take 8 s: past the grace
    body = {"model": "tiny-random", "prompt": "too long", "max_tokens": 400}
    got = {}

    def streamed():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            got["stream_status"] = r.status_code
            got["stream"] = sse_events(r)

    workers = [
        threading.Thread(target=streamed),
        threading.Thread(target=lambda: got.setdefault("plain", httpx.post(srv.url + "/v1/completions", json=body))),
    ]
    for w in workers:
        w.start()
    try:
        assert wait_for(lambda: stats(srv)["running"] == 2)
        t0 = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)  # what the signal calls
        # draining: the socket stays open, health says so, a new request gets 503 (not "connection refused")
        assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, timeout=2)
        assert httpx.get(srv.url + "/health").json()["status"] == "draining"
        late = post(srv, {"prompt": "late", "max_tokens": 2})
        assert_openai_error(late, 503, None, "unavailable")
        assert late.headers["retry-after"] == "1"
        for w in workers:
            w.join(20)
        # past the grace: the non-streaming request gets a JSON 503, the stream an error event and [DONE]
        assert_openai_error(got["plain"], 503, None, "unavailable")
        assert got["stream_status"] == 200 and got["stream"][-1] == "[DONE]"
        last = json.loads(got["stream"][-2])
        assert last["error"]["type"] == "service_unavailable" and "shut down" in last["error"]["message"]
        srv.thread.join(15)
        assert not srv.thread.is_alive() and not srv.state.loop.alive
        assert time.monotonic() - t0 < 10
    finally:
        srv.stop(timeout=15)


def test_a_second_signal_stops_the_wait(loaded, monkeypatch):
    srv = start_server(loaded, "shutdown_grace_s=60")
    slow_steps(monkeypatch, srv, 0.02)
    got = {}
    worker = threading.Thread(
        target=lambda: got.setdefault("r", post(srv, {"prompt": "long", "max_tokens": 400}))  # ~8 s
    )
    worker.start()
    try:
        assert wait_for(lambda: stats(srv)["running"] == 1)
        t0 = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, timeout=2)
        srv.server.handle_exit(signal.SIGINT, None)  # Ctrl-C again: no more waiting
        worker.join(10)
        assert_openai_error(got["r"], 503, None, "unavailable")
        srv.thread.join(10)
        assert not srv.thread.is_alive() and time.monotonic() - t0 < 5
    finally:
        srv.stop(timeout=15)


def test_an_idle_server_stops_at_once(loaded):
    srv = start_server(loaded, "shutdown_grace_s=30")
    t0 = time.monotonic()
    srv.stop(timeout=15)
    assert not srv.thread.is_alive() and time.monotonic() - t0 < 3


# ------------------------------------------------------------------------------------------------------
# more prompts than can ever be queued
# ------------------------------------------------------------------------------------------------------
def test_more_prompts_than_rows_plus_queue_get_400_naming_the_limit_before_tokenizing(loaded, monkeypatch):
    srv = start_server(loaded, "max_batch=2", "max_queue=1")
    try:
        spy = SlowTokenizer(srv.state.tokenizer, "p", delay=0.0)  # records a tokenization of any "p..." prompt
        monkeypatch.setattr(srv.state, "tokenizer", spy)
        r = post(srv, {"prompt": [f"p{i}" for i in range(4)], "max_tokens": 2})
        err = assert_openai_error(r, 400, "prompt", "too_many_prompts")
        assert "4 prompts" in err["message"] and "at most 3" in err["message"]
        assert "max_batch=2" in err["message"] and "max_queue=1" in err["message"]
        assert not spy.started.is_set()  # refused before any tokenization
        r = post(srv, {"prompt": [[5, 6]] * 4, "max_tokens": 2})
        assert_openai_error(r, 400, "prompt", "too_many_prompts")
        r = post(srv, {"prompt": [f"p{i}" for i in range(3)], "max_tokens": 2})  # exactly the limit: served
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------------
# strict types: what generate / DecodingSettings refuse, the server refuses
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "threshold": True}, "threshold"),
        ({"prompt": "hi", "threshold": "0.9"}, "threshold"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 4.0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": ["1", 2]}, "prompt"),
        ({"prompt": [True, 5]}, "prompt"),
        ({"prompt": [[5, "6"]]}, "prompt"),
        ({"prompt": [[True, 5]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stream": 1}, "stream"),
        ({"prompt": "hi", "verify": "true"}, "verify"),
        ({"prompt": "hi", "return_token_ids": 1}, "return_token_ids"),
        ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ({"prompt": "hi", "temperature": True}, "temperature"),
        ({"prompt": "hi", "seed": True}, "seed"),
        ({"prompt": "hi", "seed": 1.5}, "seed"),
        ({"prompt": "hi", "seed": "7"}, "seed"),
        ({"prompt": "hi", "stop": 123}, "stop"),
        ({"prompt": "hi", "stop": ["a", 1]}, "stop"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "top_p": "1"}, "top_p"),
        ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"prompt": "hi", "echo": 0}, "echo"),
    ],
)
def test_lax_types_are_refused_naming_the_field(server, body, param):
    err = assert_openai_error(post(server, body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "user", "content": 5}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content"),
        ({"role": True, "content": "hi"}, "messages.0.role"),
    ],
)
def test_lax_chat_messages_are_refused_naming_the_field(server, message, param):
    assert_openai_error(post(server, {"messages": [message]}, path="/v1/chat/completions"), 400, param)


def test_strict_types_still_take_what_json_and_generate_allow(server):
    """An integer is a number (``threshold: 1``, ``temperature: 0``); parts of content and lists of ids work."""
    r = post(server, {"prompt": "hi", "threshold": 1, "temperature": 0, "max_tokens": 3, "seed": 7, "stop": "x"})
    assert r.status_code == 200 and r.json()["mars"]["threshold"] == 1.0
    assert post(server, {"prompt": [[5, 6], [7]], "max_tokens": 2}).status_code == 200
    msg = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert post(server, {"messages": [msg], "max_tokens": 2}, path="/v1/chat/completions").status_code == 200
    err = assert_openai_error(post(server, {"prompt": "hi", "threshold": True}), 400, "threshold")
    assert "true" in err["message"]  # the value as the client wrote it
    for raw in (b'{"prompt": "hi", "threshold": NaN}', b'{"prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, "body")  # NaN is not JSON; nesting too deep for the parser is not a 500
