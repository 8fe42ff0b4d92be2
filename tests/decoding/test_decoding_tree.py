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
from mars.decoding.planner import StepPlanner
from mars.decoding.settings import MAX_TREE_COLUMNS, DecodingSettings, tree_columns
from mars.decoding.tree import TreeLayouts, build_template, columns_of, layouts_for, next_candidates
from mars.decoding.tree_choice import PRIOR, candidate_shapes, choose_shape, expected_tokens, smaller_shapes
from mars.decoding.verifiers import TreeVerifier


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
    keep = TreeVerifier.keep

    def oracle(self, plan, accepted):
        keep(self, plan, accepted)
        rows, tree = self.ctx.rows, self.tree
        for i, request in enumerate(rows.records.requests):
            reference = expected[prompts.index(request.prompt_ids)]
            made = int(rows.tensors.length[i]) - len(request.prompt_ids)
            depths = min(tree.depth, len(reference) - made)
            for d in range(depths):
                rows.tensors.candidates[i, d, (made + d) % tree.width] = reference[made + d]
            rows.tensors.draft_count[i] = max(depths, 0)

    monkeypatch.setattr(TreeVerifier, "keep", oracle)
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


def test_a_column_cap_trims_the_tree_before_anything_else_and_keeps_the_output(model, tokenizer, monkeypatch):
    plans = []
    plan = StepPlanner.plan
    monkeypatch.setattr(StepPlanner, "plan", lambda self, first: plans.append(plan(self, first)) or plans[-1])
    prompts = random_prompts((5, 9, 7, 12), seed=6)
    out = generate(model, tokenizer, prompts, verify=True, tree="2,1", max_step_columns=10, max_new_tokens=16)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 16)
    decoding = plans[1:]  # after the prefill
    assert all(int((p.uncached + p.predictions - 1).sum()) <= 10 for p in decoding if p.tree_layout is not None)
    assert any(p.tree_layout is None for p in decoding)  # 4 rows with their root groups (3 columns each) do not fit


def _plans(monkeypatch) -> list:
    """Every step plan the engine makes from now on, in order."""
    made = []
    plan = StepPlanner.plan
    monkeypatch.setattr(StepPlanner, "plan", lambda self, first: made.append(plan(self, first)) or made[-1])
    return made


def _layout_shapes(plans, tree: TreeLayouts) -> set:
    """The shapes (cut to the depths drafted) the tree rows of the plans fed."""
    shape_of = [s for s in tree.shapes for _ in range(len(s) + 1)]
    return {
        shape_of[a][: tree.drafted[a]]
        for p in plans
        if p.tree_layout is not None
        for a in p.tree_layout[p.tree_layout >= 0]
    }


def test_a_tree_the_column_cap_cuts_shrinks_to_the_largest_that_fits_and_still_drafts(model, tokenizer, monkeypatch):
    """tree=4 takes 10 columns with its root; under max_step_columns=8 a lone row's steps draft tree 3 (8 columns)
    instead of the root's masks alone, step after step, and the output stays greedy AR's."""
    plans = _plans(monkeypatch)
    prompts = random_prompts((9,), seed=12)
    kwargs = dict(verify=True, draft_threshold=0.0, max_new_tokens=16)
    out = generate(model, tokenizer, prompts, tree="4", max_step_columns=8, **kwargs)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 16)
    decoding = plans[1:]  # after the prefill
    assert all(int((p.uncached + p.predictions - 1).sum()) <= 8 for p in decoding)
    tree = layouts_for((4,), "all", torch.device("cpu"), smaller_shapes((4,), "all"))
    assert _layout_shapes(decoding, tree) == {(), (3,)}  # the root's masks on the first step, then tree 3
    assert out.stats.num_drafts >= len(decoding) - 2 and out.stats.num_draft_tokens == 3 * out.stats.num_drafts
    assert out.stats.extra["tree"] == "4"


def test_under_a_cap_a_batch_of_tree_rows_shrinks_its_tree_down_to_a_chain_and_keeps_drafting(
    model, tokenizer, monkeypatch
):
    plans = _plans(monkeypatch)
    prompts = random_prompts((5, 9, 7), seed=13)
    out = generate(
        model, tokenizer, prompts, verify=True, tree="2,1", draft_threshold=0.0, max_step_columns=8, max_new_tokens=16
    )
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 16)
    decoding = [p for p in plans[1:] if len(p.uncached) == 3]  # while all three rows decode
    assert all(int((p.uncached + p.predictions - 1).sum()) <= 8 for p in decoding if p.tree_layout is not None)
    chains = [p for p in decoding if p.tree_layout is None]  # no tree fits: their first-ranked candidates, a chain
    assert chains and all(p.drafts.sum() > 0 for p in chains)
    assert all(n > 0 for n in out.stats.extra["per_row_num_drafts"])


def test_smaller_shapes_lie_inside_the_tree_and_each_takes_fewer_columns():
    for shape in [(2, 1), (4,), (3, 2, 1), (1, 1)]:
        smaller = smaller_shapes(shape, "all", PRIOR)
        assert smaller[-1] == (1,) if shape != (1,) else smaller == ()
        columns = [columns_of(shape), *(columns_of(s) for s in smaller)]
        assert columns == sorted(columns, reverse=True) and len(set(columns)) == len(columns)
        assert all(len(s) <= len(shape) and all(k <= top for k, top in zip(s, shape)) for s in smaller)
    assert smaller_shapes((4,), "all", PRIOR) == ((3,), (2,), (1,))
    with pytest.raises(ValueError, match="not inside"):
        TreeLayouts((2, 1), "all", torch.device("cpu"), ((3,),))


def test_the_settings_count_a_trees_columns_as_its_template_does():
    for shape in [(1,), (2, 1), (3, 2), (4, 4), (2, 2, 2), (1, 1, 1, 1)]:
        for masks in ("all", "top"):
            assert tree_columns(shape, masks) == columns_of(shape, masks), (shape, masks)


def test_auto_chooses_only_among_shapes_that_fit_the_cap(model, tokenizer, monkeypatch, caplog):
    """A noisy timing that finds wide steps cheaper than a one-column step still picks a shape whose step fits
    max_step_columns, read as a cost that never falls with width; the choice is logged with its figures."""
    from mars.decoding import tree_choice

    noisy = {1: 1.0, 2: 0.7, 4: 0.6, 6: 0.9, 8: 0.5, 12: 0.4, 16: 1.0, 24: 1.1, 32: 1.2, 48: 1.3, 64: 1.4}
    monkeypatch.setattr(tree_choice, "step_costs", lambda runner, mask_id, widths: dict(noisy))
    monkeypatch.setattr(tree_choice, "_chosen", type(tree_choice._chosen)())
    runner = ModelRunner(model)
    with caplog.at_level("INFO", logger="mars.decoding.tree_choice"):
        capped = tree_choice.auto_shape(runner, MASK_ID, 3, "all", max_columns=7)
    assert 1 + columns_of(capped) <= 8
    assert capped == (3,)  # every width costs the one column's 1.0: the most expected tokens in 7 columns
    message = caplog.records[-1].getMessage()
    assert "tree=auto picks 3" in message and "at most 7 columns" in message and "8: 1.00" in message
    assert "expected tokens" in message and "prior" in message
    assert tree_choice.auto_shape(runner, MASK_ID, 3, "all", max_columns=2) is None  # no tree fits: chains
    out = generate(model, tokenizer, random_prompts((5,), seed=2), verify=True, max_step_columns=8, max_new_tokens=4)
    assert out.stats.extra["tree"] == "3"


def test_costs_never_fall_with_width_and_near_ties_go_to_the_fewest_columns():
    from mars.decoding.tree_choice import NEAR_TIE, non_decreasing

    assert non_decreasing({4: 0.9, 1: 1.0, 2: 1.2, 8: 1.5}) == {1: 1.0, 2: 1.2, 4: 1.2, 8: 1.5}
    acceptance = [[0.5, 0.5 + NEAR_TIE / 3], [0.5]]  # a second candidate adds less than the noise margin
    one, scores = choose_shape(lambda width: 1.0, acceptance, 1, "all")
    assert one == (1,) and scores[(2,)] > scores[(1,)]
    capped, _ = choose_shape(lambda width: 1.0, PRIOR, 3, "all", max_columns=5)
    assert capped == (2,)  # (3,) needs 7 columns
    assert choose_shape(lambda width: 1.0, PRIOR, 3, "all", max_columns=2) == (None, {})


def test_sampled_and_plain_requests_on_an_engine_with_a_tree_shape_decode_as_under_auto(model, tokenizer):
    """A server's tree is the layout of the requests it applies to: the engine's settings take a shape without
    verify, and a sampled or non-verifying request beside it decodes as it would with tree='chain'."""
    prompts = random_prompts((7, 11), seed=9)

    def decode(tree):
        engine = DecodeEngine(
            ModelRunner(model), DecodingSettings(tree=tree, max_new_tokens=10), MASK_ID, [2], tokenizer
        )
        return _decode(
            engine,
            [
                engine.make_request(prompts[0], verify=True, temperature=0.8, seed=3),
                engine.make_request(prompts[1], temperature=0.8, seed=4),
            ],
        )

    assert decode("2,1") == decode("chain")
    assert not DecodingSettings(verify=True, tree="2", temperature=0.8).tree_applies
    assert DecodingSettings(verify=True, tree="2").tree_applies and not DecodingSettings(tree="2").tree_applies


@pytest.mark.parametrize(
    "tree", ["1_0", "+2", "\u0663", "2, 1", "", "2,,1", "x2", 1.0, (2, True), (0, 1), "1,1,1,1,1,1,1,1,1"]
)
def test_a_tree_spec_is_ascii_digits_joined_by_comma_or_x(tree):
    with pytest.raises(ValueError, match="tree must be one of"):
        DecodingSettings(verify=True, tree=tree)
    with pytest.raises(ValueError, match="tree must be one of"):
        DecodingSettings.from_mapping({"verify": True, "tree": tree})


@pytest.mark.parametrize("tree", ["2,1", "2x1", (2, 1), [2, 1]])
def test_a_tree_shape_may_be_text_or_a_tuple_and_reads_as_one_spelling(tree):
    assert DecodingSettings(verify=True, tree=tree).tree == "2,1"
    assert DecodingSettings.from_mapping({"verify": "true", "tree": tree}).tree == "2,1"
    assert DecodingSettings(verify=True, tree=3).tree == DecodingSettings.from_mapping({"tree": "3"}).tree == "3"


@pytest.mark.parametrize("tree", ["32,32,32", "49152", "100000", "4,4,2"])
def test_a_tree_too_large_for_a_step_is_refused_naming_the_limit(tree):
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_COLUMNS}"):
        DecodingSettings(verify=True, tree=tree)
    assert DecodingSettings(verify=True, tree="4,4").tree == "4,4"  # 62 columns


def test_a_tree_shape_without_verify_or_with_sampling_is_refused_by_generate(model, tokenizer):
    prompts = random_prompts((5,), seed=2)
    with pytest.raises(ValueError, match="needs verify=True|set verify=True"):
        generate(model, tokenizer, prompts, tree="2,1", max_new_tokens=4)
    with pytest.raises(ValueError, match="greedy"):
        generate(model, tokenizer, prompts, verify=True, tree="2", temperature=0.8, max_new_tokens=4)
    with pytest.raises(ValueError, match="set verify=True"):
        DecodingSettings(tree="2,1").check_every_row()
    DecodingSettings(verify=True, tree="2,1", threshold=0.9).check_every_row()  # below 1.0: a chain, as documented
