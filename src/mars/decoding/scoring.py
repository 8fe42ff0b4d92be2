"""From a step's logits to what the accept phase reads: the token chosen at each prediction column (the argmax, or
a Gumbel-max draw for sampling rows), the log-probabilities where a row reads one, and the confidence the threshold
reads (for a calibrated checkpoint, with each mask depth's temperature: :mod:`mars.calibration`)."""

from __future__ import annotations

import torch

from .acceptance import confidence, gumbel_noise, top_tokens
from .step import StepContext, StepPlan, StepScores


def seeds_drafts(ctx: StepContext, plan: StepPlan) -> bool:
    """Whether this step's predictions become next drafts: a row fed masks, verifying rows fall back to Jacobi
    guesses after a rejected draft, or rows sample their drafts (whose distributions are kept)."""
    jacobi = ctx.settings.fallback == "jacobi" and plan.verifying.any()
    return bool(plan.draft_masks.any() or jacobi or ctx.rows.tensors.draft_log_q is not None)


class StepScorer:
    """See the module docstring."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.mask_temperatures = self._mask_temperatures()

    def _mask_temperatures(self) -> torch.Tensor | None:
        """The checkpoint's calibration (``model.mars_calibration``, :mod:`mars.calibration`) as one divisor per
        mask depth (index 0, the exact AR column: 1.0), or None for an uncalibrated checkpoint."""
        calibration = getattr(self.ctx.runner.model, "mars_calibration", None)
        if calibration is None:
            return None
        divisors = calibration.mask_temperatures(max(self.ctx.window, 2))
        return torch.tensor(divisors, dtype=torch.float32, device=self.ctx.device)

    def scores(self, plan: StepPlan, logits: torch.Tensor) -> StepScores:
        """The tokens chosen, log-probabilities and top probabilities of the step (:meth:`choose`), with the
        confidence its threshold reads where a row reads one and every row's remaining budget."""
        rows, metric = self.ctx.rows.tensors, self.ctx.settings.metric
        logp, predicted, top = self.choose(plan, logits)
        score = None
        if logp is not None and not self.ctx.guess_slots:
            score = confidence(self._calibrated(plan, logits, logp), predicted, metric)
        return StepScores(logits, logp, predicted, top, score, rows.end - rows.length)

    def choose(
        self, plan: StepPlan, logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Log-probabilities at every prediction column (None when no row reads one), the token chosen
        there (the argmax of the logits, or a Gumbel-max draw for sampling rows, each from its own
        generator, only its own columns) and, on a greedy step whose masks the draft threshold reads, the
        argmax's probability from the logits at the columns after the first (no log-softmax; None otherwise).
        ``logits`` come back with the never-emitted tokens at -inf."""
        ctx, reads = self.ctx, self.reads_probabilities()
        # the draft threshold reads the top probability at the columns after the AR one (after the drafts)
        drafting = seeds_drafts(ctx, plan) or plan.tree_rows.any()
        top_from = 1 if not reads and ctx.settings.draft_threshold > 0 and drafting else None
        predicted, top = top_tokens(logits, ctx.never, top_from, ctx.fused_choice)
        if not reads:
            return None, predicted, top
        logp, sampled = ctx.log_probs(logits, ctx.rows.tensors.temperature)
        if sampled is not None:
            noise = gumbel_noise(logp, ctx.rows.row_generators(), plan.predictions)
            predicted = torch.where(sampled.unsqueeze(1), torch.argmax(logp + noise, dim=-1), predicted)
        return logp, predicted, None

    def _calibrated(self, plan: StepPlan, logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """The log-probabilities the threshold reads: ``logp``, or for a calibrated checkpoint those of the logits
        with each mask column divided by its depth's temperature (the depth counted after a row's drafts), so that
        a confidence is the chance that the mask's token is the model's own greedy choice.  The tokens chosen are
        the same (a temperature keeps the argmax); only the confidence moves."""
        if self.mask_temperatures is None:
            return logp
        divisors = self.mask_temperatures
        columns = torch.arange(logits.shape[1], device=self.ctx.device).unsqueeze(0)
        depth = (columns - plan.on_device.drafts.unsqueeze(1)).clamp(0, len(divisors) - 1)
        scaled = logits / divisors[depth].unsqueeze(-1)
        return self.ctx.log_probs(scaled, self.ctx.rows.tensors.temperature)[0]

    def reads_probabilities(self) -> bool:
        """Whether a row reads a probability this step: a threshold below 1.0 (its confidence), sampling,
        typical acceptance or a draft distribution.  Greedy rows at an exact threshold read only the argmax
        (AR, lossless verify; the draft threshold takes the drafting columns' top probability from their
        logits), and Jacobi rows only theirs: the step skips the log-softmax over the vocabulary."""
        ctx, rows = self.ctx, self.ctx.rows
        if rows.sampling or ctx.settings.typical_epsilon > 0 or rows.tensors.draft_log_q is not None:
            return True
        return not (ctx.guess_slots or ctx.exact_rows().all())
