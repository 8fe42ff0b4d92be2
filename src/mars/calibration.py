"""A checkpoint's mask calibration and draft acceptance table: the stored records, their fit, the expected
calibration error, and their storage in ``mars_config.json``.  ``mars-bench calibrate`` fits and stores both.

**Calibration.**  A mask's confidence is the probability of its argmax (decoding's ``probability`` metric), and a
threshold accepts it on that alone, so a mask that says 0.9 should be right 90% of the time.  Temperature scaling
(Guo et al., arXiv 1706.04599) divides mask depth ``d``'s logits by ``T_d`` before the softmax: the argmax, and so
every token a decoder picks, is unchanged; ``T_d > 1`` lowers an overconfident depth's confidence, ``T_d < 1``
raises an underconfident one's.  Column 0 of a decoding window is the exact AR prediction and is never scaled
(:meth:`Calibration.mask_temperatures`).

**Fitting** (:func:`fit_temperature`) minimises, per depth, the binary log-loss of the top probability of
``softmax(logits / T)`` against whether the argmax is right (equals the model's own greedy token), for ``T``
in ``[1/8, 8]``.  A mask's logits span the vocabulary, so a held-out set's do not fit in memory at once: each
mask is reduced, batch by batch, to its exact log top-probability at a fixed log-spaced grid of temperatures
(:func:`top_log_probs`, 8 per doubling); the loss is minimised over that grid, then on a fine grid inside the
bracket around the coarse minimum, each mask's log-probability interpolated linearly in ``log T``.

**Expected calibration error** (:func:`expected_calibration_error`), defined once here: the confidences in
``[0, 1]`` fall into 15 equal-width bins ``[k/15, (k+1)/15)`` (the last one closed), and
``ECE = sum over bins of (n_bin / n) * |accuracy_bin - mean confidence_bin|``, accuracy being the share of the
bin's masks whose argmax is right.  0 is perfectly calibrated.

**The draft acceptance table** (:class:`DraftAcceptance`, measured by :func:`acceptance_table`): ``tree=auto``'s
chance that mask depth ``d``'s greedy token is among its top ``k`` candidates given that every earlier depth's
was, from the same teacher-forced steps as the calibration (:mod:`mars.decoding.tree_choice` weighs it against
the cost of a step's columns).

**Storage**: the checkpoint's ``mars_config.json`` (:mod:`mars.metadata`) under ``calibration``:
``{"temperatures": [T_1, ..., T_{B-1}], "block_size": B, "checkpoint": <identity>, "ece_before": [...],
"ece_after": [...], "fit_prompts": n, "eval_prompts": n}``, the identity being :func:`checkpoint_identity`
(a digest of the folder's weight files: a gated adapter's are its adapter weights), so a calibration copied
beside other weights is refused, as is a temperature outside the fit's range ``[1/8, 8]``.  Beside it, in the
same atomic write, ``draft_acceptance`` (with the same block size and identity).  Loading validates both field
by field.

This module sits below the model loader: :func:`mars.models.load_model` attaches both records when it loads the
model (``model.mars_calibration``, ``model.mars_draft_acceptance``; None when absent), the decoding engine reads
them there, and the server and the entry points check them before any model loads (:func:`check_stored_records`).
The scores a fit starts from need the decoder and the training layout, above it: ``mars-bench calibrate``
collects them (:mod:`mars.bench.mask_scores`).
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

import numpy as np
import torch

from mars.metadata import metadata_path, read_metadata, write_metadata
from mars.persistence import WEIGHT_SUFFIXES, file_sha256

log = logging.getLogger(__name__)

CALIBRATION_KEY = "calibration"
ACCEPTANCE_KEY = "draft_acceptance"
# the temperatures a fit can give (the grid spans 2**-3 .. 2**3): a stored one outside is no fit's (1e-3 accepts
# every mask, 1e39 overflows float32), refused at load
TEMPERATURE_DOUBLINGS = 3
TEMPERATURE_RANGE = (2.0**-TEMPERATURE_DOUBLINGS, 2.0**TEMPERATURE_DOUBLINGS)
_RANGE_SLACK = 1e-6  # relative: a fit at the bound read back through float32 and exp
ECE_BINS = 15
# grid points per doubling of T: between two of them a mask's log top-probability is close to linear in log T
GRID_PER_DOUBLING = 8
FINE_POINTS = 129  # points of the fine search inside the coarse minimum's bracket
# ranks measured per depth in the draft acceptance table: as many candidates as a tree=auto shape takes at a depth
ACCEPTANCE_RANKS = 4


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
# The fit: scores of the masks on a temperature grid, one temperature per depth, the ECE
# ------------------------------------------------------------------------------------------------
def temperature_grid() -> torch.Tensor:
    """The fitting grid: ``2 ** (k / 8)`` for ``k = -24..24`` (float64; its middle point is exactly 1.0)."""
    half = GRID_PER_DOUBLING * TEMPERATURE_DOUBLINGS
    return torch.exp2(torch.arange(-half, half + 1, dtype=torch.float64) / GRID_PER_DOUBLING)


def _log_grid() -> torch.Tensor:
    return temperature_grid().log()


def top_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[..., vocab]`` logits -> ``[..., grid]``: the log probability of the argmax under ``softmax(logits / T)``
    for each grid temperature, ``-logsumexp((logits - max) / T)`` (a suppressed token at -inf counts for 0)."""
    gaps = logits.float() - logits.float().amax(-1, keepdim=True)
    columns = [-torch.logsumexp(gaps / t, dim=-1) for t in temperature_grid().tolist()]
    return torch.stack(columns, dim=-1).double()


def _interpolate(log_top: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """Each mask's log top-probability ``[masks, grid]`` at the temperatures ``exp(log_t)`` ``[k]`` -> ``[masks, k]``,
    linear in ``log T`` between grid points (clamped to the grid)."""
    grid = _log_grid()
    step = float(grid[1] - grid[0])
    pos = ((log_t.double() - grid[0]) / step).clamp(0, len(grid) - 1)
    lower = pos.floor().long().clamp(max=len(grid) - 2)
    weight = pos - lower
    return log_top[:, lower] * (1 - weight) + log_top[:, lower + 1] * weight


def binary_log_loss(log_top: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Mean binary log-loss of the top probabilities ``exp(log_top)`` ``[masks, k]`` against ``correct`` ``[masks]``
    (one value per column ``k``); probabilities are kept 1e-12 inside (0, 1) so one certain mistake stays finite."""
    p = log_top.exp().clamp(1e-12, 1 - 1e-12)
    right = correct.double()[:, None]
    return -(right * p.log() + (1 - right) * torch.log1p(-p)).mean(0)


def fit_temperature(log_top: torch.Tensor, correct: torch.Tensor) -> float:
    """The ``T`` in ``[1/8, 8]`` that minimises :func:`binary_log_loss` for one depth's masks (``log_top`` from
    :func:`top_log_probs`); 1.0 without masks."""
    if log_top.shape[0] == 0:
        return 1.0
    grid = _log_grid()
    k = int(binary_log_loss(log_top, correct).argmin())
    fine = torch.linspace(float(grid[max(k - 1, 0)]), float(grid[min(k + 1, len(grid) - 1)]), FINE_POINTS)
    best = int(binary_log_loss(_interpolate(log_top, fine), correct).argmin())
    low, high = TEMPERATURE_RANGE  # float32 rounding of log T must not step past the bounds
    return min(max(float(fine[best].double().exp()), low), high)


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, bins: int = ECE_BINS) -> float | None:
    """ECE over ``bins`` equal-width confidence bins (module docstring); None without masks."""
    n = confidence.numel()
    if n == 0:
        return None
    confidence = confidence.double().flatten()
    index = (confidence * bins).long().clamp(0, bins - 1)
    stated = torch.bincount(index, weights=confidence, minlength=bins)
    right = torch.bincount(index, weights=correct.double().flatten(), minlength=bins)
    return float((stated - right).abs().sum() / n)


@dataclass(frozen=True)
class MaskScores:
    """One mask depth's masks: their log top-probabilities on the temperature grid and whether each is right."""

    log_top: torch.Tensor  # [masks, grid]
    correct: torch.Tensor  # [masks] bool: the argmax equals the model's own greedy token

    @classmethod
    def from_logits(cls, logits: torch.Tensor, correct: torch.Tensor) -> MaskScores:
        return cls(top_log_probs(logits), correct.bool())

    @classmethod
    def concat(cls, parts: Sequence[MaskScores]) -> MaskScores:
        if not parts:
            return cls(torch.zeros(0, len(temperature_grid()), dtype=torch.float64), torch.zeros(0, dtype=torch.bool))
        return cls(torch.cat([p.log_top for p in parts]), torch.cat([p.correct for p in parts]))

    def confidence(self, temperature: float = 1.0) -> torch.Tensor:
        """Each mask's top probability at ``temperature``."""
        return _interpolate(self.log_top, torch.tensor([math.log(temperature)]))[:, 0].exp()


def fit_calibration(
    fit: Sequence[MaskScores],
    held_out: Sequence[MaskScores],
    *,
    block_size: int,
    checkpoint: str,
    fit_prompts: int,
    eval_prompts: int,
) -> Calibration:
    """One temperature per mask depth from ``fit`` (depth 1 first), and each depth's ECE on ``held_out`` at
    ``T = 1`` and at its fitted temperature."""
    if len(fit) != block_size - 1 or len(held_out) != block_size - 1:
        raise ValueError(
            f"block size {block_size}: expected {block_size - 1} depths of scores, got {len(fit)}, {len(held_out)}"
        )
    temps = [fit_temperature(s.log_top, s.correct) for s in fit]
    bounds = temperature_grid()[[0, -1]].tolist()
    for depth, t in enumerate(temps, start=1):
        if min(abs(t - b) / b for b in bounds) < 1e-6:
            log.warning("mask depth %d: the fitted temperature %.3g is at the bound of the search range", depth, t)
    return Calibration(
        temperatures=tuple(temps),
        block_size=block_size,
        checkpoint=checkpoint,
        ece_before=tuple(expected_calibration_error(s.confidence(1.0), s.correct) for s in held_out),
        ece_after=tuple(expected_calibration_error(s.confidence(t), s.correct) for s, t in zip(held_out, temps)),
        fit_prompts=fit_prompts,
        eval_prompts=eval_prompts,
    )


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
    candidates given that every earlier depth's was (:func:`acceptance_table`), one row per mask depth
    (``block_size - 1``), every row as wide (the candidates measured); measured on ``prompts`` prompts of the
    ``checkpoint`` (its identity, as the calibration's) by ``measured``."""

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


def acceptance_table(ranks: np.ndarray, width: int = ACCEPTANCE_RANKS) -> list[list[float]]:
    """The draft acceptance table ``a_d(k)`` from teacher-forced steps: ``ranks`` ``[steps, depths]``, the rank of
    the model's greedy token in each mask's distribution (0: its argmax; -1 where the step has no such mask).
    ``a_d(k)`` is the share of steps whose depth-d rank is below k among those whose earlier depths' ranks all are
    (the chance a tree with k candidates at every depth so far still holds the greedy path at depth d); 0 where no
    step qualifies."""
    table = []
    for depth in range(ranks.shape[1]):
        row = []
        for k in range(1, width + 1):
            inside = ranks[:, : depth + 1] >= 0
            held = ((ranks[:, :depth] < k) & inside[:, :depth]).all(axis=1) & inside[:, depth]
            hit = held & (ranks[:, depth] < k)
            row.append(round(float(hit.sum() / held.sum()), 4) if held.any() else 0.0)
        table.append(row)
    return table


def stored_acceptance_table(meta) -> list[list[float]] | None:
    """A checkpoint's measured acceptance per depth and rank (``draft_acceptance.conditional``), from its metadata or
    the stored ``draft_acceptance`` object itself; None without one.  A malformed table is refused
    (:func:`check_acceptance_rows`), never taken for a missing one."""
    table = meta.get(ACCEPTANCE_KEY, meta) if isinstance(meta, dict) else getattr(meta, ACCEPTANCE_KEY, None)
    if isinstance(table, dict):
        table = table.get("conditional")
    if table is None:
        return None
    return [list(row) for row in check_acceptance_rows(table)]


# ------------------------------------------------------------------------------------------------
# Storage and loading
# ------------------------------------------------------------------------------------------------
def checkpoint_identity(folder: str | os.PathLike) -> str:
    """What a calibration belongs to: a sha256 over the names and content digests of the folder's weight files
    (for a gated adapter, its adapter weights); the digests are cached by :func:`mars.persistence.file_sha256`."""
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
