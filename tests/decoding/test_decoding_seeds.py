"""A sampled row's output depends on its own seed only: in a batch with any mix of decoders (greedy, sampled,
sampled and verified, a greedy chain or tree verify, thresholds below 1.0) and when it joins a running batch,
each row decodes exactly what it decodes alone."""

import pytest
from decoding_fixtures import MASK_ID, model, random_prompts, tokenizer  # noqa: F401

from mars.decoding.engine import DecodeEngine
from mars.decoding.forward import ModelRunner
from mars.decoding.settings import DecodingSettings

# every kind of row a server batches, as make_request options (the seed is added per case)
ROWS = {
    "greedy": dict(),
    "sampled": dict(temperature=0.8),
    "sampled-lossy": dict(temperature=0.8, threshold=0.9),
    "verify-sampled": dict(verify=True, temperature=0.8),
    "verify-greedy": dict(verify=True),
    "verify-lossy": dict(verify=True, threshold=0.9),
    "verify-sampled-lossy": dict(verify=True, temperature=0.8, threshold=0.9),
}
PROMPTS = random_prompts((6, 13, 9, 11, 7, 15, 10, 8), seed=21)


def _engine(model, tokenizer, tree: str, cap: int | None = None) -> DecodeEngine:  # noqa: F811
    # draft_threshold 0: every verifying row drafts whenever it can, so draws are asked of every step
    settings = DecodingSettings(tree=tree, draft_threshold=0.0, max_new_tokens=12, max_step_columns=cap)
    return DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)


def _requests(engine: DecodeEngine, seed: int, kinds) -> list:
    return [
        engine.make_request(PROMPTS[i], seed=seed + i if "temperature" in ROWS[kind] else None, **ROWS[kind])
        for i, kind in enumerate(kinds)
    ]


def _decode(engine: DecodeEngine, requests: list, join_at: int | None = None) -> tuple[list, dict]:
    """Each request's tokens; with ``join_at`` the second half joins the running first half at that step."""
    first = requests if join_at is None else requests[: len(requests) // 2]
    engine.admit(first)
    done, drafts, step = {}, {}, 0
    while engine.live or (join_at is not None and step <= join_at):
        if join_at is not None and step == join_at:
            engine.admit(requests[len(first) :])
        for event in engine.step():
            if event.finished is not None:
                done[event.request.id] = event.finished.token_ids
                drafts[event.request.id] = event.finished.draft_steps
        step += 1
    return [done[r.id] for r in requests], {r.id: drafts[r.id] for r in requests}


# (tree, max_step_columns, seed): under a cap the rows below threshold 1.0 may decode differently under different
# loads (documented), the others may not
CASES = [("chain", None, 0), ("2", None, 7), ("chain", None, 42), ("2", 8, 3), ("chain", 8, 11)]


@pytest.mark.parametrize("tree,cap,seed", CASES)
def test_every_row_of_a_mixed_batch_decodes_what_it_decodes_alone(model, tokenizer, tree, cap, seed):  # noqa: F811
    # under the cap: twice each lossless kind, enough rows that the cap cuts the step's masks
    kinds = list(ROWS) if cap is None else 2 * [k for k in ROWS if "threshold" not in ROWS[k]]
    engine = _engine(model, tokenizer, tree, cap)
    together, drafts = _decode(engine, _requests(engine, seed, kinds))
    # they verified (under the cap the greedy ones' masks may give way: the sampling ones keep theirs)
    assert all(
        drafts[r] > 0 for r, k in zip(drafts, kinds) if k.startswith("verify") and (cap is None or "sampled" in k)
    )
    joined, _ = _decode(engine := _engine(model, tokenizer, tree, cap), _requests(engine, seed, kinds), join_at=2)
    for i, kind in enumerate(kinds):
        alone_engine = _engine(model, tokenizer, tree, cap)
        alone, _ = _decode(alone_engine, [_requests(alone_engine, seed, kinds)[i]])
        assert together[i] == alone[0], (kind, "in the batch")
        assert joined[i] == alone[0], (kind, "joining a running batch" if i >= len(kinds) // 2 else "joined by rows")
