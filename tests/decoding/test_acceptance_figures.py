"""vLLM's speculative-decoding figures (docs/decoding.md, "Acceptance figures"): their definitions on hand-made
counts, and what ``generate`` reports for a verify run on the tiny model."""

import pytest
from decoding_fixtures import RAGGED, model, tokenizer  # noqa: F401

from mars.decoding import generate
from mars.decoding.stats import acceptance_figures, sum_by_position


def test_the_figures_follow_vllms_definitions():
    # 10 draft steps; depth 0 proposed on every one (one candidate) and passed on 6, depth 1 on 6 steps
    # (two tree candidates each) passed on 2, depth 2 passed once
    figures = acceptance_figures([10, 12, 2], [6, 2, 1], 10)
    assert figures["num_drafts"] == 10 and figures["num_draft_tokens"] == 24 and figures["num_accepted_tokens"] == 9
    assert figures["mean_acceptance_length"] == pytest.approx(1.9)  # the bonus/corrected token counted
    assert figures["draft_acceptance_rate"] == pytest.approx(9 / 24)
    assert figures["acceptance_by_position"] == pytest.approx([0.6, 0.2, 0.1])
    none = acceptance_figures([0, 0], [0, 0], 0)
    assert none["mean_acceptance_length"] is None and none["acceptance_by_position"] is None
    assert none["draft_acceptance_rate"] is None
    assert sum_by_position([[1, 2], [3], [0, 1, 5]]) == [4, 3, 5]


def test_generate_reports_them_for_verify_and_none_for_ar(model, tokenizer):  # noqa: F811
    # (tree="chain": "auto" would first time the step's cost per width, seconds that check nothing here)
    out = generate(model, tokenizer, RAGGED, verify=True, draft_threshold=0.0, max_new_tokens=12, tree="chain")
    stats, extra = out.stats, out.stats.extra
    drafts, accepted = sum(extra["per_row_num_drafts"]), sum(extra["per_row_num_accepted_tokens"])
    assert drafts > 0 and accepted == sum(extra["drafts_accepted"])
    assert stats.mean_acceptance_length == pytest.approx(1 + accepted / drafts)
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(stats.acceptance_by_position))
    assert stats.draft_acceptance_rate == pytest.approx(accepted / sum(extra["drafts_proposed"]))
    # a forward gives a row at most one token beyond the drafts it accepted
    for tokens, forwards, passed in zip(
        stats.per_row_tokens, stats.per_row_forwards, extra["per_row_num_accepted_tokens"]
    ):
        assert tokens <= forwards + passed
    assert stats.as_dict()["mean_acceptance_length"] == stats.mean_acceptance_length
    plain = generate(model, tokenizer, RAGGED[:1], decoder="ar", max_new_tokens=4).stats
    assert plain.mean_acceptance_length is None and plain.as_dict()["acceptance_by_position"] is None
