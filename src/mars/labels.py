"""What a model or checkpoint is called in results folders, tables and served responses.

Evaluation names its results folder and table rows with it, the server its ``model`` field: one rule, so a
checkpoint is called the same everywhere.  No torch, nothing of mars: evaluation and serving both import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# train.py exports to outputs/train/<run>/hf: for these folder names the run's name is the useful label
EXPORT_FOLDER_NAMES = ("hf", "export", "final")
# pipelines train into <name>/train/hf (scripts/reproduce.py): there the pipeline's name says which run it is
STAGE_FOLDER_NAMES = ("train",)


def checkpoint_label(path: str | Path) -> str:
    """The run's name for a checkpoint exported by training (``outputs/train/<run>/hf`` -> ``<run>``;
    ``outputs/reproduce/<name>/train/hf`` -> ``<name>-train``), else the folder's own name."""
    p = Path(path).expanduser().resolve()
    if p.name not in EXPORT_FOLDER_NAMES:
        return p.name
    run = p.parent
    return f"{run.parent.name}-{run.name}" if run.name in STAGE_FOLDER_NAMES and run.parent.name else run.name


def model_label(cfg: Mapping[str, Any]) -> str:
    """The label of a config's ``checkpoint`` if it has one, else of its ``model``: the model config's
    ``id``, else the last part of ``name_or_path`` (``embedded:x`` -> ``embedded-x``)."""
    if cfg.get("checkpoint"):
        return checkpoint_label(str(cfg["checkpoint"]))
    model = cfg.get("model") or {}
    return str(model.get("id") or Path(str(model.get("name_or_path", "model"))).name.replace(":", "-"))


__all__ = ["checkpoint_label", "model_label"]
