"""The Lightning strategy a training run uses, built from ``trainer.strategy`` and ``trainer.fsdp``.

Everything but FSDP is Lightning's own, by name.  FSDP is :class:`ShardedCheckpointFSDP`, Lightning's
``FSDPStrategy`` with the decoder-layer class of the model as its wrapping unit and two additions:

- **sharded checkpoints that can be trusted** (``state_dict_type: sharded``, the default of ``trainer=fsdp``):
  each rank writes its own shard of the weights and the optimizer state (``torch.distributed.checkpoint``; nothing
  is gathered onto one device, ~90 GB for 7B with AdamW), into a staging folder beside ``last.ckpt`` that replaces
  it only once every rank has written (:func:`~mars.training.checkpointing.replace_checkpoint_folder`), so a
  kill during a save leaves the previous checkpoint whole; each rank digests its own shard files once, as it
  writes them (:func:`~mars.training.checkpointing.write_shard_digests`), and a resume checks them.
- **CPU processes**: Lightning refuses FSDP without a GPU and hands FSDP ``device_id=None``, which FSDP takes
  for "the current accelerator"; on a CPU the model is wrapped here with the CPU named, so the same code path
  runs under gloo (the tests' two-process runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy

from mars.persistence import remove_tree
from mars.training.checkpointing import replace_checkpoint_folder, staging_path, write_shard_digests


class ShardedCheckpointFSDP(FSDPStrategy):
    """Lightning's FSDP with atomic, digested sharded checkpoints and CPU processes (module docstring)."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type == "cpu" and not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            self.kwargs.pop("auto_wrap_policy", None)  # applied: Lightning would warn that it goes unused
        return super()._setup_model(model)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(str(filepath)))
        staging = staging_path(target)
        if self.global_rank == 0 and staging.exists():
            remove_tree(staging)  # a save a kill interrupted
        self.barrier("mars-sharded-save")
        super().save_checkpoint(checkpoint, staging, storage_options)
        write_shard_digests(staging, self.global_rank)
        self.barrier("mars-sharded-written")
        if self.global_rank == 0:
            replace_checkpoint_folder(staging, target)
        self.barrier("mars-sharded-in-place")


def build_strategy(trainer_cfg: dict[str, Any], model) -> Any:
    """The strategy of ``trainer_cfg`` (its ``strategy`` and ``fsdp`` keys are taken out); FSDP wraps the model's
    decoder-layer class."""
    strategy = trainer_cfg.pop("strategy", "auto")
    fsdp = trainer_cfg.pop("fsdp", None)
    if strategy != "fsdp":
        return strategy
    layers = {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
    return ShardedCheckpointFSDP(auto_wrap_policy=layers, **(fsdp or {}))


__all__ = ["ShardedCheckpointFSDP", "build_strategy"]
