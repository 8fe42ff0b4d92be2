"""Verification of a chain of drafts: each verifying row fed ``[real | drafts | masks]``; its leading drafts that
the target's own predictions of the same forward confirm pass (greedy: equal to the argmax before them, or typical
under it with ``typical_epsilon``; sampling rows: speculative sampling), then the target's token after them, so the
output is exactly the target's AR output.  Verified drafts were computed with the right prefix, so their keys and
values are committed too.  When every draft passed, the masks after them followed the right text and their
predictions are the next drafts; after a rejection the ``fallback`` decides (no drafts, or the unverified AR
predictions as Jacobi guesses).  Below threshold 1.0 a row whose drafts all passed also accepts the leading masks
after them that meet its threshold (the paper's speculative composition, Section 4.6, with the masks as drafts):
those tokens are unverified, like a plain MARS step's, and the masks after them become the next drafts."""

from __future__ import annotations

import torch

from mars.decoding.kernels import greedy_verify_op, op_or_none

from ..acceptance import leading_run, unverified_counts
from ..scoring import seeds_drafts
from ..step import NextDrafts, StepContext, StepPlan, StepScores, Verdict
from ..verify import leading_matches, speculative_accept, typical_drafts
from .base import Verifier


class ChainVerifier(Verifier):
    """See the module docstring; it verifies every verifying row no other verifier lays out
    (:meth:`~mars.decoding.step.StepPlan.chain_only`)."""

    name = "chain"

    def __init__(self, ctx: StepContext):
        super().__init__(ctx)
        self.draft_slots = torch.arange(ctx.max_drafts, device=ctx.device)  # a row's draft positions

    def verify(self, plan: StepPlan, scores: StepScores, verdict: Verdict) -> Verdict:
        chain = plan.chain_only()
        if not chain.verifying.any():
            return verdict
        tokens, count, verified, next_drafts = self.check(chain, scores, verdict.count)
        return Verdict(tokens, count, verified, next_drafts, verdict.kept)

    def check(self, plan: StepPlan, scores: StepScores, count: torch.Tensor):
        """Verifying rows accept their passing drafts plus the target's token after them, then (below threshold
        1.0) the masks that meet their threshold; the tokens, counts, drafts passed and next drafts of every row
        (the others keep ``count``)."""
        fused = self.greedy_check(plan, scores, count)
        if fused is not None:
            return fused
        fed = plan.on_device
        tokens, passed = self._check_drafts(plan, scores)
        # the masks followed the right text only when every draft passed
        if not plan.draft_masks.any():  # no row fed masks: none followed anything
            all_passed = torch.zeros_like(fed.verifying)
        elif not plan.drafts.any():  # no row fed drafts: all of none passed
            all_passed = fed.draft_masks > 0
        else:
            all_passed = (passed == fed.drafts) & (fed.draft_masks > 0)
        # below threshold 1.0 the masks that meet it are accepted unverified; lossless rows (the usual case) none
        lossless = not (plan.verifying & ~self.ctx.exact_rows()).any()
        from_masks = None if lossless else self._confident_masks(plan, scores.score, passed, all_passed)
        appended = passed + 1 if from_masks is None else passed + 1 + from_masks
        count = torch.where(fed.verifying, appended, count)
        next_drafts = self._next_drafts(plan, scores, appended, all_passed, from_masks)
        return tokens, count, passed.where(fed.verifying, 0), next_drafts

    def greedy_check(self, plan: StepPlan, scores: StepScores, count: torch.Tensor):
        """:meth:`check` in one kernel (``mars::greedy_verify``: the same results, one op for about 25) where every
        row is greedy at its exact threshold (the step read no probability: nothing sampled, typical or accepted
        unverified) and no row falls back to Jacobi guesses, under the fused choice; None otherwise."""
        s = self.ctx.settings
        fused = self.ctx.fused_choice and scores.logp is None and s.fallback != "jacobi"
        op = op_or_none(greedy_verify_op) if fused else None
        if op is None:
            return None
        rows, fed = self.ctx.rows.tensors, plan.on_device
        threshold = s.draft_threshold if scores.top is not None else 0.0  # (no top: no row fed masks to draft from)
        args = (rows.drafts, fed.drafts, fed.draft_masks, fed.verifying, rows.draft_count, count, threshold)
        count, verified, drafts, draft_count = op(scores.predicted, scores.top, *args)
        if not seeds_drafts(self.ctx, plan):  # no next drafts: the rows keep the tensor they had
            drafts = rows.drafts
        return scores.predicted, count, verified, NextDrafts(drafts, draft_count, None)

    def _confident_masks(self, plan: StepPlan, score, passed, all_passed) -> torch.Tensor:
        """Masks a verifying row accepts unverified: the leading ones after its drafts and their AR token
        that meet its threshold, when every draft passed; none at an exact threshold (1.0)."""
        rows, dev, fed = self.ctx.rows.tensors, self.ctx.device, plan.on_device
        columns = (fed.drafts.unsqueeze(1) + 1 + torch.arange(self.ctx.window - 1, device=dev)).clamp_max(
            score.shape[1] - 1
        )
        room = rows.end - rows.length - passed - 1
        metric = self.ctx.settings.metric
        return unverified_counts(score.gather(1, columns), rows.threshold, metric, fed.draft_masks, room, all_passed)

    def _check_drafts(self, plan: StepPlan, scores: StepScores):
        """How many leading drafts pass (greedy: equal to the target's argmax before them, or typical under it
        with ``typical_epsilon``; sampling: speculative sampling) and the tokens each row appends."""
        batch, epsilon = self.ctx.rows, self.ctx.settings.typical_epsilon
        rows, logp, predicted = batch.tensors, scores.logp, scores.predicted
        drafts_fed, verifying = plan.on_device.drafts, plan.on_device.verifying
        widest = int(plan.drafts.max())
        if widest == 0:  # no row fed drafts (a step that only fed masks)
            return predicted, torch.zeros_like(drafts_fed)
        drafts = rows.drafts[:, :widest]
        typical = typical_drafts(logp, drafts, epsilon) if epsilon > 0 else None
        passed = leading_matches(drafts, predicted, drafts_fed, typical)  # the greedy rows'
        sampling = rows.draft_log_q is not None and batch.sampling
        if not sampling and typical is None:
            return predicted, passed  # the passed drafts are the argmax: the predictions are the tokens
        token = predicted.gather(1, passed.unsqueeze(1)).squeeze(1)  # the target's token after them
        deciding = plan.verifying & (plan.drafts > 0) & batch.host_sampling
        if sampling and deciding.any():
            # only the sampling rows that fed drafts draw (each from its own generator): a row's random stream is
            # spent on its own decisions alone, so its samples never depend on its batch; a sampling row without
            # drafts keeps the token it drew at its AR column, as it would alone
            generators = [g if d else None for g, d in zip(batch.records.generators, deciding)]
            sampled_passed, sampled_token = speculative_accept(
                logp[:, : widest + 1], rows.draft_log_q[:, :widest], drafts, drafts_fed, generators
            )
            speculative = torch.from_numpy(deciding).to(self.ctx.device)
            passed = torch.where(speculative, sampled_passed, passed)
            token = torch.where(speculative, sampled_token, token)
        width = predicted.shape[1]
        columns = torch.arange(width, device=self.ctx.device).unsqueeze(0)
        drafted = torch.nn.functional.pad(rows.drafts, (0, max(0, width - self.ctx.max_drafts)))[:, :width]
        after = torch.where(columns == passed.unsqueeze(1), token.unsqueeze(1), predicted)  # then accepted masks
        appended = torch.where(columns < passed.unsqueeze(1), drafted, after)
        return torch.where(verifying.unsqueeze(1), appended, predicted), passed

    def _next_drafts(self, plan: StepPlan, scores: StepScores, first, all_passed, accepted_masks) -> NextDrafts:
        """The masks' predictions when every draft passed (they followed the right text; those after any the
        row accepted: ``accepted_masks``, None for none), else the fallback: none, or the target's unverified
        predictions after the rejected draft (Jacobi-style guesses).  ``first``: the first column read, which is
        the number of tokens the row appends this step (its passing drafts, the target's token, and the masks it
        accepted, which only a row whose drafts all passed accepts)."""
        s, rows, fed = self.ctx.settings, self.ctx.rows.tensors, plan.on_device
        if not seeds_drafts(self.ctx, plan):
            return NextDrafts(rows.drafts, rows.draft_count.masked_fill(fed.verifying, 0), None)
        predicted = scores.predicted
        read = (first.unsqueeze(1) + self.draft_slots).clamp_max(predicted.shape[1] - 1)
        tokens = predicted.gather(1, read)
        from_masks = fed.draft_masks.clamp_max(self.ctx.max_drafts)  # the masks this step fed, after those accepted
        if accepted_masks is not None:
            from_masks = (from_masks - accepted_masks).clamp_min(0)
        count = from_masks.where(all_passed, 0)
        if s.fallback == "jacobi":
            # the guesses after the rejected draft: the drafts fed beyond it (passed = first - 1 there)
            count = torch.where(all_passed, count, torch.clamp(fed.drafts + 1 - first, max=self.ctx.max_drafts))
        if s.draft_threshold > 0:  # the leading drafts whose column is sure enough of its token
            count = torch.minimum(leading_run(self._draft_confidence(scores, read) >= s.draft_threshold), count)
        log_q = None
        if rows.draft_log_q is not None:
            log_q = scores.logp.gather(1, read.unsqueeze(-1).expand(-1, -1, scores.logp.shape[-1]))
        return NextDrafts(tokens, torch.where(fed.verifying, count, rows.draft_count), log_q)

    def _draft_confidence(self, scores: StepScores, read: torch.Tensor) -> torch.Tensor:
        """The top probability at the columns ``read`` (the argmax's; a sampling row's top token's): from the
        log-probabilities where the step has them, else as the scorer took it from the logits."""
        if scores.logp is None:
            return scores.top.gather(1, read)
        if self.ctx.rows.sampling:
            top_logp = scores.logp.max(dim=-1).values
        else:
            top_logp = scores.logp.gather(2, scores.predicted.unsqueeze(-1)).squeeze(-1)
        return top_logp.gather(1, read).exp()
