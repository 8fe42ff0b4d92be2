"""The quality suite (conf/benchmarks/quality.yaml): the held-out agreement task and the short-answer tasks
of eval/offline/{heldout,quality}/, their scorers on hand-written answers, the committed data against its
builder and the other prompt sets, and the whole suite end to end on the tiny random model."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from module_loading import load_module

REPO = Path(__file__).resolve().parents[2]
QUALITY = REPO / "eval" / "offline" / "quality"
HELDOUT = REPO / "eval" / "offline" / "heldout"
SHORT = ["capitals", "continents", "first_letter", "next_number", "copy"]
SUITE_LEAVES = ["mars_heldout_quick", *[f"mars_quality_{t}" for t in SHORT]]
ROWS = 100  # per short-answer task


@pytest.fixture(scope="module")
def qu():
    return load_module(QUALITY / "utils.py", "quality_utils")


@pytest.fixture(scope="module")
def hu():
    return load_module(HELDOUT / "utils.py", "heldout_utils")


@pytest.fixture(scope="module")
def builder():
    return load_module(REPO / "scripts" / "build_quality_tasks.py", "build_quality_tasks")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def data():
    return {t: read_jsonl(QUALITY / "data" / f"{t}.jsonl") for t in SHORT}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Every task of the suite (and the full held-out task) built by lm-eval from another directory."""
    import os

    from mars.evaluation.tasks import expand_suite, suite_from_config, task_manager

    suite = expand_suite(suite_from_config(yaml.safe_load((REPO / "conf" / "benchmarks" / "quality.yaml").read_text())))
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    try:
        return suite, task_manager(suite).load([*suite.leaves, "mars_heldout"])
    finally:
        os.chdir(old)


def docs(loaded, name):
    return list(loaded[1]["tasks"][name].test_docs())


# ------------------------------------------------------------------------------------------------
# the suite and its tasks
# ------------------------------------------------------------------------------------------------
def test_suite_names_the_agreement_task_and_the_short_answer_tasks(loaded):
    suite, tasks = loaded
    assert suite.name == "quality" and suite.leaves == SUITE_LEAVES and suite.apply_chat_template
    cfg = yaml.safe_load((REPO / "conf" / "benchmarks" / "quality.yaml").read_text())
    scores = {t["name"]: t.get("score", "metric") for t in cfg["tasks"]}
    assert scores["mars_heldout_quick"] == "chrf" and all(scores[f"mars_quality_{t}"] == "metric" for t in SHORT)
    sizes = {name: len(docs(loaded, name)) for name in [*SUITE_LEAVES, "mars_heldout"]}
    assert sizes == {"mars_heldout_quick": 80, "mars_heldout": 400, **{f"mars_quality_{t}": ROWS for t in SHORT}}
    for name in SUITE_LEAVES:
        gen = tasks["tasks"][name].config.generation_kwargs
        assert gen["do_sample"] is False and tasks["tasks"][name].OUTPUT_TYPE == "generate_until", name
        assert gen["max_gen_toks"] <= (96 if name == "mars_heldout_quick" else 48), name
    assert "\n" in tasks["tasks"]["mars_quality_capitals"].config.generation_kwargs["until"]
    assert "\n\n" not in tasks["tasks"]["mars_heldout_quick"].config.generation_kwargs["until"]  # free text


def test_heldout_task_reads_the_prompt_file_in_place(loaded, hu):
    rows = read_jsonl(REPO / "data" / "prompts" / "heldout.jsonl")
    full = docs(loaded, "mars_heldout")
    assert [d["prompt"] for d in full] == [r["prompt"] for r in rows]
    quick = docs(loaded, "mars_heldout_quick")
    assert [d["id"] for d in quick] == [r["id"] for r in hu.stratified(rows, 80)]
    task = loaded[1]["tasks"]["mars_heldout_quick"]
    assert task.doc_to_text(quick[0]) == quick[0]["prompt"]
    # never copied under eval/**/data/ (mars.training.prompt_overlap scans those files as evaluation prompts)
    held = {r["prompt"] for r in rows}
    for path in (REPO / "eval").glob("**/data/*.jsonl"):
        texts = {v for row in read_jsonl(path) for v in row.values() if isinstance(v, str)}
        assert not held & texts, path


def test_stratified_subset(hu):
    rows = [{"id": str(i), "category": c} for i, c in enumerate(["qa"] * 60 + ["code"] * 30 + ["chat"] * 10)]
    sub = hu.stratified(rows, 10)
    assert Counter(r["category"] for r in sub) == {"qa": 6, "code": 3, "chat": 1}
    assert [r["id"] for r in sub if r["category"] == "qa"] == [str(i) for i in range(6)]  # file order
    assert hu.stratified(rows, 7) == hu.stratified(rows, 7) and len(hu.stratified(rows, 7)) == 7
    assert hu.stratified(rows, None) == rows and hu.stratified(rows, 500) == rows
    with pytest.raises(ValueError):
        hu.stratified(rows, 0)
    assert hu.process_results({}, ["  "]) == {"nonempty": 0.0} and hu.process_results({}, ["x"]) == {"nonempty": 1.0}


def test_heldout_loader_refuses_bad_files(hu, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks fields \['category'\]"):
        hu.load_heldout({"test": str(bad)})
    with pytest.raises(FileNotFoundError, match="missing"):
        hu.load_heldout({"test": str(tmp_path / "none.jsonl")})


# ------------------------------------------------------------------------------------------------
# scorers
# ------------------------------------------------------------------------------------------------
def test_gold_answers_score_full_marks(loaded):
    for t in SHORT:
        task = loaded[1]["tasks"][f"mars_quality_{t}"]
        for doc in docs(loaded, f"mars_quality_{t}"):
            assert task.process_results(doc, [doc["answer"]])["exact_match"] == 1.0, (t, doc)


@pytest.mark.parametrize(
    "task, doc, response, right",
    [
        ("capitals", {"answer": "Ankara", "country": "Turkey"}, "The capital city of Turkey is Ankara.", True),
        ("capitals", {"answer": "Ankara", "country": "Turkey"}, "The capital city of Turkey is Istanbul.", False),
        ("capitals", {"answer": "Ankara", "country": "Turkey"}, "Cairo or Ankara.", False),  # the first one named
        ("capitals", {"answer": "Ankara", "country": "Turkey"}, "\nAnkara", True),
        ("capitals", {"answer": "Kyiv", "country": "Ukraine"}, "Kiev", True),  # an alias
        ("capitals", {"answer": "Brasilia", "country": "Brazil"}, "Brasília", True),  # accents ignored
        ("capitals", {"answer": "Ankara", "country": "Turkey"}, "Ankara.\nNo, Cairo.", True),  # first line only
        (
            "continents",
            {"answer": "Asia", "country": "Vietnam"},
            "Vietnam is a continent located in Southeast Asia.",
            True,
        ),
        ("continents", {"answer": "Asia", "country": "Vietnam"}, "Africa, Asia, Europe.", False),
        ("continents", {"answer": "South America", "country": "Chile"}, "South America", True),
        ("continents", {"answer": "North America", "country": "Cuba"}, "Cuba is in South America.", False),
        ("continents", {"answer": "Oceania", "country": "Australia"}, "Australia is in Australia.", False),  # blanked
        ("continents", {"answer": "Oceania", "country": "Fiji"}, "Fiji is in Australia.", True),
        ("first_letter", {"answer": "G"}, 'The first letter of the word "garden" is "G".', True),
        ("first_letter", {"answer": "G"}, 'The first letter of the word "garden" is "A".', False),
        ("first_letter", {"answer": "Y"}, 'The letter "Y" is a special letter.', True),  # "is a" is an article
        ("first_letter", {"answer": "W"}, "It starts with a W.", True),
        ("first_letter", {"answer": "B"}, "b", True),
        ("first_letter", {"answer": "B"}, "The word is interesting.", False),
        ("next_number", {"answer": "25", "number": 24}, "The number that comes after 24 is 25.", True),
        ("next_number", {"answer": "25", "number": 24}, "24 + 1 = 25", True),
        ("next_number", {"answer": "9", "number": 8}, "The number that comes after 8 is 10.", False),
        ("next_number", {"answer": "12", "number": 11}, "11 is not a number that can be added.", False),
        ("next_number", {"answer": "1001", "number": 1000}, "1,001", True),
        ("next_number", {"answer": "5", "number": 4}, "4.5", False),
        ("copy", {"answer": "A cat sat on the mat."}, '"A cat sat on the  mat."', True),
        ("copy", {"answer": "A cat sat on the mat."}, "A cat sat on a mat.", False),
        ("copy", {"answer": "A cat sat on the mat."}, "A cat sat on the mat", False),
    ],
)
def test_scorers_on_hand_written_answers(qu, task, doc, response, right):
    assert getattr(qu, f"process_{task}")(doc, [response])["exact_match"] == float(right)


def test_copy_grades_near_misses(qu):
    gold = "The old farmer painted a blue wooden door near the river last Tuesday."
    exact = qu.process_copy({"answer": gold}, [gold])
    near = qu.process_copy({"answer": gold}, [gold.replace("blue", "red")])
    far = qu.process_copy({"answer": gold}, ["I cannot help with that."])
    assert exact == {"exact_match": 1.0, "chrf": 1.0}
    assert near["exact_match"] == 0.0 and 0.7 < near["chrf"] < 1.0 and far["chrf"] < 0.3


# ------------------------------------------------------------------------------------------------
# committed data
# ------------------------------------------------------------------------------------------------
def test_committed_rows_are_well_formed(data, builder):
    info = json.loads((QUALITY / "build_info.json").read_text())
    assert info["size"] == builder.SIZE == ROWS and info["source"]["sha256"] == builder.GEONAMES.sha256
    for t, rows in data.items():
        assert len(rows) == info["tasks"][t]["rows"] == ROWS, t
        assert len({r["id"] for r in rows}) == ROWS and len({r["question"] for r in rows}) == ROWS, t
        for r in rows:
            assert r["question"].strip() and str(r["answer"]).strip(), r
    caps = data["capitals"]
    assert all(not builder._names_nest(r["country"], r["answer"]) for r in caps)  # no answer in the question
    assert {r["answer"] for r in data["continents"]} <= set(builder.CONTINENTS.values())
    shares = Counter(r["answer"] for r in data["continents"])
    assert max(shares.values()) / ROWS < 0.35  # no continent is a free 35%
    assert all(r["answer"] == r["word"][0].upper() and r["word"][0] not in "ai" for r in data["first_letter"])
    assert all(int(r["answer"]) == r["number"] + 1 for r in data["next_number"])
    assert all(r["question"].endswith("\n\n" + r["answer"]) for r in data["copy"])


def test_synthetic_tasks_rebuild_identically(data, builder):
    """The tasks that need no download, rebuilt from the seed, are the committed files (minus any row the
    overlap check dropped at build time)."""
    info = json.loads((QUALITY / "build_info.json").read_text())
    rebuilt = builder.synthetic_candidates(info["seed"])
    for t in ("first_letter", "next_number", "copy"):
        dropped = set(info["tasks"][t]["dropped_for_overlap"])
        assert [r for r in rebuilt[t] if r["id"] not in dropped][:ROWS] == data[t], t
    assert builder.synthetic_candidates(info["seed"] + 1)["copy"][:ROWS] != data["copy"]


def test_no_overlap_with_training_prompts_or_other_eval_sets(data, builder):
    from mars.training.prompt_overlap import EvalOverlap

    questions = [r["question"] for rows in data.values() for r in rows]
    ours = EvalOverlap(questions)
    prompts = builder.prompt_texts(REPO)
    assert not [p for p in prompts if ours(p)][:5]
    others = EvalOverlap(builder.other_eval_texts(REPO))
    assert not [q for q in questions if others(q)][:5]


def test_overlap_filter_drops_a_candidate_that_a_training_prompt_contains(builder):
    cands = [
        {"id": "a", "question": "What is the capital city of Freedonia? Answer with the name of the city only."},
        {"id": "b", "question": "What is the capital city of Sylvania? Answer with the name of the city only."},
    ]
    prompts = ["Quiz time. what is the capital city of freedonia? answer with the name of the city only. Thanks!"]
    kept, dropped = builder.drop_overlaps(cands, prompts, ["An unrelated evaluation prompt about the weather today."])
    assert [c["id"] for c in kept] == ["b"] and dropped[0]["id"] == "a"
    assert "training/held-out prompt" in dropped[0]["dropped_because"]
    kept, dropped = builder.drop_overlaps(cands, [], [cands[1]["question"]])
    assert [c["id"] for c in kept] == ["a"] and "another eval set" in dropped[0]["dropped_because"]


def test_readmes_record_sources_licences_and_measured_scores(builder):
    quality = (QUALITY / "README.md").read_text()
    for needle in (
        builder.GEONAMES.pin,
        builder.GEONAMES.sha256,
        "CC BY 4.0",
        "MIT",
        "python scripts/build_quality_tasks.py",
        "Measured",
    ):
        assert needle in quality, needle
    for t in SHORT:
        assert f"mars_quality_{t}" in quality, t
    heldout = (HELDOUT / "README.md").read_text()
    assert "data/prompts/heldout.jsonl" in heldout and "mars_heldout_quick" in heldout


# ------------------------------------------------------------------------------------------------
# end to end on the tiny random model
# ------------------------------------------------------------------------------------------------
def test_quality_suite_end_to_end_on_tiny_model(compose_cfg, tmp_path):
    from mars.evaluation import run as run_eval
    from mars.evaluation.agreement import chrf
    from mars.evaluation.store import ResultsDir

    out = tmp_path / "quality"
    cfg = compose_cfg(
        "evaluate",
        [
            "model=tiny-random",
            "benchmarks=quality",
            "limit=2",
            "thresholds=[1.0,0.3]",
            "decoding.max_new_tokens=12",
            "verify.enabled=false",  # the verify point has its own tests (test_verify_point.py)
            f"output_dir={out}",
        ],
    )
    outcome = run_eval(cfg)
    cell = {(p["threshold"], p["task"]): p for p in outcome.points}
    labels = [spec.label for spec in outcome.plan.suite.tasks]
    assert set(cell) == {(t, c) for t in (1.0, 0.3) for c in [*labels, "Average"]}
    held = labels[0]
    assert cell[(1.0, held)]["score"] == "chrf" and cell[(1.0, held)]["accuracy"] == 1.0
    store = ResultsDir(out)
    ref = {r["doc_id"]: r for r in store.read_samples(1.0, "mars_heldout_quick")}
    low = store.read_samples(0.3, "mars_heldout_quick")
    assert len(low) == 2 and all(r["prompt"].startswith("<|im_start|>") for r in low)
    expected = sum(chrf(r["output"], ref[r["doc_id"]]["output"]) for r in low) / 2
    assert cell[(0.3, held)]["accuracy"] == pytest.approx(expected) == cell[(0.3, held)]["agreement_chrf"]
    assert cell[(0.3, held)]["tokens_per_forward"] > 1.0  # the random model accepts several tokens per step
    lo, hi = cell[(0.3, held)]["tokens_per_forward_lo"], cell[(0.3, held)]["tokens_per_forward_hi"]
    assert lo <= cell[(0.3, held)]["tokens_per_forward"] <= hi
    for p in outcome.points:
        if p["accuracy"] is not None and p["accuracy_lo"] is not None:
            assert p["accuracy_lo"] - 1e-9 <= p["accuracy"] <= p["accuracy_hi"] + 1e-9, p["task"]
    if any("fidelity" in r for r in low):  # the lm-eval model records per-token fidelity
        assert cell[(0.3, held)]["mask_share"] > 0
    table = (out / "table.md").read_text()
    assert "## Agreement with the τ = 1.0 output" in table and "|  | 95% CI |" in table
    assert sum(line.startswith("|  | tok/fwd |") for line in table.splitlines()) == 2
    pngs = sorted(p.name for p in out.glob("pareto_*.png"))
    assert len(pngs) == len(labels) + 1 and all((out / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
