"""Jacobi iteration (``decoder="jacobi"``): the ``W-1`` columns after the last real token carry guesses instead of
masks; a row accepts the AR token plus every guess that matches the prediction made from the exact prefix before
it (greedy AR output, fewer forwards when guesses converge); the predictions after what it accepted are its next
guesses."""

from __future__ import annotations

import torch

from .rows import RowBatch
from .verify import leading_matches


def guess_inputs(rows: RowBatch, offset: torch.Tensor) -> torch.Tensor:
    """The guess ``offset`` places after each row's last real token (or draft)."""
    return rows.tensors.guesses.gather(1, offset.clamp(0, rows.guess_slots - 1))


def jacobi_counts(rows: RowBatch, predicted: torch.Tensor, width: int, cap_now: torch.Tensor) -> torch.Tensor:
    """Tokens each row accepts: the AR token, then every guess its prediction confirms, at most ``cap_now``
    (``width``: the step's prediction columns)."""
    compared = min(width - 1, rows.guess_slots)
    guesses = rows.tensors.guesses[:, :compared]
    run = 1 + leading_matches(guesses, predicted[:, :compared], torch.full_like(cap_now, compared))
    return torch.minimum(run, cap_now)


def keep_guesses(rows: RowBatch, predicted: torch.Tensor, count: torch.Tensor, width: int) -> None:
    """The next guesses: the predictions after the tokens each row accepted."""
    if width > 1:
        read = (count.unsqueeze(1) + torch.arange(rows.guess_slots, device=rows.device)).clamp_max(width - 1)
        rows.tensors.guesses = predicted.gather(1, read)
