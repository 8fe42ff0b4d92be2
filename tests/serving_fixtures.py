"""The tiny random model, servers on loopback and small client helpers the serving tests share (imported
by them)."""

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hydra import compose, initialize_config_dir

from mars.decoding import generate
from mars.models import load_model
from mars.serving.config import ServeConfig
from mars.serving.server import BackgroundServer, build_state

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "model=tiny-random",
    "max_tokens=24",
    "max_batch=4",
    "max_queue=8",
    "max_model_len=512",
    "shutdown_grace_s=2",
    "warmup=false",
]
PROMPTS = [
    "The sea is",
    "Once upon a time",
    "def add(a, b):",
    "Paris is the capital of",
    "1, 2, 3,",
    "A haiku about autumn",
    "Dear diary, today",
]


def compose_serve(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="serve", overrides=list(overrides))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine two OpenMP threads per forward spin against each other
    (the tiny model's steps get several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def loaded():
    cfg = compose_serve(BASE)
    return load_model("tiny-random", tiny=dict(cfg.model.tiny))


def start_server(loaded, *overrides):
    sc = ServeConfig.from_cfg(compose_serve(BASE + list(overrides)))
    return BackgroundServer(build_state(sc, loaded)).start()


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded)
    yield srv
    srv.stop()


def client(srv, **kw):
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=srv.url + "/v1", max_retries=0, **kw)


def aclient(srv):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def offline(loaded, srv, prompt, max_tokens, chat=False, **kw):
    """``generate`` with the server's decoding settings, for one prompt (outputs do not depend on the batch)."""
    settings = srv.state.settings.replace(max_new_tokens=max_tokens, **kw)
    out = generate(loaded.model, loaded.tokenizer, [prompt], settings=settings, chat_template=chat)
    return out.texts[0], out.token_ids[0]


def wait_for(predicate, timeout=10.0, every=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def stats(srv):
    return httpx.get(srv.url + "/stats").json()


def metric(srv, name):
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.startswith(name + " ") or line.split(" ")[0] == name:
                return float(line.rsplit(" ", 1)[1])
    return None


def metric_sum(srv, prefix, must_contain=""):
    total = 0.0
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(prefix) and must_contain in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_openai_error(response, status, param="unset", code="unset"):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with this status."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param != "unset":
        assert err["param"] == param, err
    if code != "unset":
        assert err["code"] == code, err
    return err
