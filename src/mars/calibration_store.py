"""A checkpoint's stored mask calibration: the record (one temperature per mask depth, how it was fitted), what
checkpoint it belongs to, and its storage in and loading from ``mars_config.json``.

Fitting lives with decoding (:mod:`mars.decoding.calibration`, ``mars-bench calibrate``); loading sits on the
ground floor because :func:`mars.models.load_model` attaches a checkpoint's calibration as
``model.mars_calibration`` when it loads the model, and the decoding engine reads it there.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CALIBRATION_KEY = "calibration"


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
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 2:
            raise ValueError(f"calibration: block_size must be an integer >= 2 (one mask at least), got {b!r}")
        temps = tuple(self.temperatures)
        ok = all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf for t in temps)
        if len(temps) != b - 1 or not ok:
            raise ValueError(f"calibration: temperatures must be {b - 1} numbers > 0 (one per mask), got {temps!r}")
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(f"calibration: checkpoint must name the checkpoint it belongs to, got {self.checkpoint!r}")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))
        object.__setattr__(self, "ece_before", tuple(self.ece_before))
        object.__setattr__(self, "ece_after", tuple(self.ece_after))

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
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: 'calibration' must be an object, got {data!r:.80}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown calibration field(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None


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


def store_calibration(folder: str | os.PathLike, calibration: Calibration) -> Path:
    """Write ``calibration`` into the checkpoint's ``mars_config.json`` (atomically; the other fields unchanged)."""
    from mars.metadata import read_metadata, write_metadata

    meta = read_metadata(folder)
    if meta is None:
        raise ValueError(f"{folder} has no mars_config.json: not a MARS checkpoint")
    if meta.block_size != calibration.block_size:
        raise ValueError(
            f"the calibration belongs to block size {calibration.block_size}; {folder} has block size {meta.block_size}"
        )
    meta.calibration = calibration.to_dict()
    return write_metadata(folder, meta)


_SAID_UNCALIBRATED: set[str] = set()


def load_calibration(
    checkpoint_dir_or_meta: str | os.PathLike | Mapping[str, Any], block_size: int, *, identity: str | None = None
) -> Calibration | None:
    """The calibration stored in a checkpoint folder's ``mars_config.json`` (or in that file's content as a
    mapping, with the folder's ``identity`` from :func:`checkpoint_identity`), checked to belong to this
    checkpoint and ``block_size``: one fitted for another checkpoint or block size is refused, naming both.
    None where there is none (logged once per checkpoint: its masks decode uncalibrated)."""
    from mars.metadata import metadata_path, read_metadata

    if isinstance(checkpoint_dir_or_meta, Mapping):
        meta, folder, where = dict(checkpoint_dir_or_meta), None, "the checkpoint's mars_config.json"
    else:
        folder = Path(checkpoint_dir_or_meta)
        read = read_metadata(folder)
        meta, where = (read.to_dict() if read else {}), str(metadata_path(folder))
    data = meta.get(CALIBRATION_KEY)
    if data is None:
        if where not in _SAID_UNCALIBRATED:
            _SAID_UNCALIBRATED.add(where)
            log.info(
                "%s holds no mask calibration: the masks decode uncalibrated (mars-bench calibrate fits one)", where
            )
        return None
    calibration = Calibration.from_dict(data, where)
    refit = f"fit it again with `mars-bench calibrate --checkpoint {folder or '<checkpoint>'}`"
    if calibration.block_size != block_size:
        raise ValueError(
            f"{where}: the calibration belongs to block size {calibration.block_size}, this checkpoint decodes "
            f"with block size {block_size}; {refit}"
        )
    if identity is None:
        if folder is None:
            raise ValueError("load_calibration: a metadata mapping needs identity=checkpoint_identity(<its folder>)")
        identity = checkpoint_identity(folder)
    if calibration.checkpoint != identity:
        raise ValueError(
            f"{where}: the calibration belongs to checkpoint {calibration.checkpoint}, not to this one "
            f"({identity}); {refit}"
        )
    return calibration
