"""What a training run is about to do, said before the model loads, and what it will cost, said after its first
steps.

:func:`plan_lines` are the run's first lines: the model and objective, the data and its rows, the global batch
and how it is made (rows x processes x accumulation), the optimizer steps, the schedule, precision and strategy,
and the checkpoint cadence.  :class:`CostEstimate` times the first optimizer steps (after one untimed step)
and logs once what the whole run will take, in hours and in device-hours (hours x processes), as evaluation does
for a threshold sweep.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

TIMED_STEPS = 5  # optimizer steps the estimate is measured over, after the first (warm-up, compilation)


def planned_steps(rows: int | None, batch_size: int, processes: int, accumulate: int, epochs, max_steps) -> int | None:
    """Optimizer steps the run will take: every rank gets ``ceil(rows / batch_size / processes)`` batches an
    epoch, and Lightning steps after every ``accumulate`` of them and at an epoch's last batch."""
    per_epoch = None
    if rows:
        batches = math.ceil(math.ceil(rows / batch_size) / processes)
        per_epoch = math.ceil(batches / accumulate)
    by_epochs = per_epoch * epochs if per_epoch is not None and epochs not in (None, -1) else None
    if max_steps is not None and max_steps > 0:
        return max_steps if by_epochs is None else min(max_steps, by_epochs)
    return by_epochs


def _data_label(data: dict[str, Any]) -> str:
    source = data.get("source")
    where = data.get("hub_id") if source == "hub" else data.get("path")
    return (
        f"{source}" + (f" {where}" if where else "") + (f" ({data.get('split')})" if source in ("hub", "disk") else "")
    )


def plan_lines(cfg, settings, rows: int | None, processes: int) -> list[str]:
    """The run's plan (module docstring); ``rows``: the rows read (None when not read, a dry run of hub data)."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    data, trainer = c["data"], c["trainer"]
    accumulate = settings.trainer.accumulate_grad_batches
    batch = data["batch_size"] * processes * accumulate
    steps = planned_steps(
        rows, data["batch_size"], processes, accumulate, trainer.get("max_epochs"), trainer.get("max_steps")
    )
    budget = c.get("budget") or {}
    if budget.get("minutes") is not None:
        length = f"until {budget['minutes']:g} minutes of {budget.get('clock', 'cpu')} time are spent"
    elif steps is None:
        length = "steps: as many as the data gives"
    else:
        epochs = trainer.get("max_epochs")
        length = f"{steps:,} optimizer steps" + (f" ({epochs} epochs)" if epochs not in (None, -1) else "")
    strategy = trainer.get("strategy", "auto")
    fsdp = trainer.get("fsdp") or {}
    if strategy == "fsdp":
        strategy += (
            f" ({fsdp.get('sharding_strategy', 'FULL_SHARD')}, {fsdp.get('state_dict_type', 'full')} checkpoints)"
        )
    cadence = (
        f"every {c['checkpoint_minutes']:g} minutes"
        if c.get("checkpoint_minutes") is not None
        else f"every {c['checkpoint_every']} optimizer steps"
    )
    precision = trainer.get("precision")
    if precision == "auto":
        from mars.training.precision import resolve_precision

        precision = f"auto: {resolve_precision('auto', trainer.get('accelerator'))}"
    optim = c["optim"]
    return [
        f"plan: {c['run_name']} (recipe {c.get('recipe') or 'train.yaml defaults'}): {settings.objective.name} "
        f"B={c['block']} from {c['model']['name_or_path']}",
        f"plan: data {_data_label(data)}: "
        + (f"{rows:,} rows" if rows is not None else "rows not read (dry run)")
        + f", max length {data['max_length']}",
        f"plan: global batch {batch} = {data['batch_size']} rows x {processes} process(es) x {accumulate} accumulation; "
        f"{length}",
        f"plan: lr {optim['lr']:g}, {optim.get('schedule', 'cosine')} after a {optim['warmup_ratio']:g} warmup; "
        f"precision {precision}; strategy {strategy}; gradient checkpointing "
        f"{'on' if c.get('gradient_checkpointing') else 'off'}",
        f"plan: checkpoints {cadence} and at the end into {c['output_dir']}/checkpoints; export {c['export_dir']}",
    ]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class CostEstimate(Callback):
    """Logs once, after :data:`TIMED_STEPS` optimizer steps past the first, the seconds per step and what the
    run's remaining steps will take (``estimate`` holds it for the run's summary)."""

    def __init__(self, steps: int = TIMED_STEPS):
        self.steps = steps
        self.start: tuple[int, float] | None = None
        self.estimate: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.estimate is not None or trainer.global_step < 1:
            return
        if self.start is None:
            self.start = (trainer.global_step, time.perf_counter())
            return
        done = trainer.global_step - self.start[0]
        if done < self.steps:
            return
        each = (time.perf_counter() - self.start[1]) / done
        total = trainer.estimated_stepping_batches
        left = max(0, int(total) - trainer.global_step) if math.isfinite(total) else None
        processes = trainer.world_size
        device = "GPU" if trainer.strategy.root_device.type == "cuda" else "CPU process"
        self.estimate = dict(seconds_per_step=round(each, 4), steps_left=left, processes=processes)
        line = f"cost: {each:.3g} s per optimizer step over steps {self.start[0] + 1}-{trainer.global_step}"
        if left is not None:
            hours = each * left / 3600
            self.estimate.update(hours_left=round(hours, 3), device_hours_left=round(hours * processes, 3))
            line += (
                f": about {_duration(each * left)} for the {left:,} steps left "
                f"({hours * processes:.1f} {device}-hours on {processes} {device}{'s' if processes > 1 else ''})"
            )
        if trainer.is_global_zero:
            log.info(line)


__all__ = ["CostEstimate", "TIMED_STEPS", "plan_lines", "planned_steps"]
