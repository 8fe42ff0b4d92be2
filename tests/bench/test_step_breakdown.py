"""``mars-bench step-breakdown``: where verified decoding's time goes, and whether a miss predicts a miss."""

import argparse
import json
import subprocess
import sys

import pytest
from conftest import REPO

from mars.bench.step_breakdown import DECODERS, Recorder, draft_transitions, time_decoders

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


def class_attributes() -> dict:
    """Every attribute of the engine's and the forwards' classes, by class."""
    from mars.decoding import engine, forward, lean

    return {cls: dict(vars(cls)) for cls in (engine.DecodeEngine, forward.ModelRunner, lean.LeanDecoder)}


def test_the_recorder_sees_every_forward_with_its_columns_and_changes_no_class(tiny):
    from mars.decoding import generate

    before = class_attributes()
    prompt = tiny.tokenizer("The quick brown fox")["input_ids"]
    ar, verify = Recorder(), Recorder()
    ar_result = generate(
        tiny.model, tiny.tokenizer, [prompt], max_new_tokens=6, observers=[ar], **DECODERS["ar-cursor"]
    )
    result = generate(tiny.model, tiny.tokenizer, [prompt], max_new_tokens=6, observers=[verify], **DECODERS["verify"])
    assert class_attributes() == before
    # AR in the engine: the prompt's prefill, then one column (no masks, no drafts) per token
    assert len(ar.steps) == ar_result.stats.forwards == len(ar_result.token_ids[0])
    assert [s.columns for s in ar.steps] == [len(prompt)] + [1] * (len(ar.steps) - 1)
    assert not any(s.masks or s.drafts for s in ar.steps)
    # verify: one record per forward; a decode step feeds the new token, its drafts and its masks
    assert len(verify.steps) == result.stats.forwards
    assert verify.steps[0].columns > len(prompt) and verify.steps[0].masks  # the prefill's masks draft
    assert all(s.masks == (s.columns > 1 + s.drafts) for s in verify.steps[1:])
    assert sum(s.drafts > 0 for s in verify.steps) == result.stats.extra["per_row_num_drafts"][0]
    assert sum(s.verified for s in verify.steps) == sum(result.stats.extra["drafts_accepted"])
    assert all(s.seconds > 0 for s in ar.steps + verify.steps)


def test_the_adapter_counts_as_live_at_steps_that_feed_masks_on_a_gated_model_only(tiny):
    from mars.adapters import AdapterSettings, attach_adapter
    from mars.models import load_model

    gated = load_model("tiny-random")
    attach_adapter(gated.model, AdapterSettings(kind="gated_lora", rank=4, alpha=8), gated.mask.id)
    decoders = {
        "ar-cursor": (gated.model, DECODERS["ar-cursor"]),
        "verify": (gated.model, DECODERS["verify"]),
        "verify without an adapter": (tiny.model, DECODERS["verify"]),
    }
    args = argparse.Namespace(repeats=1, max_new_tokens=4)
    runs, steps = time_decoders(args, decoders, tiny.tokenizer, ["Hi"], Recorder())
    live = {name: {adapter for n, _, adapter in steps if n == name} for name in decoders}
    assert live == {"ar-cursor": {False}, "verify": {True}, "verify without an adapter": {False}}
    # the timed repeat's decode steps (forwards after the prefill), each with its forward time
    for name in decoders:
        assert sum(len(t) for (n, _, _), t in steps.items() if n == name) == runs[name][0][2] > 0


def test_observers_are_refused_where_no_engine_runs(tiny):
    from mars.decoding import generate

    with pytest.raises(ValueError, match="decoder='ar'"):
        generate(tiny.model, tiny.tokenizer, ["Hi"], max_new_tokens=2, decoder="ar", observers=[Recorder()])


def test_the_breakdown_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = run_breakdown(*COMMON, "--trace-prompts", "1", "--trace-tokens", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "breakdown.json").read_text())["summary"]
    assert set(summary) == set(DECODERS)
    assert summary["ar-cursor"]["tokens_per_forward"] == 1.0
    assert all(s["tokens_per_s"] > 0 and s["forward_ms_per_step"] > 0 for s in summary.values())
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
