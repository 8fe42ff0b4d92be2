"""Bad decoding input is refused with a message that names the value as given, and the mask token is
never an output token, in any decoder."""

import pytest
import torch
from decoding_fixtures import MASK_ID, build_model, model, random_prompts, tokenizer  # noqa: F401  (fixtures)

from mars.decoding import generate


# ---------------------------------------------------------------------------------------------
# A bad input is refused with a message that names the value as given
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stop,shown",
    [(123, r"got 123 \(int\)"), (b"x", r"got b'x' \(bytes\)"), (["ok", 5], r"got 5 \(int\)"), ([""], "got ''")],
)
def test_a_bad_stop_names_the_value_as_given(model, tokenizer, stop, shown):
    with pytest.raises(ValueError, match=rf"stop .*{shown}"):
        generate(model, tokenizer, [[5, 6]], stop=stop, max_new_tokens=2)


def test_a_tiny_positive_threshold_is_a_threshold_not_zero(model, tokenizer):
    # 1e-300 lies in (0, 1]: it accepts every token (float32 rounds it to 0, which must not matter)
    out = generate(model, tokenizer, [[5, 6, 7]], threshold=1e-300, max_new_tokens=8, block_size=4)
    assert out.stats.tokens_per_forward > 1
    for bad, shown in [(-1e-300, "-1e-300"), (1 + 1e-9, "1.000000001"), (float("nan"), "nan")]:
        with pytest.raises(ValueError, match=rf"threshold.* {shown}"):
            generate(model, tokenizer, [[5, 6]], threshold=bad)
    with pytest.raises(ValueError, match=r"threshold -1e-300"):  # per-row thresholds too
        generate(model, tokenizer, [[5, 6], [7]], threshold=[0.5, -1e-300])


@pytest.mark.parametrize("prompt", [[[True, 5]], [[5, False]], [[5, 6.0]]])
def test_booleans_and_floats_are_not_token_ids(model, tokenizer, prompt):
    with pytest.raises(ValueError, match="prompt 0 is neither a string nor a list of token ids"):
        generate(model, tokenizer, prompt, max_new_tokens=2)


# ---------------------------------------------------------------------------------------------
# The mask token is never emitted, even where the model's head favours it
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mask_loving_model():
    """The shared tiny model with a head that favours the mask token (as an under-trained MARS head can):
    +20 on its logit makes it the top token at most positions."""
    m = build_model(seed=3)
    bias = torch.zeros(m.config.vocab_size)
    bias[MASK_ID] = 20.0
    m.lm_head.register_forward_hook(lambda module, args, out: out + bias.to(out.dtype))
    return m


def _share_of_mask(model, prompts) -> float:
    with torch.no_grad():
        logits = model(torch.tensor(prompts)).logits
    return float((logits.argmax(-1) == MASK_ID).float().mean())


DECODERS = [
    dict(decoder="mars", threshold=1.0),
    dict(decoder="mars", threshold=0.5),
    dict(decoder="mars", threshold=0.5, cache="block", cache_block=4),
    dict(decoder="mars", threshold=0.5, cache="none"),
    dict(decoder="mars", verify=True),
    dict(decoder="mars", verify=True, temperature=1.0, seed=0),
    dict(decoder="mars", verify=True, draft_source="lookup"),
    dict(decoder="mars", verify=True, draft_source="model", draft_model="self:1"),
    dict(decoder="mars", threshold=0.5, temperature=1.0, seed=0),
    dict(decoder="jacobi"),
    dict(decoder="ar"),
    dict(decoder="ar", temperature=1.0),
]


@pytest.mark.parametrize("kwargs", DECODERS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_the_mask_token_is_never_an_output_token(mask_loving_model, tokenizer, kwargs):
    prompts = random_prompts((6, 6, 6), seed=4)
    assert _share_of_mask(mask_loving_model, prompts) > 0.5  # without the rule it would be emitted
    out = generate(mask_loving_model, tokenizer, prompts, max_new_tokens=12, **kwargs)
    assert all(len(ids) == 12 for ids in out.token_ids)
    assert not any(MASK_ID in ids for ids in out.token_ids), out.token_ids


def test_threshold_one_still_equals_the_ar_decoder_when_the_mask_would_win(mask_loving_model, tokenizer):
    prompts = random_prompts((5, 9), seed=5)
    ar = generate(mask_loving_model, tokenizer, prompts, decoder="ar", max_new_tokens=12).token_ids
    for kwargs in (dict(threshold=1.0), dict(verify=True), dict(decoder="jacobi")):
        assert generate(mask_loving_model, tokenizer, prompts, max_new_tokens=12, **kwargs).token_ids == ar, kwargs
