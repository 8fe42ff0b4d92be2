"""``objective.mask_targets=clean_soft``: the masks learn the clean stream's whole next-token distribution."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SFT
from test_objective_levers import MASK_ID, module, ragged_batch

from mars.adapters import AdapterSettings
from mars.config_schema import ConfigError
from mars.training.config import TrainConfig
from mars.training.module import NoisyLayout
from mars.training.objectives import Objective

GATED = AdapterSettings(kind="gated_lora", rank=4)
TINY_TRAIN = ["model=tiny-random", "data=jsonl", f"data.path={TINY_SFT}", "logger=none"]


def three_columns(m, seed: int = 0):
    """Three noisy columns at positions 0..2 with random hidden states (their targets are not IGNORE)."""
    layout = NoisyLayout(torch.full((1, 3), MASK_ID), torch.arange(3)[None], torch.tensor([[5, 6, 7]]), 4, None)
    g = torch.Generator().manual_seed(seed)
    return layout, torch.randn(1, 3, m.model.get_output_embeddings().in_features, generator=g) * 3


def test_the_mask_loss_is_zero_where_the_masks_predict_the_clean_streams_distribution():
    m = module(Objective("mars", mask_targets="clean_soft"))
    layout, hidden = three_columns(m)
    out = m.mask_losses(hidden, layout, *m._mask_targets(hidden, layout))  # the clean stream is the masks' copy
    assert out["loss_mask"].item() == pytest.approx(0.0, abs=1e-6)
    _, other = three_columns(m, seed=1)
    moved = m.mask_losses(other, layout, *m._mask_targets(hidden, layout))["loss_mask"]
    teacher = torch.log_softmax(m._logits(hidden[0]), -1)
    student = torch.log_softmax(m._logits(other[0]), -1)
    expected = (teacher.exp() * (teacher - student)).sum(-1).mean()
    torch.testing.assert_close(moved, expected)
    assert moved.item() > 0.1


def test_a_cold_soft_target_is_the_clean_argmax_target():
    soft = module(Objective("mars", mask_targets="clean_soft", soft_temperature=1e-4))
    hard = module(Objective("mars", mask_targets="clean_argmax"))  # the same weights (same seed)
    layout, clean = three_columns(soft)
    _, masks = three_columns(soft, seed=1)
    targets, teacher = soft._mask_targets(clean, layout)
    hard_targets, none = hard._mask_targets(clean, layout)
    assert none is None and torch.equal(targets, hard_targets)
    assert torch.equal(teacher.argmax(-1), hard_targets[0]) and teacher.max(-1).values.exp().min() > 1 - 1e-6
    torch.testing.assert_close(
        soft.mask_losses(masks, layout, targets, teacher)["loss_mask"],
        hard.mask_losses(masks, layout, hard_targets)["loss_mask"],
    )
    warm = module(Objective("mars", mask_targets="clean_soft", soft_temperature=4.0))
    flat = warm._mask_targets(clean, layout)[1].exp().max(-1).values
    assert (flat < soft._mask_targets(clean, layout)[1].exp().max(-1).values).all()  # a warmer teacher is flatter


def test_with_a_gated_adapter_only_the_adapter_learns_and_the_teacher_is_the_frozen_base():
    m = module(Objective("mars", alpha=0.0, mask_targets="clean_soft"), GATED)
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for name, p in m.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    out = m.losses(ragged_batch(), generator=torch.Generator().manual_seed(7))
    assert out["loss_mask"].item() > 0
    out["loss"].backward()
    adapter = {n: p for n, p in m.model.named_parameters() if "lora_" in n or "mask_embedding" in n}
    assert adapter and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.values())
    base = [n for n, p in m.model.named_parameters() if n not in adapter]
    assert base and all(dict(m.model.named_parameters())[n].grad is None for n in base)


def test_under_full_fine_tuning_the_teacher_is_detached():
    m = module(Objective("mars", mask_targets="clean_soft"))
    b = ragged_batch()
    ids, loss_mask = b["input_ids"], b["loss_mask"]
    layout = m.noisy_layout(ids, loss_mask, loss_mask.bool())
    clean = m._hidden(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
    assert clean.requires_grad
    _, teacher = m._mask_targets(clean, layout)
    assert teacher is not None and not teacher.requires_grad


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective=ar", "objective.mask_targets=clean_soft"], "objective 'ar' has no mask loss"),
        (["objective=block_diffusion", "objective.mask_targets=clean_soft"], "needs intra_block=causal"),
        (["objective=mars_no_sft", "objective.mask_targets=clean_soft"], "nothing anchors that teacher"),
        (["objective=mars_gated_soft", "adapter=gated_lora", "objective.soft_temperature=0"], "must be a number > 0"),
    ],
)
def test_an_objective_without_a_usable_clean_stream_is_refused_by_the_config_check(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.of(compose_cfg("train", TINY_TRAIN + overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["objective=mars_gated_soft", "adapter=gated_lora", "objective.soft_temperature=2"],
        # full fine-tuning, anchored by the AR loss
        ["objective=mars", "objective.mask_targets=clean_soft", "+objective.soft_temperature=0.5"],
    ],
)
def test_a_frozen_or_anchored_teacher_is_accepted(compose_cfg, overrides):
    assert TrainConfig.of(compose_cfg("train", TINY_TRAIN + overrides)).objective.mask_targets == "clean_soft"
