"""Tree drafts (``tree=``): the template's columns and attention, greedy verification of a tree on hand-made
predictions, the KV move of an accepted path, the automatic shape choice, and the engine's output, which is
transformers' greedy output for every shape, batched, with stop strings and with rows joining a running batch."""

import numpy as np
import pytest
import torch
from decoding_fixtures import (  # noqa: F401
    MASK_ID,
    extra_eos,
    hf_greedy,
    model,
    ragged,
    random_prompts,
    tokenizer,
)

from mars.decoding import generate
from mars.decoding.engine import DecodeEngine
from mars.decoding.forward import ModelRunner
from mars.decoding.kv import RaggedKVCache
from mars.decoding.settings import DecodingSettings
from mars.decoding.tree import TreeLayouts, build_template, columns_of, next_candidates
from mars.decoding.tree_choice import PRIOR, candidate_shapes, choose_shape, expected_tokens


def test_a_template_holds_the_nodes_the_root_group_and_a_group_after_each_node():
    t = build_template((2, 1), group_size=2, masks="all")
    assert t.nodes == 4 and t.columns == 4 + 2 + 2 * 4  # nodes, the root's group, a group after every node
    # the first-ranked path first (its columns are its committed slots), then the rest breadth-first
    assert list(t.node_depth) == [1, 2, 1, 2] and list(t.node_rank) == [0, 0, 1, 0]
    assert list(t.node_parent) == [-1, 0, -1, 2]
    assert list(t.parent[:6]) == [-1, 0, -1, 2, -1, 4]  # the root's group: a chain of masks after the root
    assert list(t.depth[:6]) == [1, 2, 1, 2, 1, 2]
    seen = t.ancestors()
    assert seen[3, 2] and not seen[3, 0] and not seen[3, 4]
    group = t.group[1 + 3]  # the masks after node 3 see it, its parent and each other causally
    assert list(group) == [12, 13]
    assert seen[13, 12] and seen[13, 3] and seen[12, 2] and not seen[12, 0]
    top = build_template((2, 1), group_size=2, masks="top")
    assert top.columns == 4 + 2 + 2 * 2 and (top.group[[3, 4]] == -1).all()  # second-ranked nodes carry none
    assert columns_of((1,)) == 3  # one draft and the two groups: 4 columns with the root


def test_tree_verification_takes_the_deepest_passing_path_and_the_ar_token_after_it():
    tree = TreeLayouts((2, 1), "all", torch.device("cpu"))
    t = tree.templates[2]
    candidates = torch.tensor([[[10, 11], [20, 21]]]).expand(3, -1, -1)
    layout = torch.tensor([2, 2, 0])
    fed = tree.draft_tokens(layout, candidates, MASK_ID)
    assert fed[0, t.node_column].tolist() == [10, 20, 11, 20]
    assert fed[2].eq(MASK_ID).all()  # template 0: the root group alone
    predicted = torch.full((3, 1 + fed.shape[1]), 99)
    predicted[:, 0] = torch.tensor([11, 10, 11])  # the AR token at the root
    predicted[0, 1 + 2] = 20  # row 0: 11 then 20 pass (the second-ranked branch) ...
    predicted[0, 1 + 3] = 7  # ... and the AR token after them
    predicted[1, 1 + 0] = 5  # row 1: 10 passes, 20 does not
    verdict = tree.verify(layout, predicted, fed)
    assert verdict.verified.tolist() == [2, 1, 0]
    assert verdict.tokens[0].tolist() == [11, 20, 7]
    assert verdict.tokens[1, :2].tolist() == [10, 5]
    assert verdict.tokens[2, 0].item() == 11  # no drafts: the root's AR token
    assert verdict.path[0].tolist() == [2, 3] and verdict.path[1, 0].item() == 0
    assert verdict.group[0].tolist() == t.group[1 + 3].tolist()
    assert verdict.group[1].tolist() == t.group[1 + 0].tolist()
    assert verdict.group[2].tolist() == tree.templates[0].group[0].tolist()


def test_next_candidates_are_each_masks_top_tokens_cut_where_the_first_is_unsure():
    logits = torch.full((1, 4, 8), -10.0)
    logits[0, 1, 3], logits[0, 1, 5] = 5.0, 4.0  # the group's first mask: sure of 3, then 5
    logits[0, 2] = 0.0  # the second: unsure (uniform)
    predicted = logits.argmax(-1)
    candidates, depths = next_candidates(logits, predicted, None, torch.tensor([[0, 1]]), 2, draft_threshold=0.5)
    assert candidates[0, 0].tolist() == [3, 5] and depths.item() == 1
    top = torch.tensor([[1.0, 0.9, 0.9, 1.0]])  # the step's top probabilities, where it took them
    _, sure = next_candidates(logits, predicted, top, torch.tensor([[0, 1]]), 1, draft_threshold=0.5)
    assert sure.item() == 2
    _, none = next_candidates(logits, predicted, None, torch.tensor([[-1, -1]]), 2, draft_threshold=0.0)
    assert none.item() == 0


def test_moving_a_path_copies_every_layers_keys_and_values():
    cache = RaggedKVCache(num_layers=2, capacity=8)
    cache.add_rows(1)
    for i, layer in enumerate(cache.layers):
        kv = torch.arange(8.0).view(1, 1, 8, 1).repeat(1, 2, 1, 3) + 100 * i
        layer.lazy_initialization(kv, kv)
        layer.keys.copy_(kv)
        layer.values.copy_(kv)
    cache.move(torch.tensor([[5, 7]]), torch.tensor([[3, 4]]))
    for i, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [x + 100 * i for x in [0, 1, 2, 5, 7, 5, 6, 7]]
        assert torch.equal(layer.keys, layer.values)


def test_the_shape_choice_follows_the_cost_of_a_column():
    flat, _ = choose_shape(lambda width: 1.0, PRIOR, 3, "all")
    steep, _ = choose_shape(lambda width: 1.0 + 0.05 * (width - 1), PRIOR, 3, "all")
    assert expected_tokens(flat, PRIOR) > expected_tokens(steep, PRIOR)
    assert sum(flat) > sum(steep) and steep == (1,)
    assert all(columns_of(s) <= 64 for s in candidate_shapes(3, "all"))
    assert expected_tokens((1, 1), [[0.5], [0.4]]) == pytest.approx(1 + 0.5 + 0.2)


@pytest.mark.parametrize("tree,masks", [("2,1", "all"), ("3,2", "top")])
def test_tree_verify_is_hf_greedy_with_a_ragged_batch(model, tokenizer, ragged, tree, masks):
    expected = hf_greedy(model, tokenizer, ragged, 24)
    out = generate(model, tokenizer, ragged, verify=True, tree=tree, tree_masks=masks, max_new_tokens=24)
    assert out.token_ids == expected
    proposed = out.stats.extra["drafts_proposed"]
    assert proposed[0] >= int(tree[0]) * 4  # the first depth's candidates, on several steps of every row
    assert out.stats.extra["tree"] == tree


def test_tree_rows_accepting_deep_paths_at_any_rank_stay_exact(model, tokenizer, monkeypatch):
    """Candidates that hold the model's own greedy continuation, at a rank that changes from step to step: every
    step accepts a whole path, whose keys and values are moved and read by the next steps; the output is still
    greedy AR's."""
    prompts = random_prompts((6, 13, 9), seed=4)
    expected = hf_greedy(model, tokenizer, prompts, 24)
    keep = DecodeEngine._keep_proposals

    def oracle(self, plan, accepted):
        keep(self, plan, accepted)
        rows, tree = self.rows, self.tree
        for i, request in enumerate(rows.records.requests):
            reference = expected[prompts.index(request.prompt_ids)]
            made = int(rows.tensors.length[i]) - len(request.prompt_ids)
            depths = min(tree.depth, len(reference) - made)
            for d in range(depths):
                rows.tensors.candidates[i, d, (made + d) % tree.width] = reference[made + d]
            rows.tensors.draft_count[i] = max(depths, 0)

    monkeypatch.setattr(DecodeEngine, "_keep_proposals", oracle)
    out = generate(model, tokenizer, prompts, verify=True, tree="2,2", max_new_tokens=24)
    assert out.token_ids == expected
    accepted = out.stats.extra["drafts_accepted"]
    assert accepted[1] > 0 and sum(accepted) >= sum(map(len, expected)) // 2


def test_tree_verify_with_stop_strings_and_rows_joining_a_running_batch(model, tokenizer):
    prompts = random_prompts((6, 14, 9), seed=5)
    expected = hf_greedy(model, tokenizer, prompts, 20)
    runner = ModelRunner(model)
    engine = DecodeEngine(runner, DecodingSettings(verify=True, tree="2,1", max_new_tokens=20), MASK_ID, [2], tokenizer)
    requests = [engine.make_request(p) for p in prompts]
    engine.admit(requests[:1])
    done = {}
    step = 0
    while engine.live or step < 3:
        if step == 2:
            engine.admit(requests[1:])
        for event in engine.step():
            if event.finished is not None:
                done[event.request.id] = event.finished.token_ids
        step += 1
    assert [done[r.id] for r in requests] == expected


def _decode(engine, requests):
    engine.admit(requests)
    done = {}
    while engine.live:
        for event in engine.step():
            if event.finished is not None:
                done[event.request.id] = event.finished.token_ids
    return [done[r.id] for r in requests]


def test_sampling_and_lossy_rows_verify_chains_beside_tree_rows_in_one_batch(model, tokenizer):
    prompts = random_prompts((7, 11, 9), seed=9)
    settings = DecodingSettings(verify=True, tree="auto", max_new_tokens=12)

    def engine():
        return DecodeEngine(ModelRunner(model), settings, MASK_ID, [2], tokenizer)

    def requests(e):
        greedy = e.make_request(prompts[0])
        sampled = e.make_request(prompts[1], temperature=0.8, seed=1)
        lossy = e.make_request(prompts[2], threshold=0.5)
        return [greedy, sampled, lossy]

    mixed = engine()
    together = _decode(mixed, requests(mixed))
    assert mixed.tree is not None  # the greedy row drafted a tree beside the two chains
    assert together[0] == hf_greedy(model, tokenizer, prompts[:1], 12)[0]
    pair, alone = engine(), engine()
    beside_tree = _decode(pair, requests(pair)[:2])[1]
    assert _decode(alone, requests(alone)[1:2]) == [beside_tree]  # a tree row beside it changes nothing
    with pytest.raises(ValueError, match="greedy"):
        generate(model, tokenizer, prompts, verify=True, tree="2", temperature=0.8, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tree": "0"}, "candidates per depth"),
        ({"tree": "2", "draft_source": "lookup"}, "verifies a chain"),
        ({"tree": "2", "cache": "block"}, "cursor"),
        ({"tree": "1,1,1,1", "block_size": 4}, "deep"),
        ({"tree_masks": "some"}, "tree_masks"),
    ],
)
def test_bad_tree_settings_fail_before_decoding(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodingSettings(verify=True, **kwargs)


def test_auto_picks_a_shape_from_measured_step_costs(model, tokenizer):
    out = generate(model, tokenizer, random_prompts((5,), seed=2), verify=True, max_new_tokens=6)
    shape = tuple(int(k) for k in out.stats.extra["tree"].split(","))
    assert shape in candidate_shapes(3, "all")
    assert np.prod(shape) >= 1


def test_the_acceptance_table_conditions_each_depth_on_the_earlier_ones():
    from mars.decoding.tree_choice import acceptance_table, table_from

    ranks = np.array([[0, 0], [0, 1], [1, 0], [2, -1], [0, 3]])
    table = acceptance_table(ranks, width=2)
    assert table[0] == [3 / 5, 4 / 5]
    assert table[1][0] == pytest.approx(
        1 / 3, abs=1e-4
    )  # of the 3 steps whose depth 1 is top-1 (with a depth 2), 1 is top-1
    assert table[1][1] == pytest.approx(3 / 4, abs=1e-4)  # of the 4 whose depth 1 is top-2 with a depth 2: 3 are top-2
    assert table_from({"draft_acceptance": {"conditional": table}}) == table
    assert table_from({"conditional": table, "prompts": 5}) == table  # the stored object itself
    assert table_from({"draft_acceptance": None}) is None


def test_a_column_cap_trims_the_tree_before_anything_else_and_keeps_the_output(model, tokenizer, monkeypatch):
    plans = []
    plan = DecodeEngine._plan
    monkeypatch.setattr(DecodeEngine, "_plan", lambda self: plans.append(plan(self)) or plans[-1])
    prompts = random_prompts((5, 9, 7, 12), seed=6)
    out = generate(model, tokenizer, prompts, verify=True, tree="2,1", max_step_columns=10, max_new_tokens=16)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 16)
    decoding = plans[1:]  # after the prefill
    assert all(int((p.uncached + p.predictions - 1).sum()) <= 10 for p in decoding if p.tree_layout is not None)
    assert any(p.tree_layout is None for p in decoding)  # 4 rows with their root groups (3 columns each) do not fit
