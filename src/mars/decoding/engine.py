"""The step-wise decoding engine: MARS sliding window, block-level cache, per-row cursor cache,
Jacobi iteration and lossless verification, one forward per :meth:`DecodeEngine.step`.

Requests join between steps (:meth:`DecodeEngine.admit`) and leave when done, so the same engine
serves ``generate`` (admit a batch, step until empty) and a server (continuous batching).  A step
has named phases: **plan** (:mod:`mars.decoding.planner`: what each row feeds, its uncommitted real
tokens, its drafts, its masks or Jacobi guesses), **forward** (one batched model call, logits only at
the prediction columns), **accept** (:mod:`mars.decoding.scoring` reads the logits; the threshold rule,
Jacobi matching (:mod:`mars.decoding.jacobi`) or the verifiers of :mod:`mars.decoding.verifiers`),
**commit** (append the accepted tokens, advance the KV cursors, next drafts) and **retire** (EOS,
budget, stop strings, cancellation).

Right shift.  With a row's accepted text ending at position ``c`` (last real token), the output at
``c`` predicts position ``c+1`` (an exact AR prediction) and the output at the k-th mask predicts
``c+1+k``.  A window of ``W`` predictions needs the last real token plus ``W-1`` masks; masks take the
position ids that continue after ``c``.  Under causal attention a column's output does not depend on
the columns after it, so padding a row's input on the right changes none of its predictions.

Cache strategies (``none``, ``cursor``, ``block``): :mod:`mars.decoding.planner`.

Verification (a request with ``verify=True``): a row feeds ``[real | drafts | masks]``, its drafts from
a :class:`~mars.decoding.drafts.DraftSource`, and the verifiers check them against the AR predictions
of the same forward, so its output is exactly greedy AR (or exact AR sampling at temperature > 0).

The step is vectorised over rows; its one host sync is a small transfer of the accepted tokens and
counts, which also feeds streaming.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import jacobi, verifiers
from .acceptance import accept_counts, cut_at_eos, never_emitted, suppress, tempered_log_probs
from .attention import mars_attention
from .drafts import DraftSource, draft_source_for
from .fastpath import enabled_by_env
from .forward import ModelRunner
from .kv import RaggedKVCache
from .planner import StepPlanner
from .requests import new_request
from .rows import Finished, Request, RowBatch, RowMirrors
from .scoring import StepScorer
from .settings import DecodingSettings, is_exact_threshold, validate_threshold
from .step import Acceptance, Committed, StepContext, StepEvent, StepPlan, StepReport, Verdict
from .stopping import StopStrings
from .tree import TreeLayouts
from .verifiers import Verifier

# Off switch for choosing greedy tokens in one kernel pass (acceptance.top_tokens): the same tokens either way.
# MARS_FAST_PATH=0 turns it off too.
TOP_TOKENS_ENV = "MARS_TOP_TOKENS"

log = logging.getLogger(__name__)


class DecodeEngine:
    """See the module docstring.  ``settings`` fixes the engine-wide choices (decoder, cache, window,
    block size, metric, draft source and length, fallback); each :class:`Request` brings its own
    threshold, budget, stop strings, temperature, seed and verification flag.  ``draft_source``: where
    verifying rows' drafts come from (default: the one ``settings`` names).  ``observers``: called after
    each step of the running rows with its :class:`~mars.decoding.step.StepReport` (a benchmark's view)."""

    def __init__(
        self,
        runner: ModelRunner,
        settings: DecodingSettings,
        mask_token_id: int,
        eos_ids: Sequence[int],
        tokenizer=None,
        draft_source: DraftSource | None = None,
    ):
        self.runner, self.settings, self.device = runner, settings, runner.device
        self.mask_id, self.tokenizer = int(mask_token_id), tokenizer
        self.eos = torch.tensor(list(eos_ids), device=self.device)
        fill_window = settings.effective_window == "cache_block"
        window = settings.cache_block if fill_window else int(settings.effective_window)
        self.max_drafts = _max_drafts(settings, window, fill_window)
        guess_slots = window - 1 if settings.decoder == "jacobi" else 0
        self.rows = RowBatch(self.device, self.mask_id, self.max_drafts, guess_slots)
        # the one-pass choice is a kernel of the fast path: off with it (no build where it is not wanted)
        fused_choice = enabled_by_env(TOP_TOKENS_ENV) and runner.fast_path()
        never = never_emitted(self.mask_id, eos_ids)  # the mask token is never an output token
        self.ctx = StepContext(
            settings, runner, self.rows, self.mask_id, never, window, fill_window, self.max_drafts, guess_slots,
            fused_choice, self.log_probs,
        )  # fmt: skip
        self.cache = RaggedKVCache(runner.num_layers) if settings.cache != "none" else None
        if draft_source is None:
            draft_source = draft_source_for(settings, runner, self.log_probs, tokenizer)
        self.drafter = draft_source
        self.verifiers = [cls(self.ctx) for cls in verifiers.VERIFIERS]
        self.planner = StepPlanner(self.ctx, self.drafter, self.verifiers)
        self.scorer = StepScorer(self.ctx)
        self.observers: list[Callable[[StepReport], None]] = []
        self.stepped, self.forwards, self.seconds = False, 0, 0.0
        self.joining: list[Request] = []  # admitted while rows run (cursor cache): prefilled at the next step

    @property
    def tree(self) -> TreeLayouts | None:
        """The tree greedy verifying rows draft (None: chains; ``tree=auto`` resolves when the first arrives)."""
        return next((v.tree for v in self.verifiers if isinstance(v, verifiers.TreeVerifier)), None)

    def log_probs(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one place logits become the distributions tokens are chosen from (the target's and a draft
        model's): tempered log-probabilities and which rows sample; the mask token is never chosen."""
        return tempered_log_probs(suppress(logits, self.ctx.never), temperature)

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
        return new_request(self.settings, self.tokenizer, prompt_ids, stop, id, settings, options)

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
        extra = self.ctx.window + self.max_drafts + 2
        self.rows.add(list(requests), [self._cap(r) for r in requests], extra=extra)
        for verifier in self.verifiers:
            verifier.admit(requests)
        if self.cache is not None:
            self.cache.add_rows(len(requests))
        self.drafter.add_rows(len(requests))

    def _cap(self, request: Request) -> int:
        """Tokens a step may accept for this request: one for exact rows (threshold 1.0), else the window."""
        s = self.settings
        if request.exact and not request.verify:
            return 1
        return s.max_accept if s.max_accept is not None else self.ctx.window

    def set_threshold(self, request_id, threshold: float) -> bool:
        """Change a live request's threshold (a server's load-adaptive knob); it applies from the next step."""
        thr = validate_threshold(threshold, self.settings.metric)  # one number, not a request's settings
        exact = is_exact_threshold(thr, self.settings.metric)
        for r in self.joining:
            if r.id == request_id:
                r.threshold, r.exact = thr, exact
                return True
        for i, r in enumerate(self.rows.records.requests):
            if r.id == request_id:
                if r.verify:
                    return False  # a verifying request keeps its own threshold (lossless without one)
                r.threshold, r.exact = thr, exact
                self.rows.host.exact[i] = exact
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
        plan = self.planner.plan(first=not self.stepped)
        started = time.perf_counter()
        with mars_attention(self.runner.model):
            logits = self._forward(plan)
        if self.observers and self.device.type == "cuda":  # an observer reads the forward's time, not its launch
            torch.cuda.synchronize(self.device)
        forward_seconds = time.perf_counter() - started
        self.forwards += 1
        self.rows.host.forwards += 1
        committed = self._commit(plan, self._accept(plan, logits))
        events, verified = self._emit(committed, plan)
        for observe in self.observers:
            observe(StepReport(plan, verified, forward_seconds))
        self.stepped = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return events

    def _prefill(self, requests: list[Request]) -> list[StepEvent]:
        """Joining rows take their first step in a batch of their own, then merge into the running one."""
        group = DecodeEngine(
            self.runner, self.settings, self.mask_id, self.eos.tolist(), self.tokenizer, self.drafter.fork()
        )
        group.verifiers = [v.for_group(group.ctx) for v in self.verifiers]
        group.planner = StepPlanner(group.ctx, group.drafter, group.verifiers)
        group.observers = self.observers
        group._add(requests)
        for mine, theirs in zip(self.verifiers, group.verifiers):
            mine.adopt(theirs)
        events = group._step_rows()
        for e in events:
            e.forward = self.forwards + 1
        self.forwards += 1
        self.rows.extend(group.rows)
        if self.cache is not None and group.cache is not None:
            self.cache.extend(group.cache)
        self.drafter.extend(group.drafter)
        return events

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
        reads_kw = dict(
            live=live, live_columns=live_reads, widths=plan.kernel_widths(self.rows.host.exact | self.rows.host.verify)
        )
        if self.cache is None:
            attention = (columns.unsqueeze(0) <= columns.unsqueeze(1)).expand(len(self.rows), 1, width, width)
            return self.runner.logits_at(ids, positions, attention, read, **reads_kw)
        kv_length = int(self.rows.host.cached.max()) + width
        self.cache.prepare_step(positions, kv_length)  # each column's keys/values at the next free slot
        for verifier in self.verifiers:
            geometry = verifier.geometry(plan, positions, kv_length)
            if geometry is not None:
                rope, attention = geometry
                return self.runner.logits_at(ids, rope, attention.unsqueeze(1), read, self.cache, **reads_kw)
        attention = torch.arange(kv_length, device=dev).view(1, 1, -1) <= positions.unsqueeze(2)
        return self.runner.logits_at(ids, positions, attention.unsqueeze(1), read, self.cache, **reads_kw)

    def _input_ids(self, plan: StepPlan, positions: torch.Tensor, uncached: torch.Tensor) -> torch.Tensor:
        """Each row's real tokens, then its drafts, then masks (or Jacobi guesses), as its verifier lays them."""
        rows = self.rows.tensors
        ids = rows.tokens.gather(1, positions.clamp_max(self.rows.width - 1))
        after = torch.arange(positions.shape[1], device=self.device).unsqueeze(0) - uncached.unsqueeze(1)
        if self.max_drafts:  # ``after``: columns after the last real token
            drafts = plan.on_device.drafts.unsqueeze(1)
            drafted = rows.drafts.gather(1, after.clamp(0, self.max_drafts - 1))
            proposals = torch.where((after >= 0) & (after < drafts), drafted, self._proposals(after - drafts))
        else:
            proposals = self._proposals(after)
        for verifier in self.verifiers:
            proposals = verifier.inputs(plan, after, proposals)
        return torch.where(after < 0, ids, proposals)

    def _proposals(self, offset: torch.Tensor) -> torch.Tensor:
        """Token ``offset`` places after the last real token (or draft): the mask token for MARS, the
        current guess for Jacobi."""
        if self.rows.guess_slots == 0:
            return torch.full_like(offset, self.mask_id)
        return jacobi.guess_inputs(self.rows, offset)

    # ------------------------------------------------------------------ accept
    def _accept(self, plan: StepPlan, logits: torch.Tensor) -> Acceptance:
        """What every row appends: the threshold rule's tokens (one for exact rows), Jacobi's confirmed guesses,
        or for verifying rows what the verifiers decide."""
        scores = self.scorer.scores(plan, logits)
        rows = self.rows.tensors
        cap_now = torch.minimum(torch.minimum(rows.cap, scores.budget), plan.on_device.predictions)
        cap_now = cap_now.masked_fill(plan.on_device.waiting, 0)
        if self.rows.guess_slots:  # (Jacobi rows never verify)
            count = jacobi.jacobi_counts(self.rows, scores.predicted, plan.prediction_width, cap_now)
        elif scores.score is None:  # every row exact: one token (a verifying row's count is the verifier's)
            count = cap_now.clamp_max(1)
        else:
            count = accept_counts(scores.score, rows.threshold, self.settings.metric, cap_now)
        verdict = Verdict(scores.predicted, count, torch.zeros_like(count))
        if plan.verifying.any():
            for verifier in self.verifiers:
                verdict = verifier.verify(plan, scores, verdict)
        count, hit_eos = cut_at_eos(verdict.tokens, verdict.count, self.eos)
        return Acceptance(
            scores.predicted, verdict.tokens, count, hit_eos, verdict.verified, verdict.next_drafts, verdict.kept
        )

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
        moves = [m for m in (v.kv_moves(plan, accepted) for v in self.verifiers) if m is not None]
        if self.settings.cache == "cursor" or (self.settings.cache == "block" and plan.commit):
            rows.cached = rows.length + accepted.verified
        rows.length = rows.length + accepted.count
        done = accepted.hit_eos | (rows.length >= rows.end)
        self._keep_proposals(plan, accepted)
        committed = self._sync(accepted, done, width)
        for m in moves:
            if committed.verified[m.rows].any() and bool((m.source != m.target).any()):
                self.cache.move(m.source, m.target)
        return committed

    def _keep_proposals(self, plan: StepPlan, accepted: Acceptance) -> None:
        """Jacobi's next guesses; verifying rows' next drafts (rows that did not verify keep theirs); then what
        each verifier keeps."""
        rows = self.rows.tensors
        if self.rows.guess_slots:
            jacobi.keep_guesses(self.rows, accepted.predicted, accepted.count, plan.prediction_width)
        nxt = accepted.next_drafts
        if nxt is not None:
            verifying = plan.on_device.verifying
            rows.drafts = torch.where(verifying.unsqueeze(1), nxt.tokens, rows.drafts)
            rows.draft_count = nxt.count
            if nxt.log_q is not None:
                rows.draft_log_q = torch.where(verifying.view(-1, 1, 1), nxt.log_q, rows.draft_log_q)
        for verifier in self.verifiers:
            verifier.keep(plan, accepted)

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

    # ------------------------------------------------------------------ emit and retire
    def _emit(self, committed: Committed, plan: StepPlan) -> tuple[list[StepEvent], np.ndarray]:
        """Each row's new tokens after its stop strings, as events, and the drafts among them in the draft counts
        (returned: the drafts each row emitted); rows that are done retire."""
        rows, records, done = self.rows, self.rows.records, committed.done
        events: list[StepEvent] = []
        reasons: dict[int, str] = {}
        emitted = np.zeros(len(rows), dtype=np.int64)
        for i in range(len(rows)):
            new = committed.tokens[i, : committed.count[i]].tolist()
            if records.requests[i].stops is not None and new and not done[i]:
                new, reason = rows.cut_at_stop(i, new)
                if reason is not None:
                    done[i], reasons[i] = True, reason
            emitted[i] = len(new)
            records.outputs[i].extend(new)
            # a MARS row's tokens after its verified drafts and the AR token came from masks (Jacobi's did not)
            exact_until = int(committed.verified[i])
            records.from_mask[i].extend(not rows.guess_slots and k > exact_until for k in range(len(new)))
            if done[i] and i not in reasons:
                reasons[i] = "eos" if committed.hit_eos[i] else "length"
            events.append(StepEvent(records.requests[i], new, self.forwards))
        verified = np.minimum(committed.verified, emitted)
        if plan.drafts.any():  # drafts past an EOS or a stop string were verified, never emitted: not accepted
            count_drafts(self.rows.host, plan, verified, self.verifiers)
        if done.any():
            events = self._retire(done, reasons, events)
        return events, verified

    def _retire(self, done: np.ndarray, reasons: dict[int, str], events: list[StepEvent]) -> list[StepEvent]:
        rows = self.rows
        for i in np.flatnonzero(done):
            events[i].finished = rows.finished(i, reasons[i])
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
        reasons = {int(i): "cancelled" for i in np.flatnonzero(cancelled)}
        return [e for e in self._retire(cancelled, reasons, events) if e.finished is not None]


def _max_drafts(settings: DecodingSettings, window: int, fill_window: bool) -> int:
    """Draft slots per row: the masks can draft at most window - 1 tokens; other sources any number."""
    if fill_window:
        return 0
    if settings.draft_source == "masks":
        return max(0, min(settings.effective_draft_length, window - 1))
    return settings.effective_draft_length


def count_drafts(host: RowMirrors, plan: StepPlan, verified: np.ndarray, verifiers: Sequence[Verifier]) -> None:
    """Count each draft position's proposals and acceptances (rows that fed no drafts add zeros); ``verified``:
    the drafts each row emitted (those that passed, up to its EOS or stop string)."""
    slots = np.arange(host.proposed.shape[1])
    proposed = (slots < plan.drafts[:, None]).astype(np.int64)
    for verifier in verifiers:
        verifier.proposed(plan, proposed)
    host.proposed += proposed
    host.accepted += slots < verified[:, None]  # (verified <= drafts)
    host.draft_steps += plan.drafts > 0
