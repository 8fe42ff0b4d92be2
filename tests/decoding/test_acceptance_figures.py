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


@pytest.mark.parametrize("ending", ["eos", "stop"])
def test_drafts_verified_past_an_eos_or_a_stop_string_are_not_counted_accepted(model, tokenizer, ending):  # noqa: F811
    """With the target itself as draft model every draft passes: a row that ends inside a step's drafts (at an
    EOS or a stop string) counts as accepted only the drafts it emitted.  Every draft step but a row's last also
    emits the AR token after its drafts, so a row's accepted drafts are at most its tokens less that many."""
    prompts = RAGGED[:2]
    reference = generate(model, tokenizer, prompts, decoder="ar", max_new_tokens=12).token_ids
    end = next(j for j in range(2, 12) if reference[0][j] not in reference[0][:j])  # the row ends at token j
    kwargs = dict(verify=True, draft_source="model", draft_model="self", max_new_tokens=12)
    if ending == "eos":
        model.generation_config.eos_token_id = [2, reference[0][end]]
        try:
            out = generate(model, tokenizer, prompts, **kwargs)
        finally:
            model.generation_config.eos_token_id = 2
    else:
        out = generate(model, tokenizer, prompts, stop=[tokenizer.decode(reference[0][end - 1 : end + 1])], **kwargs)
    assert out.token_ids[0] == reference[0][: len(out.token_ids[0])] and len(out.token_ids[0]) <= end + 1
    extra = out.stats.extra
    for tokens, accepted, steps in zip(
        out.token_ids, extra["per_row_num_accepted_tokens"], extra["per_row_num_drafts"]
    ):
        assert accepted <= len(tokens) - (steps - 1)
    assert out.stats.num_accepted_tokens == sum(extra["per_row_num_accepted_tokens"])
    assert out.stats.num_drafts == sum(extra["per_row_num_drafts"]) > 0
    assert out.stats.num_draft_tokens == sum(extra["per_row_num_draft_tokens"]) == sum(extra["drafts_proposed"])
    assert out.stats.as_dict()["num_draft_tokens"] == out.stats.num_draft_tokens
