"""The OpenAI-compatible server on the tiny random model (``model=tiny-random``), driven by the real ``openai``
client over loopback HTTP: outputs equal offline ``generate`` whatever the arrival pattern, streaming
reassembles to the non-streamed text, 400/429 paths, disconnects free rows, failures stay with their
request, graceful shutdown, the adaptive tau, metrics, and ``python serve.py`` itself."""

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from serving_fixtures import (  # noqa: F401  (fixtures)
    BASE,
    PROMPTS,
    REPO,
    aclient,
    client,
    compose_serve,
    loaded,
    metric,
    metric_sum,
    offline,
    one_thread,
    server,
    start_server,
    stats,
    wait_for,
)

from mars.decoding import generate
from mars.serving.config import CPU_STEP_COLUMNS, ServeConfig


# ------------------------------------------------------------------------------------------------------
# equivalence with offline generate
# ------------------------------------------------------------------------------------------------------
async def _request(c, i, prompt, delay, max_tokens, kind, on_chunk=lambda: None):
    await asyncio.sleep(delay)
    extra = {"return_token_ids": True}
    if kind in ("completion", "completion-stream"):
        if kind == "completion":
            r = await c.completions.create(model="tiny-random", prompt=prompt, max_tokens=max_tokens, extra_body=extra)
            return r.choices[0].text, r.choices[0].model_extra["token_ids"], r.model_extra["mars"]
        stream = await c.completions.create(
            model="tiny-random", prompt=prompt, max_tokens=max_tokens, stream=True, extra_body=extra
        )
        text, ids, last = "", [], None
        async for ch in stream:
            on_chunk()
            text += ch.choices[0].text
            ids += ch.model_extra["mars"]["token_ids"]
            last = ch.model_extra["mars"]
        return text, ids, last
    messages = [{"role": "user", "content": prompt}]
    if kind == "chat":
        r = await c.chat.completions.create(
            model="tiny-random", messages=messages, max_tokens=max_tokens, extra_body=extra
        )
        return r.choices[0].message.content, r.choices[0].model_extra["token_ids"], r.model_extra["mars"]
    stream = await c.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=max_tokens, stream=True, extra_body=extra
    )
    text, ids, last = "", [], None
    async for ch in stream:
        text += ch.choices[0].delta.content or ""
        ids += ch.model_extra["mars"].get("token_ids", [])
        last = ch.model_extra["mars"]
    return text, ids, last


def test_threshold_one_equals_offline_generate_whatever_the_arrival_pattern(loaded, server):
    kinds = ["completion-stream", "completion", "chat-stream", "chat"]
    # one long streamed request first; the others are sent once it has streamed its first token, so
    # they join its running batch however fast the machine is (and queue: 7 requests, 4 rows), with
    # different budgets so rows leave and join at different steps
    plan = [(p, 0.0 if i == 0 else 0.01 * i, 160 if i == 0 else 6 + 4 * i, kinds[i % 4]) for i, p in enumerate(PROMPTS)]
    expected = [offline(loaded, server, p, n, chat=k.startswith("chat")) for p, _, n, k in plan]

    async def main():
        c = aclient(server)
        first_token = asyncio.Event()
        sent, chunk_times = {}, []

        async def one(i, p, d, n, k):
            if i:
                await first_token.wait()
                await asyncio.sleep(d)
                sent[i] = time.monotonic()
                return await _request(c, i, p, 0.0, n, k)
            return await _request(
                c, i, p, 0.0, n, k, on_chunk=lambda: (chunk_times.append(time.monotonic()), first_token.set())
            )

        served = await asyncio.gather(*[one(i, *step) for i, step in enumerate(plan)])
        return served, sent, chunk_times

    served, sent, chunk_times = asyncio.run(main())
    for (text, ids, mars), (ref_text, ref_ids), (p, _d, _n, k) in zip(served, expected, plan):
        assert ids == ref_ids, (p, k)
        assert text == ref_text, (p, k)
        assert mars["threshold"] == 1.0 and mars["tokens_per_forward"] == 1.0
    # the late requests really joined a running batch: the first one was still streaming after the last was sent
    assert chunk_times[-1] > max(sent.values())


def test_streaming_reassembles_the_non_streamed_text_with_multi_token_steps(loaded):
    server = start_server(loaded, "tau_min=0.3")  # the tiny random model's masks pass at 0.3, not at 0.5
    try:
        c = client(server)
        for prompt in PROMPTS[:4]:
            kw = dict(model="tiny-random", prompt=prompt, max_tokens=24, extra_body={"threshold": 0.3})
            full = c.completions.create(**kw)
            pieces, _tokens, steps = [], [], []
            for ch in c.completions.create(stream=True, **kw):
                pieces.append(ch.choices[0].text)
                steps.append(ch.model_extra["mars"]["tokens"])
            assert "".join(pieces) == full.choices[0].text
            assert sum(steps) == full.usage.completion_tokens
            assert full.model_extra["mars"]["threshold"] == 0.3
        assert max(steps) > 1  # several tokens accepted in one forward: shaded together by the UI
    finally:
        server.stop()


def test_several_prompts_in_one_completion_request(loaded, server):
    prompts = [PROMPTS[2], PROMPTS[5], [5, 6, 7, 8]]
    expected = [offline(loaded, server, p, 12) for p in prompts]
    c = client(server)
    r = c.completions.create(model="tiny-random", prompt=prompts[:2], max_tokens=12)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [e[0] for e in expected[:2]]
    assert r.usage.completion_tokens == sum(len(e[1]) for e in expected[:2])
    assert len(r.model_extra["mars"]["choices"]) == 2
    texts = {}
    for ch in c.completions.create(model="tiny-random", prompt=[prompts[2], prompts[2]], max_tokens=12, stream=True):
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected[2][0], 1: expected[2][0]}


def test_stop_strings_cut_like_offline_generate_streamed_or_not(loaded, server):
    c = client(server)
    prompt = PROMPTS[1]
    text, _ = offline(loaded, server, prompt, 24)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's output is too short for this test"
    out = generate(
        loaded.model, loaded.tokenizer, [prompt], settings=server.state.settings.replace(max_new_tokens=24), stop=[stop]
    )
    full = c.completions.create(model="tiny-random", prompt=prompt, max_tokens=24, stop=[stop])
    assert full.choices[0].text == out.texts[0] and stop not in full.choices[0].text
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model="tiny-random", prompt=prompt, max_tokens=24, stop=[stop], stream=True)
    )
    assert streamed == out.texts[0]


def test_verify_requests_are_lossless(loaded, server):
    c = client(server)
    ref, ref_ids = offline(loaded, server, PROMPTS[2], 20)
    r = c.completions.create(
        model="tiny-random", prompt=PROMPTS[2], max_tokens=20, extra_body={"verify": True, "return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == ref_ids and r.choices[0].text == ref
    assert r.model_extra["mars"]["verify"] is True and r.model_extra["mars"]["threshold"] == 1.0
    # with a threshold of its own: verified drafts plus the masks that meet it, served at that threshold
    r = c.completions.create(
        model="tiny-random", prompt=PROMPTS[2], max_tokens=20, extra_body={"verify": True, "threshold": 0.5}
    )
    assert r.model_extra["mars"]["verify"] is True and r.model_extra["mars"]["threshold"] == 0.5
    assert r.usage.completion_tokens == 20


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(srv) -> tuple[dict[str, float], dict[int, float]]:
    """The ``mars_spec_decode_*_total`` counters, and the accepted tokens per draft position."""
    totals = {name: metric(srv, f"mars_spec_decode_{name}_total") for name in SPEC_COUNTERS}
    per_pos = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith("mars_spec_decode_num_accepted_tokens_per_pos_total{"):
            per_pos[int(line.split('position="')[1].split('"')[0])] = float(line.rsplit(" ", 1)[1])
    return totals, per_pos


def test_verify_requests_report_vllm_acceptance_figures_per_request_and_in_metrics(server):
    """A verify request's response carries vLLM's acceptance figures of its own drafts, and the spec-decode
    counters of /metrics grow by exactly its draft counts; a plain request has neither."""
    c = client(server)
    before, pos_before = spec_counters(server)
    plain = c.completions.create(model="tiny-random", prompt=PROMPTS[1], max_tokens=12)
    assert "mean_acceptance_length" not in plain.model_extra["mars"] and spec_counters(server)[0] == before
    r = c.completions.create(model="tiny-random", prompt=PROMPTS[2], max_tokens=20, extra_body={"verify": True})
    after, pos_after = spec_counters(server)
    grown = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    accepted = [pos_after[d] - pos_before.get(d, 0.0) for d in sorted(pos_after)]
    assert grown["num_drafts"] > 0 and grown["num_draft_tokens"] >= grown["num_drafts"]
    assert sum(accepted) == grown["num_accepted_tokens"]
    mars = r.model_extra["mars"]
    assert mars["mean_acceptance_length"] == pytest.approx(1 + grown["num_accepted_tokens"] / grown["num_drafts"])
    assert mars["draft_acceptance_rate"] == pytest.approx(grown["num_accepted_tokens"] / grown["num_draft_tokens"])
    assert mars["acceptance_by_position"] == pytest.approx([a / grown["num_drafts"] for a in accepted])


def test_models_health_and_page(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny-random"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404


def test_the_page_reads_only_what_the_server_serves(server):
    """The page's script fetches routes of this server and reads fields of its answers: a renamed route or
    field would leave the page showing "-" without any error (the browser tests are in test_serving_ui)."""
    import re

    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    script = page.text.split("<script>", 1)[1]
    fetched = set(re.findall(r'"(/[\w/]+)"', script))
    assert {"/stats", "/v1/completions", "/v1/chat/completions"} <= fetched
    assert not re.search(r"(src|href)=\"?(https?:)?//", page.text)  # nothing loaded from elsewhere
    for route in fetched:
        assert httpx.get(server.url + route).status_code in (200, 405), route  # 405: a POST route
    live = stats(server)
    read = set(re.findall(r"\bs\.(\w+)", script))  # poll(): s = await (await fetch("/stats")).json()
    assert {"tau", "tau_min", "tau_max", "tokens_per_forward"} <= read and read <= set(live), read - set(live)
    # the streamed chunks: msg.mars per forward, and the final chunk's figures as m (showStats)
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "stream": True, "threshold": 0.7}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    per_forward = set(re.findall(r"\bmsg\.mars\.(\w+)", script))
    final = set(re.findall(r"\bm\.(\w+)", script))
    assert per_forward and all(per_forward <= set(c["mars"]) for c in chunks if c["choices"])
    assert "threshold" in final and final <= set(chunks[-1]["mars"]), final - set(chunks[-1]["mars"])
    assert chunks[-1]["mars"]["threshold"] == 0.7  # the threshold the page sends is the one served


# ------------------------------------------------------------------------------------------------------
# bad requests
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "threshold": 1.5}, "threshold"),
        ({"prompt": "hi", "threshold": 0}, "threshold"),
        ({"prompt": "hi", "threshold": "high"}, "threshold"),
        ({"prompt": "hi", "model": "gpt-17"}, "model"),
        ({"prompt": [5] * 600}, "prompt"),
        ({"prompt": "hi", "max_tokens": 600}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "treshold": 0.9}, "treshold"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": [5, 10**6]}, "prompt"),
        ({"prompt": "hi", "verify": True, "threshold": 0}, "threshold"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-random", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_bad_chat_requests_and_malformed_json(server):
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"model": "tiny-random", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body" and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "tiny-random", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, json={"model": "tiny-random", "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    long = {"model": "tiny-random", "messages": [{"role": "user", "content": "word " * 600}]}
    r = httpx.post(url, json=long)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "context" in r.json()["error"]["message"]
    r = httpx.post(
        url,
        json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    # through the openai client: a BadRequestError that names the field
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "hi"}], extra_body={"threshold": 2}
        )
    assert info.value.body["param"] == "threshold"


# ------------------------------------------------------------------------------------------------------
# queue limit, disconnects, failures, shutdown
# ------------------------------------------------------------------------------------------------------
def test_full_queue_gets_429_and_a_burst_is_answered(loaded):
    srv = start_server(loaded, "max_batch=1", "max_queue=1")
    try:
        c = client(srv)
        blocker = c.completions.create(model="tiny-random", prompt="a", max_tokens=480, stream=True)
        next(iter(blocker))  # it holds the only row
        waiting = {}
        t = threading.Thread(
            target=lambda: waiting.setdefault("r", c.completions.create(model="tiny-random", prompt="b", max_tokens=4))
        )
        t.start()
        assert wait_for(lambda: stats(srv)["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="tiny-random", prompt="c", max_tokens=4)
        assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "1"
        blocker.close()  # the blocker's client goes away: its row frees, the waiting request runs
        t.join(10)
        assert waiting["r"].choices[0].finish_reason == "length"

        async def burst(n):  # 4x the queue limit (plus the row), all at once
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
                rs = await asyncio.gather(
                    *[h.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 6}) for i in range(n)]
                )
                return [r.status_code for r in rs]

        codes = asyncio.run(burst(4 * 2))
        assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1
        assert metric_sum(srv, "mars_requests_total", 'code="429"') == codes.count(429) + 1
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_a_disconnected_client_frees_its_row(server):
    c = client(server)
    cancelled = metric_sum(server, "mars_requests_finished_total", 'reason="cancelled"')
    stream = c.completions.create(model="tiny-random", prompt="stream me", max_tokens=480, stream=True)
    next(iter(stream))
    assert stats(server)["running"] == 1
    stream.close()
    assert wait_for(lambda: stats(server)["running"] == 0, timeout=5)
    # a non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 480}, timeout=0.3)
    assert wait_for(lambda: stats(server)["running"] == 0, timeout=5)
    assert metric_sum(server, "mars_requests_finished_total", 'reason="cancelled"') == cancelled + 2


def test_an_exception_in_one_request_fails_only_that_request(loaded, server, monkeypatch):
    from mars.serving.textstream import TextStream

    original = TextStream.push

    def push(self, tokens):  # fault injection: this request's detokenization breaks
        if self.max_new_tokens == 13:
            raise RuntimeError("injected failure")
        return original(self, tokens)

    monkeypatch.setattr(TextStream, "push", push)
    ref, _ = offline(loaded, server, PROMPTS[3], 20)

    async def main():
        c = aclient(server)
        bad = c.completions.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=13)
        good = c.completions.create(model="tiny-random", prompt=PROMPTS[3], max_tokens=20)
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, openai.InternalServerError) and "injected failure" in str(bad)
    assert good.choices[0].text == ref
    assert wait_for(lambda: stats(server)["running"] == 0, timeout=5)


def test_a_failing_step_fails_its_rows_and_the_loop_goes_on(loaded, server):
    loop = server.state.loop
    engine = loop.engine
    real_step = engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = step
    c = client(server)
    with pytest.raises(openai.InternalServerError, match="device lost"):
        c.completions.create(model="tiny-random", prompt=PROMPTS[4], max_tokens=20)
    assert loop.engine is not engine and loop.alive  # rebuilt, still running
    ref, _ = offline(loaded, server, PROMPTS[4], 20)
    assert c.completions.create(model="tiny-random", prompt=PROMPTS[4], max_tokens=20).choices[0].text == ref


def test_graceful_shutdown_finishes_in_flight_requests(loaded):
    srv = start_server(loaded, "shutdown_grace_s=10")
    c = client(srv)
    stream = c.completions.create(model="tiny-random", prompt="finish me", max_tokens=120, stream=True)
    it = iter(stream)
    first = next(it)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = list(it)
    stopper.join(20)
    assert not stopper.is_alive() and not srv.state.loop.alive
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(ch.model_extra["mars"]["tokens"] for ch in [first] + rest) == 120


def test_shutdown_past_the_grace_period_cancels_cleanly(loaded):
    srv = start_server(loaded, "shutdown_grace_s=0.3")
    c = client(srv)
    stream = c.completions.create(model="tiny-random", prompt="too long", max_tokens=480, stream=True)
    it = iter(stream)
    next(it)
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 10 and not srv.state.loop.alive
    finished, cut = [], None
    try:  # the stream must be cut (or end with an error event), never complete
        for ch in it:
            finished.append(ch.choices[0].finish_reason)
    except (openai.APIError, httpx.HTTPError) as err:
        cut = err
    assert cut is not None, f"the stream completed: {finished[-3:]}"


# ------------------------------------------------------------------------------------------------------
# adaptive tau and metrics
# ------------------------------------------------------------------------------------------------------
def test_adaptive_tau_falls_under_load_and_requests_keep_their_own_threshold_within_bounds(loaded):
    srv = start_server(
        loaded,
        "max_queue=16",
        "tau_policy=adaptive",
        "tau_min=0.6",
        "adaptive.target_queue=1",
        "adaptive.relax_rate=5",
        "adaptive.recover_rate=5",
        "adaptive.smoothing_s=0",
    )
    try:

        async def load():
            c = aclient(srv)
            return await asyncio.gather(
                *[c.completions.create(model="tiny-random", prompt=p, max_tokens=40) for p in PROMPTS * 2]
            )

        results = asyncio.run(load())
        served = [r.model_extra["mars"]["threshold"] for r in results]
        assert min(served) < 1.0 and all(0.6 - 1e-9 <= t <= 1.0 for t in served)
        assert all(r.model_extra["mars"]["tau_policy"] == "adaptive" for r in results)
        assert wait_for(lambda: stats(srv)["tau"] == 1.0, timeout=5)  # idle again: back to the strict end
        c = client(srv)
        low = c.completions.create(model="tiny-random", prompt="x", max_tokens=4, extra_body={"threshold": 0.1})
        assert low.model_extra["mars"]["threshold"] == 0.6  # clamped to tau_min
        assert metric(srv, "mars_tau") == 1.0
    finally:
        srv.stop()


def test_metrics_are_exposed(server):
    client(server).completions.create(model="tiny-random", prompt="count me", max_tokens=8)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "mars_requests_total",
        "mars_queue_depth",
        "mars_running_batch_size",
        "mars_tau",
        "mars_tokens_per_second",
        "mars_tokens_per_forward",
        "mars_generated_tokens_total",
        "mars_time_to_first_token_seconds_bucket",
        "mars_request_latency_seconds_bucket",
        "mars_queue_wait_seconds_bucket",
        "mars_step_seconds_bucket",
        "mars_request_tokens_per_forward_bucket",
    ):
        assert name in text, name
    assert metric_sum(server, "mars_requests_total", 'code="200"') >= 1
    assert metric_sum(server, "mars_generated_tokens_total") >= 8
    assert metric(server, "mars_tokens_per_second") > 0


# ------------------------------------------------------------------------------------------------------
# configuration and the entry point
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, match",
    [
        (["decoding=ar"], "cannot serve"),
        (["decoding.cache=block"], "cache='block'"),
        (["tau_policy=adaptive", "tau_min=0.9", "tau_max=0.8"], "above tau_max"),
        (["threshold=0.3"], "outside"),
        (["+adaptive.speed=3", "tau_policy=adaptive"], "unknown adaptive"),
        (["port=70000"], "port"),
        (["max_batch=0"], "max_batch"),
        (["max_body_bytes=100"], "max_body_bytes"),
        (["allowed_hosts=evil.example"], "allowed_hosts"),
        (["api_key=''"], "api_key"),
        (["decoding.max_step_columns=lots"], "max_step_columns"),
        (["decoding.max_step_columns=0"], "max_step_columns"),
    ],
)
def test_bad_server_configs_are_refused_before_loading(overrides, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig.from_cfg(compose_serve(BASE + overrides))


UNTRAINED_BELOW_EXACT = [["threshold=0.9"], ["tau_policy=adaptive", "tau_min=0.7"]]
EXACT_OR_TRAINED = [
    ["threshold=1.0"],
    ["tau_policy=adaptive", "tau_min=1.0"],
    ["decoding=jacobi", "threshold=0.9"],  # Jacobi accepts only guesses the model confirms: exact anyway
    ["checkpoint=bundled:adapters/smollm2-135m-mars-rank8", "threshold=0.9"],  # the MARS-trained reference
]


def untrained_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "no MARS training" in r.getMessage()]


@pytest.mark.parametrize("overrides", UNTRAINED_BELOW_EXACT)
def test_a_model_without_mars_training_served_below_the_exact_threshold_is_warned_about_before_loading(
    overrides, caplog
):
    ServeConfig.from_cfg(compose_serve(BASE + overrides))
    (warning,) = untrained_warnings(caplog)
    assert "the base model tiny-random (no MARS training)" in warning.getMessage()
    assert "verify requests stay exact" in warning.getMessage()


@pytest.mark.parametrize("overrides", EXACT_OR_TRAINED)
def test_an_exact_threshold_or_a_mars_trained_checkpoint_serves_without_that_warning(overrides, caplog):
    ServeConfig.from_cfg(compose_serve(BASE + overrides))
    assert untrained_warnings(caplog) == []


def test_verify_requests_stay_exact_on_an_untrained_model_served_below_the_exact_threshold(loaded, caplog):
    srv = start_server(loaded, "threshold=0.9")
    try:
        assert untrained_warnings(caplog)
        ref, ref_ids = offline(loaded, srv, PROMPTS[2], 20, threshold=1.0)
        r = client(srv).completions.create(
            model="tiny-random", prompt=PROMPTS[2], max_tokens=20, extra_body={"verify": True, "return_token_ids": True}
        )
        assert r.choices[0].model_extra["token_ids"] == ref_ids and r.choices[0].text == ref
        assert r.model_extra["mars"]["threshold"] == 1.0 and r.model_extra["mars"]["server_tau"] == 0.9
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            [],
            "serving the base model tiny-random (no MARS training) as 'tiny-random': tau_policy=fixed threshold=1.0 (exact",
        ),
        (
            ["checkpoint=bundled:adapters/smollm2-135m-mars-rank8", "tau_policy=adaptive", "tau_min=0.8"],
            "smollm2-135m-mars-rank8 (MARS-trained) as 'smollm2-135m-mars-rank8': tau_policy=adaptive tau 1.0 idle -> 0.8",
        ),
    ],
)
def test_the_startup_line_says_what_is_served_with_which_policy_and_threshold(overrides, says):
    line = ServeConfig.from_cfg(compose_serve(BASE + overrides)).describe()
    assert says in line and "\n" not in line


@pytest.mark.parametrize(
    "overrides, cap",
    [
        (["device=cpu"], CPU_STEP_COLUMNS),
        (["device=cuda"], None),
        (["device=cpu", "decoding.max_step_columns=12"], 12),
        (["device=cpu", "decoding.max_step_columns=null"], None),
    ],
)
def test_a_cpu_server_caps_its_step_columns_unless_told_otherwise(overrides, cap):
    """``decoding.max_step_columns=auto`` (serve.yaml): masks give way as the batch fills on a CPU, not on a GPU;
    an explicit integer or null wins.  (Evaluation's decoding configs keep no cap.)"""
    assert ServeConfig.from_cfg(compose_serve(BASE + overrides)).settings.max_step_columns == cap


def launch_serve_py(tmp_path, *overrides):
    """``python serve.py`` on a free loopback port; (process, url) once ``/health`` answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "serve.py", "model=tiny-random", f"port={port}", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    assert wait_for(up, timeout=90, every=0.2) and proc.poll() is None
    return proc, url


@pytest.mark.slow
def test_serve_py_starts_answers_and_stops_on_sigint(tmp_path):
    proc, url = launch_serve_py(tmp_path, "max_tokens=8")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-2000:]
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert "serving the base model tiny-random (no MARS training) as 'tiny-random': tau_policy=fixed" in out


@pytest.mark.slow
def test_serve_py_drains_on_sigterm_as_documented(tmp_path):
    """The real signal: the socket stays open (503, not "connection refused"), a stream that outlives the
    grace ends with an error event and [DONE], and the process exits 0."""
    # cache=none refeeds the whole text at every step: a long stream takes many seconds even on this model
    proc, url = launch_serve_py(tmp_path, "shutdown_grace_s=1", "threads=1", "decoding.cache=none")
    events, status = [], {}

    def stream():
        body = {"model": "tiny-random", "prompt": "long", "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            status["code"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert wait_for(lambda: len(events) >= 2, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 503, timeout=5)
        late = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        reader.join(30)
        assert status["code"] == 200 and events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-2][:300]
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-2000:]
