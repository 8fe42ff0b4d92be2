"""Lossless self-speculative decoding (verify=True): greedy output equals transformers greedy for every
cache strategy, ragged batches and stop strings; batch independence; statistics; bad input; and the
speculative-sampling rule reproduces the target distribution on hand-made distributions."""

import numpy as np
import pytest
import torch
from decoding_fixtures import (  # noqa: F401
    CACHES,
    build_model,
    extra_eos,
    hf_greedy,
    kernel_or_skip,
    model,
    ragged,
    random_prompts,
    tokenizer,
)

from mars.decoding import fastpath
from mars.decoding import generate as _generate
from mars.decoding.engine import DecodeEngine
from mars.decoding.planner import StepPlanner
from mars.decoding.scoring import StepScorer
from mars.decoding.verify import leading_matches, speculative_accept, typical_drafts


def generate(*args, **kwargs):
    """The chain layout unless a test names another: this module checks the chain's verification (tree drafts:
    test_decoding_tree.py)."""
    if "settings" not in kwargs:
        kwargs.setdefault("tree", "chain")
    return _generate(*args, **kwargs)


@pytest.mark.parametrize("fallback", ["none", "jacobi"])
@pytest.mark.parametrize("cache", CACHES)
def test_verify_is_hf_greedy_with_ragged_batch(model, tokenizer, ragged, cache, fallback):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(
        model, tokenizer, ragged, verify=True, cache=cache, cache_block=8, fallback=fallback, max_new_tokens=24
    )
    assert out.token_ids == expected
    stats = out.stats.extra
    assert sum(stats["drafts_proposed"]) > 0
    # every accepted draft saved a forward: per row, tokens = forwards + accepted drafts
    assert out.stats.generated_tokens <= out.stats.forwards * len(ragged) + sum(stats["drafts_accepted"])


@pytest.mark.parametrize("length", sorted({30, 46, 62, fastpath.MAX_COLUMNS - 1, fastpath.MAX_COLUMNS, 1023, 1024}))
@pytest.mark.parametrize("exact", [{"verify": True}, {"full_window": True}])
def test_a_prefill_with_masks_gives_the_prompt_the_bits_of_ar_prefill(model, tokenizer, monkeypatch, length, exact):
    """Lossless verify prefills the prompt with its first two masks, MARS at threshold 1.0 with its whole window of
    masks, AR the prompt alone; the prompt's last column must come out bit for bit the same (SDPA's blocked kernel
    rounded it differently at 30 and 46 columns, and the prompts one or two columns under the kernel's width went
    through the kernel alone but through MKL with the masks; a prompt of 1023 or 1024 tokens, at the attention kernel's
    width, went through it alone but through SDPA with the masks)."""
    from mars.decoding.forward import ModelRunner

    kernel_or_skip()
    monkeypatch.setattr(model.config, "max_position_embeddings", 2048)  # room for the longest prompt
    first = []
    logits_at = ModelRunner.logits_at

    def spy(self, input_ids, *args, **kwargs):
        out = logits_at(self, input_ids, *args, **kwargs)
        first.append((input_ids.shape[1], out[0, 0].clone()))
        return out

    monkeypatch.setattr(ModelRunner, "logits_at", spy)
    prompt = random_prompts((length,), seed=length)
    prefills = []
    for kwargs in ({"threshold": 1.0}, exact):
        first.clear()
        generate(model, tokenizer, prompt, max_new_tokens=8, **kwargs)
        prefills.append(first[0])
    (ar_width, ar), (masked_width, masked) = prefills
    assert ar_width == length and masked_width > length
    assert torch.equal(ar, masked)


@pytest.mark.parametrize("exact", [{"verify": True}, {"full_window": True}])
def test_batched_steps_with_drafts_or_masks_give_each_row_the_bits_of_ar(model, tokenizer, monkeypatch, exact):
    """A batch of verify steps (each row its last token and two drafts or masks) is wider than the same rows' AR
    steps; with the kernel's width at 6 columns (as 16 on an AVX2 build) 3 AR rows stay within it and 3 verify rows
    of 3 columns would not, nor would the prefill of 3 prompts of 2 tokens with their masks.  The width that decides
    is the new real tokens, so every row's column at its last real token comes out of both decoders with the same
    bits."""
    from mars.decoding.forward import ModelRunner

    kernel_or_skip()
    monkeypatch.setattr(fastpath, "MAX_COLUMNS", 6)
    seen = []
    logits_at = ModelRunner.logits_at

    def spy(self, input_ids, positions, mask, columns, *args, **kwargs):
        out = logits_at(self, input_ids, positions, mask, columns, *args, **kwargs)
        first = positions.gather(1, columns[:, :1]).squeeze(1)  # the position of each row's first read column
        seen.append({(b, int(p)): out[b, 0].clone() for b, p in enumerate(first)})
        return out

    monkeypatch.setattr(ModelRunner, "logits_at", spy)
    prompts = random_prompts((2, 2, 2), seed=3)
    runs = []
    for kwargs in ({"threshold": 1.0}, exact):
        seen.clear()
        out = generate(model, tokenizer, prompts, max_new_tokens=16, **kwargs)
        runs.append((out.token_ids, {k: v for step in seen for k, v in step.items()}))
    (ar_tokens, ar), (tokens, other) = runs
    assert tokens == ar_tokens
    shared = sorted(set(ar) & set(other))
    assert len(shared) >= 6  # the prefill and later steps of every row
    assert all(torch.equal(ar[k], other[k]) for k in shared), [k for k in shared if not torch.equal(ar[k], other[k])]


@pytest.mark.parametrize("window,draft_length", [(2, None), (4, 2), (6, None)])
def test_verify_window_and_draft_length_stay_exact(model, tokenizer, window, draft_length):
    prompts = random_prompts((5, 17, 9))
    expected = hf_greedy(model, tokenizer, prompts, 20)
    out = generate(model, tokenizer, prompts, verify=True, window=window, draft_length=draft_length, max_new_tokens=20)
    assert out.token_ids == expected
    assert len(out.stats.extra["drafts_proposed"]) == (draft_length or window - 1)


def test_draft_threshold_never_changes_the_output(model, tokenizer):
    prompts = random_prompts((5, 17, 9))
    expected = hf_greedy(model, tokenizer, prompts, 20)
    proposed = []
    for dt in (0.0, 0.3, 0.9):
        out = generate(model, tokenizer, prompts, verify=True, draft_threshold=dt, max_new_tokens=20)
        assert out.token_ids == expected
        proposed.append(sum(out.stats.extra["drafts_proposed"]))
    assert proposed == sorted(proposed, reverse=True) and proposed[0] > proposed[-1]


def test_exact_greedy_steps_read_no_probabilities_and_decode_the_same(model, tokenizer, monkeypatch):
    """AR and lossless verify rows read only the argmax, so their steps skip the log-softmax over the vocabulary
    (the draft threshold takes the masks' top probability from their logits); a row below 1.0 needs it on every
    step.  Forcing the log-softmax on every step decodes the same tokens with the same forwards: the same drafts."""
    prompts = random_prompts((5, 17, 9))
    expected = hf_greedy(model, tokenizer, prompts, 20)
    widths = []
    log_probs = DecodeEngine.log_probs

    def counted(self, logits, temperature):
        widths.append(logits.shape[1])
        return log_probs(self, logits, temperature)

    monkeypatch.setattr(DecodeEngine, "log_probs", counted)
    runs = {
        "ar": dict(threshold=1.0, cache="cursor"),
        "verify": dict(verify=True, draft_threshold=0.0),
        "verify-dt": dict(verify=True, draft_threshold=0.3),
        "tau": dict(threshold=0.5, cache="cursor"),
    }
    read, outs = {}, {}
    for name, kw in runs.items():
        widths.clear()
        outs[name] = generate(model, tokenizer, prompts, max_new_tokens=20, **kw)
        read[name] = list(widths)
    assert outs["ar"].token_ids == outs["verify"].token_ids == outs["verify-dt"].token_ids == expected
    assert read["ar"] == [] and read["verify"] == [] and read["verify-dt"] == []
    assert len(read["tau"]) == outs["tau"].stats.forwards
    monkeypatch.setattr(StepScorer, "reads_probabilities", lambda self: True)
    for name, kw in runs.items():
        forced = generate(model, tokenizer, prompts, max_new_tokens=20, **kw)
        assert forced.token_ids == outs[name].token_ids and forced.stats.forwards == outs[name].stats.forwards, name


def test_verify_below_one_without_drafts_is_plain_mars(model, tokenizer):
    """Below threshold 1.0 a verifying step accepts the masks that meet the threshold; with no draft ever
    proposed (draft threshold 1.0: no mask is that sure) every step is a plain MARS step."""
    prompts = random_prompts((5, 17, 9))
    plain = generate(model, tokenizer, prompts, threshold=0.02, max_new_tokens=24)
    composed = generate(model, tokenizer, prompts, verify=True, threshold=0.02, draft_threshold=1.0, max_new_tokens=24)
    assert composed.token_ids == plain.token_ids and composed.from_mask == plain.from_mask
    assert composed.stats.per_row_forwards == plain.stats.per_row_forwards
    assert sum(composed.stats.extra["drafts_proposed"]) == 0 and any(map(any, plain.from_mask))


@pytest.mark.parametrize("cache", CACHES)
def test_verify_below_one_is_exact_except_the_masks_it_accepts(model, tokenizer, cache):
    """Verified drafts plus masks accepted at a threshold (the paper's speculative composition, here with
    prompt-lookup drafts, which the random model's repetitive text lets pass): every token not flagged as a
    mask's is the greedy AR token given the output's own prefix, and the masks save forwards beyond what
    verification alone saves."""
    from mars.evaluation.fidelity import ar_predictions

    prompts = random_prompts((5, 17, 9, 30))
    kwargs = dict(verify=True, draft_source="lookup", cache=cache, cache_block=8, max_new_tokens=24)
    exact = generate(model, tokenizer, prompts, **kwargs)
    out = generate(model, tokenizer, prompts, threshold=0.3, **kwargs)
    predicted = ar_predictions(model, prompts, out.token_ids, suppress_ids=[tokenizer.mask_token_id])
    for tokens, flags, ar in zip(out.token_ids, out.from_mask, predicted):
        assert len(flags) == len(tokens) == 24
        assert all(t == a for t, a, f in zip(tokens, ar, flags) if not f)
    assert sum(map(sum, out.from_mask)) > 0 and sum(out.stats.extra["drafts_accepted"]) > 0
    assert sum(out.stats.per_row_forwards) < sum(exact.stats.per_row_forwards)
    # at threshold 1.0 nothing is accepted unverified: greedy AR
    assert not any(map(any, exact.from_mask)) and exact.token_ids == hf_greedy(model, tokenizer, prompts, 24)


def test_verify_row_does_not_depend_on_its_batch(model, tokenizer):
    prompts = random_prompts((5, 17, 9, 30))
    together = generate(model, tokenizer, prompts, verify=True, max_new_tokens=24)
    for i, p in enumerate(prompts):
        alone = generate(model, tokenizer, [p], verify=True, max_new_tokens=24)
        assert alone.token_ids[0] == together.token_ids[i]
        assert alone.stats.per_row_forwards[0] == together.stats.per_row_forwards[i]


def test_verify_with_stop_strings_matches_ar(model, tokenizer):
    prompts = random_prompts((7, 12), seed=5)
    text = generate(model, tokenizer, prompts, decoder="ar", max_new_tokens=24).texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ar = generate(model, tokenizer, prompts, decoder="ar", max_new_tokens=24, stop=[stop])
    for cache in CACHES:
        out = generate(model, tokenizer, prompts, verify=True, cache=cache, max_new_tokens=24, stop=[stop])
        assert out.token_ids == ar.token_ids and out.texts == ar.texts
        assert out.finish_reasons == ar.finish_reasons


def test_verify_mixed_with_lossy_rows_in_one_engine(model, tokenizer):
    """A server batches verifying and threshold rows together: each row behaves as it would alone."""
    from mars.decoding import DecodeEngine, DecodingSettings
    from mars.decoding.forward import ModelRunner

    prompts = random_prompts((5, 17, 9))
    engine = DecodeEngine(ModelRunner(model), DecodingSettings(max_new_tokens=20), 16, [2], tokenizer)
    reqs = [
        engine.make_request(prompts[0], verify=True),
        engine.make_request(prompts[1], threshold=0.3),
        engine.make_request(prompts[2]),
    ]
    engine.admit(reqs)
    done = {}
    while engine.live:
        for ev in engine.step():
            if ev.finished:
                done[ev.request.id] = ev.finished.token_ids
    assert done[reqs[0].id] == hf_greedy(model, tokenizer, prompts[:1], 20)[0]
    assert done[reqs[2].id] == hf_greedy(model, tokenizer, prompts[2:], 20)[0]
    lossy = generate(model, tokenizer, prompts[1:2], threshold=0.3, max_new_tokens=20)
    assert done[reqs[1].id] == lossy.token_ids[0]


@pytest.fixture
def plans(monkeypatch) -> list:
    """Every step plan the decoding engine makes while the test runs, in order."""
    made = []
    plan = StepPlanner.plan
    monkeypatch.setattr(StepPlanner, "plan", lambda self, first: made.append(plan(self, first)) or made[-1])
    return made


@pytest.mark.parametrize("chain", ["auto", "always", "never"])
def test_chain_drafts_decides_where_masks_ride_and_never_changes_the_output(model, tokenizer, plans, chain):
    """``chain_drafts``: with ``never`` (and ``auto`` for a lossless row on this CPU) a step that carries drafts
    feeds no masks after them, with ``always`` it does; a lossy verifying row chains under ``auto`` (it
    accepts those masks unverified); the lossless output is greedy AR whatever the choice."""
    prompts = random_prompts((5, 17, 9))
    kwargs = dict(verify=True, chain_drafts=chain, draft_threshold=0.0, max_new_tokens=20)
    out = generate(model, tokenizer, prompts, **kwargs)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 20)
    drafting = [(p.drafts > 0) & p.verifying for p in plans]
    assert any(d.any() for d in drafting)
    chained = any((p.draft_masks[d] > 0).any() for p, d in zip(plans, drafting))
    assert chained == (chain == "always")
    assert all((p.draft_masks[~d & p.verifying & (p.predictions > 1)] > 0).all() for p, d in zip(plans, drafting))
    plans.clear()
    generate(model, tokenizer, prompts, threshold=0.3, **kwargs)
    lossy_chained = any((p.draft_masks[(p.drafts > 0) & p.verifying] > 0).any() for p in plans)
    assert lossy_chained == (chain != "never")


def test_greedy_steps_choose_the_same_tokens_and_drafts_with_the_fused_choice_or_aten(model, tokenizer, monkeypatch):
    """``MARS_TOP_TOKENS=0`` (the ATen ops) and the fused kernel (default, under the fast path only) pick the same
    tokens, so AR and lossless verify give the greedy text and verify proposes and accepts the same drafts either
    way."""
    prompts = random_prompts((5, 17, 9))
    fused = []
    init = DecodeEngine.__init__
    monkeypatch.setattr(
        DecodeEngine, "__init__", lambda self, *a, **k: init(self, *a, **k) or fused.append(self.ctx.fused_choice)
    )
    runs = {}
    for switch, fast_path in (("0", "1"), ("1", "1"), ("1", "0")):
        monkeypatch.setenv("MARS_TOP_TOKENS", switch)
        monkeypatch.setenv("MARS_FAST_PATH", fast_path)
        fused.clear()
        ar = generate(model, tokenizer, prompts, max_new_tokens=20)
        verified = generate(model, tokenizer, prompts, verify=True, max_new_tokens=20)
        assert set(fused) == {switch == fast_path == "1"}  # the kernel's choice only under the fast path
        assert ar.token_ids == verified.token_ids == hf_greedy(model, tokenizer, prompts, 20)
        extra = verified.stats.extra
        runs[switch, fast_path] = (verified.stats.forwards, extra["drafts_proposed"], extra["drafts_accepted"])
    assert runs["0", "1"] == runs["1", "1"]
    assert sum(runs["1", "1"][1]) > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_greedy_verify_kernel_decides_what_the_tensor_ops_decide(model, tokenizer, seed):
    """``mars::greedy_verify`` against the engine's tensor ops on random verify steps: rows verifying or not, any
    number of drafts and masks fed, drafts that match the argmax for a while, top probabilities on both sides of
    the draft threshold (NaN at the AR column), steps with and without masks, drafts strided or contiguous.  Same
    counts, drafts and flags."""
    from mars.decoding import DecodingSettings
    from mars.decoding.forward import ModelRunner
    from mars.decoding.step import StepPlan, StepScores
    from mars.decoding.verifiers import ChainVerifier

    rng = np.random.default_rng(seed)
    settings = DecodingSettings(max_new_tokens=20, verify=True, window=4)
    engine = DecodeEngine(ModelRunner(model), settings, 16, [2], tokenizer)
    assert engine.ctx.fused_choice  # the kernels are built here
    chain = next(v for v in engine.verifiers if isinstance(v, ChainVerifier))
    rows = 6
    engine.admit([engine.make_request([5, 6, 7]) for _ in range(rows)])
    slots = engine.max_drafts
    checked = {"masks": 0, "no masks": 0, "passed some": 0}
    for _ in range(60):
        verifying = rng.random(rows) < 0.8
        drafts = np.where(verifying, rng.integers(0, slots + 1, rows), 0)
        masks = np.where(verifying & (rng.random() < 0.7), rng.integers(0, slots + 1, rows), 0)
        predictions = np.where(verifying, 1 + drafts + masks, rng.integers(1, 3, rows))
        no_row = np.zeros(rows, dtype=bool)
        plan = StepPlan(np.ones(rows, np.int64), predictions, drafts, masks, no_row, verifying, True, engine.device)
        width = int(predictions.max())
        predicted = torch.from_numpy(rng.integers(0, 3, (rows, width)))
        top = torch.from_numpy(rng.random((rows, width), dtype=np.float32))
        top[:, 0] = float("nan")
        drafted = torch.from_numpy(rng.integers(0, 3, (slots, rows))).t()  # strided, as a draft source may leave it
        engine.rows.tensors.drafts = drafted if rng.random() < 0.5 else drafted.contiguous()
        engine.rows.tensors.draft_count = torch.from_numpy(rng.integers(0, slots + 1, rows))
        count = torch.from_numpy(rng.integers(0, 3, rows))
        engine.ctx.settings = settings.replace(draft_threshold=float(rng.choice([0.0, 0.3, 0.6])))
        top_read = top if engine.ctx.settings.draft_threshold > 0 and masks.any() else None
        scores = StepScores(None, None, predicted, top_read)
        decided = {}
        for fused in (True, False):
            engine.ctx.fused_choice = fused
            assert (chain.greedy_check(plan, scores, count) is not None) == fused  # the kernel, then the ops
            tokens, counts, verified, nxt = chain.check(plan, scores, count)
            assert nxt.log_q is None
            decided[fused] = (tokens, counts, verified, nxt.tokens, nxt.count)
        for kernel, ops in zip(decided[True], decided[False]):
            assert torch.equal(kernel, ops)
        checked["masks" if masks.any() else "no masks"] += 1
        checked["passed some"] += int((decided[True][2] > 0).any())
    assert min(checked.values()) > 0


def test_lookup_rows_feed_the_lean_number_of_masks_too(model, tokenizer, plans):
    """``verify_masks=auto`` trims a lossless row on a CPU to LEAN_VERIFY_MASKS masks whatever its other drafts'
    source: a prompt-lookup row feeds them on the steps lookup has no draft for."""
    prompts = random_prompts((5, 17, 9))
    out = generate(model, tokenizer, prompts, verify=True, draft_source="lookup", window=6, max_new_tokens=24)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 24)
    masks = np.concatenate([p.draft_masks[p.verifying] for p in plans])
    assert masks.max() == 2


@pytest.mark.parametrize("verify_masks,lossless,lossy", [("auto", 2, 5), ("all", 5, 5), (3, 3, 3), (1, 1, 1)])
def test_verify_masks_decides_how_many_masks_a_verifying_row_feeds(
    model, tokenizer, plans, verify_masks, lossless, lossy
):
    """``verify_masks`` (window 6: up to 5 masks): ``auto`` on this CPU trims a lossless row to
    LEAN_VERIFY_MASKS masks and keeps every mask for a lossy row, ``all`` keeps the window's, an integer sets
    it; a row never drafts more than the masks it fed, and the lossless output is greedy AR whatever the
    choice."""
    prompts = random_prompts((5, 17, 9))
    kwargs = dict(verify=True, window=6, verify_masks=verify_masks, draft_threshold=0.0, max_new_tokens=24)
    for threshold, fed in ((1.0, lossless), (0.3, lossy)):
        plans.clear()
        out = generate(model, tokenizer, prompts, threshold=threshold, **kwargs)
        if threshold == 1.0:
            assert out.token_ids == hf_greedy(model, tokenizer, prompts, 24)
        masks = np.concatenate([p.draft_masks[p.verifying] for p in plans])
        assert masks.max() == fed
        drafts = np.concatenate([p.drafts[p.verifying] for p in plans])
        assert drafts.max() <= fed and drafts.max() >= 1
    with pytest.raises(ValueError, match="more than the window's 5 masks"):
        generate(model, tokenizer, prompts, verify=True, window=6, verify_masks=6, max_new_tokens=4)
    with pytest.raises(ValueError, match="verify_masks must be"):
        generate(model, tokenizer, prompts, verify=True, verify_masks=0, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(verify=True, chain_drafts="sometimes"), "unknown chain_drafts 'sometimes'"),
        (dict(verify=True, max_accept=2), "max_accept does not apply"),
        (dict(verify=True, cache="block", window="cache_block"), "not 'cache_block'"),
        (dict(verify=True, decoder="jacobi"), "needs decoder='mars'"),
        (dict(verify=True, window=1), "window >= 2"),
        (dict(verify=True, fallback="tree"), "unknown fallback 'tree'"),
        (dict(verify=True, draft_threshold=1.5), "draft_threshold must be a number in \\[0, 1\\]"),
        (dict(verify=True, typical_epsilon=1.0), "typical_epsilon must be a number in \\[0, 1\\)"),
        (dict(typical_epsilon=0.1), "it needs verify=True"),
    ],
)
def test_verify_bad_input_fails_before_decoding(model, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, [[5, 6]], max_new_tokens=4, **kwargs)


def test_verify_needs_a_mask_token(model):
    from mars.models import embedded_tokenizer

    with pytest.raises(ValueError, match="no mask token"):
        generate(model, embedded_tokenizer(), [[5, 6]], verify=True, max_new_tokens=4)


# ---------------------------------------------------------------------------------------------
# Speculative sampling on hand-made distributions
# ---------------------------------------------------------------------------------------------
def test_leading_matches_counts_the_verified_prefix():
    drafts = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, 6]])
    predicted = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    n = torch.tensor([3, 3, 3, 2])
    assert leading_matches(drafts, predicted, n).tolist() == [3, 1, 0, 2]


def test_typical_acceptance_passes_plausible_drafts_and_always_the_argmax():
    """Medusa's rule min(eps, sqrt(eps) * exp(-H)): a flat target passes a draft it gives 0.3, a peaked one
    does not pass one it gives 0.04 (the bound is eps there), and the argmax passes at any epsilon; a token
    the target rules out (probability 0) never passes."""
    flat = torch.tensor([0.35, 0.3, 0.2, 0.15, 0.0])
    peaked = torch.tensor([0.9, 0.04, 0.03, 0.02, 0.01])
    logp = torch.stack([flat, peaked]).log().unsqueeze(0)  # one row, two draft positions
    assert typical_drafts(logp, torch.tensor([[1, 1]]), 0.09).tolist() == [[True, False]]
    assert typical_drafts(logp, torch.tensor([[4, 0]]), 0.09).tolist() == [[False, True]]
    for eps in (1e-4, 0.3, 0.99):
        assert typical_drafts(logp, torch.tensor([[0, 0]]), eps).all()
    entropy = -(peaked[:4] * peaked[:4].log()).sum()
    bound = min(0.3, 0.3**0.5 * torch.exp(-entropy).item())  # 0.3 * e^-H (about 0.2): 0.04 stays out
    assert typical_drafts(logp, torch.tensor([[0, 1]]), 0.3).tolist() == [[True, 0.04 > bound]]
    # leading_matches counts only the leading run that is the argmax or typical
    drafts = torch.tensor([[1, 2]])
    passing = typical_drafts(logp, drafts, 0.09)
    assert leading_matches(drafts, torch.tensor([[0, 0, 0]]), torch.tensor([2]), passing).item() == 1


def _ar_log_probs(model, prompt, output, never):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    logits[:, never] = float("-inf")
    return torch.log_softmax(logits.float(), dim=-1)


def test_typical_verification_emits_only_tokens_the_model_rates_plausible(tokenizer):
    """Typical acceptance (lossy): every emitted token is the AR argmax given the output's own prefix or
    has AR probability above the rule's bound there; it accepts more drafts per forward than lossless
    verify, and a row decodes the same alone and in a batch.  (The shared model's distributions are too
    peaked for its random masks' drafts ever to be plausible: a flatter head makes some of them so.)"""
    model = build_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)
    prompts = random_prompts((5, 17, 9, 30))
    eps, kwargs = 0.2, dict(verify=True, draft_threshold=0.0, max_new_tokens=24)  # every mask drafts
    exact = generate(model, tokenizer, prompts, **kwargs)
    out = generate(model, tokenizer, prompts, typical_epsilon=eps, **kwargs)
    assert sum(out.stats.extra["drafts_accepted"]) > sum(exact.stats.extra["drafts_accepted"])
    assert sum(out.stats.per_row_forwards) < sum(exact.stats.per_row_forwards)
    assert out.token_ids != exact.token_ids  # lossy: some draft that is not the argmax passed
    never = [tokenizer.mask_token_id]
    for prompt, tokens in zip(prompts, out.token_ids):
        logp = _ar_log_probs(model, prompt, tokens, never)
        chosen = logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).exp()
        entropy = torch.special.entr(logp.exp()).sum(-1)
        bound = torch.clamp(eps**0.5 * torch.exp(-entropy), max=eps)
        argmax = logp.argmax(-1) == torch.tensor(tokens)
        assert bool((argmax | (chosen > bound * 0.999)).all())
    alone = generate(model, tokenizer, prompts[1:2], typical_epsilon=eps, **kwargs)
    assert alone.token_ids[0] == out.token_ids[1]


def test_speculative_sampling_reproduces_the_target_distribution():
    """Two draft positions with q far from p: the first accepted token, and the second token given the
    first, must follow p (chi-square-like tolerance on 60k trials; a rule that kept drafts or resampled
    from p instead of the residual fails it)."""
    torch.manual_seed(0)
    vocab, trials = 5, 60_000
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.1])  # the target after any first token (context-free here)
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    q0 = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])
    q1 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    g = torch.Generator().manual_seed(1)
    d0 = torch.multinomial(q0, trials, replacement=True, generator=g)
    d1 = torch.multinomial(q1, trials, replacement=True, generator=g)
    drafts = torch.stack([d0, d1], dim=1)
    p_logp = torch.stack([p0, p1, p2]).log().expand(trials, -1, -1)
    q_logp = torch.stack([q0, q1]).log().expand(trials, -1, -1)
    accepted, token = speculative_accept(p_logp, q_logp, drafts, torch.full((trials,), 2), g)
    first = torch.where(accepted >= 1, drafts[:, 0], token)
    freq0 = torch.bincount(first, minlength=vocab).float() / trials
    assert torch.allclose(freq0, p0, atol=0.01), freq0
    has_second = accepted >= 1
    second = torch.where(accepted >= 2, drafts[:, 1], token)[has_second]
    freq1 = torch.bincount(second, minlength=vocab).float() / second.numel()
    assert torch.allclose(freq1, p1, atol=0.01), freq1
    # acceptance of the first draft happens with probability sum(min(p, q))
    assert abs(has_second.float().mean().item() - torch.minimum(p0, q0).sum().item()) < 0.01


def test_sampled_verify_is_seeded_and_per_row(model, tokenizer):
    prompts = random_prompts((5, 17))
    a = generate(model, tokenizer, prompts, verify=True, temperature=1.0, seed=3, max_new_tokens=16)
    b = generate(model, tokenizer, prompts, verify=True, temperature=1.0, seed=3, max_new_tokens=16)
    assert a.token_ids == b.token_ids
    alone = generate(model, tokenizer, prompts[1:], verify=True, temperature=1.0, seed=3, max_new_tokens=16)
    assert alone.token_ids[0] == a.token_ids[1]
    assert a.token_ids != generate(model, tokenizer, prompts, verify=True, max_new_tokens=16).token_ids
