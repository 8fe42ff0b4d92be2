"""Experiment loggers and extra callbacks, built from the ``logger`` and ``callbacks`` config groups.

As in the lightning-hydra-template, every entry of ``logger`` and ``callbacks`` that has a ``_target_`` is
one object built by ``hydra.utils.instantiate``, so another logger or callback is a YAML file (or an
override such as ``+callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging``), not
code.  ``logger=csv | wandb | tensorboard | mlflow | none`` pick a file of ``conf/logger/``;
``logger=[csv,tensorboard]`` keeps both.  :func:`check_targets` is the config check (each target imports
and takes the keys given), run before anything loads.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars.logs import wandb_mode, wandb_sync_hint

log = logging.getLogger(__name__)

# callbacks that Lightning refuses in a run without a logger; they are left out there
NEEDS_A_LOGGER = ("LearningRateMonitor", "DeviceStatsMonitor")
HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


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


def wandb_logger(*, save_dir: str, mode: str = "auto", tags: list[str] | None = None, **kwargs: Any):
    """Lightning's W&B logger (``conf/logger/wandb.yaml``'s target), offline unless credentials exist."""
    os.environ.setdefault("WANDB_SILENT", "true")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    logger = _offline_aware_wandb_logger()(
        save_dir=str(save_dir), mode=wandb_mode(mode), tags=list(tags or []), **kwargs
    )
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        # Lightning passes anonymous=None to wandb.init, which W&B answers on every run with "The anonymous
        # setting has no effect and will be removed"; left out, W&B behaves the same and says nothing
        init.pop("anonymous", None)
    return logger


def _entries(section: Mapping[str, Any] | None, group: str) -> dict[str, Mapping[str, Any]]:
    """The ``_target_`` entries of a ``logger`` / ``callbacks`` section, by name (a plain mapping)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(section):
        section = OmegaConf.to_container(section, resolve=True)
    entries = {}
    for name, entry in dict(section or {}).items():
        if not isinstance(entry, Mapping) or "_target_" not in entry:
            raise ValueError(
                f"{group}.{name} must be a mapping with a _target_ (the class or function that builds it), "
                f"got {entry!r}"
            )
        entries[name] = entry
    return entries


def check_targets(section: Mapping[str, Any] | None, group: str) -> dict[str, Any]:
    """Each entry's ``_target_`` imports and accepts the entry's keys; returns the section (a config check:
    nothing is built)."""
    for name, entry in _entries(section, group).items():
        try:
            target = _import(str(entry["_target_"]))
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{group}.{name}._target_={entry['_target_']!r} cannot be imported: {err}") from None
        kwargs = {k: v for k, v in entry.items() if k not in HYDRA_KEYS}
        try:
            inspect.signature(target).bind(*entry.get("_args_", []), **kwargs)
        except TypeError as err:
            raise ValueError(f"{group}.{name}: {entry['_target_']} cannot take {sorted(kwargs)}: {err}") from None
        except ValueError:
            pass  # no signature to read (a builtin): it is checked when built
    return dict(section or {})


def _import(dotted: str) -> Any:
    """The object a ``_target_`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and not module.startswith(err.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {dotted!r} can be imported")


def build_loggers(section: Mapping[str, Any] | None, hyperparameters: dict[str, Any] | None = None) -> list:
    """The Lightning loggers of a ``logger`` section (empty for ``logger=none``); each gets the run's whole
    resolved config as its hyperparameters."""
    from hydra.utils import instantiate

    loggers = [instantiate(entry) for entry in _entries(section, "logger").values()]
    for logger in loggers:
        if hyperparameters:
            logger.log_hyperparams(hyperparameters)
    return loggers


def build_callbacks(section: Mapping[str, Any] | None, with_logger: bool) -> list:
    """The callbacks of a ``callbacks`` section; those that need a logger are left out of a run without one."""
    from hydra.utils import instantiate

    built = [instantiate(entry) for entry in _entries(section, "callbacks").values()]
    return [cb for cb in built if with_logger or type(cb).__name__ not in NEEDS_A_LOGGER]


__all__ = ["wandb_mode", "wandb_sync_hint", "wandb_logger", "check_targets", "build_loggers", "build_callbacks"]
