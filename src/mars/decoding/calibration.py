"""Temperature calibration of the mask confidences: one temperature per mask depth, fitted on held-out text.

A mask's confidence is the probability of its argmax (decoding's ``probability`` metric), and a threshold
accepts it on that alone, so a mask that says 0.9 should be right 90% of the time.  Temperature scaling (Guo
et al., arXiv 1706.04599) divides mask depth ``d``'s logits by ``T_d`` before the softmax: the argmax, and so
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

**Storage**: the checkpoint's ``mars_config.json`` (:mod:`mars.metadata`) under ``calibration``:
``{"temperatures": [T_1, ..., T_{B-1}], "block_size": B, "checkpoint": <identity>, "ece_before": [...],
"ece_after": [...], "fit_prompts": n, "eval_prompts": n}``, the identity being :func:`checkpoint_identity`
(a digest of the folder's weight files: a gated adapter's are its adapter weights), so a calibration copied
beside other weights is refused, as is a temperature outside the fit's range ``[1/8, 8]``.  Beside it, in the
same atomic write, ``draft_acceptance`` (:class:`~mars.calibration_store.DraftAcceptance`: ``tree=auto``'s table,
with the same block size and identity).  ``mars-bench calibrate`` fits and stores both;
:func:`mars.models.load_model` attaches them as ``model.mars_calibration`` and ``model.mars_draft_acceptance``
(None when absent).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mars.calibration_store import (  # noqa: F401  (the stored records, re-exported beside their fitting)
    CALIBRATION_KEY,
    TEMPERATURE_DOUBLINGS,
    TEMPERATURE_RANGE,
    Calibration,
    DraftAcceptance,
    check_can_store,
    check_stored_records,
    checkpoint_identity,
    load_calibration,
    load_draft_acceptance,
    store_calibration,
)

log = logging.getLogger(__name__)

ECE_BINS = 15
# grid points per doubling of T: between two of them a mask's log top-probability is close to linear in log T
GRID_PER_DOUBLING = 8
GRID_DOUBLINGS = TEMPERATURE_DOUBLINGS  # the grid spans T = 2**-3 .. 2**3, the range a stored one must lie in
FINE_POINTS = 129  # points of the fine search inside the coarse minimum's bracket


def temperature_grid() -> torch.Tensor:
    """The fitting grid: ``2 ** (k / 8)`` for ``k = -24..24`` (float64; its middle point is exactly 1.0)."""
    half = GRID_PER_DOUBLING * GRID_DOUBLINGS
    return torch.exp2(torch.arange(-half, half + 1, dtype=torch.float64) / GRID_PER_DOUBLING)


def _log_grid() -> torch.Tensor:
    return temperature_grid().log()


# ------------------------------------------------------------------------------------------------
# Scores and the fit
# ------------------------------------------------------------------------------------------------
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
