"""What ``mars-bench calibrate`` fits a checkpoint's calibration and draft acceptance table from.

Each prompt is answered at threshold 1.0 (the model's own greedy text) and its masks scored against it by teacher
forcing, exactly as ``mars-bench reliability`` does (:func:`mars.bench.reliability.teacher_forced_masks`): the
masks of every step the greedy text could take, and whether each one's argmax is the greedy token.  Per mask depth
they are kept as :class:`mars.calibration.MaskScores` (the temperature fit's input) and as the rank of the greedy
token in each mask's distribution (the acceptance table's, :func:`mars.calibration.acceptance_table`).  The fit,
the ECE and the stored records are :mod:`mars.calibration`'s; the scores are collected here because they need the
decoder and the training layout, which sit above it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mars.bench.reliability import greedy_mask_module, step_columns, teacher_forced_masks
from mars.calibration import (
    ACCEPTANCE_RANKS,
    Calibration,
    DraftAcceptance,
    MaskScores,
    acceptance_table,
    checkpoint_identity,
    fit_calibration,
)
from mars.models import load_model


def depth_scores(module, texts: list[list[int]], prompt_lengths: list[int], batch_size: int):
    """One :class:`~mars.calibration.MaskScores` per mask depth ``1 .. B-1``: every decoding step of the texts,
    each mask reduced to its log top-probabilities on the temperature grid (a batch's logits at a time); and the
    greedy token's rank per step and depth (:func:`greedy_ranks`)."""
    masks = module.block_size - 1
    parts: list[list[MaskScores]] = [[] for _ in range(masks)]
    ranks = []
    for _, logp, layout, is_mask in teacher_forced_masks(module, texts, prompt_lengths, batch_size):
        right = logp.argmax(-1) == layout.targets
        _, rows, cols, valid = step_columns(is_mask, layout, masks)
        for d in range(masks):
            r, c = rows[valid[:, d], d], cols[valid[:, d], d]
            parts[d].append(MaskScores.from_logits(logp[r, c], right[r, c]))
        ranks.append(greedy_ranks(logp, layout.targets, rows, cols, valid))
    return [MaskScores.concat(p) for p in parts], torch.cat(ranks).numpy()


def greedy_ranks(logp, targets, rows, cols, valid, width: int = ACCEPTANCE_RANKS) -> torch.Tensor:
    """Per step and mask depth ``[steps, depths]``: the rank of the greedy token in the mask's distribution, capped
    at ``width`` (beyond any tree's candidates), -1 where the step has no mask of that depth."""
    at = logp[rows, cols]  # [steps, depths, vocab]
    target = targets[rows, cols].clamp_min(0)
    own = at.gather(-1, target.unsqueeze(-1))
    rank = (at > own).sum(-1).clamp_max(width)
    return torch.where(valid, rank, -1)


@dataclass(frozen=True)
class CheckpointFit:
    """A checkpoint's fitted records and the masks per depth each half of the prompts gave them."""

    calibration: Calibration
    acceptance: DraftAcceptance
    fit_masks: list[int]
    held_masks: list[int]


def fit_checkpoint(
    checkpoint: str,
    block_size: int,
    fit_prompts: list[str],
    held_prompts: list[str],
    *,
    max_new_tokens: int,
    batch_size: int,
) -> CheckpointFit:
    """Load ``checkpoint`` (fp32, without its stored calibration: that may be the stale one a new fit replaces),
    answer both halves greedily, fit the temperatures on ``fit_prompts`` and measure their ECE on
    ``held_prompts``, and measure the draft acceptance table on both."""
    identity = checkpoint_identity(checkpoint)
    loaded = load_model(checkpoint, dtype="float32", calibration=False)
    prompts = fit_prompts + held_prompts
    module, texts, lengths = greedy_mask_module(loaded, block_size, prompts, max_new_tokens, batch_size)
    n = len(fit_prompts)
    fit, fit_ranks = depth_scores(module, texts[:n], lengths[:n], batch_size)
    held, held_ranks = depth_scores(module, texts[n:], lengths[n:], batch_size)
    acceptance = DraftAcceptance(
        conditional=acceptance_table(np.concatenate([fit_ranks, held_ranks])),
        block_size=block_size,
        checkpoint=identity,
        prompts=len(prompts),
    )
    calibration = fit_calibration(
        fit, held, block_size=block_size, checkpoint=identity, fit_prompts=n, eval_prompts=len(held_prompts)
    )
    return CheckpointFit(calibration, acceptance, [len(s.correct) for s in fit], [len(s.correct) for s in held])
