"""The levers of mars.training.objectives against hand computations, and the gated step against the joint forward."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mars.adapters import AdapterSettings
from mars.models import build_tiny_random
from mars.training.masking import allowed, noisy_window_starts, two_stream_mask
from mars.training.module import IGNORE, MarsModule, NoisyLayout
from mars.training.objectives import Objective

MASK_ID = 3


@contextlib.contextmanager
def bf16_default_dtype():
    """The default dtype bf16-true precision sets, restored afterwards."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def module(objective: Objective, adapter: AdapterSettings | None = None, block: int = 4, seed: int = 0):
    model = build_tiny_random(vocab_size=97, hidden_size=32, num_layers=2, intermediate_size=64, seed=seed)
    return MarsModule(model, MASK_ID, block_size=block, objective=objective, adapter=adapter)


def ragged_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 97, (4, 20), generator=g)
    loss_mask = torch.zeros(4, 20, dtype=torch.long)
    for row, (prompt, end) in enumerate([(3, 20), (9, 15), (13, 18), (6, 11)]):
        loss_mask[row, prompt:end] = 1
        ids[row, end:] = 2
    return {"input_ids": ids, "loss_mask": loss_mask}


def three_masks_middle_wrong(m: MarsModule):
    """Three mask columns of random hidden states, their logits, and targets that the first and last argmax
    hit and the middle one misses."""
    layout = NoisyLayout(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], None, 4, None)
    head = m.model.get_output_embeddings()
    hidden = torch.randn(1, 3, head.in_features)
    logits = head(hidden)[0].float()
    targets = logits.argmax(-1).clone()[None]
    targets[0, 1] = (targets[0, 1] + 1) % logits.shape[-1]
    return layout, hidden, logits, targets


def test_certainty_forcing_is_the_mean_entropy_of_the_already_right_predictions():
    m = module(Objective("mars", certainty_weight=1.0))
    layout, hidden, logits, targets = three_masks_middle_wrong(m)
    out = m.mask_losses(hidden, layout, targets)
    p = logits.softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(out["loss_certainty"], entropy[[0, 2]].mean())
    torch.testing.assert_close(out["loss_mask"], F.cross_entropy(logits, targets[0]))


def test_unlikelihood_is_the_mean_minus_log_one_minus_p_of_the_wrong_argmaxes_only():
    m = module(Objective("mars", unlikelihood_weight=0.7, certainty_weight=0.2))
    layout, hidden, logits, targets = three_masks_middle_wrong(m)
    out = m._total(m.mask_losses(hidden, layout, targets))
    p_wrong = logits.softmax(-1)[1].max()
    torch.testing.assert_close(out["loss_unlikelihood"], -torch.log(1 - p_wrong))
    expected = out["loss_mask"] + 0.2 * out["loss_certainty"] + 0.7 * out["loss_unlikelihood"]
    torch.testing.assert_close(out["loss"], expected)
    right_only = m.mask_losses(hidden, layout, logits.argmax(-1)[None])
    assert float(right_only["loss_unlikelihood"]) == 0.0  # nothing wrong, nothing to push down


def test_depth_decay_and_reach_weights_follow_the_block_grid():
    layout = NoisyLayout(
        torch.zeros(1, 8, dtype=torch.long), torch.arange(4, 12)[None], torch.zeros(1, 8, dtype=torch.long), 4, None
    )
    sel = torch.ones(1, 8, dtype=torch.bool)
    decay = module(Objective("mars", depth_weighting="decay", depth_decay=0.5))
    assert decay._depth_weights(layout, sel, torch.zeros(8)).tolist() == [1, 0.5, 0.25, 0.125] * 2
    reach = module(Objective("mars", depth_weighting="reach"))
    label_p = torch.tensor([0.5, 0.8, 0.1, 0.9, 0.2, 0.3, 0.4, 0.6])
    w = reach._depth_weights(layout, sel, label_p.log())
    expected = [1, 0.5, 0.5 * 0.8, 0.5 * 0.8 * 0.1, 1, 0.2, 0.2 * 0.3, 0.2 * 0.3 * 0.4]
    torch.testing.assert_close(w, torch.tensor(expected))
    # under bf16-true precision the default dtype is bf16 and the masks' log-probabilities are bf16
    with bf16_default_dtype():
        w16 = reach._depth_weights(layout, sel, label_p.log().bfloat16())
    assert w16.dtype == torch.float32
    torch.testing.assert_close(w16, torch.tensor(expected), atol=1e-2, rtol=1e-2)


def test_row_block_sizes_and_offsets_move_the_block_boundaries_only():
    length = 10
    pos = torch.arange(length).repeat(2)[None].expand(2, -1)
    sizes, offsets = torch.tensor([2, 3]), torch.tensor([1, 2])
    mask = two_stream_mask(pos, length, sizes, block_offset=offsets)
    noisy = torch.arange(2 * length) >= length
    for row in range(2):
        shifted = pos[row] + offsets[row]
        ref = allowed(shifted[:, None], shifted[None, :], noisy[:, None], noisy[None, :], int(sizes[row]))
        assert torch.equal(mask[row], ref)
    # a noisy query at position 4 of row 1 (block grid (t + 2) // 3: block 2 = positions 4..6) sees clean 0..3
    q = length + 4
    assert mask[1, q, :length].nonzero().flatten().tolist() == [0, 1, 2, 3]
    starts = noisy_window_starts(torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]] * 2), sizes, offsets)
    assert starts.tolist() == [3, 4]  # the block holding position 4 (the last prompt token) in each grid


@pytest.mark.parametrize(
    "objective",
    [
        Objective("mars", alpha=0.0, certainty_weight=0.5, depth_weighting="reach"),
        Objective("mars", alpha=0.0, block_choices=(2, 3, 5), block_offset="random"),
        Objective("mars", alpha=0.0, mask_targets="clean_soft", soft_temperature=0.7, depth_weighting="reach"),
    ],
)
def test_gated_step_equals_the_joint_two_stream_forward_in_loss_and_gradient(objective):
    """The gated path (clean stream without grad, noisy stream against its keys/values) computes exactly what
    one forward over [x ; x~] computes with the same adapter."""
    gated = module(objective, AdapterSettings(kind="gated_lora", rank=4))
    joint = module(objective, AdapterSettings(kind="gated_lora", rank=4))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (_, p), (_, q) in zip(gated.model.named_parameters(), joint.model.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                q.copy_(p)
    object.__setattr__(joint, "adapter", AdapterSettings(kind="lora", rank=4))  # route through the joint forward
    b = ragged_batch()
    out_g = gated.losses(b, generator=torch.Generator().manual_seed(7))
    out_j = joint.losses(b, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out_g["loss"], out_j["loss"], atol=1e-5, rtol=1e-5)
    out_g["loss"].backward()
    out_j["loss"].backward()
    for (name, p), q in zip(gated.model.named_parameters(), joint.model.parameters()):
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_clean_argmax_targets_are_the_clean_streams_greedy_choices():
    m = module(Objective("mars", mask_targets="clean_argmax"))
    b = ragged_batch()
    ids, loss_mask = b["input_ids"], b["loss_mask"]
    layout = m.noisy_layout(ids, loss_mask, loss_mask.bool())
    with torch.no_grad():
        clean = m._hidden(ids, torch.arange(20).expand(4, -1), None)
        targets, soft = m._mask_targets(clean, layout)
        greedy = m._logits(clean).argmax(-1)
    sel = layout.targets != IGNORE
    assert soft is None and torch.equal(sel, targets != IGNORE)
    rows = torch.arange(4)[:, None].expand_as(sel)
    assert torch.equal(targets[sel], greedy[rows[sel], layout.positions[sel]])


def test_kl_to_the_starting_model_is_zero_at_the_start_and_grows_when_the_model_moves():
    m = module(Objective("mars", alpha=0.0, kl_weight=1.0))
    b = ragged_batch()
    assert m.losses(b)["loss_kl"].item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        m.model.get_output_embeddings().weight.add_(0.5)
    assert m.losses(b)["loss_kl"].item() > 1e-3


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"certainty_weight": -1}, "certainty_weight must be >= 0"),
        ({"depth_weighting": "linear"}, "depth_weighting must be one of"),
        ({"depth_decay": 0.0}, "depth_decay must be in"),
        ({"block_choices": [2, 0]}, "block_choices must be"),
        ({"block_offset": "shifted"}, "block_offset must be one of"),
        ({"mask_targets": "soft"}, "mask_targets must be one of"),
    ],
)
def test_bad_levers_fail_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        Objective("mars", **bad)


def test_gated_adapter_refuses_an_ar_term():
    with pytest.raises(ValueError, match="alpha"):
        module(Objective("mars", alpha=1.0), AdapterSettings(kind="gated_lora"))


@pytest.mark.parametrize(
    "levers",
    [
        {"depth_weighting": "decay"},
        {"depth_weighting": "reach", "certainty_weight": 0.5},
        {"unlikelihood_weight": 0.5},
        {"block_choices": (2, 3, 5), "block_offset": "random"},
        {"mask_targets": "clean_soft", "depth_weighting": "reach", "certainty_weight": 0.5},
    ],
)
def test_every_lever_takes_a_bf16_true_step(levers):
    """bf16-true precision (the CPU default where the CPU has bf16): bf16 weights and a bf16 default dtype."""
    m = module(Objective("mars", alpha=0.0, **levers), AdapterSettings(kind="gated_lora", rank=4))
    m.model.to(torch.bfloat16)
    with bf16_default_dtype():
        out = m.losses(ragged_batch(), generator=torch.Generator().manual_seed(7))
        out["loss"].backward()
    assert torch.isfinite(out["loss"])
    grads = [p.grad for p in m.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
