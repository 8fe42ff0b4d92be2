"""Kill and resume, torchtune-style: a run killed mid-epoch (and at an epoch's end) and resumed ends with
exactly the weights and the per-step losses of an uninterrupted run, on data whose size is not a multiple
of the batch size; its loss file covers the whole run as it goes."""

import pytest
import torch
from conftest import TINY_SFT
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from mars.training.loss_history import read_losses
from mars.training.run import run


class StopAfter(Callback):
    """A kill: raises when the batch after ``steps`` optimizer steps starts (Lightning tears down and
    re-raises, as for any crash); the checkpoints written until then stay."""

    class Killed(RuntimeError):
        pass

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.steps:
            raise StopAfter.Killed(f"killed after step {trainer.global_step}")


def overrides(out):
    # 10 rows in batches of 4: 3 batches per epoch, the last one of 2 rows; random_ratio masks draw random
    # numbers every step, so the masks must not depend on the process's RNG history either
    return [
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "logger=none",
        "checkpoint_every=2",
        "trainer.max_steps=8",
        "mask_schedule=random_ratio",
        f"output_dir={out}",
    ]


def test_a_killed_and_resumed_run_ends_with_the_weights_and_losses_of_an_uninterrupted_run(
    compose_cfg, tmp_path, monkeypatch
):
    straight = run(compose_cfg("train", overrides(tmp_path / "straight")))

    killed = tmp_path / "killed"
    cfg = compose_cfg("train", overrides(killed))
    with pytest.raises(StopAfter.Killed):
        run(cfg, callbacks=[StopAfter(3)])  # last checkpoint at step 2: mid-epoch 0, the partial batch still ahead
    # a killed run that is never resumed has its loss curve up to the kill
    assert [r["step"] for r in read_losses(killed / "losses.csv")] == [1, 2, 3]
    assert (killed / "loss_curve.png").is_file()
    with pytest.raises(StopAfter.Killed):
        run(cfg, callbacks=[StopAfter(7)])  # resumes at 2; last checkpoint at step 6, the end of epoch 1

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    resumed = run(cfg)  # resumes at 6
    assert len(loads) == 1  # Lightning's own restore; nothing else reads the checkpoint

    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)
    steps_straight, steps_resumed = (
        read_losses(tmp_path / "straight" / "losses.csv"),
        read_losses(killed / "losses.csv"),
    )
    assert [r["step"] for r in steps_resumed] == list(range(1, 9))  # every step once, retrained steps replaced
    for x, y in zip(steps_straight, steps_resumed):
        for key in ("loss", "loss_mask", "loss_ar"):
            assert x[key] == pytest.approx(y[key], rel=1e-6), (x["step"], key)
