"""Draft sources for verified decoding (masks, prompt lookup, a draft model): whatever the drafts, the output
is the target's greedy AR output; an identical draft model has every draft accepted; lookup drafts the
continuation of an earlier occurrence; rows join and leave a running batch with their draft state;
speculative sampling with each source's draft distribution reproduces the target distribution."""

import numpy as np
import pytest
import torch
from decoding_fixtures import MASK_ID, build_model, extra_eos, hf_greedy, model, ragged, random_prompts, tokenizer  # noqa: F401

from mars.decoding import DecodeEngine, DecodingSettings, generate
from mars.decoding.acceptance import tempered_log_probs
from mars.decoding.drafts import draw, lookup_continuation, one_hot_log_q
from mars.decoding.forward import ModelRunner
from mars.decoding.verify import speculative_accept
from mars.models import build_tiny_random


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tokenizer):
    """A different random model saved as a checkpoint folder: a draft model that is usually wrong."""
    path = tmp_path_factory.mktemp("draft") / "other"
    build_model(seed=7).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def same_model_dir(tmp_path_factory, tokenizer):
    """The target's own weights saved as a separate checkpoint folder."""
    path = tmp_path_factory.mktemp("draft") / "same"
    build_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def smaller_vocabulary_model_dir(path, tokenizer, size=64):
    """A draft checkpoint whose tokenizer holds the target's first ``size`` tokens at the same ids and
    nothing more (every id they share agrees, the rest are missing), with a ``size``-row embedding."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    kept = {token: index for token, index in tokenizer.get_vocab().items() if index < size}
    unk = tokenizer.convert_ids_to_tokens(0)
    small = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(kept, unk_token=unk)), unk_token=unk)
    build_tiny_random(vocab_size=size, seed=5).save_pretrained(path)
    small.save_pretrained(path)
    return str(path)


SOURCES = {
    "masks": dict(),
    "lookup": dict(draft_source="lookup"),
    "lookup-1gram-no-masks": dict(draft_source="lookup", lookup_ngram=1, window=1, draft_length=5),
    "self:1": dict(draft_source="model", draft_model="self:1"),
}


@pytest.mark.parametrize("cache", ["none", "block", "cursor"])
@pytest.mark.parametrize("source", SOURCES)
def test_every_draft_source_is_greedy_ar(model, tokenizer, ragged, cache, source):
    prompts = [*ragged, [5, 6, 7, 8] * 5]  # random prompts and one that repeats itself (for lookup)
    expected = hf_greedy(model, tokenizer, prompts, 24)
    kwargs = SOURCES[source]
    out = generate(model, tokenizer, prompts, verify=True, cache=cache, cache_block=8, max_new_tokens=24, **kwargs)
    assert out.token_ids == expected
    assert sum(out.stats.extra["drafts_proposed"]) > 0


def test_a_draft_model_from_a_folder_is_greedy_ar(model, tokenizer, ragged, other_model_dir):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    for window in (1, 4):
        out = generate(
            model,
            tokenizer,
            ragged,
            verify=True,
            draft_source="model",
            draft_model=other_model_dir,
            window=window,
            max_new_tokens=24,
        )
        assert out.token_ids == expected
        stats = out.stats.extra
        assert stats["draft_model_forwards"] > 0 and stats["draft_acceptance"] < 1.0  # a different model errs


@pytest.mark.parametrize("draft_model", ["self", "same"])
def test_an_identical_draft_model_has_every_draft_accepted(model, tokenizer, ragged, same_model_dir, draft_model):
    """Without masks (window=1) every draft comes from the draft model: identical weights, identical choices."""
    name = same_model_dir if draft_model == "same" else draft_model
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(
        model, tokenizer, ragged, verify=True, draft_source="model", draft_model=name, window=1, max_new_tokens=24
    )
    assert out.token_ids == expected
    stats = out.stats.extra
    assert sum(stats["drafts_proposed"]) > 0 and stats["drafts_accepted"] == stats["drafts_proposed"]
    # 4 drafts + 1 per target forward, except where a row's EOS or budget ends it first
    assert max(out.stats.per_row_forwards) <= -(-24 // 5) + 1


def markov_model():
    """A tiny model whose next token depends on the current token only (attention outputs zeroed)."""
    model = build_model(seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def test_lookup_drafts_the_continuation_of_an_earlier_occurrence(tokenizer):
    """The prompt holds the model's own greedy chain and then its start again: from there each next token
    repeats the chain, so lookup's drafts are all accepted and the row needs far fewer forwards."""
    model = markov_model()
    start = random_prompts((1,), seed=4)[0]
    chain = start + generate(model, tokenizer, [start], decoder="ar", max_new_tokens=30).token_ids[0]
    chain = chain[: next((i for i, t in enumerate(chain) if t in chain[:i]), len(chain))]  # up to its cycle
    assert len(chain) >= 24 and 2 not in chain  # long enough for 16 tokens and 4 drafts after them, no EOS
    prompt = chain + chain[:3]
    expected = hf_greedy(model, tokenizer, [prompt], 16)
    out = generate(
        model, tokenizer, [prompt], verify=True, draft_source="lookup", window=1, draft_length=4, max_new_tokens=16
    )
    assert out.token_ids == expected and out.token_ids[0][:8] == chain[3:11]
    stats = out.stats.extra
    assert stats["drafts_accepted"] == stats["drafts_proposed"] and stats["drafts_proposed"][0] > 0
    assert out.stats.forwards <= 16 // 5 + 2


def test_lookup_continuation_takes_the_latest_earlier_occurrence():
    context = np.array([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 1, 2, 3])
    assert lookup_continuation(context, 3, 2).tolist() == [7, 6]
    assert lookup_continuation(context, 3, 10).tolist() == [7, 6, 5, 1, 2, 3]
    assert lookup_continuation(context, 4, 3).tolist() == []  # (3, 1, 2, 3) never occurred before
    assert lookup_continuation(context, 1, 0).tolist() == []
    assert lookup_continuation(np.array([4, 4]), 2, 3).tolist() == []  # nothing before the n-gram itself
    assert lookup_continuation(np.array([4, 4, 4]), 2, 3).tolist() == [4]


def test_draft_rows_join_and_leave_a_running_batch(model, tokenizer):
    """A draft model keeps a KV cursor per row: rows that never drafted (verify=False) and rows prefilled on
    their own merge with it, and every row still decodes as it would alone."""
    settings = DecodingSettings(max_new_tokens=20, verify=True, draft_source="model", draft_model="self:1")
    prompts = random_prompts((5, 17, 9, 12))
    engine = DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)
    kinds = [dict(verify=False), dict(), dict(verify=False), dict(max_new_tokens=1)]
    requests = [engine.make_request(p, **kind) for p, kind in zip(prompts, kinds)]
    done, step = {}, 0
    while step < len(requests) or engine.live:
        if step < len(requests):
            engine.admit([requests[step]])
        for event in engine.step():
            if event.finished is not None:
                done[event.request.id] = event.finished.token_ids
        step += 1
    expected = hf_greedy(model, tokenizer, prompts, 20)
    assert [done[r.id] for r in requests[:3]] == expected[:3]
    assert done[requests[3].id] == expected[3][:1]


@pytest.mark.parametrize("source", ["lookup", "self:1"])
def test_sampled_verification_with_a_draft_source_is_seeded(model, tokenizer, source):
    kwargs = SOURCES[source]
    prompts = random_prompts((5, 17))
    runs = [
        generate(model, tokenizer, prompts, verify=True, temperature=1.0, seed=3, max_new_tokens=16, **kwargs)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    greedy = generate(model, tokenizer, prompts, verify=True, max_new_tokens=16, **kwargs)
    assert runs[0].token_ids != greedy.token_ids


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(draft_source="tree", verify=True), "unknown draft_source 'tree'"),
        (dict(draft_source="model", verify=True), "needs draft_model="),
        (dict(draft_model="self", verify=True), "read only with draft_source='model'"),
        (dict(draft_source="model", draft_model="self:x", verify=True), "N an integer >= 1"),
        (dict(draft_source="lookup", lookup_ngram=0, verify=True), "lookup_ngram must be an integer >= 1"),
        (dict(window=1, verify=True), "window >= 2"),
    ],
)
def test_bad_draft_settings_fail_before_decoding(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodingSettings(**kwargs)


def test_bad_draft_models_are_named(model, tokenizer):
    with pytest.raises(ValueError, match="draft_source='lookup' proposes drafts to verify: it needs verify=True"):
        generate(model, tokenizer, [[5, 6]], draft_source="lookup", max_new_tokens=4)
    with pytest.raises(ValueError, match="the target has 2 layers; use 1..2"):
        generate(model, tokenizer, [[5, 6]], verify=True, draft_source="model", draft_model="self:3", max_new_tokens=4)


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both_tokenizers_and_the_first_mismatch(
    model, tokenizer, tmp_path
):
    """Missing target tokens are a mismatch too: the draft would otherwise be fed ids past its embedding."""
    draft = smaller_vocabulary_model_dir(tmp_path / "small-vocab", tokenizer)
    first_missing = tokenizer.convert_ids_to_tokens(64)
    with pytest.raises(ValueError) as refused:
        generate(model, tokenizer, [[5, 6]], verify=True, draft_source="model", draft_model=draft, max_new_tokens=4)
    message = str(refused.value)
    assert "does not share the target's tokenizer" in message
    assert repr(tokenizer.name_or_path) in message and repr(draft) in message  # both tokenizers, by name
    assert f"{first_missing!r} as id 64" in message and "lacks it" in message
    assert f"{len(tokenizer)} tokens" in message and "64 tokens" in message


def test_draft_settings_from_strings():
    s = DecodingSettings.from_mapping(
        {"verify": "true", "draft_source": "model", "draft_model": "self:2", "lookup_ngram": "2", "window": "1"}
    )
    assert (s.draft_source, s.draft_model, s.lookup_ngram, s.window) == ("model", "self:2", 2, 1)
    assert s.effective_draft_length == s.block_size  # drafts from another source: block_size by default
    assert DecodingSettings(verify=True).effective_draft_length == 3  # from the masks: window - 1


# ---------------------------------------------------------------------------------------------
# Speculative sampling with each source's draft distribution, on hand-made logits
# ---------------------------------------------------------------------------------------------
P0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
P1 = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.1])
P2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])


def _first_two_tokens(drafts, q_logp, trials, generator):
    """The first and (where the first draft passed) second token of speculative sampling against P0, P1."""
    p_logp = torch.stack([P0, P1, P2]).log().expand(trials, -1, -1)
    accepted, token = speculative_accept(p_logp, q_logp, drafts, torch.full((trials,), 2), generator)
    first = torch.where(accepted >= 1, drafts[:, 0], token)
    second = torch.where(accepted >= 2, drafts[:, 1], token)[accepted >= 1]
    return first, second


def _frequencies(tokens):
    return torch.bincount(tokens, minlength=5).float() / tokens.numel()


def test_lookup_drafts_are_sampled_exactly():
    """Copied drafts are certain (q one-hot): speculative sampling still yields the target distribution,
    also when a mask's sampled draft precedes the copied one (a lookup extending the masks)."""
    trials, g = 60_000, torch.Generator().manual_seed(1)
    q0 = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])
    mask_drafts = torch.multinomial(q0, trials, replacement=True, generator=g)
    copied = [(torch.zeros(trials, dtype=torch.long), one_hot_log_q(torch.tensor(0), 5)), (mask_drafts, q0.log())]
    for first_draft, first_q in copied:
        drafts = torch.stack([first_draft, torch.full((trials,), 3)], dim=1)
        q_logp = torch.stack([first_q.expand(5), one_hot_log_q(torch.tensor(3), 5)]).expand(trials, -1, -1)
        first, second = _first_two_tokens(drafts, q_logp, trials, g)
        assert torch.allclose(_frequencies(first), P0, atol=0.01)
        assert torch.allclose(_frequencies(second), P1, atol=0.01)


def test_draft_model_draws_are_sampled_exactly():
    """A draft model's drafts drawn by the source's own rule from its tempered logits, with those
    distributions as q: the tokens follow the target's tempered distribution."""
    trials, temperature, g = 60_000, 0.7, torch.Generator().manual_seed(2)
    draft_logits = torch.tensor([[0.0, 2.0, 0.5, -1.0, 1.0], [1.5, 0.0, 0.0, 2.0, -0.5]])
    q_logp, sampled = tempered_log_probs(draft_logits.expand(trials, -1, -1), torch.full((trials,), temperature))
    drafting = np.ones(trials, dtype=bool)
    drafts = torch.stack([draw(q_logp[:, i], sampled, g, drafting) for i in range(2)], dim=1)
    assert torch.allclose(_frequencies(drafts[:, 0]), q_logp[0, 0].exp(), atol=0.01)  # drawn from q
    first, second = _first_two_tokens(drafts, q_logp, trials, g)
    assert torch.allclose(_frequencies(first), P0, atol=0.01)
    assert torch.allclose(_frequencies(second), P1, atol=0.01)


def test_decoding_configs_name_their_draft_source():
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    expected = {
        "mars_verified": ("masks", None),
        "mars_lookup": ("lookup", None),
        "mars_draft_model": ("model", "self:8"),
    }
    for name, (source, draft_model) in expected.items():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="evaluate", overrides=[f"decoding={name}"])
        settings = DecodingSettings.from_mapping(dict(cfg.decoding))
        assert (settings.verify, settings.draft_source, settings.draft_model) == (True, source, draft_model)


@pytest.mark.parametrize("source", ["lookup", "self:1"])
def test_sampled_verification_keeps_the_target_distribution(tokenizer, source):
    """Thousands of rows with their own seeds, each verifying one draft from the source at temperature 1:
    the first token follows the target's distribution.  Lookup drafts the target's most likely token (its
    q is one-hot); a wrong q would favour the draft (a q of ones: 0.5 -> 0.75)."""
    model = markov_model()  # the next token depends on the current one: the prompt's effect is known
    x, y, z = random_prompts((3,), seed=6)[0]
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([[z]])).logits[0, -1].float(), dim=-1)
    likely = int(p.argmax())
    prompt = [x, y, z, likely, *random_prompts((4,), seed=7)[0], x, y, z]
    settings = DecodingSettings(max_new_tokens=2, verify=True, temperature=1.0, **SOURCES[source])
    engine = DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)
    requests = [engine.make_request(prompt, seed=seed) for seed in range(3000)]
    engine.admit(requests)
    first, proposed = {}, 0
    while engine.live:
        for event in engine.step():
            if event.finished is not None:
                first[event.request.id] = event.finished.token_ids[0]
                proposed += sum(event.finished.draft_proposed)
    assert proposed == len(requests)  # one draft each, verified by speculative sampling
    frequencies = torch.bincount(torch.tensor(list(first.values())), minlength=p.numel()).float() / len(first)
    top = torch.topk(p, 3).indices
    assert torch.allclose(frequencies[top], p[top], atol=0.03), (frequencies[top], p[top])
