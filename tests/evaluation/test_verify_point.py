"""The lossless verify point every sweep includes beside its thresholds: threshold 1.0 decoded with verified drafts
(conf/decoding/mars_verified.yaml over the run's block, budget and cache) on the first ``verify.limit`` samples of
each task, in its own samples folder and its own rows of points.json, table.md and the plots, timed against the AR
point on the same samples; resumed like every point, refused before the model loads when its settings are bad, and
absent with ``verify.enabled=false``."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
from lm_eval_fixtures import suite, write_generation_task
from omegaconf import OmegaConf, open_dict

import mars.evaluation  # noqa: F401  (registers the run-name resolver)
from mars.config_schema import ConfigError
from mars.evaluation import run as run_eval
from mars.evaluation.config import check_config
from mars.evaluation.store import VERIFY, ResultsDir

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello.", "Name a fruit."]


@pytest.fixture
def peaked(tiny):
    """The tiny model with a sharpened head (tied to the embedding): its masks become confident enough to propose
    drafts (mars_verified's draft_threshold is 0.5), so the verify point has acceptance figures to report."""
    head = tiny.model.get_output_embeddings().weight
    kept = head.detach().clone()
    with torch.no_grad():
        head.mul_(20.0)
    yield tiny
    with torch.no_grad():
        head.copy_(kept)


@pytest.fixture
def tasks(tmp_path):
    folder = tmp_path / "tasks"
    for name in ("fx_a", "fx_b"):
        write_generation_task(folder, name, [{"question": q, "answer": "x"} for q in QUESTIONS], max_gen_toks=8)
    return folder


@pytest.fixture
def make_cfg(compose_cfg, tmp_path, tasks):
    def _make(overrides: list[str], names: tuple[str, ...] = ("fx_a",), out: str = "results"):
        cfg = compose_cfg(
            "evaluate",
            [
                "model=tiny-random",
                "decoding.max_new_tokens=8",
                "decoding.batch_size=2",
                "plots=false",
                f"output_dir={tmp_path / out}",
                *overrides,
            ],
        )
        with open_dict(cfg):
            cfg.benchmarks = OmegaConf.create(suite(tasks, *names))
        return cfg

    return _make


def _by_doc(rows: list[dict]) -> dict[int, dict]:
    return {r["doc_id"]: r for r in rows}


def test_a_sweep_includes_the_lossless_verify_point_beside_its_thresholds(make_cfg, loads, peaked):
    from mars.evaluation.plots import pareto_figure

    outcome = run_eval(make_cfg(["threshold=1.0", "verify.limit=3"], names=("fx_a", "fx_b")))
    # the reference first, the verify point right after it (the two it compares are timed together)
    assert outcome.computed == [(1.0, "fx_a"), (1.0, "fx_b"), (VERIFY, "fx_a"), (VERIFY, "fx_b")]
    assert outcome.plan.thresholds == [1.0] and len(loads) == 1
    store = ResultsDir(outcome.output_dir)
    points = {(p.get("mode"), p["task"]): p for p in outcome.points}
    for leaf in ("fx_a", "fx_b"):
        verify, ar = store.read_samples(VERIFY, leaf), _by_doc(store.read_samples(1.0, leaf))
        assert [r["doc_id"] for r in verify] == [0, 1, 2] and len(ar) == len(QUESTIONS)  # the first verify.limit
        assert [r["prompt"] for r in verify] == [ar[r["doc_id"]]["prompt"] for r in verify]
        assert [r["output_ids"] for r in verify] == [ar[r["doc_id"]]["output_ids"] for r in verify]  # lossless
        summary = store.read_summary(VERIFY, leaf)
        recorded = summary["verify"]
        assert recorded["config"] == "mars_verified" and recorded["limit"] == 3
        assert recorded["settings"]["verify"] is True and recorded["settings"]["block_size"] == 4
        assert recorded["settings"]["max_new_tokens"] == 8  # the run's budget, not mars_verified's 256
        decoder = summary["decoder"]
        assert decoder["num_drafts"] > 0  # the sharpened masks proposed drafts

        point, ref = points[("verify", leaf.upper())], points[("threshold", leaf.upper())]
        assert point["threshold"] == 1.0 and not point["is_reference"] and point["verify_lossless"]
        assert point["outputs_identical"] is True and point["n_identical"] == point["n_samples"] == 3
        assert point["accuracy"] == ref["accuracy"] and point["accuracy_from"] == "reference"
        assert point["tokens_per_forward"] == pytest.approx(
            sum(r["tokens"] for r in verify) / sum(r["forwards"] for r in verify)
        )
        assert point["mean_acceptance_length"] == pytest.approx(
            1 + decoder["num_accepted_tokens"] / decoder["num_drafts"]
        )
        # wall clock against the AR point on the same three samples (each sample's share of its batch's time)
        ar_speed = sum(ar[d]["tokens"] for d in (0, 1, 2)) / sum(ar[d]["seconds"] for d in (0, 1, 2))
        assert point["reference_tokens_per_second"] == pytest.approx(ar_speed)
        assert point["speedup"] == pytest.approx(point["tokens_per_second"] / ar_speed)
        assert point["speedup_samples"] == "same_samples" and point["machine"] == ref["machine"]
        assert ref["mode"] == "threshold" and ref["speedup"] == 1.0  # the AR point keeps its own
    average = points[("verify", "Average")]
    assert average["outputs_identical"] is True and average["n_samples"] == 6 and average["speedup"] > 0
    # the verify rows come after every threshold's: a reader taking the first row at 1.0 gets the AR point
    assert [p.get("mode") for p in outcome.points] == ["threshold"] * 3 + ["verify"] * 3
    rows = list(csv.DictReader(io.StringIO((outcome.output_dir / "points.csv").read_text())))
    assert [r["mode"] for r in rows].count("verify") == 3
    assert json.loads((outcome.output_dir / "points.json").read_text()) == json.loads(json.dumps(outcome.points))

    table = (outcome.output_dir / "table.md").read_text()
    head = "| **verify** (τ=1.0, lossless) | acc | "
    assert head + f"{100 * points[('threshold', 'FX_A')]['accuracy']:.1f} (= τ 1.0) |" in table
    assert "|  | identical | 3/3 | 3/3 | 6/6 |" in table
    assert f"|  | speed-up | {points[('verify', 'FX_A')]['speedup']:.2f}x |" in table
    block = table.split(head, 1)[1].split("| **", 1)[0]
    assert "|  | accept. len | " in block and "|  | tok/fwd | " in block
    assert "decodes at most the first 3 samples of each task" in table and "by construction" in table
    assert table.index("| **1.0** (AR) | acc |") < table.index(head)
    assert "Verify point: FX_A 3, FX_B 3." in table

    # the plots: the existing verify marker (a star named "verify (lossless)") in both panels
    curves: dict[str, list[dict]] = {}
    for p in outcome.points:
        if p["task"] == "Average":
            curves.setdefault(p["label"], []).append(p)
    fig = pareto_figure("Average", curves)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert "verify (lossless)" in [t.get_text() for t in ax.texts]
        star = next(c.lines[0] for c in ax.containers if c.get_label() == "tiny-random B=4 (verify)")
        assert star.get_marker() == "*"


class Interrupted(Exception):
    """A run stopped in the middle of the verify point."""


def test_the_verify_point_resumes_at_the_sample_and_is_skipped_once_finished(make_cfg, loads, monkeypatch):
    from mars.evaluation.lm_eval_model import MarsLM

    settings = ["threshold=1.0", "verify.limit=3", "decoding.batch_size=1"]
    decode = MarsLM._decode_batch
    verify_batches = []

    def stop_at_the_second_verify_batch(self, *args, **kwargs):
        if self.point == VERIFY:
            verify_batches.append(1)
            if len(verify_batches) == 2:
                raise Interrupted
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(MarsLM, "_decode_batch", stop_at_the_second_verify_batch)
    with pytest.raises(Interrupted):
        run_eval(make_cfg(settings))
    monkeypatch.setattr(MarsLM, "_decode_batch", decode)
    store = ResultsDir(make_cfg(settings).output_dir)
    assert store.is_complete(1.0, "fx_a") and not store.is_complete(VERIFY, "fx_a")
    assert len(store.load_partial(VERIFY, "fx_a")) == 1  # the verify sample it finished

    resumed = run_eval(make_cfg(settings))
    assert resumed.computed == [(VERIFY, "fx_a")]  # the finished AR point is not decoded again
    assert resumed.lm.generate_calls == 2  # batch size 1: the two verify samples it had not finished
    decoder = store.read_summary(VERIFY, "fx_a")["decoder"]
    assert decoder["resumed_requests"] == 1 and decoder["requests"] == 3
    assert not (store.root / "partial").exists()

    again = run_eval(make_cfg(settings))
    assert again.computed == [] and len(loads) == 2  # finished: no model load, nothing decoded
    assert again.table == resumed.table
    # another limit is another verify point: decoded again, the thresholds kept
    wider = run_eval(make_cfg(["threshold=1.0", "verify.limit=4", "decoding.batch_size=1"]))
    assert wider.computed == [(VERIFY, "fx_a")] and len(store.read_samples(VERIFY, "fx_a")) == 4


def test_verify_enabled_false_runs_no_verify_point(make_cfg, loads):
    outcome = run_eval(make_cfg(["threshold=1.0", "verify.enabled=false"]))
    assert outcome.plan.verify is None and outcome.computed == [(1.0, "fx_a")]
    assert not (outcome.output_dir / "samples" / "verify").exists()
    assert all(p["mode"] == "threshold" for p in outcome.points)
    assert "**verify**" not in outcome.table and "Verify point" not in outcome.table


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["verify.limit=0"], "verify.limit must be an integer >= 1 or null"),
        (["verify.limit=-2"], "verify.limit must be an integer >= 1 or null"),
        (["verify.limit=2.5"], "verify.limit must be an integer >= 1 or null (samples per task"),
        (["verify.enabled=sometimes"], "verify.enabled must be true or false, got 'sometimes'"),
        (["verify.decoding=mars_verifed"], "verify.decoding='mars_verifed' names no decoding config: choose one of"),
        (["verify.decoding=mars"], "verify.decoding='mars' does not verify"),
        (["verify.decoding=mars_typical"], "verify.decoding='mars_typical' is lossy"),
    ],
)
def test_bad_verify_settings_are_refused_before_the_model_loads(make_cfg, loads, tmp_path, overrides, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        run_eval(make_cfg(["threshold=1.0", *overrides]))
    assert message in str(err.value)
    assert "verify" in str(err.value) and loads == []
    assert not (tmp_path / "results").exists()  # refused before the results folder is made


def _verify_of(compose_cfg, overrides: list[str]):
    resolved = OmegaConf.to_container(compose_cfg("evaluate", ["model=tiny-random", *overrides]), resolve=True)
    return check_config(resolved).verify


def test_the_verify_point_follows_the_runs_samples_and_is_left_out_where_it_does_not_apply(compose_cfg):
    plan = _verify_of(compose_cfg, [])
    assert plan.config == "mars_verified" and plan.limit == 16 and plan.threshold == 1.0  # the default run has one
    # the AR baseline's run: the verify point decodes with MARS, on the run's block, budget and cache
    plan = _verify_of(compose_cfg, ["decoding=ar", "decoding.block_size=2", "decoding.max_new_tokens=32"])
    settings = plan.settings()
    assert settings.decoder == "mars" and settings.verify and settings.tree == "chain"
    assert (settings.block_size, settings.max_new_tokens, settings.draft_threshold) == (2, 32, 0.5)
    assert _verify_of(compose_cfg, ["verify.decoding=mars_lookup"]).settings().draft_source == "lookup"
    # where the run's own tau 1.0 point is verify, where there is no tau 1.0 point, where decoding samples: none
    assert _verify_of(compose_cfg, ["decoding=mars_verified"]) is None
    assert _verify_of(compose_cfg, ["threshold=0.9", "reference=false"]) is None
    assert _verify_of(compose_cfg, ["decoding.temperature=0.7"]) is None
    assert _verify_of(compose_cfg, ["verify.enabled=false"]) is None
