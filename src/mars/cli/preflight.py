"""What an entry point refuses before any work, and how: one message, a non-zero exit, no traceback and no stub run
folder (as litgpt refuses a checkpoint it cannot find).

:func:`check_sources` checks, from the composed config, that the models an evaluation or a server loads can be
fetched: the checkpoint (for a gated adapter, its base model) or the configured model, and a draft model; a hub id
that is neither reachable nor cached fails here in seconds (:func:`mars.models.check_model_source`), before the
evaluation writes its results folder or the server logs a line; so is a checkpoint whose stored calibration or
draft acceptance table the loader would refuse.  :func:`refuse` ends the process with such an
error: the run folder Hydra made for the job is removed when it holds nothing but Hydra's own files and an empty
log (a folder with anything of a run in it stays), then the message is printed as one line.  In a multirun the
error is raised instead, so that Hydra goes on with the other jobs.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

REFUSED_STATUS = 2  # the request was wrong, not the code (train.py's refusals exit so too)
HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}


def _config(cfg: DictConfig | dict[str, Any]) -> DictConfig:
    return cfg if OmegaConf.is_config(cfg) else OmegaConf.create(dict(cfg))


def model_sources(cfg: DictConfig | dict[str, Any]) -> list[str]:
    """The model names or folders an evaluation or a server loads weights from, as the config says: the
    configured model without a checkpoint; a gated adapter checkpoint's base model; a draft model
    (``decoding.draft_model``, not the target's own layers).  A full checkpoint folder is checked by the entry
    point's own checks (``read_checkpoint``)."""
    from mars.adapters import read_adapter_meta
    from mars.metadata import read_metadata
    from mars.paths import bundled_path

    cfg = _config(cfg)
    data = {  # only the keys read here are resolved (run names and the like need their own resolvers)
        key: OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        for key in ("checkpoint", "model", "decoding")
        for node in [OmegaConf.select(cfg, key)]
    }
    sources = []
    checkpoint = bundled_path(data.get("checkpoint"))
    if not checkpoint:
        sources.append(str((data.get("model") or {}).get("name_or_path")))
    elif Path(checkpoint).is_dir():
        adapter = read_adapter_meta(checkpoint) or {}
        meta = read_metadata(checkpoint) if adapter else None
        base = adapter.get("base_model") or (meta.base_model if meta else None)
        if base:
            sources.append(str(base))
    decoding = data.get("decoding") or {}
    draft = decoding.get("draft_model")
    if decoding.get("draft_source") == "model" and isinstance(draft, str) and not draft.startswith("self"):
        sources.append(draft)
    return sources


def typed_overrides() -> dict[str, str]:
    """The keys the command line set, with their values as typed (empty outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    typed = {}
    for item in HydraConfig.get().overrides.task:
        key, sep, value = item.lstrip("+~").partition("=")
        if sep:
            typed[key] = value.strip().strip("'\"")
    return typed


def check_default_checkpoint(cfg: DictConfig | dict[str, Any]) -> None:
    """Refuse (``ValueError``) a ``model.name_or_path`` that is not the base of the adapter checkpoint decoded, where
    the checkpoint is the model's default (``model.reference_checkpoint``) or the command line typed
    ``model.name_or_path=``: the adapter brings its base, so the run would decode that base, not the model
    named."""
    from mars.adapters import read_adapter_meta
    from mars.paths import bundled_path

    cfg = _config(cfg)
    checkpoint = OmegaConf.select(cfg, "checkpoint")
    named = OmegaConf.select(cfg, "model.name_or_path")
    default = checkpoint is not None and checkpoint == OmegaConf.select(cfg, "model.reference_checkpoint")
    if not checkpoint or not named or not (default or "model.name_or_path" in typed_overrides()):
        return
    folder = bundled_path(checkpoint)
    base = (read_adapter_meta(folder) or {}).get("base_model") if Path(folder).is_dir() else None
    if base and str(base) != str(named):
        which = "the default checkpoint" if default else "the checkpoint"
        keep = "" if default else f"leave model.name_or_path out to decode {base} with it, "
        raise ValueError(
            f"model.name_or_path={named} beside {which} {checkpoint}, an adapter of {base}: the adapter brings its "
            f"base, so the run would decode {base}, not {named}; {keep}set checkpoint=null to take {named} as it "
            f"is, or checkpoint=<a MARS checkpoint of {named}>"
        )


def check_sources(cfg: DictConfig | dict[str, Any]) -> None:
    """Refuse (``ConnectionError``, ``FileNotFoundError`` or ``ValueError``, naming the model and the ways out) a
    model named beside a default checkpoint of another base (:func:`check_default_checkpoint`); a model of
    :func:`model_sources` that cannot be fetched: a hub id neither reachable nor cached, a folder that is no model
    folder; and a checkpoint whose stored calibration or draft acceptance table the loader would refuse
    (:func:`mars.calibration.check_stored_records`)."""
    from mars.calibration import check_stored_records
    from mars.metadata import read_metadata
    from mars.models import check_model_source
    from mars.paths import bundled_path

    check_default_checkpoint(cfg)
    for name in model_sources(cfg):
        check_model_source(name)
    checkpoint = bundled_path(OmegaConf.select(_config(cfg), "checkpoint"))
    meta = read_metadata(checkpoint) if checkpoint and Path(checkpoint).is_dir() else None
    if meta is not None:
        check_stored_records(checkpoint, meta.to_dict())


def check_tree_spelling() -> None:
    """``decoding.tree`` as the command line spelled it: Hydra reads ``decoding.tree=1_0`` as the integer 10 (its
    grammar, like Python's, allows digit separators), so the typed text is checked by the tree parser itself."""
    from mars.decoding.settings import tree_shape

    value = typed_overrides().get("decoding.tree")
    if value is not None and not value.startswith("["):
        tree_shape(value)


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_folder() -> Path | None:
    """The run folder Hydra made for this job (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def is_stub(folder: Path) -> bool:
    """Whether ``folder`` holds only what Hydra writes when a job starts: ``.hydra/`` with its config files and
    empty log files, nothing of a run."""
    if not folder.is_dir() or folder.resolve() == Path.cwd().resolve():
        return False
    for entry in folder.iterdir():
        if entry.name == ".hydra" and entry.is_dir():
            if not {p.name for p in entry.iterdir()} <= HYDRA_FILES:
                return False
        elif not (entry.is_file() and entry.suffix == ".log" and entry.stat().st_size == 0):
            return False
    return True


def remove_stub(folder: Path | None) -> bool:
    """Remove Hydra's stub run folder (see :func:`is_stub`; its log handlers closed first) and the folders above
    it that it leaves empty, up to the working directory; whether it was removed."""
    if folder is None or not is_stub(folder):
        return False
    root = logging.getLogger()
    for handler in list(root.handlers):
        name = getattr(handler, "baseFilename", None)
        if name and Path(name).resolve().is_relative_to(folder.resolve()):
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(folder)
    cwd = Path.cwd().resolve()
    parent = folder.resolve().parent
    while parent != cwd and parent.is_relative_to(cwd) and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
    return True


def refuse(err: BaseException) -> None:
    """End the process with ``err`` as one line on stderr and :data:`REFUSED_STATUS`, leaving no stub run folder;
    in a multirun, raise it (Hydra reports it and runs the other jobs)."""
    if in_multirun():
        raise err
    remove_stub(job_folder())
    print(f"error: {err}", file=sys.stderr, flush=True)
    sys.exit(REFUSED_STATUS)


__all__ = [
    "check_default_checkpoint",
    "check_sources",
    "check_tree_spelling",
    "is_stub",
    "model_sources",
    "refuse",
    "remove_stub",
]
