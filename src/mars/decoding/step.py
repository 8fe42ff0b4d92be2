"""What one engine step passes between its phases: the context every phase reads, the plan made before the
forward, the scores read from its logits, the verdict of the verifiers, and the one host sync after the commit.

:class:`~mars.decoding.engine.DecodeEngine` runs the phases; :mod:`mars.decoding.planner` makes the plan,
:mod:`mars.decoding.scoring` the scores, the verifiers of :mod:`mars.decoding.verifiers` the verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .forward import ModelRunner
from .rows import Finished, Request, RowBatch
from .settings import DecodingSettings

LogProbs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class StepContext:
    """What every phase of a step reads: the engine's settings and fixed sizes, its rows and device.  ``window``:
    predictions a MARS row reads (the AR column and ``window - 1`` masks); ``max_drafts``: draft slots per row;
    ``guess_slots``: Jacobi's guesses per row (0 for MARS); ``never``: the tokens no row emits (the mask token);
    ``log_probs``: the one rule from logits to the distributions tokens are chosen from."""

    settings: DecodingSettings
    runner: ModelRunner
    rows: RowBatch
    mask_id: int
    never: torch.Tensor
    window: int
    fill_window: bool
    max_drafts: int
    guess_slots: int
    fused_choice: bool
    log_probs: LogProbs

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def exact_rows(self) -> np.ndarray:
        """Which rows decode at their exact threshold (1.0: lossless when verifying); the CPU ``auto`` choices of
        ``chain_drafts`` and ``verify_masks`` differ for them."""
        return self.rows.host.exact


@dataclass
class StepEvent:
    """What one step did for one row: the tokens it accepted (after stop rules) and, when the row
    left the batch, its :class:`Finished` record."""

    request: Request
    tokens: list[int]
    forward: int  # the engine's forward count at this step (tokens of one forward share it)
    finished: Finished | None = None
    error: str | None = None  # why the row left with reason "error" (its first step failed)


@dataclass
class PlanTensors:
    """A :class:`StepPlan`'s per-row arrays as device tensors (the same names)."""

    uncached: torch.Tensor
    predictions: torch.Tensor
    drafts: torch.Tensor
    draft_masks: torch.Tensor
    waiting: torch.Tensor
    verifying: torch.Tensor
    tree_layout: torch.Tensor  # [rows]: the tree template a row feeds (-1: none)


@dataclass
class StepPlan:
    """What every row feeds this step, decided on the host before the forward (one entry per row).

    A row's input is its ``uncached`` real tokens (the last of them makes an exact AR prediction),
    then its ``drafts``, then masks or Jacobi guesses; it reads ``predictions`` outputs from its last
    real token on.  Rows are padded on the right to the widest row."""

    uncached: np.ndarray  # real tokens not in the KV cache yet (the whole prompt on a row's first step)
    predictions: np.ndarray  # outputs the row reads: 1 AR + its drafts + its masks (or guesses)
    drafts: np.ndarray  # drafts fed after the real tokens (0 unless the row verifies)
    draft_masks: np.ndarray  # verifying rows: masks after the drafts, whose predictions seed the next drafts
    waiting: np.ndarray  # rows that sit this step out (cache=block: their block is full, another's is not)
    verifying: np.ndarray  # rows whose drafts this step verifies
    commit: bool  # this step's real tokens enter the KV cache
    device: torch.device
    tree_layout: np.ndarray | None = None  # rows verifying a tree: the template (TreeLayouts index), else -1
    tree_inputs: torch.Tensor | None = None  # their inputs after the root, once made (TreeVerifier.inputs)

    @cached_property
    def on_device(self) -> PlanTensors:
        """The per-row arrays on the model's device, moved in two transfers."""
        layout = self.tree_layout if self.tree_layout is not None else np.full(len(self.uncached), -1)
        counts = np.stack([self.uncached, self.predictions, self.drafts, self.draft_masks, layout]).astype(np.int64)
        flags = np.stack([self.waiting, self.verifying])
        uncached, predictions, drafts, draft_masks, layout = torch.from_numpy(counts).to(self.device)
        waiting, verifying = torch.from_numpy(flags).to(self.device)
        return PlanTensors(uncached, predictions, drafts, draft_masks, waiting, verifying, layout)

    @property
    def tree_rows(self) -> np.ndarray:
        """Rows verifying a tree this step."""
        if self.tree_layout is None:
            return np.zeros(len(self.uncached), dtype=bool)
        return self.tree_layout >= 0

    @property
    def tree_drafts(self) -> np.ndarray:
        """Tree rows whose template holds draft nodes (a tree row's ``drafts``: the depths it drafts; without any,
        its template is a group of masks after the root, the plain causal layout)."""
        return self.tree_rows & (self.drafts > 0)

    def chain_only(self) -> StepPlan:
        """This plan as the chain verification sees it: the tree rows verify nothing there."""
        if not self.tree_rows.any():
            return self
        chain = ~self.tree_rows
        return dataclasses.replace(
            self,
            verifying=self.verifying & chain,
            drafts=np.where(chain, self.drafts, 0),
            draft_masks=np.where(chain, self.draft_masks, 0),
            tree_layout=None,
        )

    def kernel_widths(self, exact: np.ndarray) -> tuple[int, int, int] | None:
        """The step's widths against the fast path's kernels (ModelRunner.logits_at): of its forward and of its LM
        head, and its queries per row against the attention kernel.  A row that must match AR bit for bit
        (``exact``: threshold 1.0, or verifying) counts as AR's step for it would, its new real tokens and one
        prediction, so that its drafts and masks never move the step from a kernel to MKL or SDPA (whose columns
        change each other); the other rows count every column they feed and read.  None (every row lossy): by the
        columns computed."""
        if not exact.any():
            return None
        extra = self.predictions - 1  # drafts and masks (or guesses) after each row's real tokens
        fed = self.uncached + np.where(exact, 0, extra)  # each row's columns as counted
        return int(fed.sum()), int(exact.sum() + self.predictions[~exact].sum()), int(fed.max())

    @property
    def prediction_width(self) -> int:
        return int(self.predictions.max())

    @property
    def input_width(self) -> int:
        return int((self.uncached + self.predictions - 1).max())


@dataclass
class NextDrafts:
    """Verifying rows' drafts for the next step, read from this step's predictions."""

    tokens: torch.Tensor  # [rows, max_drafts]
    count: torch.Tensor  # [rows] (rows that did not verify keep their count)
    log_q: torch.Tensor | None  # [rows, max_drafts, vocab]: the distributions they were drawn from


@dataclass
class StepScores:
    """What the accept phase reads of a step's logits (device tensors)."""

    logits: torch.Tensor  # [rows, predictions, vocab], the never-emitted tokens at -inf
    logp: torch.Tensor | None  # [rows, predictions, vocab] (None when no row reads one: StepScorer.reads_probabilities)
    predicted: torch.Tensor  # [rows, predictions]: the token chosen at each column
    top: torch.Tensor | None  # [rows, predictions]: the top probability, where the draft threshold reads it
    score: torch.Tensor | None = None  # [rows, predictions]: the confidence the threshold reads (None: none does)
    budget: torch.Tensor | None = None  # [rows]: tokens each row may still append


@dataclass
class Verdict:
    """What the rows append, as the verifiers decide it in turn (each changes only the rows it verifies)."""

    tokens: torch.Tensor  # [rows, predictions]: what the row appends (predicted, or verified drafts + one)
    count: torch.Tensor  # [rows]: how many of ``tokens`` it appends
    verified: torch.Tensor  # [rows]: drafts that passed (0 for rows that did not verify)
    next_drafts: NextDrafts | None = None  # None when no row verified a chain
    kept: dict[str, Any] = field(default_factory=dict)  # what a verifier keeps for its commit, under its name


@dataclass
class Acceptance:
    """What the accept phase decided for every row (device tensors)."""

    predicted: torch.Tensor  # [rows, predictions]: the token chosen at each prediction column
    tokens: torch.Tensor  # [rows, predictions]: what the row appends (predicted, or verified drafts + one)
    count: torch.Tensor  # [rows]: how many of ``tokens`` it appends (cut after an EOS)
    hit_eos: torch.Tensor  # [rows]
    verified: torch.Tensor  # [rows]: drafts that passed (0 for rows that did not verify)
    next_drafts: NextDrafts | None  # None when no row verified
    kept: dict[str, Any] = field(default_factory=dict)  # Verdict.kept


@dataclass
class KVMoves:
    """Keys and values a verifier's accepted drafts leave out of place (a tree's path): the buffer slots
    ``source`` go to ``target`` (``[rows, depth]`` each) once the step commits, when ``rows`` verified any."""

    source: torch.Tensor
    target: torch.Tensor
    rows: np.ndarray  # [rows] bool: the rows whose drafts may sit out of place


@dataclass
class Committed:
    """The step's one host sync: what every row appended and whether it is done."""

    count: np.ndarray
    done: np.ndarray  # EOS or budget (stop strings are applied after)
    hit_eos: np.ndarray
    verified: np.ndarray
    tokens: np.ndarray  # [rows, predictions]: row i appended the first count[i]


@dataclass
class StepReport:
    """What a step observer (:attr:`DecodeEngine.observers`) sees after each step of the running rows."""

    plan: StepPlan
    verified: np.ndarray  # [rows]: drafts each row emitted (those that passed, up to its EOS or stop string)
    forward_seconds: float  # the step's model forward
