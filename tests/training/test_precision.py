"""Training precision by hardware, and bf16 weights that do not lose small AdamW updates."""

import pytest
import torch

from mars import hardware
from mars.training.optim import MasterWeightAdamW, build_adamw
from mars.training.precision import resolve_precision, wants_master_weights


def test_auto_precision_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == "bf16-true"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("auto", "gpu") == "bf16-mixed"
    assert resolve_precision("32-true", "cpu") == "32-true"
    with pytest.warns(RuntimeWarning, match="50-100x slower"):
        assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"


def test_master_weights_only_for_pure_low_precision():
    assert wants_master_weights("bf16-true") and not wants_master_weights("bf16-mixed")
    assert not wants_master_weights("bf16-true", False) and wants_master_weights("32-true", True)
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    assert isinstance(
        build_adamw([{"params": [w]}], lr=1e-3, betas=(0.9, 0.999), master_weights=True), MasterWeightAdamW
    )
    f = torch.nn.Parameter(torch.ones(3))
    assert type(build_adamw([{"params": [f]}], lr=1e-3, betas=(0.9, 0.999), master_weights=True)) is torch.optim.AdamW


def _trajectory(param, make_opt, steps=20):
    """A linear loss (constant, exactly representable gradient): AdamW moves each weight by ~lr per step."""
    opt = make_opt([param])
    coeff = torch.tensor([1.0, -0.5, 0.25, 2.0])
    values = []
    for _ in range(steps):
        (param.float() * coeff).sum().backward()
        opt.step()
        opt.zero_grad()
        values.append(param.detach().float().clone())
    return values


def test_bf16_weights_keep_small_updates_with_master_weights():
    lr = 1e-3  # below half a bf16 ulp at 1.0 (2**-8): plain bf16 AdamW rounds every update away
    start = torch.tensor([1.25, 1.5, -1.25, 0.75])  # away from powers of two, where the ulp halves
    ref = _trajectory(torch.nn.Parameter(start.clone()), lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0))
    plain = _trajectory(
        torch.nn.Parameter(start.to(torch.bfloat16)), lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0)
    )
    master = _trajectory(
        torch.nn.Parameter(start.to(torch.bfloat16)), lambda p: MasterWeightAdamW(p, lr=lr, weight_decay=0.0)
    )
    assert torch.equal(plain[-1], start.to(torch.bfloat16).float()), "plain bf16 AdamW lost every update"
    for r, m in zip(ref, master):  # the masters follow fp32 AdamW exactly; the weights are their rounding
        assert torch.equal(m, r.to(torch.bfloat16).float())
    assert not torch.equal(master[-1], start.to(torch.bfloat16).float())


def test_master_weights_survive_a_checkpoint():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], lr=1e-3)
    for _ in range(3):
        p.float().sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    again = MasterWeightAdamW([q], lr=1e-3)
    again.load_state_dict(state)
    assert torch.equal(again._pairs[0][1], opt._pairs[0][1])  # fp32 masters, not the rounded weights
    assert torch.equal(q, p)


def test_bf16_true_training_runs_with_master_weights(tmp_path, compose_cfg, tiny_train_overrides):
    from mars.training.run import run

    overrides = [o for o in tiny_train_overrides if not o.startswith("trainer.precision")]
    cfg = compose_cfg("train", overrides + ["trainer.precision=bf16-true", "trainer.max_steps=2"])
    out = run(cfg)
    assert '"complete": true' in (out / "mars_config.json").read_text()
    ckpt = torch.load(out.parent / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["optimizer_states"][0]
    assert len(state["master_weights"]) > 0 and state["master_weights"][0].dtype == torch.float32
