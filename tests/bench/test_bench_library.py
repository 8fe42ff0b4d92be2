"""The benchmarks' library called as a script calls it, with typed arguments and no command line: the decoders
a choice names, a model loaded, every decoder timed in the interleaved loop and summarised into throughput's rows."""

import pytest

from mars.bench.decoders import AR_CURSOR, VERIFIED, DecoderChoice, variants
from mars.bench.loading import load
from mars.bench.tables import summarise_runs
from mars.bench.timing import DecodeSetup, time_decoders, warm_up
from mars.decoding.settings import DecodingSettings


def test_a_decoder_choice_names_its_rows_ar_baselines_first():
    choice = DecoderChoice(
        caches=("cursor",),
        eager_baselines=True,
        verify=True,
        verify_rows=({"window": 3, "draft_threshold": 0.3},),
        draft_sources=("model", "lookup+masks"),
        draft_model="self:1",
    )
    vs = {v.name: v for v in variants(choice)}
    assert list(vs) == [
        "ar-hf",
        "ar-cursor",
        "ar-hf-eager",
        "ar-cursor-eager",
        "mars-cursor",
        "mars-verify",
        "mars-verify-w3-dt0.3",
        "verify-model",
        "verify-lookup+masks",
    ]
    assert [v.is_ar for v in vs.values()] == [True] * 4 + [False] * 5
    assert vs["ar-cursor"] == AR_CURSOR and vs["ar-cursor-eager"].eager
    assert vs["mars-cursor"].fixed_threshold is None  # swept over the thresholds; every other row is exact
    assert vs["mars-verify-w3-dt0.3"].kwargs == {**VERIFIED, "window": 3, "draft_threshold": 0.3}
    assert vs["verify-model"].kwargs == {**VERIFIED, "draft_source": "model", "draft_model": "self:1", "window": 1}
    assert vs["verify-lookup+masks"].kwargs == {**VERIFIED, "draft_source": "lookup"}  # the masks draft too


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer, metadata = load("tiny-random", dtype="float32")
    assert metadata is None  # a plain model, no MARS checkpoint
    return model, tokenizer


@pytest.mark.parametrize("as_mapping", [False, True])  # a mapping of the setup's fields, as scripts pass it
def test_the_timing_loop_and_tables_without_a_command_line(tiny, as_mapping):
    model, tokenizer = tiny
    setup = DecodeSetup(DecodingSettings(max_new_tokens=5), chat_template=False)
    vs = variants(DecoderChoice(caches=("cursor",), verify=True))
    prompts = ["Say hi.", "Name a dog.", "Count to three."]
    warm_up(model, tokenizer, prompts[:1], setup, vs, 1.0, times=1)
    common = {"settings": setup.settings, "chat_template": False} if as_mapping else setup
    runs = time_decoders(model, tokenizer, prompts, 2, common, vs, [1.0, 0.5], 2)
    assert set(runs) == {1.0, 0.5} and all(len(r) == 2 for t in runs.values() for r in t.values())
    # two batches (2 prompts, then 1) per repeat; the exact decoders' figures are shared by both thresholds
    assert runs[1.0]["ar-hf"][0]["batches"] == 2 and runs[1.0]["ar-hf"] == runs[0.5]["ar-hf"]
    rows = {r["decoder"]: r for r in summarise_runs(vs, runs[1.0], 1.0, 2)}
    assert list(rows) == ["ar-hf", "ar-cursor", "mars-cursor", "mars-verify"]
    assert rows["ar-hf"]["ar_baseline"] in ("ar-hf", "ar-cursor")
    for name in ("ar-cursor", "mars-cursor", "mars-verify"):  # threshold 1.0 and verify: greedy AR exactly
        assert rows[name]["same_as_ar"] == "3/3", name
    assert rows["ar-cursor"]["tokens_per_forward"] == pytest.approx(
        rows["ar-cursor"]["generated_tokens"] / rows["ar-cursor"]["forwards"]
    )
    assert rows["mars-verify"]["num_drafts"] > 0 and rows["ar-hf"]["num_drafts"] == 0
