"""Decoding invariants on tiny random fp32 models: exact AR at threshold 1.0 for every cache strategy,
cached == uncached below 1.0, batch independence, stop rules and statistics."""

import time

import numpy as np
import pytest
from decoding_fixtures import (  # noqa: F401  (fixtures)
    CACHES,
    build_model,
    extra_eos,
    hf_greedy,
    model,
    ragged,
    random_prompts,
    tokenizer,
)

from mars.decoding import generate
from mars.decoding.forward import ModelRunner
from mars.decoding.planner import masks_within
from mars.models import embedded_tokenizer


# ---------------------------------------------------------------------------------------------
# Exact AR
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
def test_threshold_one_is_hf_greedy_at_batch_one(model, tokenizer, cache):
    prompt = random_prompts((11,), seed=3)
    expected = hf_greedy(model, tokenizer, prompt, 20)
    out = generate(model, tokenizer, prompt, threshold=1.0, cache=cache, cache_block=8, max_new_tokens=20)
    assert out.token_ids == expected
    assert len(expected[0]) == 20


@pytest.mark.parametrize("cache", CACHES)
def test_threshold_one_is_hf_greedy_with_ragged_batch(model, tokenizer, ragged, cache):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    assert len({len(r) for r in expected}) > 1, "rows should finish at different steps"
    out = generate(model, tokenizer, ragged, threshold=1.0, cache=cache, cache_block=8, max_new_tokens=24)
    assert out.token_ids == expected
    assert out.stats.forwards == max(len(r) for r in expected)  # one token per step at threshold 1.0
    ar = generate(model, tokenizer, ragged, decoder="ar", max_new_tokens=24)
    assert ar.token_ids == expected


@pytest.mark.parametrize("cache", CACHES)
def test_max_accept_one_is_greedy_at_any_threshold(model, tokenizer, ragged, cache):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(model, tokenizer, ragged, threshold=0.2, max_accept=1, cache=cache, max_new_tokens=24)
    assert out.token_ids == expected


@pytest.mark.parametrize("cache", CACHES)
def test_jacobi_is_lossless_greedy(model, tokenizer, ragged, cache):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(model, tokenizer, ragged, decoder="jacobi", cache=cache, max_new_tokens=24)
    assert out.token_ids == expected
    assert out.stats.forwards <= max(len(r) for r in expected)


# ---------------------------------------------------------------------------------------------
# Cached == uncached below threshold 1.0; batch independence
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0.35, 0.3, 0.25])
@pytest.mark.parametrize("cache,cache_block", [("cursor", 32), ("block", 8), ("block", 3)])
def test_caches_match_sliding_window_below_one(model, tokenizer, threshold, cache, cache_block):
    prompts = random_prompts((5, 17, 9, 30))
    reference = generate(model, tokenizer, prompts, threshold=threshold, cache="none", max_new_tokens=24)
    # The comparison is only meaningful if several tokens were accepted per step somewhere.
    assert max(t / f for t, f in zip(reference.stats.per_row_tokens, reference.stats.per_row_forwards)) > 1.2
    out = generate(
        model, tokenizer, prompts, threshold=threshold, cache=cache, cache_block=cache_block, max_new_tokens=24
    )
    assert out.token_ids == reference.token_ids


@pytest.mark.parametrize("cache", CACHES)
def test_row_output_does_not_depend_on_its_batch(model, tokenizer, cache):
    prompts = random_prompts((5, 17, 9, 30))
    together = generate(model, tokenizer, prompts, threshold=0.3, cache=cache, cache_block=8, max_new_tokens=24)
    for i, p in enumerate(prompts):
        alone = generate(model, tokenizer, [p], threshold=0.3, cache=cache, cache_block=8, max_new_tokens=24)
        assert alone.token_ids[0] == together.token_ids[i]
    # and in a different batch composition and order
    other = generate(model, tokenizer, prompts[::-1][:3], threshold=0.3, cache=cache, cache_block=8, max_new_tokens=24)
    assert other.token_ids == together.token_ids[::-1][:3]


def test_per_row_thresholds_in_one_batch(model, tokenizer):
    prompts = random_prompts((5, 17, 9))
    mixed = generate(model, tokenizer, prompts, threshold=[1.0, 0.3, 0.5], max_new_tokens=24)
    for i, thr in enumerate([1.0, 0.3, 0.5]):
        alone = generate(model, tokenizer, [prompts[i]], threshold=thr, max_new_tokens=24)
        assert mixed.token_ids[i] == alone.token_ids[0]
    assert mixed.token_ids[0] == hf_greedy(model, tokenizer, prompts[:1], 24)[0]


def test_lower_threshold_accepts_more_tokens_per_forward(model, tokenizer):
    prompts = random_prompts((5, 17, 9, 30))
    rates = [
        generate(model, tokenizer, prompts, threshold=t, max_new_tokens=24).stats.tokens_per_forward
        for t in (1.0, 0.5, 0.3, 0.2)
    ]
    assert rates == sorted(rates) and rates[-1] > rates[0]


def test_cache_block_window_fills_the_block_and_is_exact_at_one(model, tokenizer, ragged):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    exact = generate(model, tokenizer, ragged, cache="block", window="cache_block", cache_block=6, max_new_tokens=24)
    assert exact.token_ids == expected
    # Below 1.0 the masks reach the block end, beyond the training window: steps can accept more than
    # block_size tokens, never more than the cache block.
    wide = generate(
        model, tokenizer, ragged, threshold=0.2, cache="block", window="cache_block", cache_block=12, max_new_tokens=24
    )
    rates = [t / f for t, f in zip(wide.stats.per_row_tokens, wide.stats.per_row_forwards)]
    assert max(rates) > 4
    narrow = generate(model, tokenizer, ragged, threshold=0.2, cache="block", cache_block=12, max_new_tokens=24)
    assert max(t / f for t, f in zip(narrow.stats.per_row_tokens, narrow.stats.per_row_forwards)) <= 4


# ---------------------------------------------------------------------------------------------
# A cap on the columns of a step
# ---------------------------------------------------------------------------------------------
def test_masks_within_cuts_the_rows_with_most_masks_first():
    assert masks_within(np.array([3, 3, 1]), 100).tolist() == [3, 3, 1]
    assert masks_within(np.array([3, 3, 1]), 5).tolist() == [2, 2, 1]
    assert masks_within(np.array([3, 3, 1]), 4).tolist() == [1, 1, 1]
    assert masks_within(np.array([3, 3, 1]), 2).tolist() == [0, 0, 0]
    assert masks_within(np.array([2, 0]), -3).tolist() == [0, 0]


def test_a_step_column_cap_bounds_every_decode_step(model, tokenizer, ragged, monkeypatch):
    """Under ``max_step_columns`` every step after the prompts' computes at most that many columns, masks still
    ride along where they fit, and at a cap no mask fits under the output is exactly greedy AR."""
    computed = []
    logits_at = ModelRunner.logits_at

    def recording(self, input_ids, *args, live=None, **kwargs):
        computed.append(int(live.sum()) if live is not None else input_ids.numel())
        return logits_at(self, input_ids, *args, live=live, **kwargs)

    monkeypatch.setattr(ModelRunner, "logits_at", recording)
    cap = len(ragged) + 3
    capped = generate(model, tokenizer, ragged, threshold=0.2, max_step_columns=cap, max_new_tokens=24)
    assert max(computed[1:]) <= cap < max(computed)  # the prompts' step is exempt: no mask is fed with them
    free = generate(model, tokenizer, ragged, threshold=0.2, max_new_tokens=24)
    assert 1 < capped.stats.tokens_per_forward < free.stats.tokens_per_forward
    greedy = generate(model, tokenizer, ragged, threshold=0.2, max_step_columns=1, max_new_tokens=24)
    assert greedy.token_ids == hf_greedy(model, tokenizer, ragged, 24)


@pytest.mark.parametrize("lossless", [dict(verify=True), dict(decoder="jacobi")], ids=["verify", "jacobi"])
def test_lossless_decoders_under_a_column_cap_stay_lossless(model, tokenizer, ragged, lossless):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(model, tokenizer, ragged, **lossless, max_step_columns=len(ragged) + 2, max_new_tokens=24)
    assert out.token_ids == expected


def test_a_column_cap_must_be_a_positive_integer(model, tokenizer):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_step_columns"):
            generate(model, tokenizer, random_prompts((5,)), max_step_columns=bad, max_new_tokens=4)


# ---------------------------------------------------------------------------------------------
# Statistics, stop rules, sampling
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
def test_statistics_count_generated_tokens_only(model, tokenizer, ragged, cache):
    start = time.perf_counter()
    out = generate(model, tokenizer, ragged, threshold=0.3, cache=cache, cache_block=8, max_new_tokens=24)
    wall = time.perf_counter() - start
    s = out.stats
    assert s.per_row_tokens == [len(r) for r in out.token_ids]
    assert s.generated_tokens == sum(s.per_row_tokens)
    assert s.tokens_per_forward == pytest.approx(s.generated_tokens / s.forwards)
    assert all(0 < n <= 24 for n in s.per_row_tokens)
    # Rows that finished early took part in fewer forwards (they left the batch).
    assert min(s.per_row_forwards) < s.forwards or cache == "block"
    assert max(s.per_row_forwards) == s.forwards
    assert 0 < s.seconds <= wall  # the decoder's own time, in seconds, inside the call
    assert 0 < s.first_token_seconds < s.seconds  # the prefill step, before the decode phase
    # The EOS ends a row and is counted; no row goes past max_new_tokens.
    eos = set(model.generation_config.eos_token_id)
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        assert all(t not in eos for t in ids[:-1])
        assert (reason == "eos") == (ids[-1] in eos)
        assert reason in ("eos", "length")
        if reason == "length":
            assert len(ids) == 24


def test_hf_baseline_times_its_first_token(model, tokenizer, ragged):
    start = time.perf_counter()
    out = generate(model, tokenizer, ragged, decoder="ar", max_new_tokens=12)
    wall = time.perf_counter() - start
    assert 0 < out.stats.first_token_seconds < out.stats.seconds <= wall


def test_every_decoder_makes_the_first_cos_of_the_process_before_its_own(model, tokenizer, monkeypatch):
    """A process's first cos may round differently (mars.decoding.forward.warm_vector_math): the engine and the
    transformers baseline both make it before their first forward."""
    from mars.decoding import baselines, forward

    order = []
    rotary = type(model.model.rotary_emb)
    rotary_forward = rotary.forward
    monkeypatch.setattr(
        rotary, "forward", lambda self, *a, **k: order.append("rotary") or rotary_forward(self, *a, **k)
    )
    for module in (forward, baselines):
        monkeypatch.setattr(module, "warm_vector_math", lambda: order.append("warm"))
    for decoder in ("mars", "ar"):
        order.clear()
        generate(model, tokenizer, [[5, 6, 7]], decoder=decoder, max_new_tokens=2)
        assert order[0] == "warm" and "rotary" in order, decoder


def test_max_new_tokens_is_never_exceeded(model, tokenizer):
    prompts = random_prompts((5, 17))
    for budget in (1, 2, 5):
        out = generate(model, tokenizer, prompts, threshold=0.2, max_new_tokens=budget)
        assert [len(r) for r in out.token_ids] == [budget, budget]


def test_stop_strings_cut_both_decoders_identically(model, tokenizer):
    prompts = random_prompts((7, 12), seed=5)
    free = generate(model, tokenizer, prompts, decoder="ar", max_new_tokens=24)
    text = free.texts[0]
    # A stop string taken from the middle of row 0's text.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    ar = generate(model, tokenizer, prompts, decoder="ar", max_new_tokens=24, stop=[stop])
    for cache in CACHES:
        mars = generate(model, tokenizer, prompts, threshold=1.0, cache=cache, max_new_tokens=24, stop=[stop])
        assert mars.token_ids == ar.token_ids
        assert mars.texts == ar.texts
    assert ar.finish_reasons[0] == "stop"
    assert stop not in ar.texts[0] and text.startswith(ar.texts[0])
    assert len(ar.token_ids[0]) < len(free.token_ids[0])
    assert ar.stats.per_row_tokens[0] == len(ar.token_ids[0])
    # Multi-token steps may overshoot a stop string: the tokens past it are dropped and not counted.
    fast = generate(model, tokenizer, prompts, threshold=0.2, max_new_tokens=24, stop=[stop])
    for _ids, t in zip(fast.token_ids, fast.texts):
        assert stop not in t
        assert fast.stats.generated_tokens == sum(map(len, fast.token_ids))


def test_sampling_is_seeded_and_differs_from_greedy(model, tokenizer):
    prompts = random_prompts((5, 17))
    a = generate(model, tokenizer, prompts, threshold=0.5, temperature=1.0, seed=7, max_new_tokens=16)
    b = generate(model, tokenizer, prompts, threshold=0.5, temperature=1.0, seed=7, max_new_tokens=16)
    greedy = generate(model, tokenizer, prompts, threshold=0.5, max_new_tokens=16)
    assert a.token_ids == b.token_ids
    assert a.token_ids != greedy.token_ids


def test_string_prompts_and_chat_template(tokenizer):
    model = build_model()
    model.resize_token_embeddings(len(tokenizer))  # real text needs the full vocabulary
    out = generate(model, tokenizer, ["Hello", "What is two plus two?"], chat_template=True, max_new_tokens=5)
    assert out.texts == tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)  # the tokens' own text
    assert out.stats.per_row_tokens == [5, 5]
    ar = generate(
        model, tokenizer, ["Hello", "What is two plus two?"], chat_template=True, decoder="ar", max_new_tokens=5
    )
    assert ar.token_ids == out.token_ids


# ---------------------------------------------------------------------------------------------
# Bad input fails fast
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(block_size=0), "block_size must be an integer >= 1, got 0"),
        (dict(threshold=1.5), "threshold 1.5 is invalid for metric 'probability'"),
        (dict(threshold=0.0, metric="margin"), "must lie in \\(0, 1\\]"),
        (dict(threshold=-0.5, metric="entropy"), "must be >= 0"),
        (dict(metric="confidence"), "unknown acceptance metric 'confidence'"),
        (dict(cache="paged"), "unknown cache strategy 'paged'"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(decoder="beam"), "unknown decoder 'beam'"),
        (dict(window="cache_block", cache="cursor"), "needs cache='block'"),
        (dict(max_accept=0), "max_accept must be None or an integer >= 1"),
        (dict(threshold=[0.9]), "1 thresholds for 2 prompts"),
    ],
)
def test_bad_arguments_fail_fast(model, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, [[5, 6], [7]], **kwargs)


def test_prompt_longer_than_context_fails(model, tokenizer):
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens, longer than the model's context of 256"):
        generate(model, tokenizer, [[5, 6], [7] * 300])


def test_missing_mask_token_fails(model):
    tok = embedded_tokenizer()
    assert tok.mask_token_id is None
    with pytest.raises(ValueError, match="no mask token"):
        generate(model, tok, [[5, 6]])
    # AR needs none
    assert generate(model, tok, [[5, 6]], decoder="ar", max_new_tokens=2).stats.generated_tokens == 2
