"""A checkpoint's stored decoding records, ``mars-bench calibrate``'s results: the mask calibration (one
temperature per mask depth, how it was fitted) and the draft acceptance table (``tree=auto``'s chance that the
greedy token is among a mask's top k, per depth), each naming the checkpoint and block size it belongs to; their
storage in ``mars_config.json`` (both in one atomic write) and their loading, validated field by field.

Fitting lives with decoding (:mod:`mars.decoding.calibration`, :func:`mars.decoding.tree_choice.acceptance_table`);
loading sits on the ground floor because :func:`mars.models.load_model` attaches both when it loads the model
(``model.mars_calibration``, ``model.mars_draft_acceptance``), the decoding engine reads them there, and the
server checks them before any model loads (:func:`check_stored_records`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CALIBRATION_KEY = "calibration"
ACCEPTANCE_KEY = "draft_acceptance"
# the temperatures a fit can give (mars.decoding.calibration searches 2**-3 .. 2**3): a stored one outside is no
# fit's (1e-3 accepts every mask, 1e39 overflows float32), refused at load
TEMPERATURE_DOUBLINGS = 3
TEMPERATURE_RANGE = (2.0**-TEMPERATURE_DOUBLINGS, 2.0**TEMPERATURE_DOUBLINGS)
_RANGE_SLACK = 1e-6  # relative: a fit at the bound read back through float32 and exp


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_identity(kind: str, block_size: Any, checkpoint: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"{kind}.block_size must be an integer >= 2 (one mask at least), got {block_size!r}")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ValueError(f"{kind}.checkpoint must name the checkpoint it belongs to, got {checkpoint!r}")


# ------------------------------------------------------------------------------------------------
# The calibration of a checkpoint
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """Per-depth temperatures of a checkpoint's masks (``temperatures[d - 1]`` divides mask depth ``d``'s logits)
    and how they were fitted: ``block_size``, the ``checkpoint``'s identity, the ECE per depth on held-out
    prompts before and after, and the prompts of each split."""

    temperatures: tuple[float, ...]
    block_size: int
    checkpoint: str
    ece_before: tuple[float | None, ...] = ()
    ece_after: tuple[float | None, ...] = ()
    fit_prompts: int = 0
    eval_prompts: int = 0

    def __post_init__(self) -> None:
        _check_identity("calibration", self.block_size, self.checkpoint)
        masks = self.block_size - 1
        low, high = TEMPERATURE_RANGE
        temps = self.temperatures
        expected = f"a list of {masks} numbers in [{low:g}, {high:g}] (one per mask depth: the fit's range)"
        if not isinstance(temps, Sequence) or isinstance(temps, str) or len(temps) != masks:
            raise ValueError(f"calibration.temperatures must be {expected}, got {temps!r:.80}")
        bad = [
            (d, t)
            for d, t in enumerate(temps, start=1)
            if not _is_number(t) or not low * (1 - _RANGE_SLACK) <= t <= high * (1 + _RANGE_SLACK)
        ]
        if bad:
            depth, value = bad[0]
            raise ValueError(f"calibration.temperatures must be {expected}; mask depth {depth} has {value!r}")
        for name in ("ece_before", "ece_after"):
            values = getattr(self, name)
            if not isinstance(values, Sequence) or isinstance(values, str):
                raise ValueError(f"calibration.{name} must be a list of numbers or nulls, got {values!r:.80}")
            object.__setattr__(self, name, tuple(values))
        for name in ("fit_prompts", "eval_prompts"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"calibration.{name} must be an integer >= 0, got {n!r}")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))

    def mask_temperatures(self, window: int) -> list[float]:
        """One divisor per column of a ``window``-wide decoding step: 1.0 for column 0 (the exact AR prediction),
        then ``T_1 .. T_{window-1}``; a window wider than the training block reuses the last depth's."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        last = len(self.temperatures) - 1
        return [1.0] + [self.temperatures[min(d - 1, last)] for d in range(1, window)]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Any, where: str = "calibration") -> Calibration:
        return _record_from_dict(cls, CALIBRATION_KEY, data, where)


def _record_from_dict(cls, key: str, data: Any, where: str):
    """``cls`` from a stored object: not an object, unknown or missing fields and bad values are refused
    naming ``where`` (the file) and the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: '{key}' must be an object, got {data!r:.80}")
    fields = cls.__dataclass_fields__
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown {key} field(s) {unknown}; known: {sorted(fields)}")
    required = [n for n, f in fields.items() if f.default is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        refit = " (mars-bench calibrate writes them)" if "checkpoint" in missing else ""
        raise ValueError(f"{where}: {key} lacks the field(s) {missing}{refit}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


# ------------------------------------------------------------------------------------------------
# The draft acceptance table of a checkpoint
# ------------------------------------------------------------------------------------------------
def check_acceptance_rows(table: Any, depths: int | None = None) -> tuple[tuple[float, ...], ...]:
    """A draft acceptance table checked: ``depths`` rows (any number >= 1: None), each a non-empty list as long
    as the first, of numbers in [0, 1] (no bool, NaN or infinity); as tuples of floats."""
    count = f"{depths} rows (one per mask depth)" if depths is not None else "one row per mask depth"
    expected = f"a list of {count}, each a non-empty list of the same length of numbers in [0, 1]"
    field = f"{ACCEPTANCE_KEY}.conditional"
    if not isinstance(table, Sequence) or isinstance(table, str) or not table or len(table) != (depths or len(table)):
        raise ValueError(f"{field} must be {expected}, got {table!r:.80}")
    for depth, row in enumerate(table, start=1):
        if not isinstance(row, Sequence) or isinstance(row, str) or not row or len(row) != len(table[0]):
            raise ValueError(f"{field} must be {expected}; depth {depth} has {row!r:.80}")
        bad = [k for k, a in enumerate(row, start=1) if not _is_number(a) or not 0 <= a <= 1]
        if bad:
            raise ValueError(f"{field} must be {expected}; depth {depth}, top-{bad[0]} has {row[bad[0] - 1]!r:.80}")
    return tuple(tuple(float(a) for a in row) for row in table)


@dataclass(frozen=True)
class DraftAcceptance:
    """``conditional[d - 1][k - 1]``: the chance that mask depth ``d``'s greedy token is among its top ``k``
    candidates given that every earlier depth's was (:func:`mars.decoding.tree_choice.acceptance_table`), one row
    per mask depth (``block_size - 1``), every row as wide (the candidates measured); measured on ``prompts``
    prompts of the ``checkpoint`` (its identity, as the calibration's) by ``measured``."""

    conditional: tuple[tuple[float, ...], ...]
    block_size: int
    checkpoint: str
    prompts: int = 0
    measured: str = "teacher forcing"

    def __post_init__(self) -> None:
        _check_identity(ACCEPTANCE_KEY, self.block_size, self.checkpoint)
        table = check_acceptance_rows(self.conditional, self.block_size - 1)
        n = self.prompts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{ACCEPTANCE_KEY}.prompts must be an integer >= 0, got {n!r}")
        if not isinstance(self.measured, str) or not self.measured:
            raise ValueError(f"{ACCEPTANCE_KEY}.measured must say how it was measured, got {self.measured!r}")
        object.__setattr__(self, "conditional", table)

    def table(self) -> list[list[float]]:
        return [list(row) for row in self.conditional]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "conditional": self.table()}

    @classmethod
    def from_dict(cls, data: Any, where: str = ACCEPTANCE_KEY) -> DraftAcceptance:
        return _record_from_dict(cls, ACCEPTANCE_KEY, data, where)


# ------------------------------------------------------------------------------------------------
# Storage and loading
# ------------------------------------------------------------------------------------------------
def checkpoint_identity(folder: str | os.PathLike) -> str:
    """What a calibration belongs to: a sha256 over the names and content digests of the folder's weight files
    (for a gated adapter, its adapter weights); the digests are cached by :func:`mars.persistence.file_sha256`."""
    from mars.persistence import WEIGHT_SUFFIXES, file_sha256

    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ValueError(f"{folder} holds no weight files (any of {WEIGHT_SUFFIXES}): nothing to calibrate")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{file_sha256(p)};".encode())
    return f"sha256:{h.hexdigest()}"


def check_can_store(folder: str | os.PathLike) -> Path:
    """``folder``'s ``mars_config.json``, checked to exist and to be replaceable (a file can be created in the
    folder, as the atomic write does) before any work whose result would go there."""
    from mars.metadata import metadata_path

    path = metadata_path(folder)
    if not path.is_file():
        raise ValueError(f"{folder} has no mars_config.json: not a MARS checkpoint")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
    except OSError as err:
        raise PermissionError(
            f"{path} cannot be updated: {path.parent} is not writable ({err.strerror}); copy the checkpoint to "
            "a writable folder or make this one writable"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


def store_calibration(
    folder: str | os.PathLike, calibration: Calibration, acceptance: DraftAcceptance | None = None
) -> Path:
    """Write ``calibration`` (and ``acceptance``, fitted with it) into the checkpoint's ``mars_config.json`` in
    one atomic write, the other fields unchanged: a kill leaves the old records or the new ones, never one of
    each."""
    from mars.metadata import read_metadata, write_metadata

    meta = read_metadata(folder)
    if meta is None:
        raise ValueError(f"{folder} has no mars_config.json: not a MARS checkpoint")
    for record in (calibration, acceptance):
        if record is not None and meta.block_size != record.block_size:
            raise ValueError(
                f"the {type(record).__name__} belongs to block size {record.block_size}; {folder} has block "
                f"size {meta.block_size}"
            )
    if acceptance is not None and acceptance.checkpoint != calibration.checkpoint:
        raise ValueError(
            f"the calibration ({calibration.checkpoint}) and the draft acceptance ({acceptance.checkpoint}) "
            "belong to different checkpoints"
        )
    meta.calibration = calibration.to_dict()
    if acceptance is not None:
        meta.draft_acceptance = acceptance.to_dict()
    return write_metadata(folder, meta)


_SAID_UNCALIBRATED: set[str] = set()


def _stored(checkpoint_dir_or_meta: str | os.PathLike | Mapping[str, Any]) -> tuple[dict, Path | None, str]:
    """The metadata (as a mapping), the folder (None for a mapping) and the name of the file, for messages."""
    from mars.metadata import metadata_path, read_metadata

    if isinstance(checkpoint_dir_or_meta, Mapping):
        return dict(checkpoint_dir_or_meta), None, "the checkpoint's mars_config.json"
    folder = Path(checkpoint_dir_or_meta)
    read = read_metadata(folder)
    return (read.to_dict() if read else {}), folder, str(metadata_path(folder))


def _belongs(record, key: str, where: str, folder: Path | None, block_size: int, identity: str | None) -> None:
    """Refuse a stored record fitted for another block size or checkpoint, naming both."""
    refit = f"fit it again with `mars-bench calibrate --checkpoint {folder or '<checkpoint>'}`"
    if record.block_size != block_size:
        raise ValueError(
            f"{where}: {key}.block_size: the {key} belongs to block size {record.block_size}, this checkpoint "
            f"decodes with block size {block_size}; {refit}"
        )
    if identity is None:
        if folder is None:
            raise ValueError(f"load_{key}: a metadata mapping needs identity=checkpoint_identity(<its folder>)")
        identity = checkpoint_identity(folder)
    if record.checkpoint != identity:
        raise ValueError(
            f"{where}: {key}.checkpoint: the {key} belongs to checkpoint {record.checkpoint}, not to this one "
            f"({identity}); {refit}"
        )


def load_calibration(
    checkpoint_dir_or_meta: str | os.PathLike | Mapping[str, Any], block_size: int, *, identity: str | None = None
) -> Calibration | None:
    """The calibration stored in a checkpoint folder's ``mars_config.json`` (or in that file's content as a
    mapping, with the folder's ``identity`` from :func:`checkpoint_identity`), checked field by field and to
    belong to this checkpoint and ``block_size``: one fitted for another checkpoint or block size is refused,
    naming both.  None where there is none (logged once per checkpoint: its masks decode uncalibrated)."""
    meta, folder, where = _stored(checkpoint_dir_or_meta)
    data = meta.get(CALIBRATION_KEY)
    if data is None:
        if where not in _SAID_UNCALIBRATED:
            _SAID_UNCALIBRATED.add(where)
            log.info(
                "%s holds no mask calibration: the masks decode uncalibrated (mars-bench calibrate fits one)", where
            )
        return None
    calibration = Calibration.from_dict(data, where)
    _belongs(calibration, CALIBRATION_KEY, where, folder, block_size, identity)
    return calibration


def load_draft_acceptance(
    checkpoint_dir_or_meta: str | os.PathLike | Mapping[str, Any], block_size: int, *, identity: str | None = None
) -> DraftAcceptance | None:
    """The draft acceptance table stored beside the calibration, checked as :func:`load_calibration` checks
    that (its shape, every value a number in [0, 1], the block size, the checkpoint's identity); None where there
    is none (``tree=auto`` then weighs its prior)."""
    meta, folder, where = _stored(checkpoint_dir_or_meta)
    data = meta.get(ACCEPTANCE_KEY)
    if data is None:
        return None
    acceptance = DraftAcceptance.from_dict(data, where)
    _belongs(acceptance, ACCEPTANCE_KEY, where, folder, block_size, identity)
    return acceptance


def check_stored_records(folder: str | os.PathLike, metadata: Mapping[str, Any] | None) -> None:
    """Load and check a checkpoint folder's calibration and draft acceptance (``metadata``: its
    ``mars_config.json``; None: not a MARS checkpoint, nothing to check) without a model, so that a bad record is
    refused before one loads."""
    if not metadata or (metadata.get(CALIBRATION_KEY) is None and metadata.get(ACCEPTANCE_KEY) is None):
        return
    block = int(metadata["block_size"])
    load_calibration(folder, block)
    load_draft_acceptance(folder, block)
