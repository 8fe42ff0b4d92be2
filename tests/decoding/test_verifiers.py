"""The verifier seam (:mod:`mars.decoding.verifiers`): a new way of checking drafts is one class and one line in
``VERIFIERS``; the engine asks it for the rows it verifies and its output stays the target's greedy output."""

import torch
from decoding_fixtures import hf_greedy, model, random_prompts, tokenizer  # noqa: F401

from mars.decoding import generate, verifiers
from mars.decoding.step import Verdict
from mars.decoding.verifiers import Verifier


class FirstDraftOnly(Verifier):
    """A toy verifier: a verifying row keeps at most its first passing draft, then the target's token after it."""

    name = "first-draft-only"
    calls = 0

    def verify(self, plan, scores, verdict):
        FirstDraftOnly.calls += 1
        verifying = plan.on_device.verifying
        kept = torch.where(verifying, verdict.verified.clamp_max(1), verdict.verified)
        cut = verifying & (verdict.verified > kept)
        at = kept.unsqueeze(1)
        after = scores.predicted.gather(1, at)  # the target's token after the kept draft
        tokens = verdict.tokens.scatter(1, at, torch.where(cut.unsqueeze(1), after, verdict.tokens.gather(1, at)))
        count = torch.where(cut, kept + 1, verdict.count)
        return Verdict(tokens, count, kept, verdict.next_drafts, verdict.kept)


def test_a_verifier_registered_in_one_line_decides_the_rows_and_keeps_the_output_exact(model, tokenizer, monkeypatch):
    """With the target as its own draft model every draft passes the chain verifier; the toy verifier, registered
    after it, cuts each step to one draft: the output is still greedy AR's, no draft past the first is accepted,
    and the steps that accepted two or more drafts before now take more forwards."""
    prompts = random_prompts((5, 11, 8), seed=3)
    kwargs = dict(verify=True, draft_source="model", draft_model="self", draft_length=3, max_new_tokens=16)
    expected = hf_greedy(model, tokenizer, prompts, 16)
    chain = generate(model, tokenizer, prompts, **kwargs)
    assert chain.token_ids == expected and chain.stats.extra["drafts_accepted"][1] > 0

    monkeypatch.setattr(verifiers, "VERIFIERS", [*verifiers.VERIFIERS, FirstDraftOnly])  # the registration line
    toy = generate(model, tokenizer, prompts, **kwargs)
    assert FirstDraftOnly.calls > 0
    assert toy.token_ids == expected
    accepted = toy.stats.extra["drafts_accepted"]
    assert accepted[0] > 0 and accepted[1:] == [0] * (len(accepted) - 1)
    assert toy.stats.forwards > chain.stats.forwards
