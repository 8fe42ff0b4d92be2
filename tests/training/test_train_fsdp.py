"""FSDP on 2 CPU processes: the export after sharded training holds the full trained weights (gathered on
every rank, saved by rank 0), and a run killed and resumed from a sharded checkpoint -- a directory, like a
DeepSpeed one -- resumes without anything but Lightning reading it.

Lightning refuses ``strategy=fsdp`` without a GPU ("The strategy `fsdp` requires a GPU accelerator, but
received `accelerator='cpu'`", an exact-type check) and wraps the model with ``device_id=None``, which FSDP
refuses on a CPU ("FSDP needs a non-CPU accelerator device"); the helper below subclasses the strategy to get
past both, and keeps checkpoints sharded (Lightning's full-state-dict checkpoint offloads to the CPU, which
torch cannot do for tensors already there).  Everything else is train.py's own code path.
"""

import json
import os
import subprocess
import sys

import torch
from conftest import CONF, REPO, TINY_SFT
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mars.models import read_mars_metadata
from mars.training.export import read_lightning_checkpoint

HELPER = """
import os, sys
import lightning.pytorch.strategies as strategies
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback


class CPUFSDPStrategy(strategies.FSDPStrategy):
    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self.kwargs)


class StopAfter(Callback):
    def __init__(self, steps):
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.steps:
            raise SystemExit(3)


strategies.FSDPStrategy = CPUFSDPStrategy
from mars.training.run import run

with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[2:])
stop = int(os.environ.get("STOP_AFTER", "0"))
run(cfg, callbacks=[StopAfter(stop)] if stop else [])
"""


def fsdp_run(tmp_path, out, stop_after=0):
    helper = tmp_path / "fsdp_cpu.py"
    helper.write_text(HELPER)
    cmd = [
        sys.executable,
        str(helper),
        str(CONF),
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=2",
        "trainer=fsdp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.max_steps=3",
        "trainer.fsdp.state_dict_type=sharded",
        "checkpoint_every=1",
        "logger=none",
        f"output_dir={out}",
    ]
    env = {**os.environ, "STOP_AFTER": str(stop_after)}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)


def test_fsdp_export_holds_the_gathered_trained_weights_and_resumes_from_a_sharded_folder(tmp_path):
    out = tmp_path / "fsdp"
    killed = fsdp_run(tmp_path, out, stop_after=2)
    assert killed.returncode != 0 and (out / "checkpoints" / "last.ckpt").is_dir(), killed.stderr[-3000:]
    assert not (out / "hf").exists()
    done = fsdp_run(tmp_path, out)  # resumes from the sharded folder at step 2
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["steps_this_run"] == 1

    meta = read_mars_metadata(out / "hf")
    assert meta["complete"] and meta["global_step"] == 3
    exported = load_file(out / "hf" / "model.safetensors")
    # the full weights of the final step, as Lightning's own sharded checkpoint holds them
    final, info = read_lightning_checkpoint(out / "checkpoints" / "last.ckpt")
    assert info["global_step"] == 3
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
