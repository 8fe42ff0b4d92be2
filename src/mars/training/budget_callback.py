"""The compute budget's clock (:mod:`mars.training.budget`): a Lightning callback that ends the run when the budget is
used, exports the learning curve's snapshots, and keeps the budget used in every checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from mars.training.budget import BudgetSettings

log = logging.getLogger(__name__)


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
