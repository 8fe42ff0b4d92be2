"""The seam between the engine and a way of checking drafts.

Each step the engine asks every verifier of :data:`mars.decoding.verifiers.VERIFIERS`, in order: how the rows it
verifies feed (:meth:`Verifier.plan`), their inputs after the last real token and their attention
(:meth:`Verifier.inputs`, :meth:`Verifier.geometry`), what they accept (:meth:`Verifier.verify`: each verifier
changes the verdict only for its own rows), and what they keep for the next step (:meth:`Verifier.kv_moves`,
:meth:`Verifier.keep`).  A verifier that only checks drafts implements :meth:`Verifier.verify`; the rest have
defaults that leave a step as the chain of drafts lays it out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..rows import Request
from ..step import Acceptance, KVMoves, StepContext, StepPlan, StepScores, Verdict


class Verifier:
    """A way of checking drafts; see the module docstring."""

    name = "verifier"

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def for_group(self, ctx: StepContext) -> Verifier:
        """The same verifier for a group of joining rows prefilled in a batch of their own (``ctx``: theirs)."""
        return type(self)(ctx)

    def adopt(self, group: Verifier) -> None:
        """A prefilled group's verifier (:meth:`for_group`) joins this one with its rows."""

    def admit(self, requests: Sequence[Request]) -> None:
        """Requests joined the rows (before the rows' tensors grow to them)."""

    def plan(self, plan: StepPlan, budget: np.ndarray) -> StepPlan:
        """The step's plan with this verifier's rows laid out as it feeds them (``budget``: tokens each row may
        still append)."""
        return plan

    def inputs(self, plan: StepPlan, after: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
        """The input ids after each row's last real token (``after``: the column index counted from there;
        ``proposals``: the chain's drafts then masks or guesses), this verifier's rows replaced."""
        return proposals

    def geometry(
        self, plan: StepPlan, positions: torch.Tensor, kv_length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE positions and the attention mask ``[rows, columns, kv_length]`` of a step whose columns are not
        causal at their slots (``positions``), or None: the causal step."""
        return None

    def verify(self, plan: StepPlan, scores: StepScores, verdict: Verdict) -> Verdict:
        """The verdict with this verifier's rows decided: the tokens they append, how many, their drafts passed."""
        raise NotImplementedError

    def kv_moves(self, plan: StepPlan, accepted: Acceptance) -> KVMoves | None:
        """Keys and values that the accepted drafts leave out of place (read before the commit moves the
        cursors), or None."""
        return None

    def keep(self, plan: StepPlan, accepted: Acceptance) -> None:
        """What this verifier's rows keep for the next step, after the next drafts are written."""

    def proposed(self, plan: StepPlan, proposed: np.ndarray) -> None:
        """Drafts proposed per row and draft position (``[rows, max_drafts]``, the chain's counted), this verifier's
        rows counted as it proposes them."""
