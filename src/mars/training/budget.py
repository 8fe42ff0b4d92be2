"""Train for a compute budget instead of a step count: equal-compute comparisons of training recipes.

``budget.minutes`` of compute end the run and drive the learning-rate schedule (warmup, then cosine decay
over the budget, :func:`mars.training.module.budget_lr_factor`), so a recipe with cheaper steps simply takes more of
them.  Two clocks:

* ``wall`` -- elapsed time, Lightning's ``trainer.max_time`` semantics.  Honest on a machine that runs
  nothing else.
* ``cpu`` (default) -- this process's CPU time divided by its torch threads.  Another process sharing the
  cores slows a run down but does not eat its budget, so variants trained while the machine is busy
  still get the same compute.  OpenMP threads that spin while they wait count as work: export
  ``OMP_WAIT_POLICY=PASSIVE`` before comparing budgets across runs (scripts/recipe_search.py does for its
  training stages; train.py leaves the wait policy to the environment).

The used budget is saved in every checkpoint, so a killed run resumes with what was left.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

CLOCKS = ("cpu", "wall")
# an upper bound on what a CPU core reaches in fp32 (AVX2 FMA at ~3.5 GHz); only used to refuse a
# budget that cannot hold a single step, so it must never be an underestimate of the machine's speed
_PEAK_FLOPS_PER_CORE = 120e9


@dataclass(frozen=True)
class BudgetSettings:
    minutes: float | None = None  # null: no budget (trainer.max_steps / max_epochs decide)
    clock: str = "cpu"
    # export a snapshot of the model when this much of the budget is used (minutes): a learning curve's points
    snapshots: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "snapshots", tuple(self.snapshots or ()))
        # a budget ends the run: NaN and infinity never end it (and NaN makes the lr factor 0)
        if self.minutes is not None and not _finite_positive(self.minutes):
            raise ValueError(f"budget.minutes must be a finite number > 0 or null, got {self.minutes!r}")
        for m in self.snapshots:
            if not _finite_positive(m):
                raise ValueError(f"budget.snapshots must be finite minutes > 0, got {list(self.snapshots)!r}")
            if self.minutes is None or m > self.minutes:
                raise ValueError(
                    f"budget.snapshots {list(self.snapshots)} must lie within budget.minutes={self.minutes}"
                )
        if self.clock not in CLOCKS:
            raise ValueError(f"budget.clock must be one of {CLOCKS}, got {self.clock!r}")

    @property
    def seconds(self) -> float | None:
        return None if self.minutes is None else 60.0 * float(self.minutes)


def _finite_positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def minimum_step_seconds(num_parameters: int, tokens_per_step: int, streams: int, cores: int) -> float:
    """A lower bound on one training step's time on a CPU: forward + backward is ~6 FLOPs per parameter and
    token, at most ``_PEAK_FLOPS_PER_CORE`` per core."""
    return 6.0 * num_parameters * tokens_per_step * streams / (_PEAK_FLOPS_PER_CORE * max(1, cores))


class ComputeBudget(Callback):
    """Stops training once ``settings.minutes`` of compute are used; ``progress()`` is the share used.
    ``on_snapshot(trainer, pl_module, minutes)`` is called once per ``settings.snapshots`` entry, after the
    first optimizer step that uses that much of the budget (also across resumes)."""

    def __init__(self, settings: BudgetSettings, on_snapshot: Callable[[Any, Any, float], None] | None = None):
        if settings.seconds is None:
            raise ValueError("ComputeBudget needs budget.minutes")
        self.settings = settings
        self.on_snapshot = on_snapshot
        self.used = 0.0  # budget seconds consumed by finished steps, across resumes
        self.snapshots_done: list[float] = []
        self.exhausted = False
        self._mark: float | None = None

    @property
    def state_key(self) -> str:
        return "ComputeBudget"

    def _now(self) -> float:
        if self.settings.clock == "wall":
            return time.perf_counter()
        return time.process_time() / max(1, torch.get_num_threads())

    def progress(self) -> float:
        running = self._now() - self._mark if self._mark is not None else 0.0
        return min(1.0, (self.used + running) / self.settings.seconds)

    def on_train_start(self, trainer, pl_module):
        self._mark = self._now()
        if self.used >= self.settings.seconds:
            self.exhausted = True
            trainer.should_stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = self._now()
        self.used += now - self._mark
        for minutes in self.settings.snapshots:
            if minutes not in self.snapshots_done and self.used >= 60.0 * minutes:
                if self.on_snapshot is not None:
                    self.on_snapshot(trainer, pl_module, minutes)
                self.snapshots_done.append(minutes)
        self._mark = self._now()  # a snapshot's export is not training compute
        if self.used >= self.settings.seconds:
            if not self.exhausted:
                log.info(
                    "compute budget of %.1f min (%s clock) used: stopping", self.settings.minutes, self.settings.clock
                )
            self.exhausted = True
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "used": self.used,
            "minutes": self.settings.minutes,
            "clock": self.settings.clock,
            "snapshots_done": list(self.snapshots_done),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.used = float(state.get("used", 0.0))
        self.snapshots_done = [float(m) for m in state.get("snapshots_done", [])]
