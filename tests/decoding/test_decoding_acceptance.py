"""The acceptance rule on hand-made logits: metrics, at-least-one, caps, per-row thresholds, EOS."""

import math

import pytest
import torch

from mars.decoding.acceptance import (
    accept_counts,
    choose_tokens,
    cut_at_eos,
    exact_ar_rows,
    top_probability,
    top_tokens,
    unverified_counts,
    validate_threshold,
)


def logits_from_probs(rows):
    """Logits whose softmax is exactly the given probability rows (padded with tiny mass)."""
    return torch.log(torch.tensor(rows, dtype=torch.float32))


# Position probabilities for one row: top probabilities 0.9, 0.8, 0.5, 0.95 over a 3-token vocabulary.
ROW = [[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.25, 0.25, 0.5], [0.95, 0.03, 0.02]]


def test_probability_metric_accepts_left_to_right_run():
    tokens, score = choose_tokens(logits_from_probs([ROW]), "probability")
    assert tokens.tolist() == [[0, 1, 2, 0]]
    assert torch.allclose(score, torch.tensor([[0.9, 0.8, 0.5, 0.95]]))
    cap = torch.tensor([4])
    # 0.9 and 0.8 pass 0.75, 0.5 breaks the run: the later 0.95 is not reachable.
    assert accept_counts(score, torch.tensor([0.75]), "probability", cap).tolist() == [2]
    assert accept_counts(score, torch.tensor([0.5]), "probability", cap).tolist() == [4]
    assert accept_counts(score, torch.tensor([0.85]), "probability", cap).tolist() == [1]


def test_top_probability_from_logits_is_the_softmax_maximum_with_masked_tokens():
    """The draft threshold's confidence without a log-softmax: the top token's softmax probability from the
    logits and their maximum alone, also with a token at -inf (the mask token) and logits far from zero."""
    rows = logits_from_probs([ROW])
    shifted = torch.randn(2, 5, 4000) * 4 + 80.0
    shifted[..., 7] = float("-inf")
    for logits, expected in ((rows, torch.tensor([[0.9, 0.8, 0.5, 0.95]])), (shifted, None)):
        expected = torch.softmax(logits, -1).max(-1).values if expected is None else expected
        got = top_probability(logits, logits.max(-1).values)
        assert torch.allclose(got, expected, rtol=1e-5, atol=0)


def _hard_logits() -> torch.Tensor:
    """[2 rows, 3 columns, 37 tokens] (not a whole number of vectors): ties, a NaN column, an all -inf column and
    a maximum at the suppressed token 5."""
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 37)
    logits[0, 0, 5] = 9.0  # the suppressed token holds the maximum
    logits[0, 1, [4, 20, 36]] = 7.0  # tied maxima: the first wins
    logits[1, 0, [8, 30]] = float("nan")  # NaN: the first NaN is the max, as torch's
    logits[1, 2] = float("-inf")
    return logits


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("top_from", [None, 0, 1, 3])
def test_top_tokens_is_the_suppressed_argmax_and_top_probability(fused, top_from):
    """Both paths (the fused CPU kernel and the ATen ops) give ``max(-1)``'s index after the suppression, which
    they write into the logits, and the top probability from column ``top_from`` on (NaN before; None for no
    column); the kernel's probability is the ATen one within rounding."""
    logits = _hard_logits()
    reference = logits.clone()
    reference[..., 5] = float("-inf")
    best = reference.max(dim=-1)
    indices, top = top_tokens(logits, [5], top_from, fused=fused)
    assert torch.equal(indices, best.indices)
    assert indices[0, 0] != 5 and indices[0, 1] == 4 and indices[1, 0] == 8 and indices[1, 2] == 0
    assert torch.equal(logits.isnan(), reference.isnan())
    assert torch.equal(logits.nan_to_num(), reference.nan_to_num())  # suppressed in place, nothing else
    if top_from is None:
        assert top is None
        return
    expected = top_probability(reference, best.values)
    assert top.shape == expected.shape and top[:, :top_from].isnan().all()
    torch.testing.assert_close(top[:, top_from:], expected[:, top_from:], rtol=1e-5, atol=0, equal_nan=True)


def test_top_tokens_kernel_and_aten_agree_on_a_vocabulary_of_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 49152) * 4
    kernel, kernel_top = top_tokens(logits.clone(), [49151], 1, fused=True)
    aten, aten_top = top_tokens(logits.clone(), [49151], 1, fused=False)
    assert torch.equal(kernel, aten)
    # a softmax over 49152 logits sums them in another order than ATen (8 lanes with AVX2, 16 with AVX-512): the
    # fp32 rounding of such a sum reaches about sqrt(49152) * 6e-8 = 1.3e-5 of it
    torch.testing.assert_close(kernel_top, aten_top, rtol=3e-5, atol=0, equal_nan=True)


def test_at_least_one_token_even_when_first_fails():
    _, score = choose_tokens(logits_from_probs([ROW]), "probability")
    assert accept_counts(score, torch.tensor([0.99]), "probability", torch.tensor([4])).tolist() == [1]


def test_cap_bounds_the_run_and_zero_cap_waits():
    _, score = choose_tokens(logits_from_probs([ROW, ROW, ROW]), "probability")
    counts = accept_counts(score, torch.tensor([0.4, 0.4, 0.4]), "probability", torch.tensor([4, 2, 0]))
    assert counts.tolist() == [4, 2, 0]


def test_per_row_thresholds_in_one_batch():
    _, score = choose_tokens(logits_from_probs([ROW, ROW, ROW]), "probability")
    counts = accept_counts(score, torch.tensor([0.95, 0.75, 0.45]), "probability", torch.tensor([4, 4, 4]))
    assert counts.tolist() == [1, 2, 4]


def test_masks_after_verified_drafts_need_their_threshold_the_right_text_and_room():
    """Verify below threshold 1.0: no forced first mask; none after a rejected draft or at threshold 1.0;
    never more than were fed or fit in the budget."""
    _, score = choose_tokens(logits_from_probs([ROW[:3]] * 6), "probability")  # scores 0.9, 0.8, 0.5
    thresholds = torch.tensor([0.75, 0.95, 0.75, 0.75, 0.75, 1.0])
    fed = torch.tensor([3, 3, 3, 1, 3, 3])
    room = torch.tensor([9, 9, 9, 9, 1, 9])
    right_text = torch.tensor([True, True, False, True, True, True])
    counts = unverified_counts(score, thresholds, "probability", fed, room, right_text)
    assert counts.tolist() == [2, 0, 0, 1, 1, 0]


def test_entropy_metric_accepts_while_entropy_low():
    _, score = choose_tokens(logits_from_probs([ROW]), "entropy")
    expected = [-sum(p * math.log(p) for p in row) for row in ROW]
    assert torch.allclose(score[0], torch.tensor(expected), atol=1e-5)
    # Entropies: 0.394, 0.639, 1.040, 0.226 -> threshold 0.7 accepts the first two.
    assert accept_counts(score, torch.tensor([0.7]), "entropy", torch.tensor([4])).tolist() == [2]
    assert accept_counts(score, torch.tensor([1.1]), "entropy", torch.tensor([4])).tolist() == [4]
    assert accept_counts(score, torch.tensor([0.1]), "entropy", torch.tensor([4])).tolist() == [1]


def test_margin_metric_is_top1_minus_top2():
    _, score = choose_tokens(logits_from_probs([ROW]), "margin")
    assert torch.allclose(score[0], torch.tensor([0.85, 0.7, 0.25, 0.92]), atol=1e-6)
    assert accept_counts(score, torch.tensor([0.6]), "margin", torch.tensor([4])).tolist() == [2]
    assert accept_counts(score, torch.tensor([0.2]), "margin", torch.tensor([3])).tolist() == [3]


def test_exact_ar_rows_are_threshold_one_or_entropy_zero():
    assert exact_ar_rows(torch.tensor([1.0, 0.99]), "probability").tolist() == [True, False]
    assert exact_ar_rows(torch.tensor([1.0, 0.5]), "margin").tolist() == [True, False]
    assert exact_ar_rows(torch.tensor([0.0, 0.5]), "entropy").tolist() == [True, False]


def test_cut_at_first_eos_keeps_the_eos():
    tokens = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 6, 7, 8]])
    counts, hit = cut_at_eos(tokens, torch.tensor([4, 4, 1]), torch.tensor([2]))
    assert counts.tolist() == [2, 4, 1]
    assert hit.tolist() == [True, False, True]
    # An EOS beyond the accepted run does not count.
    counts, hit = cut_at_eos(torch.tensor([[5, 6, 2, 8]]), torch.tensor([2]), torch.tensor([2]))
    assert counts.tolist() == [2] and hit.tolist() == [False]


def test_sampling_uses_tempered_distribution_and_is_seeded():
    logits = torch.tensor([[[2.0, 1.0, 0.0]] * 4000])
    g = torch.Generator().manual_seed(0)
    tokens, score = choose_tokens(logits, "probability", temperature=1.0, generator=g)
    freq = torch.bincount(tokens.flatten(), minlength=3).float() / tokens.numel()
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    assert torch.allclose(freq, expected, atol=0.03)
    # The score is the probability of the sampled token.
    assert torch.allclose(score, expected[tokens])
    again, _ = choose_tokens(logits, "probability", temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


@pytest.mark.parametrize(
    "threshold,metric",
    [(0.0, "probability"), (1.5, "probability"), (-0.1, "margin"), (-1.0, "entropy"), (float("nan"), "entropy")],
)
def test_bad_thresholds_fail_fast(threshold, metric):
    with pytest.raises(ValueError, match="threshold"):
        validate_threshold(threshold, metric)


def test_an_unknown_metric_is_named():
    with pytest.raises(ValueError, match="unknown acceptance metric 'confidence'"):
        validate_threshold(0.5, "confidence")
