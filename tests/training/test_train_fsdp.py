"""FSDP on 2 CPU processes (gloo), through train.py itself: checkpoints are sharded folders (one file per rank,
written beside ``last.ckpt`` and put in its place only once every rank has written, each rank's shards digested
by that rank), a run killed and resumed from one ends loss for loss and weight for weight where an
uninterrupted run does, and the export after sharded training holds the full trained weights (gathered, saved
by rank 0).  Lightning refuses FSDP without a GPU; :class:`mars.training.strategies.ShardedCheckpointFSDP`
wraps the model with the CPU named, so this is the same code path a GPU run takes, on gloo."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY_SFT
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mars.models import read_mars_metadata
from mars.training.checkpointing import verify_sharded_checkpoint
from mars.training.export import read_lightning_checkpoint
from mars.training.loss_history import read_losses

HERE = REPO / "tests" / "training"


def fsdp_run(out, steps: int, kill_after: int = 0) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "train.py",
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=2",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        f"trainer.max_steps={steps}",
        "mask_schedule=random_ratio",  # random numbers every step: the resumed RNG state must be the run's
        "checkpoint_every=1",
        "logger=none",
        "callbacks=none",
        f"output_dir={out}",
    ]
    if kill_after:
        cmd += ["+callbacks.kill._target_=kill_after.KillAfter", f"+callbacks.kill.steps={kill_after}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def assert_same_weights(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


def test_fsdp_checkpoints_are_sharded_folders_and_the_export_holds_the_gathered_trained_weights(tmp_path):
    """One 2-process run; resuming from its sharded folder is ``-m slow`` below (and, in one process, the GPU
    check's recipe test)."""
    out = tmp_path / "fsdp"
    done = fsdp_run(out, steps=2)
    assert done.returncode == 0, done.stderr[-3000:]
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    assert sorted(p.name for p in last.glob("sha256.rank*.json")) == ["sha256.rank0.json", "sha256.rank1.json"]
    assert verify_sharded_checkpoint(last)  # every shard digested by the rank that wrote it
    assert not list(last.parent.glob(".last.ckpt.*"))  # no staging folder left behind
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 2

    meta = read_mars_metadata(out / "hf")
    assert meta["complete"] and meta["global_step"] == 2
    exported = load_file(out / "hf" / "model.safetensors")
    # the full weights of the final step, as the sharded checkpoint written at the end holds them
    final, info = read_lightning_checkpoint(last)
    assert info["global_step"] == 2
    assert set(exported) <= set(final) and "model.layers.1.mlp.down_proj.weight" in exported
    for key, value in exported.items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=0, msg=key)
    # a vanilla transformers load with the base model's parameter count, and the weights moved
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert sum(p.numel() for p in model.parameters()) == meta["base_num_parameters"]
    from mars.models import build_tiny_random

    untrained = build_tiny_random().state_dict()
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"], untrained["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.slow
def test_a_run_resumed_from_a_sharded_checkpoint_matches_an_uninterrupted_run_loss_for_loss(tmp_path):
    """Three 2-process runs (about a minute on 2 vCPUs): uninterrupted, killed after step 2 (its sharded folder
    complete, no export yet), resumed."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert fsdp_run(straight, steps=5).returncode == 0
    killed = fsdp_run(resumed, steps=5, kill_after=2)
    assert killed.returncode != 0 and "killed after step 2" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    assert verify_sharded_checkpoint(resumed / "checkpoints" / "last.ckpt") and not (resumed / "hf").exists()
    done = fsdp_run(resumed, steps=5)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((resumed / "train_summary.json").read_text())["steps_this_run"] == 3
    a, b = read_losses(straight / "losses.csv"), read_losses(resumed / "losses.csv")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        for key in ("loss", "loss_mask", "loss_ar"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
    assert_same_weights(straight / "hf", resumed / "hf")
