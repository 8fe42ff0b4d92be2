"""Decoding on the embedded 135M model (slow) and on a CUDA device (gpu): exact AR at threshold 1.0 for
every cache strategy, and cached == uncached below 1.0."""

import pytest
import torch
from conftest import REPO

from mars.decoding import generate

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "List three prime numbers.",
]
CACHES = ("none", "block", "cursor")


@pytest.fixture(scope="module")
def embedded():
    from mars.models import load_model

    return load_model("embedded:smollm2-135m")


@pytest.mark.slow
def test_embedded_threshold_one_is_hf_greedy_for_every_cache(embedded):
    model, tok = embedded.model, embedded.tokenizer
    ar = generate(model, tok, PROMPTS, decoder="ar", chat_template=True, max_new_tokens=40)
    # the reference is transformers greedy generate itself
    text = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    enc = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
    width = enc["input_ids"].shape[1]
    for row, ids in zip(out[:, width:].tolist(), ar.token_ids):
        cut = next((i + 1 for i, t in enumerate(row) if t == tok.eos_token_id), len(row))
        assert row[:cut] == ids
    for cache in CACHES:
        res = generate(
            model, tok, PROMPTS, threshold=1.0, cache=cache, cache_block=8, chat_template=True, max_new_tokens=40
        )
        assert res.token_ids == ar.token_ids, cache
        assert res.texts == ar.texts


@pytest.mark.slow
def test_embedded_caches_agree_below_one(embedded):
    model, tok = embedded.model, embedded.tokenizer
    ref = generate(model, tok, PROMPTS, threshold=0.9, cache="none", chat_template=True, max_new_tokens=32)
    assert ref.stats.tokens_per_forward > 1.0  # masks were accepted: the caches are compared below AR
    for cache in ("block", "cursor"):
        res = generate(
            model, tok, PROMPTS, threshold=0.9, cache=cache, cache_block=8, chat_template=True, max_new_tokens=32
        )
        assert res.token_ids == ref.token_ids, cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_exact_ar_and_cache_agreement():
    from test_decoding_engine import build_model, random_prompts

    from mars.models import embedded_tokenizer

    tok = embedded_tokenizer()
    tok.padding_side, tok.pad_token, tok.mask_token = "left", tok.eos_token, "<empty_output>"
    model = build_model().cuda()
    prompts = random_prompts((5, 17, 9, 30))
    ar = generate(model, tok, prompts, decoder="ar", max_new_tokens=24)
    for cache in CACHES:
        assert generate(model, tok, prompts, cache=cache, cache_block=8, max_new_tokens=24).token_ids == ar.token_ids
    ref = generate(model, tok, prompts, threshold=0.3, cache="none", max_new_tokens=24)
    for cache in ("block", "cursor"):
        assert (
            generate(model, tok, prompts, threshold=0.3, cache=cache, cache_block=8, max_new_tokens=24).token_ids
            == ref.token_ids
        )
    # bf16 runs end to end (exact equality is not expected across kernels in bf16)
    out = generate(model.to(torch.bfloat16), tok, prompts, threshold=0.3, cache="cursor", max_new_tokens=24)
    assert out.stats.generated_tokens == sum(map(len, out.token_ids)) > 0


@pytest.mark.slow
def test_the_committed_rank8_adapter_decodes_as_the_base_at_threshold_one_and_verifies_more_per_forward(embedded):
    """data/adapters/smollm2-135m-mars-rank8 (4.9 MB): the figures of its README can be re-checked without
    retraining, and the gate leaves every real column to the base."""
    from mars.models import load_model

    adapted = load_model(str(REPO / "data" / "adapters" / "smollm2-135m-mars-rank8"))
    assert adapted.model.mars_adapter.rank == 8
    ar = generate(embedded.model, embedded.tokenizer, PROMPTS, decoder="ar", chat_template=True, max_new_tokens=40)
    for kwargs in (dict(threshold=1.0), dict(verify=True)):
        res = generate(adapted.model, adapted.tokenizer, PROMPTS, chat_template=True, max_new_tokens=40, **kwargs)
        assert res.token_ids == ar.token_ids, kwargs
    assert res.stats.tokens_per_forward > 1.1  # verify: the masks' drafts pass often enough to matter
