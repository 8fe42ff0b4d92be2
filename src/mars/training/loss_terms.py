"""The loss terms of :class:`mars.training.objectives.Objective`, scored on the hidden states of a training
forward: the noisy stream's mask loss (cross-entropy, or KL to a soft teacher, depth-weighted if configured), its
certainty and unlikelihood terms, the clean stream's AR cross-entropy and the KL to the frozen start, weighted
into the total; and :class:`NoisyLayout`, the noisy stream they score.  :class:`LossTerms` is a mixin of
:class:`mars.training.module.MarsModule`, which runs the forwards and hands their hidden states here, so the
objective's arithmetic reads apart from the two-stream plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100  # the target of a position without loss (cross-entropy's default ignore_index)


@dataclass
class NoisyLayout:
    """The noisy stream of a batch: its tokens, positions, targets and each row's block grid."""

    ids: torch.Tensor  # [n, W] noisy tokens (masks at masked response positions)
    positions: torch.Tensor  # [n, W] position ids (shared with the clean copy)
    targets: torch.Tensor  # [n, W] the token each noisy column predicts, IGNORE where no loss
    block_size: int | torch.Tensor  # one size, or [n] per row
    block_offset: torch.Tensor | None  # [n] grid shifts, or None

    def depth(self) -> torch.Tensor:
        """Each column's index inside its block (0 = the block's first mask, which predicts 2 tokens ahead)."""
        pos = self.positions + (self.block_offset[:, None] if self.block_offset is not None else 0)
        size = self.block_size[:, None] if isinstance(self.block_size, torch.Tensor) else self.block_size
        return pos % size


class LossTerms:
    """The objective's loss terms.  The module provides ``objective``, ``_logits`` (the vocabulary projection of
    hidden states, in float) and ``_reference`` (the frozen start model for ``kl_weight``, or empty)."""

    def _ce(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over positions with a target; logits only where needed."""
        sel = targets != IGNORE
        if not sel.any():
            return hidden.sum() * 0.0  # keeps the graph (and DDP) happy on a batch with no target
        return F.cross_entropy(self._logits(hidden[sel]), targets[sel])

    def mask_losses(
        self, hidden: torch.Tensor, layout: NoisyLayout, targets: torch.Tensor, soft: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The noisy stream's loss terms: cross-entropy to ``targets``, or with ``soft`` (the teacher's
        log-probabilities at the selected columns, ``clean_soft``) the KL divergence from it, depth-weighted if
        configured; certainty forcing and unlikelihood of wrong choices, judged against ``targets``."""
        sel = targets != IGNORE
        if not sel.any():
            zero = hidden.sum() * 0.0
            return {"loss_mask": zero}
        logits = self._logits(hidden[sel])
        labels = targets[sel]
        logq = torch.log_softmax(logits, dim=-1)
        label_logp = logq.gather(-1, labels[:, None]).squeeze(-1)
        # KL, not cross-entropy, to a soft target: zero where the mask already predicts the teacher's distribution
        per_mask = -label_logp if soft is None else F.kl_div(logq, soft, log_target=True, reduction="none").sum(-1)
        obj = self.objective
        out: dict[str, torch.Tensor] = {}
        if obj.depth_weighting == "none":
            out["loss_mask"] = per_mask.mean()
        else:
            weights = self._depth_weights(layout, sel, label_logp.detach())
            out["loss_mask"] = (weights * per_mask).sum() / weights.sum().clamp(min=1e-6)
        if obj.certainty_weight == 0 and obj.unlikelihood_weight == 0:
            return out
        chosen = logits.detach().argmax(-1)
        right = chosen == labels
        if obj.certainty_weight > 0:
            if right.any():
                logp = torch.log_softmax(logits[right], dim=-1)
                out["loss_certainty"] = -(logp.exp() * logp).sum(-1).mean()
            else:
                out["loss_certainty"] = logits.sum() * 0.0
        if obj.unlikelihood_weight > 0:
            if (~right).any():
                p_wrong = torch.softmax(logits[~right], dim=-1).gather(-1, chosen[~right, None]).squeeze(-1)
                out["loss_unlikelihood"] = -torch.log1p(-p_wrong.clamp(max=1 - 1e-6)).mean()
            else:
                out["loss_unlikelihood"] = logits.sum() * 0.0
        return out

    def _depth_weights(self, layout: NoisyLayout, sel: torch.Tensor, label_logp: torch.Tensor) -> torch.Tensor:
        """Per selected column: ``decay ** depth`` or the chance that decoding reaches it (the product of the
        probabilities the earlier masks of its block give their labels; detached)."""
        depth = layout.depth()
        if self.objective.depth_weighting == "decay":
            return self.objective.depth_decay ** depth[sel].float()
        # float32 whatever the default dtype (bf16-true precision makes it bf16): a product of many probabilities
        logp = torch.zeros(sel.shape, device=sel.device, dtype=torch.float32)
        logp[sel] = label_logp.float()
        reach = torch.zeros_like(logp)  # log of the chance to reach each column
        biggest = int(layout.block_size.max()) if isinstance(layout.block_size, torch.Tensor) else layout.block_size
        for k in range(1, biggest):
            prev = torch.nn.functional.pad((reach + logp)[:, :-1], (1, 0))
            reach = torch.where(depth == k, prev, reach)
        return reach[sel].exp()

    def _mask_targets(
        self, clean_hidden: torch.Tensor, layout: NoisyLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The noisy stream's targets ``[n, W]`` under ``objective.mask_targets``: the data's tokens, or the clean
        stream's greedy choice at each target's position; for ``clean_soft`` also the clean stream's
        log-probabilities there (``[selected, vocab]``, at ``soft_temperature``).  Computed without gradient: under
        full fine-tuning the clean stream is the model being trained, and the mask loss must not move the teacher
        towards its students."""
        kind = self.objective.mask_targets
        targets = layout.targets
        sel = targets != IGNORE
        if kind == "data" or not sel.any():
            return targets, None
        targets = targets.clone()
        rows = torch.arange(targets.shape[0], device=targets.device)[:, None].expand_as(targets)[sel]
        with torch.no_grad():
            logits = self._logits(clean_hidden[rows, layout.positions[sel]])
            targets[sel] = logits.argmax(-1)
            if kind != "clean_soft":
                return targets, None
            return targets, torch.log_softmax(logits / self.objective.soft_temperature, dim=-1)

    def _kl_to_reference(self, ids, pos, clean_hidden, ar_targets) -> torch.Tensor:
        sel = ar_targets != IGNORE
        if not sel.any():
            return clean_hidden.sum() * 0.0
        reference = self._reference[0].to(clean_hidden.device)
        with torch.no_grad():
            ref_hidden = getattr(reference, reference.base_model_prefix)(
                input_ids=ids, position_ids=pos
            ).last_hidden_state
            ref_logp = torch.log_softmax(reference.get_output_embeddings()(ref_hidden[sel]).float(), -1)
        logp = torch.log_softmax(self._logits(clean_hidden[sel]), -1)
        return F.kl_div(logp, ref_logp, log_target=True, reduction="batchmean")

    def _total(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``out`` with ``loss``, the sum of its terms each weighted by the objective."""
        obj = self.objective
        weights = {
            "loss_mask": obj.mask_weight,
            "loss_ar": obj.alpha,
            "loss_certainty": obj.certainty_weight,
            "loss_unlikelihood": obj.unlikelihood_weight,
            "loss_kl": obj.kl_weight,
        }
        out["loss"] = sum(weights[k] * v for k, v in out.items())
        return out
