"""Tree drafts from the masks, verified in one forward, with drafts for the next step on every step.

A verifying row's step feeds, after its last real token (the *root*), a template of columns:

- the root's **mask group**: ``D`` masks after the root, whose predictions are the next step's drafts when no
  draft passes (the step then appends the root's AR token);
- the **draft nodes**: the top-``k1`` candidates of the first mask of the previous step, each followed by the
  top-``k2`` of the second mask, ... (Medusa-style candidates per depth, one mask distribution per depth), in
  breadth-first order;
- a **mask group after each node** the step may end on (``tree_masks=all``; ``top``: the nodes of the
  first-ranked path only): when the accepted path ends at a node, the masks after it were conditioned on
  exactly the accepted text, so the next step always drafts from masks that followed the right prefix (the
  paper's Section 4.6 layout, generalised from a chain to a tree).

Every column attends to the row's committed and real tokens and to its own ancestors in the template (a tree
attention mask), and sits at the RoPE position of its depth; its keys and values are written at the next free
buffer slots, one per column.  Greedy verification walks the tree: a node passes when its token equals the AR
prediction at its parent and its parent passed; the deepest passing node ends the accepted path, whose tokens
plus the AR token after it are exactly greedy AR's.  The path's keys and values move down to the slots right
after the committed text (:meth:`mars.decoding.kv.RaggedKVCache.move`), so they are committed like a chain's.

A row whose previous step left ``a < D`` depths of drafts (its first step, a depth whose mask was not sure
enough, the end of its budget) uses the template of the shape cut to ``a`` depths; its mask groups keep ``D``
masks.  Template ``0`` is the root group alone: ``D`` masks in a row, which is also the plain causal layout.

Under a cap on a step's columns (``max_step_columns``) a step whose tree rows do not fit takes a smaller shape
inside the tree (fewer candidates or depths, :func:`mars.decoding.tree_choice.smaller_shapes`), the largest that
fits, each row cut to the depths it has; where none fits, the rows verify their first-ranked candidates as a chain.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Template:
    """One layout of a verifying row's columns after its root (numpy; column indices count from 0 after the
    root).  ``parent``: the column each column attends through (-1: the root); ``depth``: positions after the
    root; ``node_*``: per draft node (breadth-first) its column, parent node (-1: the root), depth (1-based) and
    rank; ``group``: per possible end of the path (0: the root, 1 + n: node n) the columns of its mask group,
    -1 where it has none."""

    parent: np.ndarray
    depth: np.ndarray
    node_column: np.ndarray
    node_parent: np.ndarray
    node_depth: np.ndarray
    node_rank: np.ndarray
    group: np.ndarray

    @property
    def columns(self) -> int:
        return len(self.parent)

    @property
    def nodes(self) -> int:
        return len(self.node_column)

    def ancestors(self) -> np.ndarray:
        """``[columns, columns]``: column i sees column j (itself and its ancestors)."""
        return _lineage(self.parent)


def _nodes(shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """Draft nodes as (parent node, rank path), a node at depth d having a rank path of length d: the path of
    first-ranked candidates first (its columns are then the slots its keys and values are committed at, so accepting
    it moves nothing), then the others breadth-first; parents always before their children."""
    paths = [p for d in range(1, len(shape) + 1) for p in itertools.product(*(range(k) for k in shape[:d]))]
    paths.sort(key=lambda p: (any(p), len(p)))  # stable: breadth-first within each part
    index = {(): -1, **{p: i for i, p in enumerate(paths)}}
    return [(index[p[:-1]], p) for p in paths]


def build_template(shape: tuple[int, ...], group_size: int, masks: str = "all") -> Template:
    """The columns of a tree of ``shape`` candidates per depth with mask groups of ``group_size`` masks (``masks``:
    which nodes carry one, ``all`` or ``top``)."""
    nodes = _nodes(shape)
    parent, depth, node_column = [], [], []
    for p, path in nodes:
        node_column.append(len(parent))
        parent.append(-1 if p < 0 else node_column[p])
        depth.append(len(path))
    group = np.full((len(nodes) + 1, group_size), -1, dtype=np.int64)
    first = len(parent)  # the root's group: a chain of masks after the root
    group[0] = np.arange(first, first + group_size)
    parent.extend([-1, *range(first, first + group_size - 1)])
    depth.extend(range(1, group_size + 1))
    for n, (_, path) in enumerate(nodes):
        if masks == "top" and any(path):
            continue
        first = len(parent)
        group[n + 1] = np.arange(first, first + group_size)
        parent.extend([node_column[n], *range(first, first + group_size - 1)])
        depth.extend(len(path) + j for j in range(1, group_size + 1))
    return Template(
        parent=np.array(parent, dtype=np.int64),
        depth=np.array(depth, dtype=np.int64),
        node_column=np.array(node_column, dtype=np.int64),
        node_parent=np.array([p for p, _ in nodes], dtype=np.int64),
        node_depth=np.array([len(path) for _, path in nodes], dtype=np.int64),
        node_rank=np.array([path[-1] for _, path in nodes], dtype=np.int64),
        group=group,
    )


def _parent_reads(t: Template) -> np.ndarray:
    return np.where(t.node_parent < 0, 0, 1 + t.node_column[np.maximum(t.node_parent, 0)])


def _lineage(parent: np.ndarray) -> np.ndarray:
    """``[n, n]``: item i is item j or descends from it, given each item's ``parent`` (-1: none; parents first)."""
    seen = np.eye(len(parent), dtype=bool)
    for i, p in enumerate(parent):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


@functools.cache
def columns_of(shape: tuple[int, ...], masks: str = "all") -> int:
    """Columns a step of this shape feeds after the root (its drafts and its mask groups)."""
    return build_template(shape, len(shape), masks).columns


class TreeLayouts:
    """The templates of one shape cut to 0..D depths (template ``a``: the shape cut to ``a`` depths), then those of
    each of its ``smaller`` shapes cut to 0..their depths, with mask groups as deep as each (the layouts a step
    shrinks to where a column cap cannot fit the shape's: inside the shape, no deeper and no wider at any depth),
    stacked as device tensors padded to the widest (``columns``), and the verification of a step's rows against
    them."""

    def __init__(self, shape: tuple[int, ...], masks: str, device: torch.device, smaller=()):
        self.shape, self.masks, self.depth = tuple(shape), masks, len(shape)
        self.width = max(shape)  # candidates kept per depth
        self.shapes = (self.shape, *(tuple(s) for s in smaller))
        for s in self.shapes[1:]:
            if len(s) > self.depth or any(k > top for k, top in zip(s, shape)):
                raise ValueError(f"tree {s} is not inside tree {self.shape}: it would draft candidates it has not")
        self.templates: list[Template] = []
        self.first = []  # per shape: the index of its template cut to no depth
        drafted = []  # per template: the depths it drafts candidates at
        for s in self.shapes:
            self.first.append(len(self.templates))
            self.templates += [build_template(s[:d], len(s), masks) for d in range(len(s) + 1)]
            drafted += range(len(s) + 1)
        self.drafted = np.array(drafted)
        t = self.templates
        self.columns = np.array([x.columns for x in t])  # per template
        self.nodes_at_depth = np.zeros((len(t), self.depth), dtype=np.int64)
        for a, x in enumerate(t):
            np.add.at(self.nodes_at_depth[a], x.node_depth - 1, 1)
        X, N = int(self.columns.max()), max(x.nodes for x in t)

        def stack(get, size, fill, dtype=torch.long):
            out = np.full((len(t), *size), fill)
            for a, x in enumerate(t):
                value = get(x)
                out[(a, *(slice(0, s) for s in value.shape))] = value
            return torch.as_tensor(out, dtype=dtype, device=device)

        self.depth_of = stack(lambda x: x.depth, (X,), 1)
        self.ancestors = stack(lambda x: x.ancestors(), (X, X), False, torch.bool)
        self.node_column = stack(lambda x: x.node_column, (N,), 0)
        self.node_parent = stack(lambda x: x.node_parent, (N,), -1)
        self.node_depth = stack(lambda x: x.node_depth, (N,), 0)
        self.node_rank = stack(lambda x: x.node_rank, (N,), 0)
        self.node_real = stack(lambda x: np.ones(x.nodes, dtype=bool), (N,), False, torch.bool)
        self.group = stack(lambda x: x.group, (N + 1, self.depth), -1)
        # per node: where its parent's AR prediction is read (0: the root's), its ancestors among the nodes (itself
        # included) and its depth one-hot
        self.node_parent_read = stack(lambda x: _parent_reads(x), (N,), 0)
        self.node_lineage = stack(lambda x: _lineage(x.node_parent), (N, N), False, torch.bool)
        self.node_depth_hot = stack(
            lambda x: x.node_depth[:, None] == np.arange(1, self.depth + 1), (N, self.depth), False, torch.bool
        )

    def __repr__(self) -> str:
        return f"tree {','.join(map(str, self.shape))} (masks after {self.masks} nodes)"

    @property
    def label(self) -> str:
        return ",".join(map(str, self.shape))

    def layout(self, choice: int, depths: np.ndarray) -> np.ndarray:
        """Per row the template of shape ``choice`` (0: the tree's own, then its smaller shapes) cut to the depths
        of candidates the row has (``depths``, at most the tree's depth)."""
        return self.first[choice] + np.minimum(depths, len(self.shapes[choice]))

    def draft_tokens(self, layout: torch.Tensor, candidates: torch.Tensor, mask_id: int) -> torch.Tensor:
        """``[rows, columns]``: each row's input after its root under its template ``layout``: the candidate of its
        depth and rank at a node's column, the mask token elsewhere."""
        rows = len(layout)
        X = self.depth_of.shape[1]
        ids = torch.full((rows, X), mask_id, dtype=torch.long, device=layout.device)
        column, depth, rank = self.node_column[layout], self.node_depth[layout], self.node_rank[layout]
        real = self.node_real[layout]
        token = candidates.gather(1, (depth - 1).clamp_min(0).unsqueeze(-1).expand(-1, -1, self.width))
        token = token.gather(2, rank.unsqueeze(-1)).squeeze(-1)
        return ids.scatter(1, column.masked_fill(~real, X - 1), torch.where(real, token, ids[:, -1:]))

    def verify(self, layout: torch.Tensor, predicted: torch.Tensor, fed: torch.Tensor) -> TreeVerdict:
        """Greedy verification of every row under its template: ``predicted`` ``[rows, 1 + columns]`` (the AR token
        at the root, then at each column), ``fed`` ``[rows, columns]`` (the inputs after the root).  A node passes
        when its token is the AR prediction at its parent and every ancestor passes too."""
        real, column, depth = self.node_real[layout], self.node_column[layout], self.node_depth[layout]
        passes = real & (fed.gather(1, column) == predicted.gather(1, self.node_parent_read[layout]))
        lineage = self.node_lineage[layout]  # [rows, node, ancestor]
        passed = passes & ~(lineage & ~passes.unsqueeze(1)).any(-1)
        verified, end = torch.where(passed, depth, 0).max(dim=1)  # the deepest passing node (siblings differ)
        on_path = lineage.gather(1, end.view(-1, 1, 1).expand(-1, 1, lineage.shape[2])).squeeze(1)
        on_path = on_path & (verified > 0).unsqueeze(1)
        at_depth = on_path.unsqueeze(-1) & self.node_depth_hot[layout]  # [rows, node, depth]
        path = (at_depth * column.unsqueeze(-1)).sum(1)  # [rows, depth]: 0 past the path
        end_read = torch.where(verified > 0, 1 + column.gather(1, end.unsqueeze(1)).squeeze(1), 0)
        bonus = predicted.gather(1, end_read.unsqueeze(1))
        steps = torch.arange(self.depth + 1, device=layout.device).unsqueeze(0)
        tokens = torch.nn.functional.pad(fed.gather(1, path), (0, 1))
        tokens = torch.where(
            steps == verified.unsqueeze(1), bonus, torch.where(steps < verified.unsqueeze(1), tokens, 0)
        )
        ends = torch.where(verified > 0, end + 1, 0)
        group = self.group[layout].gather(1, ends.view(-1, 1, 1).expand(-1, 1, self.depth)).squeeze(1)
        return TreeVerdict(tokens, verified, path, group)


@functools.cache
def layouts_for(
    shape: tuple[int, ...], masks: str, device: torch.device, smaller: tuple[tuple[int, ...], ...] = ()
) -> TreeLayouts:
    """One :class:`TreeLayouts` per shape, smaller shapes, masks and device (its tensors are read, never written)."""
    return TreeLayouts(shape, masks, device, smaller)


@dataclass
class TreeVerdict:
    """What verification decided per row: ``tokens`` ``[rows, D + 1]`` (the passing path, then the AR token after
    it), ``verified`` (drafts passed), ``path`` ``[rows, D]`` (the columns of the passing nodes by depth, 0 past the
    path) and ``group`` ``[rows, D]`` (the columns of the mask group after the path's end, -1 for none)."""

    tokens: torch.Tensor
    verified: torch.Tensor
    path: torch.Tensor
    group: torch.Tensor


def next_candidates(
    logits: torch.Tensor,
    predicted: torch.Tensor,
    top: torch.Tensor | None,
    group: torch.Tensor,
    width: int,
    draft_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step's candidates ``[rows, D, width]``: the tokens of each mask of the group after the accepted path
    (``predicted`` ``[rows, 1 + columns]``, its argmax first, then the next-best of ``logits`` ``[rows, 1 + columns,
    vocab]``, whose never-emitted tokens are at -inf), and how many depths each row keeps: the leading depths whose
    first candidate is at least ``draft_threshold`` likely (``top``: the argmax's probability per column, where the
    step took it), none without a group."""
    read = 1 + group.clamp_min(0)
    first = predicted.gather(1, read)
    candidates = first.unsqueeze(-1)
    at = None
    if width > 1:
        at = logits.gather(1, read.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        candidates = torch.cat([candidates, at.topk(width, dim=-1).indices[..., 1:]], dim=-1)
    sure = group >= 0
    if draft_threshold > 0:
        if top is not None:
            likely = top.gather(1, read)
        else:
            at = at if at is not None else logits.gather(1, read.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
            likely = (at.gather(2, first.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(at, dim=-1)).exp()
        sure = sure & (likely >= draft_threshold)
    depths = torch.cumprod(sure.to(torch.long), dim=1).sum(dim=1)
    return candidates, depths
