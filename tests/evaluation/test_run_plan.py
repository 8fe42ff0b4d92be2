"""What evaluate.py says before the expensive work: one line with its plan, a time estimate from the first
requests, and a warning when thresholds below 1.0 are applied to masks that had no MARS training."""

from __future__ import annotations

import logging

import pytest
from lm_eval_fixtures import suite, write_generation_task
from omegaconf import OmegaConf, open_dict

import mars.evaluation  # noqa: F401  (registers the run-name resolver)
from mars.evaluation import run as run_eval
from mars.evaluation.config import check_config
from mars.evaluation.store import write_json

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello.", "Name a fruit."]


@pytest.fixture
def events(monkeypatch, tiny):
    """Model loads routed to the tiny model; the order of log lines and loads recorded."""
    import mars.evaluation.runner as run_mod

    seen: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def fake_load(plan):
        seen.append("<model loaded>")
        return tiny

    monkeypatch.setattr(run_mod, "load_for_plan", fake_load)
    handler = Recorder(level=logging.INFO)
    logger = logging.getLogger("mars")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _suite(tmp_path) -> dict:
    folder = tmp_path / "tasks"
    folder.mkdir()
    rows = [{"question": q, "answer": "x"} for q in QUESTIONS]
    write_generation_task(folder, "fx_plan", rows, max_gen_toks=6, data_file="rows.jsonl")
    return suite(folder, "fx_plan")


def test_evaluate_states_its_plan_in_one_line_before_the_model_loads(compose_cfg, events, tmp_path):
    cfg = compose_cfg(
        "evaluate",
        [
            "model=tiny-random",
            "thresholds=[1.0,0.7]",
            "limit=3",
            "decoding.batch_size=2",
            f"output_dir={tmp_path / 'o'}",
        ],
    )
    with open_dict(cfg):
        cfg.benchmarks = OmegaConf.create(_suite(tmp_path))
    run_eval(cfg)
    plans = [line for line in events if line.startswith("plan: ")]
    assert len(plans) == 1 and "\n" not in plans[0]
    line = plans[0]
    assert events.index(line) < events.index("<model loaded>")
    assert "base model tiny-random (no MARS training)" in line and "B=4" in line and "decoding mars" in line
    assert "benchmarks fixture (fx_plan): 3 samples per threshold (limit=3)" in line
    assert "thresholds 1.0, 0.7 (2 to run)" in line and str(tmp_path / "o") in line
    assert "verify point (mars_verified, lossless) on 3 samples" in line  # limit=3 under its default 16
    # the first batch's timing gives the estimate: per threshold, and for the two thresholds of the sweep
    eta = [e for e in events if "per threshold for 3 requests" in e]
    assert eta and "over the first 2" in eta[0] and "2 thresholds to run: about" in eta[0]


def _requests(n: int):
    from lm_eval.api.instance import Instance

    return [
        Instance("generate_until", {}, (q, {"until": [], "max_gen_toks": 4}), idx=0, metadata=("t", i, 1))
        for i, q in enumerate(QUESTIONS[:n])
    ]


def test_the_estimate_comes_after_the_first_batch_and_only_when_work_is_left(tiny, caplog):
    from mars.evaluation.lm_eval_model import MarsLM

    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id, batch_size=2)
    lm.thresholds_to_run = 3
    with caplog.at_level(logging.INFO, logger="mars.evaluation.lm_eval_model"):
        lm.generate_until(_requests(5), disable_tqdm=True)
    lines = [r.getMessage() for r in caplog.records if "per threshold" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tau=1: about ") and "for 5 requests" in lines[0] and "over the first 2" in lines[0]
    assert "3 thresholds to run: about" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mars.evaluation.lm_eval_model"):
        lm.generate_until(_requests(2), disable_tqdm=True)  # one batch: done before there is anything to estimate
    assert not [r for r in caplog.records if "per threshold" in r.getMessage()]


def _checkpoint(tmp_path, tiny, objective: str):
    ckpt = tmp_path / f"ckpt-{objective}"
    tiny.model.save_pretrained(ckpt)
    tiny.tokenizer.save_pretrained(ckpt)
    meta = {"block_size": 4, "objective": objective, "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id}
    write_json(ckpt / "mars_config.json", meta)
    return ckpt


@pytest.mark.parametrize(
    "objective, overrides, warned",
    [
        (None, ["threshold=0.9"], True),  # the base model: its masks never trained
        ("ar", ["thresholds=[1.0,0.8]"], True),  # an AR SFT checkpoint: no MARS training either
        ("mars", ["threshold=0.9"], False),
        (None, ["threshold=1.0"], False),  # exact: greedy AR whatever the masks are
        (None, ["decoding=mars_verified", "reference=false"], False),  # lossless verify at 1.0
        (None, ["decoding.metric=entropy", "threshold=0.0"], False),  # entropy's exact point
        (None, ["decoding.metric=entropy", "threshold=0.5"], True),
    ],
)
def test_thresholds_below_one_on_masks_without_mars_training_are_warned_about(
    compose_cfg, tiny, tmp_path, caplog, objective, overrides, warned
):
    checkpoint = [f"checkpoint={_checkpoint(tmp_path, tiny, objective)}"] if objective else []
    resolved = OmegaConf.to_container(
        compose_cfg("evaluate", ["model=tiny-random", *checkpoint, *overrides]), resolve=True
    )
    with caplog.at_level(logging.WARNING, logger="mars.evaluation.config"):
        check_config(resolved)
    messages = [r.getMessage() for r in caplog.records if "no MARS training" in r.getMessage()]
    assert bool(messages) == warned, messages
    if warned:
        assert "untrained masks" in messages[0]
        assert ("base model tiny-random" if objective is None else f"objective {objective}") in messages[0]
