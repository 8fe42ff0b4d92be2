"""A server started with a tree shape, its request field ``tree``, the checks of its settings and of the checkpoint's
stored records before any model loads, and failures inside the engine pinned on the one request they belong to, on
the tiny random model over loopback."""

import json
import re
import shutil
import threading
import time

import httpx
import pytest
from serving_fixtures import (  # noqa: F401  (fixtures)
    BASE,
    PROMPTS,
    assert_openai_error,
    compose_serve,
    loaded,
    offline,
    one_thread,
    start_server,
    stats,
    wait_for,
)

from mars.decoding.settings import DecodingSettings
from mars.serving.config import ServeConfig
from mars.serving.scheduler import Job


def post(srv, body):
    return httpx.post(srv.url + "/v1/completions", json={"model": "tiny-random", **body}, timeout=60)


@pytest.fixture(scope="module")
def tree_server(loaded):
    srv = start_server(loaded, "decoding.tree=2x1")  # a plain key of the decoding config: no '+'
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------------------------
# a server with a tree shape
# ------------------------------------------------------------------------------------------------------
def test_a_tree_server_serves_sampled_and_non_verify_requests(loaded, tree_server):
    assert tree_server.state.settings.tree == "2,1"
    for verify in (False, True):
        for seed in (3, 4):
            r = post(
                tree_server,
                {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.8, "seed": seed, "verify": verify},
            )
            assert r.status_code == 200, r.text
            again = post(
                tree_server,
                {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.8, "seed": seed, "verify": verify},
            )
            assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # its seed's sample
    greedy, _ = offline(loaded, tree_server, PROMPTS[1], 16, tree="chain")  # greedy AR
    for body in ({}, {"verify": True}, {"verify": True, "tree": "chain"}, {"verify": True, "tree": "2x1"}):
        r = post(tree_server, {"prompt": PROMPTS[1], "max_tokens": 16, **body})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (body, r.text)


def test_a_requests_tree_is_the_servers_or_a_chain_and_is_checked_like_the_other_fields(tree_server):
    assert "tree" in DecodingSettings.per_request_fields()
    for tree, says in (("3,1", "this server drafts tree='2,1'"), ("bogus", "tree must be"), ("0", "tree must be")):
        err = assert_openai_error(
            post(tree_server, {"prompt": "x", "max_tokens": 4, "verify": True, "tree": tree}), 400, "tree"
        )
        assert says in err["message"], err
    assert_openai_error(post(tree_server, {"prompt": "x", "max_tokens": 4, "tree": [2, 1]}), 400, "tree")


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["decoding.draft_length=1", "decoding.tree=2x1"],
            "decoding.tree='2,1' is 2 deep, but a verifying row drafts at most 1",
        ),
        (["decoding.window=2", "decoding.tree=2x1"], "is 2 deep"),
        (["decoding.tree=4x"], "tree must be"),
    ],
)
def test_a_tree_its_verify_requests_could_not_draft_is_refused_before_the_model_loads(overrides, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ServeConfig.from_cfg(compose_serve(BASE + overrides))


def test_every_decoding_setting_is_a_key_of_the_decoding_config_with_the_settings_default():
    """``serve.py decoding.tree=4`` (no '+'): every DecodingSettings field is a key of the base decoding config, at
    the dataclass's default (the threshold is each entry point's own top-level key)."""
    import dataclasses

    import yaml

    from mars.paths import conf_dir

    base = yaml.safe_load((conf_dir() / "decoding" / "mars.yaml").read_text())
    for f in dataclasses.fields(DecodingSettings):
        if f.name == "threshold":
            assert f.name not in base
        elif f.name != "block_size":  # null: the checkpoint's training block size
            assert f.name in base and base[f.name] == f.default, f.name
    cfg = compose_serve(BASE + ["decoding.tree=4", "decoding.tree_masks=top", "decoding.draft_threshold=0.3"])
    assert ServeConfig.from_cfg(cfg).settings.tree == "4"


# ------------------------------------------------------------------------------------------------------
# the checkpoint's stored records, before the model loads
# ------------------------------------------------------------------------------------------------------
def shipped_copy(tmp_path):
    from mars.paths import bundled_path

    folder = tmp_path / "adapter"
    shutil.copytree(bundled_path("bundled:adapters/smollm2-135m-mars-rank8"), folder)
    return folder


@pytest.mark.parametrize(
    "field, change, says",
    [
        ("draft_acceptance", lambda d: {**d, "conditional": [["x"] * 4] * 3}, "draft_acceptance.conditional must be"),
        ("draft_acceptance", lambda d: {**d, "checkpoint": "sha256:another"}, "draft_acceptance.checkpoint: "),
        ("calibration", lambda c: {**c, "temperatures": None}, "calibration.temperatures must be"),
        ("calibration", lambda c: {**c, "temperatures": [1e-3, 1.0, 1.0]}, "calibration.temperatures must be"),
    ],
)
def test_a_bad_stored_record_is_refused_naming_file_and_field_before_the_model_loads(tmp_path, field, change, says):
    folder = shipped_copy(tmp_path)
    path = folder / "mars_config.json"
    data = json.loads(path.read_text())
    data[field] = change(data[field])
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}: {says}"):
        ServeConfig.from_cfg(compose_serve(BASE + [f"checkpoint={folder}"]))


# ------------------------------------------------------------------------------------------------------
# one bad request never fails the others of its step
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def broken_table_server(loaded):
    """A tree server whose model carries a malformed acceptance table (set on the model, past the loader's check):
    the tree of the first greedy verify request cannot be resolved, every other request can decode."""
    loaded.model.mars_draft_acceptance = {"conditional": [["x", 0.5]] * 3}
    srv = start_server(loaded, "decoding.tree=2x1", "max_tokens=40")
    yield srv
    srv.stop()
    loaded.model.mars_draft_acceptance = None


def run_jobs(srv, jobs, timeout=60.0):
    """Submit ``jobs`` to the engine loop in one go (admitted in the same iteration) and collect their last events."""
    done, finished = {}, threading.Event()

    def sink(event):
        if event.done:
            done[event.job.index] = event
            if len(done) == len(jobs):
                finished.set()

    for i, job in enumerate(jobs):
        job.index, job.sink, job.streaming = i, sink, False
    srv.state.loop.submit(jobs)
    assert finished.wait(timeout)
    return [done[i] for i in range(len(jobs))]


def test_a_request_that_fails_in_its_admission_or_first_step_fails_alone(loaded, broken_table_server):
    srv = broken_table_server
    tok = loaded.tokenizer
    refs = [offline(loaded, srv, p, 20, tree="chain")[1] for p in PROMPTS[:3]]
    jobs = [
        Job(tok(PROMPTS[0])["input_ids"], 20),
        Job(tok(PROMPTS[1])["input_ids"], 20, verify=True, threshold=1.0),  # its tree cannot be resolved
        Job(tok(PROMPTS[2])["input_ids"], 20, temperature=0.0),
    ]
    plain, verify, other = run_jobs(srv, jobs)  # admitted together into an empty engine
    assert verify.error and verify.status == 500 and "draft_acceptance.conditional must be" in verify.error
    assert plain.error is None and jobs[0].token_ids == refs[0]
    assert other.error is None and jobs[2].token_ids == refs[2]
    assert srv.state.loop.alive and wait_for(lambda: stats(srv)["running"] == 0)


def test_a_request_joining_running_rows_that_fails_in_its_first_step_fails_alone(loaded, broken_table_server):
    srv = broken_table_server
    ref, _ = offline(loaded, srv, PROMPTS[3], 40, tree="chain")
    engine, real = srv.state.loop.engine, srv.state.loop.engine.step

    def slow_step():  # 40 tokens take more than a second: the plain request is surely running
        time.sleep(0.03)
        return real()

    engine.step = slow_step
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", post(srv, {"prompt": PROMPTS[3], "max_tokens": 40}))
    )
    worker.start()
    assert wait_for(lambda: stats(srv)["running"] == 1)
    bad = post(srv, {"prompt": PROMPTS[4], "max_tokens": 8, "verify": True})
    err = assert_openai_error(bad, 500)
    assert "draft_acceptance.conditional must be" in err["message"]
    worker.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == ref
    assert srv.state.loop.engine is engine  # nothing was rebuilt: the running row never noticed


def test_a_step_that_fails_before_its_rows_decoded_anything_fails_only_the_row_it_fails_with(
    loaded, tree_server, monkeypatch
):
    """Fault injection: every step holding the row of budget 13 raises (as a row whose forward breaks would).  The
    three jobs admitted together lose their first step; none had a token, so each is admitted again on its own, and
    only the one the failure follows fails."""
    from mars.decoding.engine import DecodeEngine

    srv = tree_server
    real = DecodeEngine.step

    def step(self):
        if any(r.max_new_tokens == 13 for r in [*self.rows.records.requests, *self.joining]):
            raise RuntimeError("this row's forward breaks")
        return real(self)

    monkeypatch.setattr(DecodeEngine, "step", step)
    tok = loaded.tokenizer
    refs = [offline(loaded, srv, p, 20, tree="chain")[1] for p in PROMPTS[:2]]
    jobs = [Job(tok(PROMPTS[5])["input_ids"], 13)] + [Job(tok(p)["input_ids"], 20) for p in PROMPTS[:2]]
    bad, *good = run_jobs(srv, jobs)
    assert bad.status == 500 and "this row's forward breaks" in bad.error
    assert [e.error for e in good] == [None, None] and [j.token_ids for j in jobs[1:]] == refs
