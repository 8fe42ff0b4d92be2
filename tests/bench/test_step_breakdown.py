"""``mars-bench step-breakdown``: where verified decoding's time goes, and whether a miss predicts a miss."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from mars.bench.step_breakdown import DECODERS, Recorder, draft_transitions

COMMON = ["--model", "tiny-random", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "4", "--threads", "1"]


def run_breakdown(*args: str) -> subprocess.CompletedProcess:
    """``python -m mars.bench step-breakdown ARGS`` from the repository root (the default prompts file)."""
    cmd = [sys.executable, "-m", "mars.bench", "step-breakdown", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_draft_transitions_count_what_follows_a_step_with_and_without_a_draft():
    # (drafts fed, passed) per step; step t+1 fed drafts <=> step t's masks proposed one
    trace = [(0, 0), (2, 1), (0, 0), (1, 1), (3, 0), (0, 0), (0, 0)]
    stats = draft_transitions([trace])
    # proposed per step (from the next step's feed): [T, F, T, T, F, F]; transitions TF, FT, TT, TF, FF
    assert stats["transitions"] == 5
    assert stats["p_draft_after_none"] == 0.5  # FT, FF
    assert stats["p_draft_after_draft"] == 1 / 3  # TF, TT, TF
    assert stats["p_draft"] == 2 / 5


def test_the_recorder_leaves_the_engine_unwrapped():
    from mars.decoding import engine, lean

    before = (lean.LeanDecoder.__call__, engine.DecodeEngine._draft_stats)
    with Recorder():
        assert (lean.LeanDecoder.__call__, engine.DecodeEngine._draft_stats) != before
    assert (lean.LeanDecoder.__call__, engine.DecodeEngine._draft_stats) == before


def test_the_breakdown_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = run_breakdown(*COMMON, "--trace-prompts", "1", "--trace-tokens", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "breakdown.json").read_text())["summary"]
    assert set(summary) == set(DECODERS)
    assert summary["ar-cursor"]["tokens_per_forward"] == 1.0
    assert all(s["tokens_per_s"] > 0 for s in summary.values())
    assert "| ar-cursor | 1 | no |" in (out / "breakdown.md").read_text()


@pytest.mark.slow  # two more runs of the tool (about 15 s); the default suite runs it end to end once
def test_the_breakdown_times_a_chosen_subset_and_other_checkpoints_beside_ar(tmp_path):
    out = tmp_path / "out"
    args = ["--trace-prompts", "0", "--decoders", "verify", "--checkpoints", "tiny-random", "--out", str(out)]
    proc = run_breakdown(*COMMON, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "breakdown.json").read_text())["summary"]
    assert list(summary) == ["ar-cursor", "verify", "verify, checkpoint 1 (tiny-random)"]
    proc = run_breakdown(*COMMON, "--decoders", "verify;jacobi", "--out", str(out))
    assert proc.returncode == 2 and "unknown ['jacobi']" in proc.stderr
