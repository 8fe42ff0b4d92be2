"""``mars_config.json``: the small metadata file beside an exported checkpoint, read and written here only.

It is what makes a plain Hugging Face directory a MARS checkpoint: the training block size (decoding's
default window), the objective it was trained with (name, ``alpha``, intra-block pattern), the mask
token and how it was obtained, the base model and its parameter count (the "no new parameters" check),
the optimizer step the weights come from, ``complete`` -- true only for the export of a training run
that reached its configured end -- and the masks' ``calibration`` when one was fitted (its fields are
:mod:`mars.calibration`'s, checked when a decoder loads it).  Training (:mod:`mars.training.run`) and
``python -m mars.training.export`` write it through :func:`write_metadata`; readers (training's skip check, :func:`mars.models.load_model`,
evaluation) call :func:`read_metadata`, which validates the fields and names the file and the field
when one is wrong.  Keys this version does not know are kept (``extra``) and written back unchanged.

Also what a model or checkpoint is called (:func:`checkpoint_label`, :func:`model_label`): evaluation names its
results folder and table rows with it, the server its ``model`` field, so a checkpoint is called the same
everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars.persistence import atomic_write_json

METADATA_FILE = "mars_config.json"
ADAPTER_FILE = "mars_adapter.json"  # a gated adapter's folder (mars.adapters.ADAPTER_META)
INTRA_BLOCK = ("causal", "bidirectional")


class MetadataError(ValueError):
    """``mars_config.json`` exists but cannot be used: bad JSON or a field of the wrong type or range."""


@dataclass
class MarsMetadata:
    block_size: int
    objective: str
    mask_token: str
    mask_token_id: int
    alpha: float | None = None  # weight of the clean-copy AR loss (None: unknown, e.g. an old export)
    intra_block: str | None = None  # causal (MARS) | bidirectional (Block Diffusion)
    mask_schedule: str | None = None
    mask_token_policy: str | None = None  # existing | spare_row | reused | added_row
    base_model: str | None = None
    base_num_parameters: int | None = None
    num_parameters: int | None = None
    global_step: int | None = None
    complete: bool = False  # True only for the export of a training run that reached its configured end
    # gated_lora: the folder holds an adapter for base_model (mars.adapters), not full weights
    adapter: str | None = None
    # per-depth temperatures of the mask confidences (mars.calibration; mars-bench calibrate writes it)
    calibration: dict[str, Any] | None = None
    # the masks' acceptance per depth and rank, for tree=auto (mars.calibration; mars-bench calibrate writes it)
    draft_acceptance: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self, where: str = "mars_config.json") -> None:
        def bad(name: str, expected: str) -> MetadataError:
            return MetadataError(f"{where}: field {name!r} must be {expected}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.block_size) or self.block_size < 1:
            raise bad("block_size", "an integer >= 1")
        if not isinstance(self.objective, str) or not self.objective:
            raise bad("objective", "a non-empty string")
        if not isinstance(self.mask_token, str) or not self.mask_token:
            raise bad("mask_token", "a non-empty string")
        if not is_int(self.mask_token_id) or self.mask_token_id < 0:
            raise bad("mask_token_id", "an integer >= 0")
        if self.alpha is not None and (
            isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha < 0
        ):
            raise bad("alpha", "a number >= 0 or null")
        if self.intra_block is not None and self.intra_block not in INTRA_BLOCK:
            raise bad("intra_block", f"one of {INTRA_BLOCK} or null")
        for name in ("base_num_parameters", "num_parameters", "global_step"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise bad(name, "an integer >= 0 or null")
        if not isinstance(self.complete, bool):
            raise bad("complete", "true or false")
        if self.adapter not in (None, "gated_lora"):
            raise bad("adapter", "null or 'gated_lora'")
        if self.adapter is not None and not self.base_model:
            raise bad("base_model", "the base model an adapter applies to")
        if self.calibration is not None and not isinstance(self.calibration, dict):
            raise bad("calibration", "an object or null")
        if self.draft_acceptance is not None and not isinstance(self.draft_acceptance, dict):
            raise bad("draft_acceptance", "an object or null")

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "mars_config.json") -> MarsMetadata:
        if not isinstance(data, dict):
            raise MetadataError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in data]
        if missing:
            raise MetadataError(f"{where}: missing field(s) {missing}; found {sorted(data)}")
        meta = cls.__new__(cls)  # validated below, with the file named in the message
        for f in dataclasses.fields(cls):
            if f.name != "extra":
                setattr(meta, f.name, data.get(f.name, f.default if f.default is not dataclasses.MISSING else None))
        meta.extra = {k: v for k, v in data.items() if k not in known}
        meta.validate(where)
        return meta


def metadata_path(folder: str | os.PathLike) -> Path:
    return Path(folder) / METADATA_FILE


def read_metadata(folder: str | os.PathLike) -> MarsMetadata | None:
    """The validated metadata of a checkpoint folder, or None when it has no ``mars_config.json``."""
    path = metadata_path(folder)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MetadataError(f"{path} is not valid JSON ({err})") from None
    return MarsMetadata.from_dict(data, where=str(path))


def write_metadata(folder: str | os.PathLike, meta: MarsMetadata) -> Path:
    """Write ``mars_config.json`` atomically (a reader never sees half a file)."""
    meta.validate()
    path = metadata_path(folder)
    atomic_write_json(path, meta.to_dict(), sort_keys=True)
    return path


def is_complete(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds the export of a finished training run."""
    meta = read_metadata(folder)
    return bool(meta and meta.complete)


# ------------------------------------------------------------------------------------------
# Reading a checkpoint to decode with (evaluation, serving, the benchmark commands)
# ------------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A ``checkpoint=`` folder that cannot be decoded with: missing, not a model folder, no mask token."""


def read_checkpoint(path: str | os.PathLike, key: str = "checkpoint") -> dict[str, Any]:
    """The metadata of a checkpoint folder to decode with, before any weight is read: its validated
    ``mars_config.json`` as a dict (empty without one), with the mask token (the metadata's, else the one
    its tokenizer config names); its model config and weight files are checked to be whole.  ``key`` names
    the setting in the messages."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{key}={path}: no such folder (expected a Hugging Face directory written by train.py)")
    adapter = (folder / ADAPTER_FILE).is_file()  # a gated adapter run's folder: base model + adapter
    if not (folder / "config.json").is_file() and not adapter:
        raise CheckpointError(
            f"{key}={path}: no config.json, so it is not a Hugging Face model folder (nor a gated adapter "
            f"folder with {ADAPTER_FILE})"
        )
    if not adapter:
        _check_model_config(folder / "config.json")
    try:
        meta = read_metadata(folder)  # validated: a field of the wrong type is named, not an int() error later
    except MetadataError as err:
        raise CheckpointError(f"{key}={path}: {err}") from None
    info = meta.to_dict() if meta is not None else {}
    if not info and not adapter:  # the paper's own format: what it says of itself (mars.paper_checkpoints)
        from mars.paper_checkpoints import PaperFormatError, paper_checkpoint

        try:
            paper = paper_checkpoint(folder)
        except PaperFormatError as err:
            raise CheckpointError(f"{key}={path}: {err}") from None
        info = paper.metadata() if paper is not None else {}
    mask = info.get("mask_token") or _tokenizer_mask_token(folder)
    if not mask:
        raise CheckpointError(
            f"{key}={path} has no mask token: neither {METADATA_FILE} nor the tokenizer names one. "
            "MARS decoding appends mask tokens after the context; use a checkpoint exported by train.py "
            "(or `python -m mars.training.export`), or a base model with model=<config> instead."
        )
    info["mask_token"] = mask
    from mars.persistence import check_weight_files

    try:
        check_weight_files(folder, required=False)  # a truncated copy fails now, before a results folder exists
    except ValueError as err:
        raise CheckpointError(f"{key}={path}: {err}") from None
    return info


def _check_model_config(config_file: Path) -> None:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file} is not valid JSON ({err}); the checkpoint cannot be loaded") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a Hugging Face model config (a JSON object); got {config!r:.80}")


def _tokenizer_mask_token(folder: Path) -> str | None:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    mask = json.loads(config.read_text(encoding="utf-8")).get("mask_token")
    return mask.get("content") if isinstance(mask, dict) else mask  # an AddedToken is serialised as a dict


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


# folder names that say where a checkpoint is, not which one it is (train.py's export folder, a pipeline stage)
GENERIC_NAMES = ("train", "hf", "export", "final", "checkpoint", "checkpoints", "model", "adapter", "outputs")


def is_generic_label(label: str) -> bool:
    """Whether a checkpoint's label is only a generic folder name that says nothing about what it is."""
    return label.lower() in GENERIC_NAMES


def meaningful_label(label: str, meta: dict[str, Any] | None) -> str:
    """A checkpoint's label for tables, plots and folder names: its run's name, or, when that is only a generic
    folder name (``train``, ``hf``...), what its mars_config.json says it is: ``<base>-<objective>[-<adapter>]``
    (e.g. ``smollm2-135m-mars-gated_lora``)."""
    if not is_generic_label(label) or not meta:
        return label
    base = str(meta.get("base_model") or "").rstrip("/").split("/")[-1].split(":")[-1]
    parts = [base, str(meta.get("objective") or ""), str(meta.get("adapter") or "")]
    described = "-".join(p for p in parts if p and p != "none")
    return described or label


def model_label(cfg: Mapping[str, Any]) -> str:
    """The label of a config's ``checkpoint`` if it has one, else of its ``model``: the model config's
    ``id``, else the last part of ``name_or_path`` (``embedded:x`` -> ``embedded-x``)."""
    if cfg.get("checkpoint"):
        return checkpoint_label(str(cfg["checkpoint"]))
    model = cfg.get("model") or {}
    return str(model.get("id") or Path(str(model.get("name_or_path", "model"))).name.replace(":", "-"))


def mars_trained(meta: Mapping[str, Any] | None) -> bool:
    """Whether a checkpoint's metadata (:func:`read_checkpoint`'s dict; None: a base model) says its masks were
    trained: an objective other than plain AR.  Thresholds below 1.0 mean something only then."""
    return bool(meta) and str(meta.get("objective") or "ar") != "ar"


__all__ = [
    "mars_trained",
    "CheckpointError",
    "read_checkpoint",
    "METADATA_FILE",
    "MarsMetadata",
    "MetadataError",
    "read_metadata",
    "write_metadata",
    "is_complete",
    "metadata_path",
    "checkpoint_label",
    "is_generic_label",
    "meaningful_label",
    "model_label",
]
