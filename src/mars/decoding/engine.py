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

Verification (a request with ``verify=True``): a row feeds ``[real | drafts | W-1 masks]``; drafts are
checked against the AR predictions of the same forward (:mod:`mars.decoding.verify`), so its output is
exactly greedy AR (or exact AR sampling at temperature > 0).  Verified drafts were computed with the
right prefix, so their keys/values are committed too.  When every draft passed, the masks' predictions
(conditioned on them) are the next drafts; after a rejection the ``fallback`` decides (no drafts, or
the unverified AR predictions as Jacobi guesses).

The step is vectorised over rows; its one host sync is a small transfer of the accepted tokens and
counts, which also feeds streaming.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .acceptance import accept_counts, confidence, cut_at_eos, gumbel_noise, never_emitted, suppress, tempered_log_probs
from .attention import gqa_attention
from .forward import ModelRunner
from .kv import RaggedKVCache
from .rows import Finished, Request, RowBatch
from .settings import DecodingSettings, is_exact_threshold, validate_threshold
from .stopping import StopStrings
from .verify import leading_matches, speculative_accept

CACHES = ("none", "block", "cursor")


@dataclass
class StepEvent:
    """What one step did for one row: the tokens it accepted (after stop rules) and, when the row
    left the batch, its :class:`Finished` record."""

    request: Request
    tokens: list[int]
    forward: int  # the engine's forward count at this step (tokens of one forward share it)
    finished: Finished | None = None


class DecodeEngine:
    """See the module docstring.  ``settings`` fixes the engine-wide choices (decoder, cache, window,
    block size, metric, draft length, fallback); each :class:`Request` brings its own threshold,
    budget, stop strings, temperature, seed and verification flag."""

    def __init__(
        self,
        runner: ModelRunner,
        settings: DecodingSettings,
        mask_token_id: int,
        eos_ids: Sequence[int],
        tokenizer=None,
    ):
        self.runner, self.settings = runner, settings
        self.device = runner.device
        self.mask_id = int(mask_token_id)
        self.never = never_emitted(self.mask_id, eos_ids)  # the mask token is never an output token
        self.eos = torch.tensor(list(eos_ids), device=self.device)
        self.tokenizer = tokenizer
        self.fill_window = settings.effective_window == "cache_block"
        self.W = settings.cache_block if self.fill_window else int(settings.effective_window)
        self.K = max(0, min(settings.effective_draft_length, self.W - 1)) if not self.fill_window else 0
        self.G = self.W - 1 if settings.decoder == "jacobi" else 0
        self.rows = RowBatch(self.device, self.mask_id, self.K, self.G)
        self.cache = RaggedKVCache(runner.num_layers) if settings.cache != "none" else None
        self.stepped = False
        self.forwards = 0
        self.seconds = 0.0
        self.joining: list[Request] = []  # admitted while rows run (cursor cache): prefilled at the next step
        self.out_h: list[list[int]] = []  # generated ids per live row (host copy, for streaming and stops)
        self.mask_h: list[list[bool]] = []  # per generated id: accepted from a mask prediction (not verified)

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt_ids: Sequence[int],
        *,
        threshold: float | None = None,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | StopStrings | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        verify: bool | None = None,
        id=None,
    ) -> Request:
        """A request with this engine's defaults for every knob not given (validated)."""
        s = self.settings
        thr = validate_threshold(s.threshold if threshold is None else threshold, s.metric)
        verify = s.verify if verify is None else bool(verify)
        if verify:  # the same rules as the settings object (threshold, decoder, max_accept, window)
            s.replace(verify=True, threshold=thr)
        budget = s.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {budget!r}")
        temp = s.temperature if temperature is None else float(temperature)
        if not temp >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if not isinstance(stop, StopStrings) and stop is not None:
            if self.tokenizer is None:
                raise ValueError("stop strings need the engine's tokenizer")
            stop = StopStrings(self.tokenizer, stop)
        if isinstance(stop, StopStrings) and not stop:
            stop = None
        kwargs = {} if id is None else {"id": id}
        return Request(
            prompt_ids=[int(t) for t in prompt_ids],
            threshold=thr,
            max_new_tokens=budget,
            stops=stop,
            temperature=temp,
            seed=s.seed if seed is None else seed,
            verify=verify,
            exact=is_exact_threshold(thr, s.metric),
            **kwargs,
        )

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
        if any(r.temperature > 0 and r.verify for r in requests) and self.rows.draft_logq is None and self.K:
            vocab = self.runner.vocab_size
            self.rows.draft_logq = torch.zeros((len(self.rows), self.K, vocab), device=self.device)
        self.rows.add(list(requests), [self._cap(r) for r in requests], extra=self.W + self.K + 2)
        self.out_h.extend([] for _ in requests)
        self.mask_h.extend([] for _ in requests)
        if self.cache is not None:
            self.cache.add_rows(len(requests))

    def _cap(self, request: Request) -> int:
        """Tokens a step may accept for this request: one for exact rows (threshold 1.0), else the window."""
        s = self.settings
        return 1 if (request.exact and not request.verify) else (s.max_accept if s.max_accept is not None else self.W)

    def set_threshold(self, request_id, threshold: float) -> bool:
        """Change a live request's threshold (a server's load-adaptive knob); it applies from the next step."""
        thr = validate_threshold(threshold, self.settings.metric)
        for r in self.joining:
            if r.id == request_id:
                r.threshold, r.exact = thr, is_exact_threshold(thr, self.settings.metric)
                return True
        for i, r in enumerate(self.rows.requests):
            if r.id == request_id:
                if r.verify:
                    return False  # verified rows are exact at any threshold
                r.threshold, r.exact = thr, is_exact_threshold(thr, self.settings.metric)
                with torch.inference_mode():  # the row tensors were made inside a step
                    self.rows.thr[i] = thr
                    self.rows.cap[i] = self._cap(r)
                self.rows.cap_h[i] = self._cap(r)
                return True
        return False

    def cancel(self, request_id) -> bool:
        """Mark a request cancelled; it leaves the batch at the next step (reason ``cancelled``)."""
        for r in [*self.rows.requests, *self.joining]:
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
            events += self._prefill(joining)
        self.seconds += time.perf_counter() - t0
        return events

    def _step_rows(self) -> list[StepEvent]:
        plan = self._plan()
        with gqa_attention(self.runner.model):
            logits = self._forward(plan)
        self.forwards += 1
        self.rows.forwards_h += 1
        accepted = self._accept(plan, logits)
        events = self._commit_and_retire(plan, accepted)
        self.stepped = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return events

    def _prefill(self, requests: list[Request]) -> list[StepEvent]:
        """Joining rows take their first step in a batch of their own, then merge into the running one."""
        group = DecodeEngine(self.runner, self.settings, self.mask_id, self.eos.tolist(), self.tokenizer)
        group._add(requests)
        events = group._step_rows()
        for e in events:
            e.forward = self.forwards + 1
        self.forwards += 1
        self.rows.extend(group.rows)
        self.out_h.extend(group.out_h)
        self.mask_h.extend(group.mask_h)
        if self.cache is not None and group.cache is not None:
            self.cache.extend(group.cache)
        return events

    def _plan(self) -> dict:
        s, rows = self.settings, self.rows
        A = len(rows)
        u_h = rows.n_h - rows.start_h
        first = not self.stepped
        commit = s.cache == "cursor" or (s.cache == "block" and first)
        waiting = np.zeros(A, dtype=bool)
        if s.cache == "block" and not first:
            full = u_h >= s.cache_block
            commit = bool(full.all())
            waiting = full & (not commit)
        budget_h = rows.end_h - rows.n_h
        # Predictions per row.  A row capped at k tokens (threshold 1.0, max_accept, the end of its
        # budget) needs only k; at threshold 1.0 no masks are appended and MARS costs what AR costs.
        if self.fill_window:
            room = np.full(A, s.cache_block) if commit else s.cache_block - u_h
            P_h = np.maximum(room, 1)
            waiting = waiting | (room <= 0)
        else:
            P_h = np.full(A, self.W)
        if not s.full_window:
            P_h = np.minimum(P_h, np.maximum(np.minimum(rows.cap_h, budget_h), 1))
        # Verifying rows: the AR column, their drafts (no more than can still be accepted), and masks
        # for the next drafts when tokens can follow this step's.
        v_h = rows.verify_h & ~waiting
        k_h = np.where(v_h, np.minimum(rows.n_drafts_h, budget_h - 1), 0)
        masks_v = np.where(budget_h > k_h + 1, self.W - 1, 0)
        P_h = np.where(v_h, 1 + k_h + masks_v, P_h)
        P_h = np.where(waiting, 1, P_h)
        return dict(
            u_h=u_h,
            P_h=P_h,
            k_h=k_h,
            masks_v=masks_v,
            waiting=waiting,
            commit=commit,
            v_h=v_h,
            budget_h=budget_h,
            P=int(P_h.max()),
            Q=int((u_h + P_h - 1).max()),
        )

    def _forward(self, plan: dict) -> torch.Tensor:
        rows, dev = self.rows, self.device
        Q, P = plan["Q"], plan["P"]
        u = torch.as_tensor(plan["u_h"], device=dev)
        k = torch.as_tensor(plan["k_h"], device=dev)
        cols = torch.arange(Q, device=dev)
        wpos = rows.start.unsqueeze(1) + cols  # position ids (= KV buffer positions)
        ids = rows.seq.gather(1, wpos.clamp_max(rows.width - 1))
        off = cols.unsqueeze(0) - u.unsqueeze(1)  # columns after the last real token
        if self.K:
            is_draft = (off >= 0) & (off < k.unsqueeze(1))
            drafted = rows.drafts.gather(1, off.clamp(0, self.K - 1))
            after = torch.where(is_draft, drafted, self._proposals(off - k.unsqueeze(1)))
        else:
            after = self._proposals(off)
        ids = torch.where(off < 0, ids, after)
        pred_cols = ((u - 1).unsqueeze(1) + torch.arange(P, device=dev)).clamp_max(Q - 1)
        # Columns a row reads: its real tokens and the inputs of its own P_h predictions; the rest pads it
        # to the batch's widest row (a threshold-1.0 row beside rows with masks), skipped by the fast path.
        P_b = torch.as_tensor(plan["P_h"], device=dev).unsqueeze(1)
        live = cols.unsqueeze(0) < u.unsqueeze(1) + P_b - 1
        live_preds = torch.arange(P, device=dev).unsqueeze(0) < P_b
        if self.cache is None:
            attn = (cols.unsqueeze(0) <= cols.unsqueeze(1)).expand(len(rows), 1, Q, Q)
            return self.runner.logits_at(ids, wpos, attn, pred_cols, live=live, live_columns=live_preds)
        kv_len = int(rows.start_h.max()) + Q
        attn = torch.arange(kv_len, device=dev).view(1, 1, -1) <= wpos.unsqueeze(2)
        self.cache.prepare_step(wpos, kv_len)
        return self.runner.logits_at(
            ids, wpos, attn.unsqueeze(1), pred_cols, self.cache, live=live, live_columns=live_preds
        )

    def _proposals(self, offset: torch.Tensor) -> torch.Tensor:
        """Token ``offset`` places after the last real token (or draft): the mask token for MARS, the
        current guess for Jacobi."""
        if self.G == 0:
            return torch.full_like(offset, self.mask_id)
        return self.rows.guess.gather(1, offset.clamp(0, self.G - 1))

    def _accept(self, plan: dict, logits: torch.Tensor) -> dict:
        s, rows, dev = self.settings, self.rows, self.device
        P = plan["P"]
        logp, sampled = tempered_log_probs(suppress(logits, self.never), rows.temp)
        tokens = torch.argmax(logp, dim=-1)
        gens = rows.row_generators()
        if sampled is not None:
            draws = torch.argmax(logp + gumbel_noise(logp, gens, plan["P_h"]), dim=-1)
            tokens = torch.where(sampled.unsqueeze(1), draws, tokens)
        P_b = torch.as_tensor(plan["P_h"], device=dev)
        waiting = torch.as_tensor(plan["waiting"], device=dev)
        budget = rows.end - rows.n
        cap_now = torch.minimum(torch.minimum(rows.cap, budget), P_b).masked_fill(waiting, 0)
        if self.G:
            m = min(P - 1, self.G)
            run = 1 + leading_matches(rows.guess[:, :m], tokens[:, :m], torch.full_like(cap_now, m))
            n_acc = torch.minimum(run, cap_now)
        else:
            n_acc = accept_counts(confidence(logp, tokens, s.metric), rows.thr, s.metric, cap_now)
        acc_tokens = tokens
        out = dict(tokens=tokens, logp=logp)
        if plan["v_h"].any():
            acc_tokens, n_acc = self._verify(plan, logp, tokens, n_acc, out)
        n_acc, hit_eos = cut_at_eos(acc_tokens, n_acc, self.eos)
        out.update(acc_tokens=acc_tokens, n_acc=n_acc, hit_eos=hit_eos)
        return out

    def _verify(self, plan: dict, logp: torch.Tensor, tokens: torch.Tensor, n_acc: torch.Tensor, out: dict):
        """Accept verified drafts plus the AR token after them; choose the next drafts."""
        s, rows, dev = self.settings, self.rows, self.device
        v = torch.as_tensor(plan["v_h"], device=dev)
        k = torch.as_tensor(plan["k_h"], device=dev)
        kmax = int(plan["k_h"].max())
        acc_tokens = tokens
        if rows.draft_logq is not None and bool((rows.temp > 0).any()):
            j, x = speculative_accept(
                logp[:, : kmax + 1], rows.draft_logq[:, :kmax], rows.drafts[:, :kmax], k, rows.row_generators()
            )
            greedy_rows = rows.temp <= 0
            j = torch.where(greedy_rows, leading_matches(rows.drafts[:, :kmax], tokens, k), j)
            x = torch.where(greedy_rows, tokens.gather(1, j.unsqueeze(1)).squeeze(1), x)
            cols = torch.arange(tokens.shape[1], device=dev).unsqueeze(0)
            drafted = torch.nn.functional.pad(rows.drafts, (0, max(0, tokens.shape[1] - self.K)))[:, : tokens.shape[1]]
            spec = torch.where(cols < j.unsqueeze(1), drafted, x.unsqueeze(1))
            acc_tokens = torch.where(v.unsqueeze(1), spec, tokens)
        else:
            j = leading_matches(rows.drafts[:, :kmax], tokens, k)
        n_acc = torch.where(v, j + 1, n_acc)
        # next drafts: the masks' predictions when every draft passed, else the fallback
        W1 = self.W - 1
        all_ok = (j == k) & torch.as_tensor(plan["masks_v"] > 0, device=dev)
        idx = torch.where(all_ok, k + 1, j + 1).unsqueeze(1) + torch.arange(self.K, device=dev)
        idx = idx.clamp_max(tokens.shape[1] - 1)
        nxt = tokens.gather(1, idx)
        count = torch.where(all_ok, torch.full_like(k, min(self.K, W1)), torch.zeros_like(k))
        if s.fallback == "jacobi":
            count = torch.where(all_ok, count, torch.clamp(k - j, max=self.K))
        if s.draft_threshold > 0:
            top = logp.max(dim=-1).values.gather(1, idx).exp()
            strong = leading_matches(torch.ones_like(nxt), (top >= s.draft_threshold).long(), count)
            count = torch.minimum(count, strong)
        out.update(
            j=j,
            k=k,
            next_drafts=nxt,
            next_count=torch.where(v, count, rows.n_drafts),
            next_logq=logp.gather(1, idx.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
            if rows.draft_logq is not None
            else None,
            verify_rows=v,
        )
        return acc_tokens, n_acc

    def _commit_and_retire(self, plan: dict, acc: dict) -> list[StepEvent]:
        s, rows, dev = self.settings, self.rows, self.device
        P = plan["P"]
        n_acc, acc_tokens, hit_eos = acc["n_acc"], acc["acc_tokens"], acc["hit_eos"]
        ks = torch.arange(P, device=dev)
        trash = rows.width - 1
        dst = torch.where(ks.unsqueeze(0) < n_acc.unsqueeze(1), rows.n.unsqueeze(1) + ks, trash)
        rows.seq.scatter_(1, dst, acc_tokens[:, :P])
        n_old = rows.n
        # KV cursor: real tokens fed this step are committed (cursor; block at a block boundary);
        # verified drafts were fed with the right prefix, so theirs are committed too.
        verified = (
            acc["j"].where(acc["verify_rows"], torch.zeros_like(n_acc)) if "j" in acc else torch.zeros_like(n_acc)
        )
        if s.cache == "cursor" or (s.cache == "block" and plan["commit"]):
            rows.start = n_old + verified
        rows.n = n_old + n_acc
        done = hit_eos | (rows.n >= rows.end)
        if self.G and P > 1:
            nxt = (n_acc.unsqueeze(1) + torch.arange(self.G, device=dev)).clamp_max(P - 1)
            rows.guess = acc["tokens"].gather(1, nxt)
        if "next_drafts" in acc:  # rows that did not verify this step (waiting) keep their drafts
            v = acc["verify_rows"]
            rows.drafts = torch.where(v.unsqueeze(1), acc["next_drafts"], rows.drafts)
            rows.n_drafts = acc["next_count"]
            if acc["next_logq"] is not None:
                rows.draft_logq = torch.where(v.view(-1, 1, 1), acc["next_logq"], rows.draft_logq)
        # the one host sync: counts, flags and the accepted tokens
        parts = [n_acc, done.long(), hit_eos.long(), rows.start, rows.n_drafts]
        if "j" in acc:
            parts.append(acc["j"])
        host = torch.cat([torch.stack(parts, dim=1), acc_tokens[:, :P]], dim=1).cpu().numpy()
        width = len(parts)
        n_acc_h, done_h, eos_h = host[:, 0], host[:, 1].astype(bool), host[:, 2].astype(bool)
        rows.start_h, rows.n_drafts_h = host[:, 3].copy(), host[:, 4].copy()
        rows.n_h = rows.n_h + n_acc_h
        if "j" in acc:
            self._draft_stats(plan["k_h"], host[:, 5], plan["v_h"])

        events: list[StepEvent] = []
        reasons: dict[int, str] = {}
        for i in range(len(rows)):
            new = host[i, width : width + n_acc_h[i]].tolist()
            stops = rows.requests[i].stops
            if stops is not None and new and not done_h[i]:
                try:
                    keep = stops.completion_index(self.out_h[i] + new, len(new))
                except Exception:  # a request's own failure must not stop the others
                    keep, reasons[i] = 0, "error"
                    done_h[i] = True
                if keep is not None:
                    cut = keep - len(self.out_h[i])
                    new = new[: max(cut, 0)]
                    rows.n_h[i] = rows.plen_h[i] + len(self.out_h[i]) + len(new)
                    done_h[i] = True
                    reasons.setdefault(i, "stop")
            self.out_h[i].extend(new)
            # a MARS row's tokens after the first of a step came from masks (verified and Jacobi ones did not)
            from_mask = not self.G and not rows.verify_h[i]
            self.mask_h[i].extend(from_mask and k > 0 for k in range(len(new)))
            if done_h[i] and i not in reasons:
                reasons[i] = "eos" if eos_h[i] else "length"
            events.append(StepEvent(rows.requests[i], new, self.forwards))
        if done_h.any():
            events = self._retire(done_h, reasons, events)
        return events

    def _draft_stats(self, k_h: np.ndarray, j_h: np.ndarray, v_h: np.ndarray) -> None:
        for i in np.flatnonzero(v_h & (k_h > 0)):
            for pos in range(int(k_h[i])):
                self.rows.proposed[i][pos] += 1
                if pos < j_h[i]:
                    self.rows.accepted[i][pos] += 1

    def _retire(self, done_h: np.ndarray, reasons: dict[int, str], events: list[StepEvent]) -> list[StepEvent]:
        rows = self.rows
        for i in np.flatnonzero(done_h):
            events[i].finished = Finished(
                rows.requests[i],
                list(self.out_h[i]),
                int(rows.forwards_h[i]),
                reasons[i],
                list(rows.proposed[i]),
                list(rows.accepted[i]),
                list(self.mask_h[i]),
            )
        keep_h = np.flatnonzero(~done_h)
        rows.keep(keep_h)
        self.out_h = [self.out_h[i] for i in keep_h]
        self.mask_h = [self.mask_h[i] for i in keep_h]
        if self.cache is not None and len(keep_h) < len(done_h):
            self.cache.select_rows(torch.as_tensor(keep_h, dtype=torch.long, device=self.device))
        return events

    def _retire_cancelled(self) -> list[StepEvent]:
        cancelled = np.array([r.cancelled for r in self.rows.requests], dtype=bool)
        if not cancelled.any():
            return []
        events = [StepEvent(r, [], self.forwards) for r in self.rows.requests]
        events = self._retire(cancelled, {int(i): "cancelled" for i in np.flatnonzero(cancelled)}, events)
        return [e for e in events if e.finished is not None]
