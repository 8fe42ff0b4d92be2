"""The step-wise decoding engine: MARS sliding window, block-level cache, per-row cursor cache,
Jacobi iteration and lossless verification, one forward per :meth:`DecodeEngine.step`.

Requests join between steps (:meth:`DecodeEngine.admit`) and leave when done, so the same engine
serves ``generate`` (admit a batch, step until empty) and a server (continuous batching).  A step
has named phases: **plan** (what each row feeds: its uncommitted real tokens, its drafts, its masks
or Jacobi guesses), **forward** (one batched model call, logits only at the prediction columns),
**accept** (the threshold rule, Jacobi matching or draft verification), **commit** (append the
accepted tokens, advance the KV cursors, next drafts) and **retire** (EOS, budget, stop strings,
cancellation).

Right shift.  With a row's accepted text ending at position ``c`` (last real token), the output at
``c`` predicts position ``c+1`` (an exact AR prediction) and the output at the k-th mask predicts
``c+1+k``.  A window of ``W`` predictions needs the last real token plus ``W-1`` masks; masks take the
position ids that continue after ``c``.  Under causal attention a column's output does not depend on
the columns after it, so padding a row's input on the right changes none of its predictions.

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

Jacobi (``decoder="jacobi"``): the ``W-1`` columns after the last real token carry guesses instead of
masks; a row accepts the AR token plus every guess that matches the prediction made from the exact
prefix before it — greedy AR output, fewer forwards when guesses converge.

Verification (a request with ``verify=True``): a row feeds ``[real | drafts | masks]`` (``W-1`` masks, or
``verify_masks``; none after the drafts unless the row chains, ``chain_drafts``); drafts are
checked against the AR predictions of the same forward (:mod:`mars.decoding.verify`), so its output is
exactly greedy AR (or exact AR sampling at temperature > 0).  Verified drafts are computed with the
right prefix, so their keys/values are committed too.  When every draft passed, the masks' predictions
(conditioned on them) are the next drafts; after a rejection the ``fallback`` decides (no drafts, or
the unverified AR predictions as Jacobi guesses).  With ``typical_epsilon > 0`` a greedy row's draft also
passes when the AR distribution finds it plausible though not its argmax (Medusa's typical acceptance):
lossy, every such token one the model itself rates likely.  Below threshold 1.0 a verifying row also
accepts, when every draft passed, the leading masks after them that meet its threshold (the paper's speculative
composition, Section 4.6, with the masks as drafts): those tokens are unverified, like a plain MARS step's,
and the masks after them become the next drafts.

The step is vectorised over rows; its one host sync is a small transfer of the accepted tokens and
counts, which also feeds streaming.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from mars.decoding.kernels import greedy_verify_op, op_or_none

from .acceptance import (
    accept_counts,
    confidence,
    cut_at_eos,
    gumbel_noise,
    leading_run,
    never_emitted,
    suppress,
    tempered_log_probs,
    top_tokens,
    unverified_counts,
)
from .attention import mars_attention
from .drafts import DraftSource, draft_source_for
from .fastpath import enabled_by_env
from .forward import ModelRunner
from .kv import RaggedKVCache
from .rows import Finished, Request, RowBatch
from .settings import LEAN_VERIFY_MASKS, DecodingSettings, is_exact_threshold, tree_shape, validate_threshold
from .stopping import StopStrings
from .tree import TreeLayouts, columns_of, layouts_for, next_candidates
from .tree_choice import acceptance_of, auto_shape, smaller_shapes
from .verify import leading_matches, speculative_accept, typical_drafts

# Off switch for choosing greedy tokens in one kernel pass (acceptance.top_tokens): the same tokens either way.
# MARS_FAST_PATH=0 turns it off too.
TOP_TOKENS_ENV = "MARS_TOP_TOKENS"
AUTO_TREE_DEPTH = 3  # tree=auto looks no deeper: a fourth depth's candidates rarely pass

log = logging.getLogger(__name__)


def masks_within(masks: np.ndarray, room: int) -> np.ndarray:
    """Each row's masks cut to a common ceiling, the highest at which they fit in ``room`` columns in all (none
    when the rows' other columns already fill the room): the rows with the most masks give up theirs first."""
    for ceiling in range(int(masks.max(initial=0)), 0, -1):
        kept = np.minimum(masks, ceiling)
        if kept.sum() <= room:
            return kept
    return np.zeros_like(masks)


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
    tree_inputs: torch.Tensor | None = None  # their inputs after the root, once made (DecodeEngine._tree_inputs)

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
class Acceptance:
    """What the accept phase decided for every row (device tensors)."""

    predicted: torch.Tensor  # [rows, predictions]: the token chosen at each prediction column
    tokens: torch.Tensor  # [rows, predictions]: what the row appends (predicted, or verified drafts + one)
    count: torch.Tensor  # [rows]: how many of ``tokens`` it appends (cut after an EOS)
    hit_eos: torch.Tensor  # [rows]
    verified: torch.Tensor  # [rows]: drafts that passed (0 for rows that did not verify)
    next_drafts: NextDrafts | None  # None when no row verified
    tree: TreeStep | None = None  # rows that verified a tree


@dataclass
class TreeStep:
    """What a tree step leaves for the commit: where its accepted paths sit and the next candidates."""

    rows: torch.Tensor  # [rows] bool: the rows that verified a tree
    path: torch.Tensor  # [rows, depth]: the accepted nodes' columns after the root, by depth
    candidates: torch.Tensor  # [rows, depth, width]
    depths: torch.Tensor  # [rows]: how many depths of candidates the next step drafts


@dataclass
class StepScores:
    """What verification reads of a step's logits (device tensors)."""

    logp: torch.Tensor | None  # [rows, predictions, vocab] (None when no row reads one: see _reads_probabilities)
    predicted: torch.Tensor  # [rows, predictions]: the token chosen at each column
    top: torch.Tensor | None  # [rows, predictions]: the top probability, where the draft threshold reads it


@dataclass
class Committed:
    """The step's one host sync: what every row appended and whether it is done."""

    count: np.ndarray
    done: np.ndarray  # EOS or budget (stop strings are applied after)
    hit_eos: np.ndarray
    verified: np.ndarray
    tokens: np.ndarray  # [rows, predictions]: row i appended the first count[i]


class DecodeEngine:
    """See the module docstring.  ``settings`` fixes the engine-wide choices (decoder, cache, window,
    block size, metric, draft source and length, fallback); each :class:`Request` brings its own
    threshold, budget, stop strings, temperature, seed and verification flag.  ``draft_source``: where
    verifying rows' drafts come from (default: the one ``settings`` names)."""

    def __init__(
        self,
        runner: ModelRunner,
        settings: DecodingSettings,
        mask_token_id: int,
        eos_ids: Sequence[int],
        tokenizer=None,
        draft_source: DraftSource | None = None,
    ):
        self.runner, self.settings = runner, settings
        self.device = runner.device
        self.mask_id = int(mask_token_id)
        self.never = never_emitted(self.mask_id, eos_ids)  # the mask token is never an output token
        # the one-pass choice is a kernel of the fast path: off with it (no build where it is not wanted)
        self.fused_choice = enabled_by_env(TOP_TOKENS_ENV) and runner.fast_path()
        self.eos = torch.tensor(list(eos_ids), device=self.device)
        self.tokenizer = tokenizer
        self.fill_window = settings.effective_window == "cache_block"
        self.window = settings.cache_block if self.fill_window else int(settings.effective_window)
        self.max_drafts = self._max_drafts()
        self.mask_temperatures = self._mask_temperatures()
        self.tree: TreeLayouts | None = None  # the tree greedy verifying rows draft (None: chains)
        self.tree_resolved = False  # tree=auto is resolved when the first verifying row arrives
        self.draft_slots = torch.arange(self.max_drafts, device=self.device)  # a row's draft positions
        self.guess_slots = self.window - 1 if settings.decoder == "jacobi" else 0
        self.rows = RowBatch(self.device, self.mask_id, self.max_drafts, self.guess_slots)
        self.cache = RaggedKVCache(runner.num_layers) if settings.cache != "none" else None
        if draft_source is None:
            draft_source = draft_source_for(settings, runner, self.log_probs, tokenizer)
        self.drafter = draft_source
        self.stepped = False
        self.forwards = 0
        self.seconds = 0.0
        self.joining: list[Request] = []  # admitted while rows run (cursor cache): prefilled at the next step

    def _mask_temperatures(self) -> torch.Tensor | None:
        """The checkpoint's calibration (``model.mars_calibration``, :mod:`mars.decoding.calibration`) as one divisor
        per mask depth (index 0, the exact AR column: 1.0), or None for an uncalibrated checkpoint."""
        calibration = getattr(self.runner.model, "mars_calibration", None)
        if calibration is None:
            return None
        divisors = calibration.mask_temperatures(max(self.window, 2))
        return torch.tensor(divisors, dtype=torch.float32, device=self.device)

    def _resolve_tree(self) -> None:
        """The tree of this engine's greedy lossless verifying rows: the shape ``tree`` names, or for ``auto`` the
        one :func:`mars.decoding.tree_choice.auto_shape` picks for this model and device among those a lone row's
        step fits in ``max_step_columns`` (None: chains), with the smaller shapes its steps shrink to under the cap
        (:func:`mars.decoding.tree_choice.smaller_shapes`)."""
        if self.tree_resolved:
            return
        self.tree_resolved = True
        s = self.settings
        shape = tree_shape(s.tree)
        room = None if s.max_step_columns is None else s.max_step_columns - 1  # a lone row's root takes one
        if shape is None:
            if s.tree == "chain" or not self._tree_applies():
                return
            depth = min(self.max_drafts, AUTO_TREE_DEPTH)
            shape = auto_shape(self.runner, self.mask_id, depth, s.tree_masks, room)
            if shape is None:
                return
        elif len(shape) > self.max_drafts:
            raise ValueError(f"tree={s.tree!r} is {len(shape)} deep; this engine drafts at most {self.max_drafts}")
        elif room is not None and columns_of(shape, s.tree_masks) > room:
            log.info(
                "tree=%s takes %d columns per step, over max_step_columns=%d: its steps draft the largest smaller "
                "tree that fits",
                s.tree,
                1 + columns_of(shape, s.tree_masks),
                s.max_step_columns,
            )
        smaller = smaller_shapes(tuple(shape), s.tree_masks, acceptance_of(self.runner.model))
        self.tree = layouts_for(tuple(shape), s.tree_masks, self.device, tuple(smaller))

    def _tree_applies(self) -> bool:
        """Whether ``tree=auto`` drafts trees here: masks as the source, the cursor cache, exact checks."""
        s = self.settings
        usable = s.decoder == "mars" and s.draft_source == "masks" and s.cache == "cursor"
        return usable and s.typical_epsilon == 0 and not self.fill_window and self.max_drafts > 0

    def _max_drafts(self) -> int:
        """Draft slots per row: the masks can draft at most window - 1 tokens; other sources any number."""
        s = self.settings
        if self.fill_window:
            return 0
        if s.draft_source == "masks":
            return max(0, min(s.effective_draft_length, self.window - 1))
        return s.effective_draft_length

    def log_probs(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one place logits become the distributions tokens are chosen from (the target's and a draft
        model's): tempered log-probabilities and which rows sample; the mask token is never chosen."""
        return tempered_log_probs(suppress(logits, self.never), temperature)

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt_ids: Sequence[int],
        *,
        stop: str | Sequence[str] | StopStrings | None = None,
        id=None,
        settings: DecodingSettings | None = None,
        **options,
    ) -> Request:
        """A request decoded with ``options``, the per-request fields of :class:`DecodingSettings`
        (``threshold``, ``max_new_tokens``, ``temperature``, ``seed``, ``verify``, ``lookup_ngram``: see
        ``DecodingSettings.per_request_fields()``; ``None`` or absent = this engine's), validated once
        together with the engine's settings; or with ``settings``, a request's settings validated already
        (``generate``'s per-prompt thresholds), which may differ from the engine's in those fields only."""
        s = self._request_settings(settings, options)
        if not isinstance(stop, StopStrings) and stop is not None:
            if self.tokenizer is None:
                raise ValueError("stop strings need the engine's tokenizer")
            stop = StopStrings(self.tokenizer, stop)
        if isinstance(stop, StopStrings) and not stop:
            stop = None
        kwargs = {} if id is None else {"id": id}
        return Request(
            prompt_ids=[int(t) for t in prompt_ids],
            threshold=s.threshold,
            max_new_tokens=s.max_new_tokens,
            stops=stop,
            temperature=s.temperature,
            seed=s.seed,
            verify=s.verify,
            exact=is_exact_threshold(s.threshold, s.metric),
            settings=s,
            **kwargs,
        )

    def _request_settings(self, settings: DecodingSettings | None, options: dict) -> DecodingSettings:
        allowed = DecodingSettings.per_request_fields()
        if settings is not None:
            if options:
                raise ValueError(f"make_request got settings= and {sorted(options)}: pass one or the other")
            fixed = [k for k in DecodingSettings.field_names() if k not in allowed]
            differ = [k for k in fixed if getattr(settings, k) != getattr(self.settings, k)]
            if differ:
                raise ValueError(f"a request may not change the engine's {differ}; per request: {list(allowed)}")
            return settings
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"{unknown} cannot be set per request; per-request settings: {list(allowed)}")
        given = {k: v for k, v in options.items() if v is not None}
        tree = given.get("tree", "chain")
        if tree not in ("chain", "auto", self.settings.tree) and tree_shape(tree) != tree_shape(self.settings.tree):
            raise ValueError(
                f"tree={tree!r}: this engine drafts tree={self.settings.tree!r} for its rows; a request may verify "
                "along a chain (tree='chain') or with the engine's own"
            )
        # one validation for the request: the threshold for the metric, what verify allows, the budget...
        return self.settings.replace(**given) if given else self.settings

    def admit(self, requests: Sequence[Request]) -> None:
        """Add requests to the batch.  With the cursor cache, requests joining rows that are already
        running are prefilled in a forward of their own at the next step and then merge into the running
        batch, so the running rows never pay for a newcomer's (padded) prompt."""
        if not requests:
            return
        if self.settings.cache == "block" and self.stepped:
            raise RuntimeError(
                "cache='block' synchronises rows on shared block boundaries; requests can only "
                "join before the first step (use cache='cursor' for continuous batching)"
            )
        if self.settings.cache == "cursor" and len(self.rows):
            self.joining.extend(requests)
            return
        self._add(requests)

    def _add(self, requests: Sequence[Request]) -> None:
        if any(r.temperature > 0 and r.verify for r in requests):
            self.rows.ensure_draft_distributions(self.runner.vocab_size)
        extra = self.window + self.max_drafts + 2
        self.rows.add(list(requests), [self._cap(r) for r in requests], extra=extra)
        if any(r.verify and r.temperature <= 0 and r.exact for r in requests):
            self._resolve_tree()
        if self.tree is not None:
            self.rows.ensure_candidates(self.tree.depth, self.tree.width)
        if self.cache is not None:
            self.cache.add_rows(len(requests))
        self.drafter.add_rows(len(requests))

    def _cap(self, request: Request) -> int:
        """Tokens a step may accept for this request: one for exact rows (threshold 1.0), else the window."""
        s = self.settings
        if request.exact and not request.verify:
            return 1
        return s.max_accept if s.max_accept is not None else self.window

    def set_threshold(self, request_id, threshold: float) -> bool:
        """Change a live request's threshold (a server's load-adaptive knob); it applies from the next step."""
        thr = validate_threshold(threshold, self.settings.metric)  # one number, not a request's settings
        for r in self.joining:
            if r.id == request_id:
                r.threshold, r.exact = thr, is_exact_threshold(thr, self.settings.metric)
                return True
        for i, r in enumerate(self.rows.records.requests):
            if r.id == request_id:
                if r.verify:
                    return False  # a verifying request keeps its own threshold (lossless without one)
                r.threshold, r.exact = thr, is_exact_threshold(thr, self.settings.metric)
                self.rows.host.exact[i] = r.exact
                with torch.inference_mode():  # the row tensors were made inside a step
                    self.rows.tensors.threshold[i] = thr
                    self.rows.tensors.cap[i] = self._cap(r)
                self.rows.host.cap[i] = self._cap(r)
                return True
        return False

    def cancel(self, request_id) -> bool:
        """Mark a request cancelled; it leaves the batch at the next step (reason ``cancelled``)."""
        for r in [*self.rows.records.requests, *self.joining]:
            if r.id == request_id:
                r.cancelled = True
                return True
        return False

    @property
    def live(self) -> int:
        return len(self.rows) + len(self.joining)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One forward for every running row (plus one prefill forward for rows joining them); returns
        what each row accepted and who finished."""
        events = self._retire_cancelled()
        joining = [r for r in self.joining if not r.cancelled]
        events += [
            StepEvent(r, [], self.forwards, Finished(r, [], 0, "cancelled")) for r in self.joining if r.cancelled
        ]
        self.joining = []
        t0 = time.perf_counter()
        if len(self.rows):
            events += self._step_rows()
        if joining:
            try:
                events += self._prefill(joining)
            except Exception:  # the joining rows' own first step: the running rows' step above stands
                log.exception("the first step of %d joining row(s) failed; retrying each alone", len(joining))
                events += self._prefill_each(joining)
        self.seconds += time.perf_counter() - t0
        return events

    def _prefill_each(self, requests: list[Request]) -> list[StepEvent]:
        """Each joining request's first step on its own: one that fails leaves at once (reason ``error``, the
        error on its event) and the others join (a failed prefill leaves this engine's rows as they were)."""
        events = []
        for r in requests:
            try:
                events += self._prefill([r])
            except Exception as err:
                log.exception("the first step of request %s failed", r.id)
                reason = f"{type(err).__name__}: {err}"
                events.append(StepEvent(r, [], self.forwards, Finished(r, [], 0, "error"), error=reason))
        return events

    def _step_rows(self) -> list[StepEvent]:
        plan = self._plan()
        with mars_attention(self.runner.model):
            logits = self._forward(plan)
        self.forwards += 1
        self.rows.host.forwards += 1
        acceptance = self._accept(plan, logits)
        events = self._emit(self._commit(plan, acceptance), plan)
        self.stepped = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return events

    def _prefill(self, requests: list[Request]) -> list[StepEvent]:
        """Joining rows take their first step in a batch of their own, then merge into the running one."""
        group = DecodeEngine(
            self.runner, self.settings, self.mask_id, self.eos.tolist(), self.tokenizer, self.drafter.fork()
        )
        group.tree, group.tree_resolved = self.tree, self.tree_resolved
        group._add(requests)
        if group.tree is not None and self.tree is None:  # the group resolved it: one tree for the batch
            self.tree, self.tree_resolved = group.tree, True
            self.rows.ensure_candidates(self.tree.depth, self.tree.width)
        events = group._step_rows()
        for e in events:
            e.forward = self.forwards + 1
        self.forwards += 1
        self.rows.extend(group.rows)
        if self.cache is not None and group.cache is not None:
            self.cache.extend(group.cache)
        self.drafter.extend(group.drafter)
        return events

    # ------------------------------------------------------------------ plan
    def _plan(self) -> StepPlan:
        s, host = self.settings, self.rows.host
        uncached = host.length - host.cached
        commit, waiting = self._block_schedule(uncached)
        budget = host.end - host.length
        if self.fill_window:
            room = np.full(len(uncached), s.cache_block) if commit else s.cache_block - uncached
            predictions = np.maximum(room, 1)
            waiting = waiting | (room <= 0)
        else:
            predictions = np.full(len(uncached), self.window)
        if not s.full_window:
            # A row capped at k tokens (threshold 1.0, max_accept, the end of its budget) needs only k
            # predictions; at threshold 1.0 no masks are appended and MARS costs what AR costs.
            predictions = np.minimum(predictions, np.maximum(np.minimum(host.cap, budget), 1))
        # Verifying rows: the AR column, their drafts (no more than can still be accepted), and masks
        # for the next drafts when tokens can follow this step's (after drafts only for chaining rows).
        verifying = host.verify & ~waiting
        drafts = draft_masks = np.zeros(len(uncached), dtype=np.int64)  # read only when a row verifies
        if verifying.any():
            self.drafter.propose(self.rows, verifying, np.minimum(self.max_drafts, budget - 1))
            drafts = np.where(verifying, np.minimum(host.draft_count, budget - 1), 0)
            draft_masks = np.where(budget > drafts + 1, self._masks_fed(), 0)
            if drafts.any():
                draft_masks = np.where((drafts > 0) & ~self._chains(), 0, draft_masks)
            predictions = np.where(verifying, 1 + drafts + draft_masks, predictions)
        layout = self._tree_layout(verifying, budget, uncached, drafts)
        if layout is not None:
            tree = layout >= 0
            drafts = np.where(tree, self.tree.drafted[np.maximum(layout, 0)], drafts)  # depths of candidates fed
            draft_masks = np.where(tree, 0, draft_masks)  # (the tree's masks are its own)
            predictions = np.where(tree, 1 + self.tree.columns[np.maximum(layout, 0)], predictions)
        predictions = np.where(waiting, 1, predictions)
        if s.max_step_columns is not None:
            fixed = layout >= 0 if layout is not None else np.zeros(len(uncached), dtype=bool)
            # a lossless sampling row's masks are its next drafts, whose draws decide its samples: kept whole, so
            # that what it samples never depends on the load
            fixed = fixed | (verifying & self.rows.host_sampling & self._exact_rows())
            masks = np.where(fixed, 0, predictions - 1 - drafts)  # masks or guesses: what a row can do without
            kept = masks_within(
                masks, s.max_step_columns - int((uncached + np.where(fixed, predictions - 1, drafts)).sum())
            )
            predictions = predictions - (masks - kept)
            draft_masks = np.where(fixed, draft_masks, np.minimum(draft_masks, kept))
        return StepPlan(uncached, predictions, drafts, draft_masks, waiting, verifying, commit, self.device, layout)

    def _tree_layout(
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
        requests = self.rows.records.requests
        # (a request may ask for a chain instead: tree="chain" among its settings)
        treed = [r.temperature <= 0 and getattr(r.settings, "tree", None) != "chain" for r in requests]
        greedy = np.array(treed, dtype=bool)
        tree = verifying & greedy & self._exact_rows()
        if not tree.any():
            return None
        depths = np.clip(np.minimum(self.rows.host.draft_count, budget - 1), 0, self.tree.depth)
        cap = self.settings.max_step_columns
        if cap is None:
            return np.where(tree, self.tree.layout(0, depths), -1)
        other = int((uncached + drafts)[~tree].sum())  # the other rows' real tokens (with their AR column), drafts
        for choice in range(len(self.tree.shapes)):
            layout = self.tree.layout(choice, depths)
            if other + int((uncached + self.tree.columns[layout])[tree].sum()) <= cap:
                return np.where(tree, layout, -1)
        return None

    def _masks_fed(self) -> np.ndarray:
        """How many masks each verifying row feeds on a step (``verify_masks``; ``auto`` on a CPU trims the
        lossless rows to LEAN_VERIFY_MASKS, whatever their other drafts' source)."""
        s, full = self.settings, self.window - 1
        if s.verify_masks == "all":
            return np.full(len(self.rows), full)
        if s.verify_masks != "auto":
            return np.full(len(self.rows), min(int(s.verify_masks), full))
        if self.device.type != "cpu":
            return np.full(len(self.rows), full)
        return np.where(self._exact_rows(), min(LEAN_VERIFY_MASKS, full), full)

    def _chains(self) -> np.ndarray:
        """Which rows' masks ride after their drafts (``chain_drafts``; ``auto`` on a CPU asks each row's
        threshold)."""
        mode = self.settings.chain_drafts
        if mode == "auto" and self.device.type == "cpu":
            return ~self._exact_rows()
        return np.full(len(self.rows), mode != "never")

    def _exact_rows(self) -> np.ndarray:
        """Which rows decode at their exact threshold (1.0: lossless when verifying); the CPU ``auto`` choices
        of ``chain_drafts`` and ``verify_masks`` differ for them."""
        return self.rows.host.exact

    def _block_schedule(self, uncached: np.ndarray) -> tuple[bool, np.ndarray]:
        """Whether this step's real tokens enter the KV cache, and which rows wait.  The block cache
        commits only when every row has filled its block; until then the rows that have wait."""
        s = self.settings
        first = not self.stepped
        commit = s.cache == "cursor" or (s.cache == "block" and first)
        waiting = np.zeros(len(uncached), dtype=bool)
        if s.cache == "block" and not first:
            full = uncached >= s.cache_block
            commit = bool(full.all())
            waiting = full & (not commit)
        return commit, waiting

    # ------------------------------------------------------------------ forward
    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[rows, prediction_width, vocab]``: column i predicts the token i places after the last real one."""
        dev, width, reads = self.device, plan.input_width, plan.prediction_width
        uncached = plan.on_device.uncached
        columns = torch.arange(width, device=dev)
        positions = self.rows.tensors.cached.unsqueeze(1) + columns  # position ids (= KV buffer positions)
        ids = self._input_ids(plan, positions, uncached)
        read = ((uncached - 1).unsqueeze(1) + torch.arange(reads, device=dev)).clamp_max(width - 1)
        # Columns a row reads: its real tokens and the inputs of its own predictions; the rest pads it to
        # the batch's widest row (a threshold-1.0 row beside rows with masks), skipped by the fast path.
        row_reads = plan.on_device.predictions.unsqueeze(1)
        live = columns.unsqueeze(0) < uncached.unsqueeze(1) + row_reads - 1
        live_reads = torch.arange(reads, device=dev).unsqueeze(0) < row_reads
        reads_kw = dict(live=live, live_columns=live_reads, widths=self._kernel_widths(plan))
        if self.cache is None:
            attention = (columns.unsqueeze(0) <= columns.unsqueeze(1)).expand(len(self.rows), 1, width, width)
            return self.runner.logits_at(ids, positions, attention, read, **reads_kw)
        kv_length = int(self.rows.host.cached.max()) + width
        self.cache.prepare_step(positions, kv_length)  # each column's keys/values at the next free slot
        if plan.tree_drafts.any():
            rope, attention = self._tree_geometry(plan, positions, kv_length)
            return self.runner.logits_at(ids, rope, attention.unsqueeze(1), read, self.cache, **reads_kw)
        attention = torch.arange(kv_length, device=dev).view(1, 1, -1) <= positions.unsqueeze(2)
        return self.runner.logits_at(ids, positions, attention.unsqueeze(1), read, self.cache, **reads_kw)

    def _tree_inputs(self, plan: StepPlan) -> torch.Tensor:
        """The tree rows' inputs after their roots (:meth:`TreeLayouts.draft_tokens`), made once per step."""
        if plan.tree_inputs is None:
            layout = plan.on_device.tree_layout.clamp_min(0)
            plan.tree_inputs = self.tree.draft_tokens(layout, self.rows.tensors.candidates, self.mask_id)
        return plan.tree_inputs

    def _tree_geometry(self, plan: StepPlan, slots: torch.Tensor, kv_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE positions and the attention mask ``[rows, columns, kv_length]`` of a step with tree rows: a tree
        row's column after its root sits at the root's position plus its depth and sees the committed text, the
        row's real tokens and its ancestors in the template; every other column is causal at its slot."""
        tree, fed = self.tree, plan.on_device
        width, X = slots.shape[1], self.tree.depth_of.shape[1]
        columns = torch.arange(width, device=self.device)
        after = columns.unsqueeze(0) - fed.uncached.unsqueeze(1)  # [rows, width]: index after the root (< 0: real)
        layout = fed.tree_layout.clamp_min(0)
        is_tree = ((fed.tree_layout >= 0) & (fed.drafts > 0)).unsqueeze(1)  # rows whose template has nodes
        index = after.clamp(0, X - 1)
        depth = tree.depth_of[layout].gather(1, index)
        root = slots[:, :1] + fed.uncached.unsqueeze(1) - 1
        rope = torch.where(is_tree & (after >= 0), root + depth, slots)
        seen = tree.ancestors[layout].gather(1, index.unsqueeze(2).expand(-1, -1, X))
        seen = seen.gather(2, index.unsqueeze(1).expand(-1, width, -1))  # [rows, query, key]
        tree_view = (after.unsqueeze(1) < 0) | (seen & (after.unsqueeze(1) < X))
        causal = columns.view(1, 1, -1) <= columns.view(1, -1, 1)
        step = torch.where(is_tree.unsqueeze(2) & (after.unsqueeze(2) >= 0), tree_view, causal)
        relative = torch.arange(kv_length, device=self.device).unsqueeze(0) - slots[:, :1]  # [rows, kv]
        inside = step.gather(2, relative.clamp(0, width - 1).unsqueeze(1).expand(-1, width, -1))
        return rope, (relative < 0).unsqueeze(1) | ((relative < width).unsqueeze(1) & inside)

    def _kernel_widths(self, plan: StepPlan) -> tuple[int, int, int] | None:
        """The step's widths against the fast path's kernels (ModelRunner.logits_at): of its forward and of its LM
        head, and its queries per row against the attention kernel.  A row that must match AR bit for bit (threshold
        1.0, or verifying) counts as AR's step for it would, its new real tokens and one prediction, so that its
        drafts and masks never move the step from a kernel to MKL or SDPA (whose columns change each other); the
        other rows count every column they feed and read.  None (every row lossy): by the columns computed."""
        host = self.rows.host
        exact = host.exact | host.verify
        if not exact.any():
            return None
        extra = plan.predictions - 1  # drafts and masks (or guesses) after each row's real tokens
        fed = plan.uncached + np.where(exact, 0, extra)  # each row's columns as counted
        return int(fed.sum()), int(exact.sum() + plan.predictions[~exact].sum()), int(fed.max())

    def _input_ids(self, plan: StepPlan, positions: torch.Tensor, uncached: torch.Tensor) -> torch.Tensor:
        """Each row's real tokens, then its drafts, then masks (or Jacobi guesses)."""
        rows = self.rows.tensors
        ids = rows.tokens.gather(1, positions.clamp_max(self.rows.width - 1))
        after = torch.arange(positions.shape[1], device=self.device).unsqueeze(0) - uncached.unsqueeze(1)
        if self.max_drafts:  # ``after``: columns after the last real token
            drafts = plan.on_device.drafts.unsqueeze(1)
            drafted = rows.drafts.gather(1, after.clamp(0, self.max_drafts - 1))
            proposals = torch.where((after >= 0) & (after < drafts), drafted, self._proposals(after - drafts))
        else:
            proposals = self._proposals(after)
        if plan.tree_drafts.any():  # tree rows with draft nodes: their template's inputs
            nodes = (plan.on_device.tree_layout >= 0) & (plan.on_device.drafts > 0)
            fed = self._tree_inputs(plan)
            from_tree = fed.gather(1, after.clamp(0, fed.shape[1] - 1))
            proposals = torch.where(nodes.unsqueeze(1) & (after >= 0), from_tree, proposals)
        return torch.where(after < 0, ids, proposals)

    def _proposals(self, offset: torch.Tensor) -> torch.Tensor:
        """Token ``offset`` places after the last real token (or draft): the mask token for MARS, the
        current guess for Jacobi."""
        if self.guess_slots == 0:
            return torch.full_like(offset, self.mask_id)
        return self.rows.tensors.guesses.gather(1, offset.clamp(0, self.guess_slots - 1))

    # ------------------------------------------------------------------ accept
    def _accept(self, plan: StepPlan, logits: torch.Tensor) -> Acceptance:
        s, rows = self.settings, self.rows.tensors
        logp, predicted, top = self._choose(plan, logits)
        budget = rows.end - rows.length
        cap_now = torch.minimum(torch.minimum(rows.cap, budget), plan.on_device.predictions)
        cap_now = cap_now.masked_fill(plan.on_device.waiting, 0)
        if self.guess_slots:  # Jacobi: the AR token, then every guess its prediction confirms
            compared = min(plan.prediction_width - 1, self.guess_slots)
            guesses = rows.guesses[:, :compared]
            run = 1 + leading_matches(guesses, predicted[:, :compared], torch.full_like(cap_now, compared))
            count, score = torch.minimum(run, cap_now), None  # (Jacobi rows never verify)
        elif logp is None:  # every row exact: one token (a verifying row's count is the verifier's)
            count, score = cap_now.clamp_max(1), None
        else:
            score = confidence(self._calibrated(plan, logits, logp), predicted, s.metric)
            count = accept_counts(score, rows.threshold, s.metric, cap_now)
        tokens, verified, next_drafts, tree = predicted, torch.zeros_like(count), None, None
        if plan.verifying.any():
            chain = plan.chain_only()
            if chain.verifying.any():
                scores = StepScores(logp, predicted, top)
                tokens, count, verified, next_drafts = self._verify(chain, scores, score, count)
            if plan.tree_rows.any():
                chosen = (predicted, top)
                tokens, count, verified, tree = self._verify_tree(
                    plan, logits, chosen, (tokens, count, verified), budget
                )
        count, hit_eos = cut_at_eos(tokens, count, self.eos)
        return Acceptance(predicted, tokens, count, hit_eos, verified, next_drafts, tree)

    def _verify_tree(self, plan: StepPlan, logits: torch.Tensor, chosen, chain, budget: torch.Tensor):
        """The tree rows' tokens, counts and verified drafts (the other rows keep ``chain``'s) and their next
        candidates, read from the mask group after each row's accepted path (:mod:`mars.decoding.tree`)."""
        tokens, count, verified = chain
        tree, fed = self.tree, plan.on_device
        is_tree = fed.tree_layout >= 0
        layout = fed.tree_layout.clamp_min(0)
        predicted, top = chosen
        inputs = self._tree_inputs(plan)
        width, needed = tokens.shape[1], 1 + inputs.shape[1]
        predicted = torch.nn.functional.pad(predicted, (0, max(0, needed - width)), value=-1)
        verdict = tree.verify(layout, predicted[:, :needed], inputs)
        tree_tokens = torch.nn.functional.pad(verdict.tokens, (0, width - verdict.tokens.shape[1]))
        tree_count = torch.minimum(verdict.verified + 1, budget)
        tokens = torch.where(is_tree.unsqueeze(1), tree_tokens, tokens)
        count = torch.where(is_tree, tree_count, count)
        verified = torch.where(is_tree, torch.minimum(verdict.verified, tree_count - 1), verified)
        group = torch.where(is_tree.unsqueeze(1), verdict.group, -1).clamp_max(logits.shape[1] - 2)
        candidates, depths = next_candidates(logits, predicted, top, group, tree.width, self.settings.draft_threshold)
        return tokens, count, verified, TreeStep(is_tree, verdict.path, candidates, depths)

    def _calibrated(self, plan: StepPlan, logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """The log-probabilities the threshold reads: ``logp``, or for a calibrated checkpoint those of the logits
        with each mask column divided by its depth's temperature (the depth counted after a row's drafts), so that
        a confidence is the chance that the mask's token is the model's own greedy choice.  The tokens chosen are
        the same (a temperature keeps the argmax); only the confidence moves."""
        if self.mask_temperatures is None:
            return logp
        divisors = self.mask_temperatures
        columns = torch.arange(logits.shape[1], device=self.device).unsqueeze(0)
        depth = (columns - plan.on_device.drafts.unsqueeze(1)).clamp(0, len(divisors) - 1)
        scaled = logits / divisors[depth].unsqueeze(-1)
        return self.log_probs(scaled, self.rows.tensors.temperature)[0]

    def _choose(
        self, plan: StepPlan, logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Log-probabilities at every prediction column (None when no row reads one), the token chosen
        there (the argmax of the logits, or a Gumbel-max draw for sampling rows, each from its own
        generator, only its own columns) and, on a greedy step whose masks the draft threshold reads, the
        argmax's probability from the logits at the columns after the first (no log-softmax; None otherwise).
        ``logits`` come back with the never-emitted tokens at -inf."""
        s, reads = self.settings, self._reads_probabilities(plan)
        # the draft threshold reads the top probability at the columns after the AR one (after the drafts)
        drafting = self._seeds_drafts(plan) or plan.tree_rows.any()
        top_from = 1 if not reads and s.draft_threshold > 0 and drafting else None
        predicted, top = top_tokens(logits, self.never, top_from, self.fused_choice)
        if not reads:
            return None, predicted, top
        logp, sampled = self.log_probs(logits, self.rows.tensors.temperature)
        if sampled is not None:
            noise = gumbel_noise(logp, self.rows.row_generators(), plan.predictions)
            predicted = torch.where(sampled.unsqueeze(1), torch.argmax(logp + noise, dim=-1), predicted)
        return logp, predicted, None

    def _seeds_drafts(self, plan: StepPlan) -> bool:
        """Whether this step's predictions become next drafts: a row fed masks, verifying rows fall back to Jacobi
        guesses after a rejected draft, or rows sample their drafts (whose distributions are kept)."""
        jacobi = self.settings.fallback == "jacobi" and plan.verifying.any()
        return bool(plan.draft_masks.any() or jacobi or self.rows.tensors.draft_log_q is not None)

    def _reads_probabilities(self, plan: StepPlan) -> bool:
        """Whether a row reads a probability this step: a threshold below 1.0 (its confidence), sampling,
        typical acceptance or a draft distribution.  Greedy rows at an exact threshold read only the argmax
        (AR, lossless verify; the draft threshold takes the drafting columns' top probability from their
        logits), and Jacobi rows only theirs: the step skips the log-softmax over the vocabulary."""
        s, rows = self.settings, self.rows
        if rows.sampling or s.typical_epsilon > 0 or rows.tensors.draft_log_q is not None:
            return True
        return not (self.guess_slots or self._exact_rows().all())

    def _verify(self, plan: StepPlan, scores: StepScores, score, count: torch.Tensor):
        """Verifying rows accept their passing drafts plus the target's token after them, then (below
        threshold 1.0) the masks that meet their threshold; next drafts."""
        fused = self._greedy_verify(plan, scores, count)
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
        lossless = not (plan.verifying & ~self._exact_rows()).any()
        from_masks = None if lossless else self._confident_masks(plan, score, passed, all_passed)
        appended = passed + 1 if from_masks is None else passed + 1 + from_masks
        count = torch.where(fed.verifying, appended, count)
        next_drafts = self._next_drafts(plan, scores, appended, all_passed, from_masks)
        return tokens, count, passed.where(fed.verifying, 0), next_drafts

    def _greedy_verify(self, plan: StepPlan, scores: StepScores, count: torch.Tensor):
        """:meth:`_verify` in one kernel (``mars::greedy_verify``: the same results, one op for about 25) where every
        row is greedy at its exact threshold (the step read no probability: nothing sampled, typical or accepted
        unverified) and no row falls back to Jacobi guesses, under the fused choice; None otherwise."""
        s = self.settings
        fused = self.fused_choice and scores.logp is None and s.fallback != "jacobi"
        op = op_or_none(greedy_verify_op) if fused else None
        if op is None:
            return None
        rows, fed = self.rows.tensors, plan.on_device
        threshold = s.draft_threshold if scores.top is not None else 0.0  # (no top: no row fed masks to draft from)
        args = (rows.drafts, fed.drafts, fed.draft_masks, fed.verifying, rows.draft_count, count, threshold)
        count, verified, drafts, draft_count = op(scores.predicted, scores.top, *args)
        if not self._seeds_drafts(plan):  # no next drafts: the rows keep the tensor they had
            drafts = rows.drafts
        return scores.predicted, count, verified, NextDrafts(drafts, draft_count, None)

    def _confident_masks(self, plan: StepPlan, score, passed, all_passed) -> torch.Tensor:
        """Masks a verifying row accepts unverified: the leading ones after its drafts and their AR token
        that meet its threshold, when every draft passed; none at an exact threshold (1.0)."""
        rows, dev, fed = self.rows.tensors, self.device, plan.on_device
        columns = (fed.drafts.unsqueeze(1) + 1 + torch.arange(self.window - 1, device=dev)).clamp_max(
            score.shape[1] - 1
        )
        room = rows.end - rows.length - passed - 1
        metric = self.settings.metric
        return unverified_counts(score.gather(1, columns), rows.threshold, metric, fed.draft_masks, room, all_passed)

    def _check_drafts(self, plan: StepPlan, scores: StepScores):
        """How many leading drafts pass (greedy: equal to the target's argmax before them, or typical under it
        with ``typical_epsilon``; sampling: speculative sampling) and the tokens each row appends."""
        rows, epsilon = self.rows.tensors, self.settings.typical_epsilon
        logp, predicted = scores.logp, scores.predicted
        drafts_fed, verifying = plan.on_device.drafts, plan.on_device.verifying
        widest = int(plan.drafts.max())
        if widest == 0:  # no row fed drafts (a step that only fed masks)
            return predicted, torch.zeros_like(drafts_fed)
        drafts = rows.drafts[:, :widest]
        typical = typical_drafts(logp, drafts, epsilon) if epsilon > 0 else None
        passed = leading_matches(drafts, predicted, drafts_fed, typical)  # the greedy rows'
        sampling = rows.draft_log_q is not None and self.rows.sampling
        if not sampling and typical is None:
            return predicted, passed  # the passed drafts are the argmax: the predictions are the tokens
        token = predicted.gather(1, passed.unsqueeze(1)).squeeze(1)  # the target's token after them
        deciding = plan.verifying & (plan.drafts > 0) & self.rows.host_sampling
        if sampling and deciding.any():
            # only the sampling rows that fed drafts draw (each from its own generator): a row's random stream is
            # spent on its own decisions alone, so its samples never depend on its batch; a sampling row without
            # drafts keeps the token it drew at its AR column, as it would alone
            generators = [g if d else None for g, d in zip(self.rows.records.generators, deciding)]
            sampled_passed, sampled_token = speculative_accept(
                logp[:, : widest + 1], rows.draft_log_q[:, :widest], drafts, drafts_fed, generators
            )
            speculative = torch.from_numpy(deciding).to(self.device)
            passed = torch.where(speculative, sampled_passed, passed)
            token = torch.where(speculative, sampled_token, token)
        width = predicted.shape[1]
        columns = torch.arange(width, device=self.device).unsqueeze(0)
        drafted = torch.nn.functional.pad(rows.drafts, (0, max(0, width - self.max_drafts)))[:, :width]
        after = torch.where(columns == passed.unsqueeze(1), token.unsqueeze(1), predicted)  # then accepted masks
        appended = torch.where(columns < passed.unsqueeze(1), drafted, after)
        return torch.where(verifying.unsqueeze(1), appended, predicted), passed

    def _next_drafts(self, plan: StepPlan, scores: StepScores, first, all_passed, accepted_masks) -> NextDrafts:
        """The masks' predictions when every draft passed (they followed the right text; those after any the
        row accepted: ``accepted_masks``, None for none), else the fallback: none, or the target's unverified
        predictions after the rejected draft (Jacobi-style guesses).  ``first``: the first column read, which is
        the number of tokens the row appends this step (its passing drafts, the target's token, and the masks it
        accepted, which only a row whose drafts all passed accepts)."""
        s, rows, fed = self.settings, self.rows.tensors, plan.on_device
        jacobi = s.fallback == "jacobi"
        if not self._seeds_drafts(plan):
            return NextDrafts(rows.drafts, rows.draft_count.masked_fill(fed.verifying, 0), None)
        predicted = scores.predicted
        read = (first.unsqueeze(1) + self.draft_slots).clamp_max(predicted.shape[1] - 1)
        tokens = predicted.gather(1, read)
        from_masks = fed.draft_masks.clamp_max(self.max_drafts)  # the masks this step fed, after those accepted
        if accepted_masks is not None:
            from_masks = (from_masks - accepted_masks).clamp_min(0)
        count = from_masks.where(all_passed, 0)
        if jacobi:
            # the guesses after the rejected draft: the drafts fed beyond it (passed = first - 1 there)
            count = torch.where(all_passed, count, torch.clamp(fed.drafts + 1 - first, max=self.max_drafts))
        if s.draft_threshold > 0:  # the leading drafts whose column is sure enough of its token
            count = torch.minimum(leading_run(self._draft_confidence(scores, read) >= s.draft_threshold), count)
        log_q = None
        if rows.draft_log_q is not None:
            log_q = scores.logp.gather(1, read.unsqueeze(-1).expand(-1, -1, scores.logp.shape[-1]))
        return NextDrafts(tokens, torch.where(fed.verifying, count, rows.draft_count), log_q)

    def _draft_confidence(self, scores: StepScores, read: torch.Tensor) -> torch.Tensor:
        """The top probability at the columns ``read`` (the argmax's; a sampling row's top token's): from the
        log-probabilities where the step has them, else as ``_choose`` took it from the logits."""
        if scores.logp is None:
            return scores.top.gather(1, read)
        if self.rows.sampling:
            top_logp = scores.logp.max(dim=-1).values
        else:
            top_logp = scores.logp.gather(2, scores.predicted.unsqueeze(-1)).squeeze(-1)
        return top_logp.gather(1, read).exp()

    # ------------------------------------------------------------------ commit
    def _commit(self, plan: StepPlan, accepted: Acceptance) -> Committed:
        """Append the accepted tokens, move the KV cursors, keep the next drafts and guesses; one host sync."""
        rows, dev = self.rows.tensors, self.device
        width = plan.prediction_width
        steps = torch.arange(width, device=dev)
        trash = self.rows.width - 1
        target = torch.where(steps.unsqueeze(0) < accepted.count.unsqueeze(1), rows.length.unsqueeze(1) + steps, trash)
        rows.tokens.scatter_(1, target, accepted.tokens[:, :width])
        # KV cursor: real tokens fed this step are committed (cursor; block at a block boundary);
        # verified drafts were fed with the right prefix, so theirs are committed too.
        moves = self._path_moves(plan, accepted) if accepted.tree is not None else None
        if self.settings.cache == "cursor" or (self.settings.cache == "block" and plan.commit):
            rows.cached = rows.length + accepted.verified
        rows.length = rows.length + accepted.count
        done = accepted.hit_eos | (rows.length >= rows.end)
        self._keep_proposals(plan, accepted)
        committed = self._sync(accepted, done, width)
        if moves is not None and committed.verified[plan.tree_rows].any() and bool((moves[0] != moves[1]).any()):
            self.cache.move(*moves)
        return committed

    def _path_moves(self, plan: StepPlan, accepted: Acceptance) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the tree rows' accepted nodes sit in the KV buffer and where they go: right after the row's text
        (the node at depth d to the length before this step plus d - 1); other slots stay put."""
        tree = accepted.tree
        base = (self.rows.tensors.cached + plan.on_device.uncached).unsqueeze(1)  # the length before this step
        depth = torch.arange(self.tree.depth, device=self.device).unsqueeze(0)
        target = base + depth
        moving = tree.rows.unsqueeze(1) & (depth < accepted.verified.unsqueeze(1))
        return torch.where(moving, base + tree.path, target), target

    def _keep_proposals(self, plan: StepPlan, accepted: Acceptance) -> None:
        """Jacobi's next guesses; verifying rows' next drafts (rows that did not verify keep theirs)."""
        rows, width = self.rows.tensors, plan.prediction_width
        if self.guess_slots and width > 1:
            read = (accepted.count.unsqueeze(1) + torch.arange(self.guess_slots, device=self.device)).clamp_max(
                width - 1
            )
            rows.guesses = accepted.predicted.gather(1, read)
        nxt = accepted.next_drafts
        if nxt is not None:
            verifying = plan.on_device.verifying
            rows.drafts = torch.where(verifying.unsqueeze(1), nxt.tokens, rows.drafts)
            rows.draft_count = nxt.count
            if nxt.log_q is not None:
                rows.draft_log_q = torch.where(verifying.view(-1, 1, 1), nxt.log_q, rows.draft_log_q)
        tree = accepted.tree
        if rows.candidates is not None and nxt is not None:  # rows that verified a chain: its drafts rank first
            chain = plan.on_device.verifying & (plan.on_device.tree_layout < 0)
            first = torch.where(chain.unsqueeze(1), rows.drafts[:, : self.tree.depth], rows.candidates[..., 0])
            rows.candidates = torch.cat([first.unsqueeze(-1), rows.candidates[..., 1:]], dim=-1)
        if tree is not None:
            rows.candidates = torch.where(tree.rows.view(-1, 1, 1), tree.candidates, rows.candidates)
            first = torch.nn.functional.pad(tree.candidates[..., 0], (0, self.max_drafts - self.tree.depth))
            rows.drafts = torch.where(tree.rows.unsqueeze(1), first, rows.drafts)
            rows.draft_count = torch.where(tree.rows, tree.depths, rows.draft_count)

    def _sync(self, accepted: Acceptance, done: torch.Tensor, width: int) -> Committed:
        """The step's one host transfer: counts, flags, cursors, drafts and the accepted tokens."""
        rows, host = self.rows.tensors, self.rows.host
        counts = [
            accepted.count,
            done.long(),
            accepted.hit_eos.long(),
            rows.cached,
            rows.draft_count,
            accepted.verified,
        ]
        synced = torch.cat([torch.stack(counts, dim=1), rows.drafts, accepted.tokens[:, :width]], dim=1).cpu().numpy()
        count, drafts_end = synced[:, 0], len(counts) + self.max_drafts
        host.cached, host.draft_count = synced[:, 3].copy(), synced[:, 4].copy()
        host.drafts = synced[:, len(counts) : drafts_end].copy()
        self.drafter.advance(host.length + synced[:, 5])  # the text is right up to there
        host.length = host.length + count
        done_host, eos_host = synced[:, 1].astype(bool), synced[:, 2].astype(bool)
        return Committed(count, done_host, eos_host, synced[:, 5], synced[:, drafts_end:])

    def _draft_stats(self, plan: StepPlan, verified: np.ndarray) -> None:
        """Count each draft position's proposals and acceptances (rows that fed no drafts add zeros); ``verified``:
        the drafts each row emitted (those that passed, up to its EOS or stop string)."""
        host, slots = self.rows.host, np.arange(self.max_drafts)
        proposed = (slots < plan.drafts[:, None]).astype(np.int64)
        tree = plan.tree_rows
        if tree.any():  # a tree proposes every node at a depth
            proposed[tree, : self.tree.depth] = self.tree.nodes_at_depth[plan.tree_layout[tree]]
        host.proposed += proposed
        host.accepted += slots < verified[:, None]  # (verified <= drafts)
        host.draft_steps += plan.drafts > 0

    # ------------------------------------------------------------------ emit and retire
    def _emit(self, committed: Committed, plan: StepPlan) -> list[StepEvent]:
        """Each row's new tokens after its stop strings, as events, and the drafts among them in the draft counts;
        rows that are done retire."""
        rows, records, done = self.rows, self.rows.records, committed.done
        events: list[StepEvent] = []
        reasons: dict[int, str] = {}
        emitted = np.zeros(len(rows), dtype=np.int64)
        for i in range(len(rows)):
            new = committed.tokens[i, : committed.count[i]].tolist()
            if records.requests[i].stops is not None and new and not done[i]:
                new, reason = self._apply_stops(i, new)
                if reason is not None:
                    done[i], reasons[i] = True, reason
            emitted[i] = len(new)
            records.outputs[i].extend(new)
            # a MARS row's tokens after its verified drafts and the AR token came from masks (Jacobi's did not)
            exact_until = int(committed.verified[i])
            records.from_mask[i].extend(not self.guess_slots and k > exact_until for k in range(len(new)))
            if done[i] and i not in reasons:
                reasons[i] = "eos" if committed.hit_eos[i] else "length"
            events.append(StepEvent(records.requests[i], new, self.forwards))
        if plan.drafts.any():  # drafts past an EOS or a stop string were verified, never emitted: not accepted
            self._draft_stats(plan, np.minimum(committed.verified, emitted))
        if done.any():
            events = self._retire(done, reasons, events)
        return events

    def _apply_stops(self, i: int, new: list[int]) -> tuple[list[int], str | None]:
        """Row ``i``'s new tokens cut at a stop string, and ``stop`` (or ``error``) when it ends there."""
        rows = self.rows
        outputs = rows.records.outputs[i]
        reason = "stop"
        try:
            keep = rows.records.requests[i].stops.completion_index(outputs + new, len(new))
        except Exception:  # a request's own failure must not stop the others
            keep, reason = 0, "error"
        if keep is None:
            return new, None
        new = new[: max(keep - len(outputs), 0)]
        rows.host.length[i] = rows.host.prompt_length[i] + len(outputs) + len(new)
        return new, reason

    def _retire(self, done: np.ndarray, reasons: dict[int, str], events: list[StepEvent]) -> list[StepEvent]:
        rows, records = self.rows, self.rows.records
        for i in np.flatnonzero(done):
            events[i].finished = Finished(
                records.requests[i],
                list(records.outputs[i]),
                int(rows.host.forwards[i]),
                reasons[i],
                rows.host.proposed[i].tolist(),
                rows.host.accepted[i].tolist(),
                list(records.from_mask[i]),
                int(rows.host.draft_steps[i]),
            )
        keep = np.flatnonzero(~done)
        rows.keep(keep)
        if self.cache is not None and len(keep) < len(done):
            self.cache.select_rows(torch.as_tensor(keep, dtype=torch.long, device=self.device))
        self.drafter.keep(keep)
        return events

    def _retire_cancelled(self) -> list[StepEvent]:
        cancelled = np.array([r.cancelled for r in self.rows.records.requests], dtype=bool)
        if not cancelled.any():
            return []
        events = [StepEvent(r, [], self.forwards) for r in self.rows.records.requests]
        events = self._retire(cancelled, {int(i): "cancelled" for i in np.flatnonzero(cancelled)}, events)
        return [e for e in events if e.finished is not None]
