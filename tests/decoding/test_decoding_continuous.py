"""The step-wise engine: requests join a running batch (continuous batching) and leave when done, and a
row's output depends neither on its batch nor on when it arrived; cancellation; input validation."""

import pytest
from decoding_fixtures import MASK_ID, hf_greedy, model, random_prompts, tokenizer  # noqa: F401

from mars.decoding import DecodeEngine, DecodingSettings, generate
from mars.decoding.forward import ModelRunner


def run_staggered(model, tokenizer, prompts, arrivals, settings, **request_kwargs):
    """Admit prompt i before step ``arrivals[i]``; step until every row finished; outputs by prompt."""
    engine = DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)
    requests = [engine.make_request(p, **request_kwargs) for p in prompts]
    done, step = {}, 0
    while len(done) < len(prompts):
        engine.admit([r for r, a in zip(requests, arrivals) if a == step])
        for ev in engine.step():
            if ev.finished:
                done[ev.request.id] = ev.finished
        step += 1
    return [done[r.id] for r in requests], engine


@pytest.mark.parametrize("cache", ["cursor", "none"])
@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_output_does_not_depend_on_arrival(model, tokenizer, cache, threshold):
    prompts = random_prompts((5, 17, 9, 30), seed=11)
    settings = DecodingSettings(cache=cache, max_new_tokens=20, threshold=threshold)
    together = generate(model, tokenizer, prompts, settings=settings)
    staggered, engine = run_staggered(model, tokenizer, prompts, [0, 3, 4, 9], settings)
    assert [f.token_ids for f in staggered] == together.token_ids
    if threshold == 1.0:
        assert together.token_ids == hf_greedy(model, tokenizer, prompts, 20)
    # rows that arrived later took part in fewer forwards than the engine ran
    assert staggered[3].forwards < engine.forwards


def test_verify_rows_can_join_a_running_batch(model, tokenizer):
    prompts = random_prompts((5, 17, 9), seed=12)
    settings = DecodingSettings(max_new_tokens=20, verify=True)
    staggered, _ = run_staggered(model, tokenizer, prompts, [0, 2, 5], settings)
    assert [f.token_ids for f in staggered] == hf_greedy(model, tokenizer, prompts, 20)


def test_block_cache_refuses_late_arrivals(model, tokenizer):
    engine = DecodeEngine(
        ModelRunner(model), DecodingSettings(cache="block", max_new_tokens=8), MASK_ID, [2], tokenizer
    )
    engine.admit([engine.make_request([5, 6, 7])])
    engine.step()
    with pytest.raises(RuntimeError, match="only join before the first step"):
        engine.admit([engine.make_request([8, 9])])


def test_cancelled_request_leaves_at_the_next_step(model, tokenizer):
    engine = DecodeEngine(ModelRunner(model), DecodingSettings(max_new_tokens=50), MASK_ID, [2], tokenizer)
    keep, drop = engine.make_request([5, 6, 7]), engine.make_request([8, 9, 10, 11])
    engine.admit([keep, drop])
    engine.step()
    assert engine.cancel(drop.id)
    events = engine.step()
    gone = [e for e in events if e.finished is not None]
    assert [e.request.id for e in gone] == [drop.id] and gone[0].finished.reason == "cancelled"
    assert engine.live == 1
    while engine.live:
        engine.step()


def test_per_request_budget_and_stop(model, tokenizer):
    engine = DecodeEngine(ModelRunner(model), DecodingSettings(max_new_tokens=30), MASK_ID, [2], tokenizer)
    a, b = engine.make_request([5, 6, 7], max_new_tokens=3), engine.make_request([8, 9], max_new_tokens=11)
    engine.admit([a, b])
    done = {}
    while engine.live:
        for ev in engine.step():
            if ev.finished:
                done[ev.request.id] = ev.finished
    assert len(done[a.id].token_ids) == 3 and done[a.id].reason == "length"
    assert len(done[b.id].token_ids) <= 11


def test_streamed_tokens_add_up_to_the_output(model, tokenizer):
    settings = DecodingSettings(max_new_tokens=20, threshold=0.3)
    engine = DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)
    reqs = [engine.make_request(p) for p in random_prompts((5, 9), seed=4)]
    engine.admit(reqs)
    streamed = {r.id: [] for r in reqs}
    final = {}
    while engine.live:
        for ev in engine.step():
            streamed[ev.request.id].extend(ev.tokens)
            if ev.finished:
                final[ev.request.id] = ev.finished.token_ids
    assert streamed == final


# ---------------------------------------------------------------------------------------------
# Input validation (before any forward)
# ---------------------------------------------------------------------------------------------
def test_bytes_prompts_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="prompt 1 is bytes"):
        generate(model, tokenizer, [[5, 6], b"hello"], max_new_tokens=2)


def test_token_ids_outside_the_vocabulary_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="prompt 0 has token id 5000, outside the model's vocabulary of 1024"):
        generate(model, tokenizer, [[5, 5000]], max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1"):
        generate(model, tokenizer, [[-1, 4]], max_new_tokens=2)


def test_generation_past_the_context_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="would reach position 260, past the model's context of 256"):
        generate(model, tokenizer, [[5] * 200], max_new_tokens=60)
    assert len(generate(model, tokenizer, [[5] * 200], max_new_tokens=56).token_ids[0]) <= 56


def test_joining_rows_are_prefilled_in_a_forward_of_their_own(model, tokenizer):
    engine = DecodeEngine(ModelRunner(model), DecodingSettings(max_new_tokens=12), MASK_ID, [2], tokenizer)
    first = engine.make_request([5, 6, 7])
    engine.admit([first])
    engine.step()
    joining = engine.make_request(random_prompts((40,), seed=9)[0])
    engine.admit([joining])
    assert engine.live == 2 and len(engine.rows) == 1  # waits for the next step's prefill
    before = engine.forwards
    events = engine.step()
    assert engine.forwards == before + 2  # the running row's step, then the newcomer's prefill
    assert {e.request.id for e in events} == {first.id, joining.id} and len(engine.rows) == 2
    assert all(len(e.tokens) == 1 for e in events)


def test_a_live_rows_threshold_can_change(model, tokenizer):
    prompt = random_prompts((9,), seed=2)[0]
    engine = DecodeEngine(ModelRunner(model), DecodingSettings(max_new_tokens=30), MASK_ID, [2], tokenizer)
    req = engine.make_request(prompt)
    engine.admit([req])
    steps = [len(engine.step()[0].tokens) for _ in range(3)]
    assert steps == [1, 1, 1]
    assert engine.set_threshold(req.id, 0.2)
    accepted = []
    while engine.live:
        accepted += [len(e.tokens) for e in engine.step()]
    assert max(accepted) > 1
    with pytest.raises(ValueError, match="threshold"):
        engine.set_threshold(req.id, 1.5)
    assert not engine.set_threshold("no such request", 0.9)
