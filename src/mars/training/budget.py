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

The used budget is saved in every checkpoint, so a killed run resumes with what was left
(:class:`mars.training.budget_callback.ComputeBudget`, the callback that keeps the clock).  This module holds the
settings alone and loads neither torch nor Lightning, so train.py's config check and its ``--help`` do not wait for
Lightning to load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
