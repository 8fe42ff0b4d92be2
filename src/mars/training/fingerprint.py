"""The fingerprint of a training run folder: a rerun may resume or skip it only with the same settings.

``outputs/train/<run_name>`` is named after the model, objective, block and mask schedule, and the run's length
when one is set (``data.limit``, ``trainer.max_steps``, ``budget.minutes``: :func:`run_length_suffix`), so two
commands that differ in learning rate or data land in the same folder.  Before the model
loads, :func:`check_run_folder` compares the settings that change the trained weights with the ones the
folder was started with (``fingerprint.json``) and refuses a mismatch, naming each differing key and how to
proceed; resuming a half-finished run with another optimizer config, or skipping a finished run trained on
other data, would otherwise hand back a checkpoint whose recorded config is false.

In the fingerprint (they change the result):

- ``model``: ``name_or_path``, ``tiny`` (the random model's shape), ``mask_token``,
  ``allow_new_embedding_row``; a local model folder also by a digest of its ``config.json`` and weight
  files (a retrained stage-1 folder under the same path is another model).
- ``data``: every key except ``path`` and ``num_workers``; the file behind ``path`` (and the offline split)
  by a digest of its content, so the same file under another path matches and an edited file does not; a
  dataset folder (``source: disk``) by the digests of its files.
  The self-distillation sub-config ``data.distill`` likewise, except ``threads``, ``batch_size`` (the
  answers do not depend on them) and ``root`` (where the cache lives), its prompt file by content.
- ``objective`` (every field), ``block``, ``mask_schedule``, ``optim`` (its ``schedule`` only when it is not
  the cosine every run had before the key existed, so their folders still match), ``seed``, ``adapter`` and the
  compute ``budget`` (it sets the run's length and lr schedule).
- ``trainer``: ``max_steps``, ``max_epochs``, ``precision``, ``accumulate_grad_batches``,
  ``gradient_clip_val`` and the number of processes (``devices`` x ``num_nodes``, resolved): with the
  data's batch size they fix the effective batch and the learning-rate schedule's length.

Left out (they do not change the trained weights, or only as floating-point noise):
``gradient_checkpointing`` (recomputes the same activations), ``crop_noisy_prompt`` (tested to leave
losses and gradients unchanged), ``model.attn_implementation`` and ``model.id`` (a kernel and a label),
``trainer.strategy`` / ``accelerator`` / ``log_every_n_steps`` (how, not what; a checkpoint written under
another strategy is refused by Lightning itself), ``data.num_workers``, and the bookkeeping keys
(``run_name``, ``output_dir``, ``export_dir``, ``checkpoint_every``, ``checkpoint_minutes``, ``resume``,
``ckpt_path``, ``overwrite``, ``stop_grace_seconds``, ``logger``, ``recipe``, ``dry_run``).  ``global_batch`` is
in it through what it sets, ``trainer.accumulate_grad_batches`` with the number of processes.

A folder that holds checkpoints or an export but no ``fingerprint.json`` (deleted by hand, or an ``overwrite``
killed half-way) is refused: absence is never a match. Files are digested completely
(:func:`mars.persistence.file_sha256`, cached by path, size and timestamps), never by samples: a multi-GB
shard is read once per machine, and only global rank 0 of a job computes the fingerprint
(``mars.training.run``). ``ckpt_path`` (resume from a checkpoint of another folder) is deliberately not
checked: it is the explicit way to continue a run under new settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from mars.persistence import atomic_write_json, file_sha256, fingerprint_differences, remove_tree

log = logging.getLogger(__name__)

FINGERPRINT_FILE = "fingerprint.json"
VERSION = 2  # 2: complete content digests (1 sampled large files)
MODEL_KEYS = ("name_or_path", "tiny", "mask_token", "allow_new_embedding_row")
TRAINER_KEYS = ("max_steps", "max_epochs", "precision", "accumulate_grad_batches", "gradient_clip_val")
DATA_EXCLUDED = ("path", "num_workers")
DEFAULT_SCHEDULE = "cosine"  # optim.schedule of every run before the key existed
DISTILL_EXCLUDED = ("threads", "batch_size", "root")
# what overwrite=true removes before training from scratch (the logger's folders are left alone), in this
# order: the export first and the fingerprint last, so that a kill at any point leaves a folder whose
# results are still described by its fingerprint (or no results at all)
RUN_OUTPUTS = ("checkpoints", "losses.csv", "loss_curve.png", "train_summary.json", FINGERPRINT_FILE)


class RunMismatchError(ValueError):
    """The run folder was started with settings that change the result."""


# ------------------------------------------------------------------------------------------
# Digests (every byte, never a sample: a digest of size + first and last MiB misses an edit in the middle
# of a weight or data file)
# ------------------------------------------------------------------------------------------
def _dataset_folder_digest(folder: Path) -> str:
    """Every file of a saved dataset folder (its Arrow shards and their index), each digested once and cached."""
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(folder).as_posix()}:{file_sha256(p)};".encode())
    return h.hexdigest()


def _model_folder_digest(folder: Path) -> str:
    files = sorted(
        p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf", ".pt")
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{file_sha256(p)};".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------
# The fingerprint
# ------------------------------------------------------------------------------------------
def world_size(trainer: dict[str, Any]) -> int:
    """Processes a trainer config starts: ``devices`` (resolved as Lightning does) x ``num_nodes``."""
    devices, nodes = trainer.get("devices", 1), int(trainer.get("num_nodes") or 1)
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    # "auto" / -1: every GPU when the accelerator may use them, else one CPU process
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count() * nodes
    return nodes


def _data_fingerprint(data: dict[str, Any]) -> dict[str, Any]:
    from mars.training.data import OFFLINE_DATA

    out = {k: v for k, v in data.items() if k not in DATA_EXCLUDED and k != "distill"}
    if data.get("path") and Path(str(data["path"])).expanduser().is_dir():
        out["content"] = _dataset_folder_digest(Path(str(data["path"])).expanduser())
    elif data.get("path"):
        out["content"] = file_sha256(Path(str(data["path"])).expanduser())
    elif data.get("source") == "offline":
        out["content"] = file_sha256(OFFLINE_DATA / f"{data.get('split', 'train')}.jsonl")
    distill = data.get("distill")
    if distill:
        d = {k: v for k, v in distill.items() if k not in DISTILL_EXCLUDED}
        prompts = dict(d.get("prompts") or {})
        if prompts.get("source") == "jsonl" and prompts.get("path"):
            prompts["content"] = file_sha256(Path(str(prompts.pop("path"))).expanduser())
        d["prompts"] = prompts
        out["distill"] = d
    return out


def run_fingerprint(cfg) -> dict[str, Any]:
    """The settings of a composed ``train.yaml`` config that change the trained weights (module docstring)."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    model = {k: c["model"].get(k) for k in MODEL_KEYS}
    local = Path(str(model["name_or_path"])).expanduser()
    if model["name_or_path"] not in ("tiny-random",) and local.is_dir():
        model["content"] = _model_folder_digest(local)
    trainer = {k: c["trainer"].get(k) for k in TRAINER_KEYS}
    trainer["world_size"] = world_size(c["trainer"])
    return {
        "version": VERSION,
        "model": model,
        "data": _data_fingerprint(c["data"]),
        "objective": c["objective"],
        "block": c["block"],
        "mask_schedule": c["mask_schedule"],
        "optim": {k: v for k, v in c["optim"].items() if not (k == "schedule" and v == DEFAULT_SCHEDULE)},
        "seed": c["seed"],
        "trainer": trainer,
        "adapter": c.get("adapter") or {"kind": "none"},
        "budget": c.get("budget") or {"minutes": None},
    }


# ------------------------------------------------------------------------------------------
# The run's name
# ------------------------------------------------------------------------------------------
def run_length_suffix(limit: Any = None, max_steps: Any = None, minutes: Any = None) -> str:
    """``-limit32-steps5`` / ``-20min``: the part of the default run name (a Hydra resolver of train.yaml) that
    says how much a run trains, when it is set.  These are the settings a quick run varies (the quickstart's
    ``data.limit`` and ``trainer.max_steps``), so a rerun with another value gets its own folder instead of
    being refused by this folder's fingerprint; at their defaults (no limit, no step cap, no budget) the name is
    the plain one."""
    parts = []
    if limit is not None:
        parts.append(f"limit{limit}")
    if max_steps is not None and max_steps != -1:
        parts.append(f"steps{max_steps}")
    if minutes is not None:  # a bad value is named by the config check, not here
        parts.append(f"{minutes:g}min" if isinstance(minutes, (int, float)) else f"{minutes}min")
    return "".join(f"-{p}" for p in parts)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mars_run_length"):
        OmegaConf.register_new_resolver("mars_run_length", run_length_suffix)


# ------------------------------------------------------------------------------------------
# Comparing and recording
# ------------------------------------------------------------------------------------------
def read_fingerprint(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(out_dir) / FINGERPRINT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def holds_results(out_dir: str | os.PathLike, export_dir: str | os.PathLike) -> bool:
    """A checkpoint or an export: something a rerun would resume from or skip for."""
    checkpoints = Path(out_dir) / "checkpoints"
    return (checkpoints.is_dir() and any(checkpoints.iterdir())) or (Path(export_dir) / "mars_config.json").is_file()


def check_run_folder(
    out_dir: str | os.PathLike,
    export_dir: str | os.PathLike,
    fingerprint: dict[str, Any],
    *,
    overwrite: bool = False,
    clear: bool = True,
    run_name: str | None = None,
) -> None:
    """Refuse a folder that holds checkpoints or an export of other settings; with ``overwrite`` clear it
    for a fresh run (only where ``clear``: global rank 0).  Writes nothing else: the fingerprint is recorded
    by :func:`record_fingerprint` once training starts, so a request that fails before (bad rows, a model
    that does not load) leaves no record that would refuse its corrected rerun."""
    out, export = Path(out_dir), Path(export_dir)
    if overwrite:
        if clear:
            clear_run_folder(out, export)
        return
    if not holds_results(out, export):
        return  # nothing to resume or skip: any earlier record is simply replaced
    saved = read_fingerprint(out)
    if saved is None:  # deleted, or an overwrite killed half-way: never a match
        raise RunMismatchError(
            f"The run folder {out} holds "
            + ("an export" if (export / "mars_config.json").is_file() else "checkpoints")
            + f" but no {FINGERPRINT_FILE}, so the settings it was trained with cannot be checked against "
            "these; resuming or skipping it could hand back a checkpoint of other settings. Retrain it with "
            f"overwrite=true, or start a separate run with run_name=<new name> (now {run_name!r})."
        )
    if saved.get("version") != fingerprint.get("version"):
        raise RunMismatchError(
            f"The run folder {out} was fingerprinted by another version of mars ({FINGERPRINT_FILE} version "
            f"{saved.get('version')!r}, now {fingerprint.get('version')!r}: version 1 digested large files by "
            "samples, which cannot vouch for their content). Retrain it with overwrite=true, or start a "
            f"separate run with run_name=<new name> (now {run_name!r})."
        )
    diff = fingerprint_differences(saved, fingerprint)
    if diff:
        shown = "; ".join(f"{k}: folder has {a!r}, now {b!r}" for k, a, b in diff[:10])
        more = f" (and {len(diff) - 10} more)" if len(diff) > 10 else ""
        raise RunMismatchError(
            f"The run folder {out} was started with other settings ({shown}{more}). Resuming or skipping it "
            "would give a checkpoint whose recorded config is false. Start a separate run with "
            f"run_name=<new name> (now {run_name!r}) or output_dir=..., or retrain this folder from scratch "
            "with overwrite=true (deletes its checkpoints and export)."
        )


def clear_run_folder(out: Path, export: Path) -> None:
    """Remove a run's results for ``overwrite=true``: the export first, the fingerprint last (see
    ``RUN_OUTPUTS``); each folder is renamed away before it is deleted, so none is ever half there."""
    if export.is_dir():
        remove_tree(export)
    for name in RUN_OUTPUTS:
        target = out / name
        if target.is_dir():
            remove_tree(target)
        elif target.exists():
            target.unlink()


def record_fingerprint(out_dir: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / FINGERPRINT_FILE, fingerprint, sort_keys=True)


__all__ = [
    "FINGERPRINT_FILE",
    "register_resolvers",
    "run_length_suffix",
    "RunMismatchError",
    "check_run_folder",
    "clear_run_folder",
    "holds_results",
    "read_fingerprint",
    "record_fingerprint",
    "run_fingerprint",
    "world_size",
]
