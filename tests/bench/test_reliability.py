"""mars.bench.reliability: step scores against a decoding step's own forward, and the figures by hand."""

import numpy as np
import pytest
import torch

from mars.adapters import AdapterSettings
from mars.bench import reliability as rel
from mars.models import build_tiny_random
from mars.training.module import MarsModule
from mars.training.objectives import Objective

MASK_ID = 3


def gated_module(block: int = 4) -> MarsModule:
    model = build_tiny_random(vocab_size=97, hidden_size=32, num_layers=2, intermediate_size=64, seed=1)
    module = MarsModule(
        model,
        MASK_ID,
        block_size=block,
        objective=Objective("mars", alpha=0.0),
        adapter=AdapterSettings(kind="gated_lora", rank=4),
    )
    g = torch.Generator().manual_seed(0)
    for name, p in module.model.named_parameters():  # a trained-looking adapter: B is zero at init
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    return module.eval()


def test_each_step_scores_what_a_decoding_step_with_masks_after_its_last_real_token_predicts():
    module = gated_module()
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(4, 97, (n,), generator=g).tolist() for n in (23, 17)]
    prompt_lengths = [6, 9]
    steps = rel.score_texts(module, texts, prompt_lengths, masks_per_step=3, batch_size=2)
    # every answer position but the last starts one step (each grid offset supplies a quarter of them)
    for i, text in enumerate(texts):
        starts = sorted(steps.start[steps.prompt == i].tolist())
        assert starts == list(range(prompt_lengths[i], len(text) - 1))
    checked = 0
    with torch.no_grad():
        for k in range(len(steps.prompt)):
            i, s = int(steps.prompt[k]), int(steps.start[k])
            text = texts[i]
            ids = torch.tensor([text[:s] + [MASK_ID] * 3])
            logits = module.model(input_ids=ids).logits[0, s:].float()
            logits[:, MASK_ID] = float("-inf")
            probs = logits.softmax(-1)
            for d in range(3):
                if s + d + 1 >= len(text):
                    assert not steps.valid[k, d] and steps.confidence[k, d] == 0
                    continue
                assert steps.valid[k, d]
                assert steps.confidence[k, d] == pytest.approx(float(probs[d].max()), abs=1e-5)
                assert bool(steps.correct[k, d]) == (int(probs[d].argmax()) == text[s + d + 1])
                checked += 1
    assert checked > 40


def hand_steps() -> rel.StepScores:
    conf = np.array([[0.99, 0.95, 0.5], [0.97, 0.2, 0.99], [0.5, 0.99, 0.99], [0.99, 0.99, 0.0]])
    correct = np.array([[True, False, True], [True, True, True], [True, True, True], [True, True, False]])
    valid = np.array([[True] * 3, [True] * 3, [True] * 3, [True, True, False]])
    return rel.StepScores(conf, correct, valid, prompt=np.array([0, 0, 1, 1]), start=np.array([5, 6, 7, 8]))


def test_frontier_counts_the_leading_run_at_or_above_the_threshold_and_its_share_right():
    steps = hand_steps()
    p = rel.frontier_point(steps, 0.95)
    # accepted runs: 2 (0.99, 0.95), 1 (0.97), 0 (0.5 first), 2 (third mask not valid)
    assert p["tokens_per_forward"] == pytest.approx((3 + 2 + 1 + 3) / 4)
    assert p["fidelity"] == pytest.approx(4 / 5)  # the second mask of step 0 is wrong
    assert p["tokens_per_forward_lo"] <= p["tokens_per_forward"] <= p["tokens_per_forward_hi"]
    strict = rel.frontier_point(steps, 0.999)
    assert strict["tokens_per_forward"] == 1.0 and strict["fidelity"] is None


def test_oracle_accepts_exactly_the_leading_right_masks():
    assert rel.oracle(hand_steps())["tokens_per_forward"] == pytest.approx((2 + 4 + 4 + 3) / 4)


def test_best_at_fidelity_takes_the_most_tokens_among_thresholds_that_keep_it():
    points = [rel.frontier_point(hand_steps(), t) for t in (0.5, 0.95, 0.98, 0.999)]
    best = rel.best_at_fidelity(points, 0.9)
    assert best["threshold"] == 0.98 and best["fidelity"] == 1.0  # 0.5 and 0.95 accept a wrong mask
    assert rel.best_at_fidelity(points[:2], 0.99) is None


def test_reliability_bins_each_depths_masks_by_confidence():
    rows = rel.reliability_table(hand_steps(), bins=(0.0, 0.9, 1.0))
    by = {(r["depth"], r["bin"]): r for r in rows}
    assert by[(0, "[0, 0.9)")]["masks"] == 1 and by[(0, "[0.9, 1]")]["masks"] == 3
    assert by[(1, "[0.9, 1]")]["right"] == pytest.approx(2 / 3)  # 0.95 wrong, two 0.99 right
    assert by[(2, "[0.9, 1]")]["masks"] == 2  # the invalid third mask of the last step is not counted
    assert by[(2, "[0, 0.9)")]["mean_confidence"] == pytest.approx(0.5)


def test_step_scores_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        rel.StepScores(np.zeros((2, 3)), np.zeros((2, 2), bool), np.zeros((2, 3), bool), np.zeros(2), np.zeros(2))


def test_command_refuses_bad_input_before_loading_a_model(tmp_path):
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        rel.main(["--checkpoint", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="--name given 2 times for 1"):
        rel.main(["--checkpoint", str(tmp_path), "--name", "a", "--name", "b"])
    with pytest.raises(SystemExit, match="--window must be >= 2"):
        rel.main(["--checkpoint", str(tmp_path), "--window", "1"])
