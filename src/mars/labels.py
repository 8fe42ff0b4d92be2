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


def checkpoint_label(path: str | Path) -> str:
    """The run's name for a checkpoint exported by training (``outputs/train/<run>/hf`` -> ``<run>``), else
    the folder's own name."""
    p = Path(path).expanduser().resolve()
    return p.parent.name if p.name in EXPORT_FOLDER_NAMES else p.name


def model_label(cfg: Mapping[str, Any]) -> str:
    """The label of a config's ``checkpoint`` if it has one, else of its ``model``: the model config's
    ``id``, else the last part of ``name_or_path`` (``embedded:x`` -> ``embedded-x``)."""
    if cfg.get("checkpoint"):
        return checkpoint_label(str(cfg["checkpoint"]))
    model = cfg.get("model") or {}
    return str(model.get("id") or Path(str(model.get("name_or_path", "model"))).name.replace(":", "-"))


__all__ = ["checkpoint_label", "model_label"]
