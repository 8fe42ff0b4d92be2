"""``losses.csv``: one row per optimizer step of a training run, written by Lightning's ``CSVLogger``, and
the loss curve redrawn from it.

Columns ``step, loss, loss_mask, loss_ar, tokens_per_s`` (a term the objective lacks stays empty); each value
is the mean over the step's micro-batches.  The file is flushed after every step, so a killed run keeps
every step it finished; a resumed run first drops the rows past the step it resumes from (those steps are
trained again), so the file covers the whole run once.

Lightning's logger writes ``metrics.csv`` into a versioned folder of its own and deletes an existing file
when it starts; :class:`LossesLogger` points it at the run folder's ``losses.csv`` and leaves the resume
handling to :class:`LossHistory`.  It is not one of the trainer's loggers (those get every logged metric
at ``log_every_n_steps``); the callback feeds it the per-step means.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from mars.figures import PlotSettings
from mars.persistence import atomic_write_text
from mars.training.loss_plot import plot_losses

LOSSES_FILE = "losses.csv"
LOSS_COLUMNS = ("step", "loss", "loss_mask", "loss_ar", "tokens_per_s")


class _LossesWriter(ExperimentWriter):
    NAME_METRICS_FILE = LOSSES_FILE

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.metrics_keys = list(LOSS_COLUMNS)  # every column from the first row on: no header rewrite later

    def _check_log_dir_exists(self) -> None:
        pass  # the run folder holds checkpoints and more; an existing losses.csv is the resumed run's history

    def _record_new_keys(self) -> set[str]:
        new = super()._record_new_keys()
        # Lightning sorts the columns alphabetically; keep the documented order (unknown keys after it)
        self.metrics_keys.sort(key=lambda k: (LOSS_COLUMNS.index(k) if k in LOSS_COLUMNS else len(LOSS_COLUMNS), k))
        return new


class LossesLogger(CSVLogger):
    """Lightning's ``CSVLogger`` writing ``<out_dir>/losses.csv``, flushed at every logged step."""

    def __init__(self, out_dir: str | Path):
        super().__init__(out_dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    def path(self) -> Path:
        return Path(self.save_dir) / LOSSES_FILE

    @property
    @rank_zero_experiment
    def experiment(self) -> _LossesWriter:
        if self._experiment is None:
            self._experiment = _LossesWriter(self.log_dir)
        return self._experiment

    def keep_until(self, step: int) -> None:
        """Cut the file to the rows of steps ``<= step`` (atomically), before a resumed run logs again."""
        kept = [r for r in read_losses(self.path) if r["step"] <= step]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.experiment.metrics_keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
        atomic_write_text(self.path, text.getvalue())


def read_losses(path: Path) -> list[dict[str, float]]:
    """The rows of a ``losses.csv`` (``step`` as int, other columns as float where present); a line torn
    by a kill (the last one without its newline, or one with more or fewer cells than the header) is
    skipped."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    text = text[: text.rfind("\n") + 1]  # every row ends in a newline: what follows the last one is torn
    rows = []
    for raw in csv.DictReader(io.StringIO(text)):
        if None in raw or None in raw.values():
            continue
        try:
            row = {k: float(v) for k, v in raw.items() if v != ""}
        except ValueError:
            continue
        if "step" in row:
            row["step"] = int(row["step"])
            rows.append(row)
    return rows


class LossHistory(Callback):
    """Logs one row per optimizer step to ``losses.csv`` (the mean over its micro-batches, see the module
    docstring) and redraws ``loss_curve.<plots.format>`` at every checkpoint and at the end where a step was
    added since the last drawing, on global rank 0."""

    def __init__(self, out_dir: Path, plots: PlotSettings | None = None):
        self.plots = plots or PlotSettings()
        self.csv = LossesLogger(out_dir)
        self.path, self.png = self.csv.path, Path(out_dir) / self.plots.file_name("loss_curve")
        self.start_step = 0  # optimizer steps already done when this process started training
        self.last: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._written = 0
        self._drawn: int | None = None  # the step the drawn curve ends at: a save at the same step redraws nothing

    def on_train_start(self, trainer, pl_module):
        self.start_step = self._written = trainer.global_step
        if trainer.is_global_zero:
            self.csv.keep_until(self.start_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        for key in LOSS_COLUMNS[1:]:
            if f"train/{key}" in metrics:
                self._sums[key] = self._sums.get(key, 0.0) + float(metrics[f"train/{key}"])
                self._counts[key] = self._counts.get(key, 0) + 1
        if trainer.global_step <= self._written:
            return  # accumulating gradients: the optimizer has not stepped yet
        means: dict[str, Any] = {k: self._sums[k] / self._counts[k] for k in self._sums}
        self._sums, self._counts, self._written = {}, {}, trainer.global_step
        self.last = {"step": trainer.global_step, **means}
        if trainer.is_global_zero:
            self.csv.log_metrics(means, step=trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._draw(trainer)

    def on_train_end(self, trainer, pl_module):
        self._draw(trainer)

    def _draw(self, trainer) -> None:
        if trainer.is_global_zero and self.plots.enabled and self._drawn != self._written:
            plot_losses(read_losses(self.path), self.png, self.plots)
            self._drawn = self._written


__all__ = ["LOSS_COLUMNS", "LossHistory", "LossesLogger", "read_losses"]
