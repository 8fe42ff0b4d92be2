"""Verification of a tree of drafts (:mod:`mars.decoding.tree`): greedy lossless rows feed, after their last real
token, a template of candidate tokens per depth (each depth's top tokens of the masks) and a group of masks after
each node; a column sees the committed text, the row's real tokens and its ancestors in the template.  The longest
path of candidates the target's own predictions confirm is accepted, its keys and values moved to follow the row's
text, and the mask group after it gives the next candidates.  The tree (``tree``: a shape, or ``auto`` chosen for
this model and device) is resolved when the first such row arrives; under ``max_step_columns`` a step takes the
largest of its smaller shapes that fits, down to a chain."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..rows import Request
from ..settings import tree_shape
from ..step import Acceptance, KVMoves, StepContext, StepPlan, StepScores, Verdict
from ..tree import TreeLayouts, columns_of, layouts_for, next_candidates
from ..tree_choice import acceptance_of, auto_shape, smaller_shapes
from .base import Verifier

AUTO_TREE_DEPTH = 3  # tree=auto looks no deeper: a fourth depth's candidates rarely pass

log = logging.getLogger(__name__)


@dataclass
class TreeStep:
    """What a tree step leaves for the commit: where its accepted paths sit and the next candidates."""

    rows: torch.Tensor  # [rows] bool: the rows that verified a tree
    path: torch.Tensor  # [rows, depth]: the accepted nodes' columns after the root, by depth
    candidates: torch.Tensor  # [rows, depth, width]
    depths: torch.Tensor  # [rows]: how many depths of candidates the next step drafts


class TreeVerifier(Verifier):
    """See the module docstring.  ``tree``: the layouts its rows draft (None: no tree, every row a chain)."""

    name = "tree"

    def __init__(self, ctx: StepContext):
        super().__init__(ctx)
        self.tree: TreeLayouts | None = None
        self.resolved = False  # tree=auto is resolved when the first greedy lossless verifying row arrives

    def for_group(self, ctx: StepContext) -> TreeVerifier:
        group = TreeVerifier(ctx)
        group.tree, group.resolved = self.tree, self.resolved
        return group

    def adopt(self, group: Verifier) -> None:
        assert isinstance(group, TreeVerifier)
        if group.tree is not None and self.tree is None:  # the group resolved it: one tree for the batch
            self.tree, self.resolved = group.tree, True
            self.ctx.rows.ensure_candidates(self.tree.depth, self.tree.width)

    def admit(self, requests: Sequence[Request]) -> None:
        if any(r.verify and r.temperature <= 0 and r.exact for r in requests):
            self._resolve()
        if self.tree is not None:
            self.ctx.rows.ensure_candidates(self.tree.depth, self.tree.width)

    def _resolve(self) -> None:
        """The tree of this engine's greedy lossless verifying rows: the shape ``tree`` names, or for ``auto`` the
        one :func:`mars.decoding.tree_choice.auto_shape` picks for this model and device among those a lone row's
        step fits in ``max_step_columns`` (None: chains), with the smaller shapes its steps shrink to under the cap
        (:func:`mars.decoding.tree_choice.smaller_shapes`)."""
        if self.resolved:
            return
        self.resolved = True
        s, ctx = self.ctx.settings, self.ctx
        shape = tree_shape(s.tree)
        room = None if s.max_step_columns is None else s.max_step_columns - 1  # a lone row's root takes one
        if shape is None:
            if s.tree == "chain" or not self._applies():
                return
            depth = min(ctx.max_drafts, AUTO_TREE_DEPTH)
            shape = auto_shape(ctx.runner, ctx.mask_id, depth, s.tree_masks, room)
            if shape is None:
                return
        elif len(shape) > ctx.max_drafts:
            raise ValueError(f"tree={s.tree!r} is {len(shape)} deep; this engine drafts at most {ctx.max_drafts}")
        elif room is not None and columns_of(shape, s.tree_masks) > room:
            log.info(
                "tree=%s takes %d columns per step, over max_step_columns=%d: its steps draft the largest smaller "
                "tree that fits",
                s.tree,
                1 + columns_of(shape, s.tree_masks),
                s.max_step_columns,
            )
        smaller = smaller_shapes(tuple(shape), s.tree_masks, acceptance_of(ctx.runner.model))
        self.tree = layouts_for(tuple(shape), s.tree_masks, ctx.device, tuple(smaller))

    def _applies(self) -> bool:
        """Whether ``tree=auto`` drafts trees here: masks as the source, the cursor cache, exact checks."""
        s = self.ctx.settings
        usable = s.decoder == "mars" and s.draft_source == "masks" and s.cache == "cursor"
        return usable and s.typical_epsilon == 0 and not self.ctx.fill_window and self.ctx.max_drafts > 0

    # ------------------------------------------------------------------ plan
    def plan(self, plan: StepPlan, budget: np.ndarray) -> StepPlan:
        layout = self._layout(plan.verifying, budget, plan.uncached, plan.drafts)
        if layout is None:
            return plan
        tree, template = layout >= 0, np.maximum(layout, 0)
        plan.tree_layout = layout
        plan.drafts = np.where(tree, self.tree.drafted[template], plan.drafts)  # depths of candidates fed
        plan.draft_masks = np.where(tree, 0, plan.draft_masks)  # (the tree's masks are its own)
        plan.predictions = np.where(tree, 1 + self.tree.columns[template], plan.predictions)
        return plan

    def _layout(
        self, verifying: np.ndarray, budget: np.ndarray, uncached: np.ndarray, drafts: np.ndarray
    ) -> np.ndarray | None:
        """Per row the tree template it feeds (the depths of candidates it has, within its budget), -1 for rows
        that do not verify a tree (those not verifying, sampling or below their exact threshold: chains).  Under
        ``max_step_columns`` the step takes the first of the tree's shapes (its own, then the smaller ones it
        shrinks to) at which the tree rows fit beside the other rows' real tokens and drafts; where none fits, no
        tree (None): the tree rows verify their first-ranked candidates as a chain, whose masks the cap trims as
        any chain's.  Under load a step's drafts shrink, down to a chain, rather than stop."""
        if self.tree is None or not verifying.any():
            return None
        requests = self.ctx.rows.records.requests
        # (a request may ask for a chain instead: tree="chain" among its settings)
        greedy = np.array([r.temperature <= 0 and getattr(r.settings, "tree", None) != "chain" for r in requests])
        tree = verifying & greedy.astype(bool) & self.ctx.exact_rows()
        if not tree.any():
            return None
        depths = np.clip(np.minimum(self.ctx.rows.host.draft_count, budget - 1), 0, self.tree.depth)
        cap = self.ctx.settings.max_step_columns
        if cap is None:
            return np.where(tree, self.tree.layout(0, depths), -1)
        other = int((uncached + drafts)[~tree].sum())  # the other rows' real tokens (with their AR column), drafts
        for choice in range(len(self.tree.shapes)):
            layout = self.tree.layout(choice, depths)
            if other + int((uncached + self.tree.columns[layout])[tree].sum()) <= cap:
                return np.where(tree, layout, -1)
        return None

    # ------------------------------------------------------------------ forward
    def _inputs_after_root(self, plan: StepPlan) -> torch.Tensor:
        """The tree rows' inputs after their roots (:meth:`TreeLayouts.draft_tokens`), made once per step."""
        if plan.tree_inputs is None:
            layout = plan.on_device.tree_layout.clamp_min(0)
            plan.tree_inputs = self.tree.draft_tokens(layout, self.ctx.rows.tensors.candidates, self.ctx.mask_id)
        return plan.tree_inputs

    def inputs(self, plan: StepPlan, after: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
        if not plan.tree_drafts.any():
            return proposals
        nodes = (plan.on_device.tree_layout >= 0) & (plan.on_device.drafts > 0)  # tree rows with draft nodes
        fed = self._inputs_after_root(plan)
        from_tree = fed.gather(1, after.clamp(0, fed.shape[1] - 1))
        return torch.where(nodes.unsqueeze(1) & (after >= 0), from_tree, proposals)

    def geometry(
        self, plan: StepPlan, positions: torch.Tensor, kv_length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A tree row's column after its root sits at the root's position plus its depth and sees the committed
        text, the row's real tokens and its ancestors in the template; every other column is causal at its slot."""
        if not plan.tree_drafts.any():
            return None
        tree, fed, dev = self.tree, plan.on_device, self.ctx.device
        width, X = positions.shape[1], self.tree.depth_of.shape[1]
        columns = torch.arange(width, device=dev)
        after = columns.unsqueeze(0) - fed.uncached.unsqueeze(1)  # [rows, width]: index after the root (< 0: real)
        layout = fed.tree_layout.clamp_min(0)
        is_tree = ((fed.tree_layout >= 0) & (fed.drafts > 0)).unsqueeze(1)  # rows whose template has nodes
        index = after.clamp(0, X - 1)
        depth = tree.depth_of[layout].gather(1, index)
        root = positions[:, :1] + fed.uncached.unsqueeze(1) - 1
        rope = torch.where(is_tree & (after >= 0), root + depth, positions)
        seen = tree.ancestors[layout].gather(1, index.unsqueeze(2).expand(-1, -1, X))
        seen = seen.gather(2, index.unsqueeze(1).expand(-1, width, -1))  # [rows, query, key]
        tree_view = (after.unsqueeze(1) < 0) | (seen & (after.unsqueeze(1) < X))
        causal = columns.view(1, 1, -1) <= columns.view(1, -1, 1)
        step = torch.where(is_tree.unsqueeze(2) & (after.unsqueeze(2) >= 0), tree_view, causal)
        relative = torch.arange(kv_length, device=dev).unsqueeze(0) - positions[:, :1]  # [rows, kv]
        inside = step.gather(2, relative.clamp(0, width - 1).unsqueeze(1).expand(-1, width, -1))
        return rope, (relative < 0).unsqueeze(1) | ((relative < width).unsqueeze(1) & inside)

    # ------------------------------------------------------------------ accept
    def verify(self, plan: StepPlan, scores: StepScores, verdict: Verdict) -> Verdict:
        """The tree rows' tokens, counts and verified drafts (the other rows keep the verdict's) and their next
        candidates, read from the mask group after each row's accepted path (:mod:`mars.decoding.tree`)."""
        if not plan.tree_rows.any():
            return verdict
        tokens, count, verified = verdict.tokens, verdict.count, verdict.verified
        tree, fed, logits = self.tree, plan.on_device, scores.logits
        is_tree = fed.tree_layout >= 0
        inputs = self._inputs_after_root(plan)
        width, needed = tokens.shape[1], 1 + inputs.shape[1]
        predicted = torch.nn.functional.pad(scores.predicted, (0, max(0, needed - width)), value=-1)
        checked = tree.verify(fed.tree_layout.clamp_min(0), predicted[:, :needed], inputs)
        tree_tokens = torch.nn.functional.pad(checked.tokens, (0, width - checked.tokens.shape[1]))
        tree_count = torch.minimum(checked.verified + 1, scores.budget)
        tokens = torch.where(is_tree.unsqueeze(1), tree_tokens, tokens)
        count = torch.where(is_tree, tree_count, count)
        verified = torch.where(is_tree, torch.minimum(checked.verified, tree_count - 1), verified)
        group = torch.where(is_tree.unsqueeze(1), checked.group, -1).clamp_max(logits.shape[1] - 2)
        threshold = self.ctx.settings.draft_threshold
        candidates, depths = next_candidates(logits, predicted, scores.top, group, tree.width, threshold)
        kept = {**verdict.kept, self.name: TreeStep(is_tree, checked.path, candidates, depths)}
        return Verdict(tokens, count, verified, verdict.next_drafts, kept)

    # ------------------------------------------------------------------ commit
    def kv_moves(self, plan: StepPlan, accepted: Acceptance) -> KVMoves | None:
        """Where the tree rows' accepted nodes sit in the KV buffer and where they go: right after the row's text
        (the node at depth d to the length before this step plus d - 1); other slots stay put."""
        step = accepted.kept.get(self.name)
        if step is None:
            return None
        rows = self.ctx.rows.tensors
        base = (rows.cached + plan.on_device.uncached).unsqueeze(1)  # the length before this step
        depth = torch.arange(self.tree.depth, device=self.ctx.device).unsqueeze(0)
        target = base + depth
        moving = step.rows.unsqueeze(1) & (depth < accepted.verified.unsqueeze(1))
        return KVMoves(torch.where(moving, base + step.path, target), target, plan.tree_rows)

    def keep(self, plan: StepPlan, accepted: Acceptance) -> None:
        """Rows that verified a chain rank their next drafts first among their candidates; tree rows keep their
        next candidates and draft the first-ranked ones."""
        rows, step = self.ctx.rows.tensors, accepted.kept.get(self.name)
        if rows.candidates is not None and accepted.next_drafts is not None:
            chain = plan.on_device.verifying & (plan.on_device.tree_layout < 0)
            first = torch.where(chain.unsqueeze(1), rows.drafts[:, : self.tree.depth], rows.candidates[..., 0])
            rows.candidates = torch.cat([first.unsqueeze(-1), rows.candidates[..., 1:]], dim=-1)
        if step is not None:
            rows.candidates = torch.where(step.rows.view(-1, 1, 1), step.candidates, rows.candidates)
            first = torch.nn.functional.pad(step.candidates[..., 0], (0, self.ctx.max_drafts - self.tree.depth))
            rows.drafts = torch.where(step.rows.unsqueeze(1), first, rows.drafts)
            rows.draft_count = torch.where(step.rows, step.depths, rows.draft_count)

    def proposed(self, plan: StepPlan, proposed: np.ndarray) -> None:
        tree = plan.tree_rows
        if tree.any():  # a tree proposes every node at a depth
            proposed[tree, : self.tree.depth] = self.tree.nodes_at_depth[plan.tree_layout[tree]]
