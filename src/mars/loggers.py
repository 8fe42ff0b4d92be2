"""Experiment loggers from the ``logger`` config group (wandb | csv | none)."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def wandb_mode(requested: str = "auto") -> str:
    """``online`` only with credentials; ``offline`` otherwise, so W&B never prompts for a key."""
    if requested in ("online", "offline", "disabled"):
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


def wandb_sync_hint(run) -> str | None:
    """For a W&B run kept offline, the line that says how to upload it (W&B itself is silenced)."""
    if run is None or not getattr(run, "offline", False):
        return None
    return f"W&B run saved offline; upload it with: wandb sync {Path(run.dir).parent}"


def _offline_aware_wandb_logger():
    from lightning.pytorch.loggers import WandbLogger
    from lightning.pytorch.utilities import rank_zero_only

    class OfflineAwareWandbLogger(WandbLogger):
        """Lightning's W&B logger that, when training ends, names the ``wandb sync`` command of an offline run."""

        @rank_zero_only
        def finalize(self, status: str) -> None:
            super().finalize(status)
            hint = wandb_sync_hint(self._experiment)
            if hint:
                log.info(hint)

    return OfflineAwareWandbLogger


def build_logger(cfg: dict[str, Any] | None, save_dir: str | os.PathLike, run_name: str, config: dict | None = None):
    """A Lightning logger, or False for ``none``."""
    cfg = dict(cfg or {"name": "none"})
    name = cfg.get("name", "none")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    if name == "none":
        return False
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir, name="csv", version="")
    if name == "wandb":
        mode = wandb_mode(cfg.get("mode", "auto"))
        os.environ.setdefault("WANDB_SILENT", "true")
        return _offline_aware_wandb_logger()(
            project=cfg.get("project", "mars"),
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            name=run_name,
            save_dir=str(save_dir),
            mode=mode,
            config=config,
        )
    raise ValueError(f"logger must be one of wandb | csv | none, got {name!r}")
