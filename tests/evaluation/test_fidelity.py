"""mars.evaluation.fidelity: the greedy AR prediction at every output position given the output's own prefix, and the
per-row counts of tokens equal to it, overall and among the tokens a decoder accepted from masks."""

from decoding_fixtures import model, random_prompts, tokenizer  # noqa: F401

from mars.decoding import generate
from mars.evaluation.fidelity import ar_predictions, token_fidelity


def test_only_the_tokens_accepted_from_masks_can_differ_from_the_ar_prediction(model, tokenizer):
    prompts = random_prompts((5, 17, 9))
    exact = generate(model, tokenizer, prompts, max_new_tokens=16)
    assert not any(any(f) for f in exact.from_mask)  # threshold 1.0: every token is an AR prediction
    lossy = generate(model, tokenizer, prompts, threshold=0.25, max_new_tokens=16)
    assert any(any(f) for f in lossy.from_mask)
    assert all(len(f) == len(t) for f, t in zip(lossy.from_mask, lossy.token_ids))
    verified = generate(model, tokenizer, prompts, verify=True, tree="chain", max_new_tokens=16)
    assert not any(any(f) for f in verified.from_mask)
    # AR predictions given each output's own prefix: exact outputs agree everywhere
    preds = ar_predictions(model, prompts, exact.token_ids)
    fid = token_fidelity(exact.token_ids, preds)
    assert all(r["ar_equal"] == r["tokens"] for r in fid)
    # lossy outputs: only mask-accepted tokens can differ from the AR choice
    fid = token_fidelity(lossy.token_ids, ar_predictions(model, prompts, lossy.token_ids), lossy.from_mask)
    for r in fid:
        assert r["tokens"] - r["ar_equal"] == r["mask_tokens"] - r["mask_ar_equal"]
    assert sum(r["mask_tokens"] - r["mask_ar_equal"] for r in fid) > 0
