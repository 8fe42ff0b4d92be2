"""The plan phase of a step: what every row feeds (its uncommitted real tokens, its drafts, its masks or Jacobi
guesses), decided on the host before the forward.  A verifying row feeds ``[real | drafts | masks]`` (``W-1``
masks, or ``verify_masks``; none after the drafts unless the row chains, ``chain_drafts``); a verifier may lay out
its own rows (a tree); under ``max_step_columns`` the masks give way first.

Cache strategies (all compute the same thing with the default window, up to float rounding):

- ``none``: every step feeds a row's whole text plus its masks (the paper's sliding window).
- ``cursor``: each row keeps its own committed length in a :class:`RaggedKVCache`; a step feeds only
  the row's real tokens that are not cached yet (the prompt on its first step) plus its masks; the
  real tokens are committed, the masks forgotten.  Rows never wait for each other, finished rows
  leave at once and new rows can join at any step (continuous batching).
- ``block``: the paper's block-level cache.  The committed prefix only grows at block boundaries:
  each step re-feeds all of a row's tokens since its block start; a row that has accepted at least
  ``cache_block`` tokens in the block waits until every row has, then the next forward commits the
  blocks.  Acceptance is never cut at the block end, so the output equals ``none``/``cursor``.  With
  ``window="cache_block"`` the masks instead fill the rest of the cache block (the paper's sampler;
  acceptance stops at the block end), which changes outputs.  Rows join only before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .drafts import DraftSource
from .settings import LEAN_VERIFY_MASKS
from .step import StepContext, StepPlan
from .verifiers import Verifier


def masks_within(masks: np.ndarray, room: int) -> np.ndarray:
    """Each row's masks cut to a common ceiling, the highest at which they fit in ``room`` columns in all (none
    when the rows' other columns already fill the room): the rows with the most masks give up theirs first."""
    for ceiling in range(int(masks.max(initial=0)), 0, -1):
        kept = np.minimum(masks, ceiling)
        if kept.sum() <= room:
            return kept
    return np.zeros_like(masks)


class StepPlanner:
    """See the module docstring; ``drafter`` tops up the verifying rows' drafts before each plan."""

    def __init__(self, ctx: StepContext, drafter: DraftSource, verifiers: Sequence[Verifier]):
        self.ctx, self.drafter, self.verifiers = ctx, drafter, verifiers

    def plan(self, first: bool) -> StepPlan:
        """The plan of the next step (``first``: the engine's first step)."""
        s, host = self.ctx.settings, self.ctx.rows.host
        uncached = host.length - host.cached
        commit, waiting = self._block_schedule(uncached, first)
        budget = host.end - host.length
        predictions, waiting = self._mars_predictions(uncached, commit, budget, waiting)
        # Verifying rows: the AR column, their drafts (no more than can still be accepted), and masks
        # for the next drafts when tokens can follow this step's (after drafts only for chaining rows).
        verifying = host.verify & ~waiting
        drafts = draft_masks = np.zeros(len(uncached), dtype=np.int64)  # read only when a row verifies
        if verifying.any():
            room = np.minimum(self.ctx.max_drafts, budget - 1)
            self.ctx.rows.append_drafts(self.drafter.propose(self.ctx.rows, verifying, room))
            drafts = np.where(verifying, np.minimum(host.draft_count, budget - 1), 0)
            draft_masks = np.where(budget > drafts + 1, self._masks_fed(), 0)
            if drafts.any():
                draft_masks = np.where((drafts > 0) & ~self._chains(), 0, draft_masks)
            predictions = np.where(verifying, 1 + drafts + draft_masks, predictions)
        plan = StepPlan(uncached, predictions, drafts, draft_masks, waiting, verifying, commit, self.ctx.device)
        for verifier in self.verifiers:
            plan = verifier.plan(plan, budget)
        plan.predictions = np.where(waiting, 1, plan.predictions)
        if s.max_step_columns is not None:
            self._cap_columns(plan)
        return plan

    def _mars_predictions(
        self, uncached: np.ndarray, commit: bool, budget: np.ndarray, waiting: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Predictions each row reads before verification (the window; ``window="cache_block"``: the rest of the
        block, the rows whose block is full waiting), cut to what the row can accept this step."""
        s, host = self.ctx.settings, self.ctx.rows.host
        if self.ctx.fill_window:
            room = np.full(len(uncached), s.cache_block) if commit else s.cache_block - uncached
            predictions = np.maximum(room, 1)
            waiting = waiting | (room <= 0)
        else:
            predictions = np.full(len(uncached), self.ctx.window)
        if not s.full_window:
            # A row capped at k tokens (threshold 1.0, max_accept, the end of its budget) needs only k
            # predictions; at threshold 1.0 no masks are appended and MARS costs what AR costs.
            predictions = np.minimum(predictions, np.maximum(np.minimum(host.cap, budget), 1))
        return predictions, waiting

    def _cap_columns(self, plan: StepPlan) -> None:
        """Under ``max_step_columns``: the masks (or guesses) cut to fit, the rows with the most giving up theirs
        first; a verifier's own layout (a tree) and a lossless sampling row's masks are kept whole."""
        # a lossless sampling row's masks are its next drafts, whose draws decide its samples: kept whole, so
        # that what it samples never depends on the load
        fixed = plan.tree_rows | (plan.verifying & self.ctx.rows.host_sampling & self.ctx.exact_rows())
        masks = np.where(fixed, 0, plan.predictions - 1 - plan.drafts)  # what a row can do without
        used = int((plan.uncached + np.where(fixed, plan.predictions - 1, plan.drafts)).sum())
        kept = masks_within(masks, self.ctx.settings.max_step_columns - used)
        plan.predictions = plan.predictions - (masks - kept)
        plan.draft_masks = np.where(fixed, plan.draft_masks, np.minimum(plan.draft_masks, kept))

    def _masks_fed(self) -> np.ndarray:
        """How many masks each verifying row feeds on a step (``verify_masks``; ``auto`` on a CPU trims the
        lossless rows to LEAN_VERIFY_MASKS, whatever their other drafts' source)."""
        s, full, rows = self.ctx.settings, self.ctx.window - 1, len(self.ctx.rows)
        if s.verify_masks == "all":
            return np.full(rows, full)
        if s.verify_masks != "auto":
            return np.full(rows, min(int(s.verify_masks), full))
        if self.ctx.device.type != "cpu":
            return np.full(rows, full)
        return np.where(self.ctx.exact_rows(), min(LEAN_VERIFY_MASKS, full), full)

    def _chains(self) -> np.ndarray:
        """Which rows' masks ride after their drafts (``chain_drafts``; ``auto`` on a CPU asks each row's
        threshold)."""
        mode = self.ctx.settings.chain_drafts
        if mode == "auto" and self.ctx.device.type == "cpu":
            return ~self.ctx.exact_rows()
        return np.full(len(self.ctx.rows), mode != "never")

    def _block_schedule(self, uncached: np.ndarray, first: bool) -> tuple[bool, np.ndarray]:
        """Whether this step's real tokens enter the KV cache, and which rows wait.  The block cache
        commits only when every row has filled its block; until then the rows that have wait."""
        s = self.ctx.settings
        commit = s.cache == "cursor" or (s.cache == "block" and first)
        waiting = np.zeros(len(uncached), dtype=bool)
        if s.cache == "block" and not first:
            full = uncached >= s.cache_block
            commit = bool(full.all())
            waiting = full & (not commit)
        return commit, waiting
