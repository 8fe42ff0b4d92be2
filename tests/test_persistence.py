"""The ground-floor persistence helpers every layer writes through (mars.persistence): append-only JSONL
that survives a kill mid-write, strict JSONL with the bad line named, folders that appear whole, fingerprint
differences compared as JSON stores them, and the training losses CSV written by Lightning's CSVLogger."""

import json

import numpy as np
import pytest

from mars.persistence import (
    append_jsonl,
    atomic_dir,
    fingerprint_differences,
    read_appended_jsonl,
    read_jsonl,
)
from mars.training.loss_history import LOSS_COLUMNS, LossesLogger, read_losses


def test_a_torn_line_is_skipped_and_the_next_append_starts_on_a_fresh_line(tmp_path):
    path = tmp_path / "cache.jsonl"
    append_jsonl(path, [{"id": "a"}, {"id": "b"}])
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"id": "c", "te')  # a batch cut by a kill
    assert read_appended_jsonl(path) == [{"id": "a"}, {"id": "b"}]
    append_jsonl(path, [{"id": "d"}])
    assert read_appended_jsonl(path) == [{"id": "a"}, {"id": "b"}, {"id": "d"}]  # "d" not glued to the torn line
    # repair: the file is rewritten with the whole rows only, so a plain JSONL reader accepts it
    assert read_appended_jsonl(path, repair=True) == [{"id": "a"}, {"id": "b"}, {"id": "d"}]
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b"}, {"id": "d"}]


def test_a_last_line_without_its_newline_counts_as_torn_even_if_it_parses(tmp_path):
    path = tmp_path / "cache.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}')  # the kill came between the object and its newline
    assert read_appended_jsonl(path) == [{"id": "a"}]
    assert read_appended_jsonl(tmp_path / "missing.jsonl") == []


def test_repair_keeps_whole_lines_byte_for_byte_and_leaves_a_clean_file_untouched(tmp_path):
    path = tmp_path / "rows.jsonl"
    clean = '{"k": "é",  "n": 1}\n{"k": 2}\n'
    path.write_text(clean, encoding="utf-8")
    before = path.stat().st_mtime_ns, path.stat().st_ino
    read_appended_jsonl(path, repair=True)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before  # nothing to repair: not rewritten
    path.write_text(clean + "not json\n" + '{"k": 3', encoding="utf-8")
    read_appended_jsonl(path, repair=True)
    assert path.read_text(encoding="utf-8") == clean


def test_strict_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"samples.jsonl, line 3: not valid JSON"):
        read_jsonl(path)


def test_atomic_dir_replaces_by_default_and_can_keep_a_copy_another_process_finished(tmp_path):
    target = tmp_path / "model"
    with atomic_dir(target) as tmp:
        (tmp / "w").write_text("first")
    with atomic_dir(target) as tmp:
        (tmp / "w").write_text("second")
    assert (target / "w").read_text() == "second"
    with atomic_dir(target, replace=False) as tmp:
        (tmp / "w").write_text("third")
    assert (target / "w").read_text() == "second"
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "broken") as tmp:
        (tmp / "w").write_text("half")
        raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no half folder, no temporary left


def test_fingerprint_differences_compare_values_as_json_stores_them():
    saved = json.loads(json.dumps({"a": {"betas": [0.9, 0.95], "lr": 0.5}, "n": 3}))
    assert fingerprint_differences(saved, {"a": {"betas": (0.9, 0.95), "lr": np.float64(0.5)}, "n": 3}) == []
    assert fingerprint_differences(saved, {"a": {"betas": [0.9, 0.99], "lr": 0.5}}) == [
        ("a.betas", [0.9, 0.95], [0.9, 0.99]),
        ("n", 3, "<missing>"),
    ]


def test_the_losses_csv_keeps_its_columns_and_is_cut_back_on_resume(tmp_path):
    logger = LossesLogger(tmp_path)
    logger.keep_until(0)  # a fresh run: the header only
    for step in (1, 2, 3):
        logger.log_metrics({"loss": 4.0 / step, "loss_ar": 1.0, "tokens_per_s": 100.0}, step=step)
    lines = (tmp_path / "losses.csv").read_text().splitlines()
    assert lines[0] == ",".join(LOSS_COLUMNS) and lines[1] == "1,4.0,,1.0,100.0"  # loss_mask absent: empty
    with open(tmp_path / "losses.csv", "a") as handle:
        handle.write("4,1.0,")  # torn by a kill
    assert [r["step"] for r in read_losses(tmp_path / "losses.csv")] == [1, 2, 3]
    resumed = LossesLogger(tmp_path)  # a rerun resuming from the checkpoint of step 2
    resumed.keep_until(2)
    resumed.log_metrics({"loss": 1.5, "loss_ar": 1.0, "tokens_per_s": 90.0}, step=3)
    rows = read_losses(tmp_path / "losses.csv")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 4.0), (2, 2.0), (3, 1.5)]
    assert "loss_mask" not in rows[0] and rows[2]["tokens_per_s"] == 90.0
