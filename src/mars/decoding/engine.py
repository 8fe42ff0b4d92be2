"""The multi-token decoding loop (MARS sliding window, block-level cache, per-row cursor cache) and
its Jacobi variant.

Right shift.  With a row's accepted text ending at position ``c`` (last real token), the output at
``c`` predicts position ``c+1`` (an exact AR prediction) and the output at the k-th mask predicts
``c+1+k``.  A window of ``W`` predictions therefore needs the last real token plus ``W-1`` masks: a
W-th mask would be dead weight under causal attention (its output predicts nothing we read and no
earlier column attends to it).  Masks take the position ids that continue after ``c``.  Under causal
attention a mask's output does not depend on the masks after it, so the first ``W`` predictions are
the same however many masks follow.

Cache strategies (all compute the same thing with the default window, up to float rounding):

- ``none``: every step runs the full ``[prompt | accepted | W-1 masks]`` of every unfinished row,
  left-padded to a common length (the paper's sliding window).
- ``cursor``: each row keeps its own committed length in a :class:`RaggedKVCache`; a step feeds only
  the row's real tokens that are not cached yet (those accepted in the previous step, or the prompt
  on the first step) plus ``W-1`` masks; the real tokens are committed, the masks forgotten.  Rows
  never wait for each other and finished rows leave the batch at once.
- ``block``: the paper's block-level cache.  The committed prefix only grows at block boundaries:
  each step re-feeds all of a row's tokens since its block start; a row that has accepted at least
  ``cache_block`` tokens in the block waits (accepts nothing) until every row has, then the next
  forward (in which all rows feed their full block) commits the blocks.  Acceptance is never cut at
  the block end, so the output equals ``none``/``cursor``; only the work differs.  With
  ``window="cache_block"`` the masks instead fill the rest of the cache block (the paper's
  block-level sampler; acceptance stops at the block end), which changes outputs.

Jacobi (``proposal="jacobi"``): the ``W-1`` columns after the last real token carry guesses instead
of masks; the predictions at the columns before a guess verify it, so a row accepts the AR token plus
every guess that matches the prediction made from the exact prefix before it — greedy AR output,
fewer forwards when guesses converge.  Next guesses are the unaccepted predictions.

The hot loop is vectorised over rows; the only host sync per step is one small transfer of the
accepted counts and finished flags (plus the generated ids when stop strings are in use).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .acceptance import accept_counts, choose_tokens, cut_at_eos
from .forward import ModelRunner
from .kv import RaggedKVCache
from .stats import DecodeStats
from .stopping import StopStrings

CACHES = ("none", "block", "cursor")


@dataclass
class EngineConfig:
    cache: str
    window: int | str  # int W, or "cache_block"
    cache_block: int
    metric: str
    max_new_tokens: int
    max_accept: int | None
    temperature: float
    proposal: str = "mask"  # mask | jacobi
    # Append masks even when no row can accept more than one token (only to measure their cost).
    full_window: bool = False


class MultiTokenDecoder:
    """Decodes a batch of prompt id lists; see the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        cfg: EngineConfig,
        mask_token_id: int,
        eos_ids: list[int],
        stops: StopStrings,
        generator: torch.Generator | None = None,
        progress: bool = False,
    ):
        self.runner, self.cfg = runner, cfg
        self.mask_id = int(mask_token_id)
        self.device = runner.device
        self.eos = torch.tensor(eos_ids, device=self.device)
        self.stops = stops
        self.generator = generator
        self.progress = progress
        self.fill_window = cfg.window == "cache_block"
        self.W = cfg.cache_block if self.fill_window else int(cfg.window)

    # ------------------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], thresholds: torch.Tensor, ar_rows: torch.Tensor):
        cfg, dev = self.cfg, self.device
        start = time.perf_counter()
        B = len(prompts)
        plen = np.array([len(p) for p in prompts], dtype=np.int64)
        W = self.W
        # Buffer width: prompt + budget + the widest window, plus one trash column for writes to ignore.
        cap = int(plen.max()) + cfg.max_new_tokens + W + 1
        trash = cap
        seq = torch.full((B, cap + 1), self.mask_id, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            seq[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        n = torch.tensor(plen, device=dev)
        prompt_len = n.clone()
        committed = torch.zeros(B, dtype=torch.long, device=dev)
        thr = thresholds.to(dev)
        max_acc = cfg.max_accept if cfg.max_accept is not None else W
        row_cap = torch.where(ar_rows.to(dev), torch.ones_like(n), torch.full_like(n, max_acc))
        row_cap_h = row_cap.cpu().numpy()
        # Jacobi guesses for the W-1 columns after the last real token (the last prompt token repeated).
        guess = seq.gather(1, (n - 1).unsqueeze(1)).expand(B, max(W - 1, 0)).clone()

        n_h, committed_h = plen.copy(), np.zeros(B, dtype=np.int64)
        rows = np.arange(B)  # original index of each live row
        row_forwards = np.zeros(B, dtype=np.int64)
        final_ids: list[list[int] | None] = [None] * B
        cache = None
        if cfg.cache != "none":
            cache = RaggedKVCache(self.runner.num_layers, cap + W)
        forwards = 0
        first = True
        bar = tqdm(total=B, desc=f"mars[{cfg.cache}]", leave=False, disable=not self.progress)

        while len(rows):
            A = len(rows)
            u_h = n_h - committed_h
            commit = cfg.cache == "cursor" or first
            waiting = np.zeros(A, dtype=bool)
            if cfg.cache == "block" and not first:
                full = u_h >= cfg.cache_block
                commit = bool(full.all())
                waiting = full & (not commit)
            # Predictions per row (P_b) and masks per row (P_b - 1).
            if self.fill_window:
                room = np.full(A, cfg.cache_block) if commit else cfg.cache_block - u_h
                P_h = np.maximum(room, 1)
                waiting |= room <= 0
            else:
                P_h = np.full(A, W)
            # Predictions a row cannot accept are dead weight: a waiting row needs only its AR column,
            # and a row capped at k tokens (threshold 1.0, max_accept, the end of its budget) needs
            # only k.  At threshold 1.0 no masks are appended at all and MARS costs what AR costs.
            if not cfg.full_window:
                cap_h = np.minimum(row_cap_h, plen[rows] + cfg.max_new_tokens - n_h)
                P_h = np.minimum(P_h, np.maximum(cap_h, 1))
            P_h = np.where(waiting, 1, P_h)
            P = int(P_h.max())
            P_b = torch.as_tensor(P_h, device=dev)
            ks = torch.arange(P, device=dev)

            if cfg.cache == "none":
                T = int(n_h.max()) + P - 1
                cols = torch.arange(T, device=dev)
                pad = T - (P_b - 1) - n  # real tokens start here
                idx = cols.unsqueeze(0) - pad.unsqueeze(1)
                ids = seq.gather(1, idx.clamp(0, cap - 1))
                ids = torch.where(idx < n.unsqueeze(1), ids, self._proposals(guess, idx - n.unsqueeze(1)))
                pos = idx.clamp_min(0)
                key_ok = idx >= 0
                causal = cols.unsqueeze(0) <= cols.unsqueeze(1)
                attn = (causal.unsqueeze(0) & key_ok.unsqueeze(1)) | torch.eye(T, dtype=torch.bool, device=dev)
                pred_cols = (n - 1 + pad).unsqueeze(1) + ks
                logits = self.runner.logits_at(ids, pos, attn.unsqueeze(1), pred_cols.clamp_max(T - 1))
            else:
                u = n - committed
                Q = int((u_h + P_h - 1).max())
                cols = torch.arange(Q, device=dev)
                wpos = committed.unsqueeze(1) + cols
                ids = seq.gather(1, wpos.clamp_max(cap - 1))
                ids = torch.where(cols < u.unsqueeze(1), ids, self._proposals(guess, cols - u.unsqueeze(1)))
                kv_len = int(committed_h.max()) + Q
                attn = torch.arange(kv_len, device=dev).view(1, 1, -1) <= wpos.unsqueeze(2)
                cache.prepare_step(wpos, kv_len)
                pred_cols = (u - 1).unsqueeze(1) + ks
                logits = self.runner.logits_at(ids, wpos, attn.unsqueeze(1), pred_cols.clamp_max(Q - 1), cache)
            forwards += 1
            row_forwards[rows] += 1

            tokens, score = choose_tokens(logits, cfg.metric, cfg.temperature, self.generator)
            budget = prompt_len + cfg.max_new_tokens - n
            cap_now = torch.minimum(torch.minimum(row_cap, budget), P_b)
            if waiting.any():
                cap_now = cap_now.masked_fill(torch.as_tensor(waiting, device=dev), 0)
            if cfg.proposal == "jacobi":
                # Guess k is verified when the prediction before it (from an exact prefix) equals it.
                m = min(P - 1, guess.shape[1])
                match = (tokens[:, :m] == guess[:, :m]).to(torch.int32)
                run = 1 + torch.cumprod(match, dim=1).sum(dim=1)
                n_acc = torch.minimum(run.to(torch.long), cap_now)
            else:
                n_acc = accept_counts(score, thr, cfg.metric, cap_now)
            n_acc, hit_eos = cut_at_eos(tokens, n_acc, self.eos)

            # Append the accepted tokens (unaccepted positions write to the trash column).
            dst = torch.where(ks.unsqueeze(0) < n_acc.unsqueeze(1), n.unsqueeze(1) + ks, trash)
            seq.scatter_(1, dst, tokens)
            if cfg.proposal == "jacobi" and P > 1:
                nxt = (n_acc.unsqueeze(1) + torch.arange(guess.shape[1], device=dev)).clamp_max(P - 1)
                guess = tokens.gather(1, nxt)
            if commit:
                committed = n.clone()
                committed_h = n_h.copy()
            n = n + n_acc
            done = hit_eos | (n - prompt_len >= cfg.max_new_tokens)

            # The one host sync of the step.
            packed = torch.stack([n_acc, done.to(torch.long)]).cpu().numpy()
            n_h = n_h + packed[0]
            done_h = packed[1].astype(bool)
            if self.stops:
                done_h = self._check_stops(seq, rows, plen, n_h, packed[0], done_h)
                n = torch.as_tensor(n_h, device=dev)
            first = False

            if done_h.any():
                seq_h = seq[torch.as_tensor(np.flatnonzero(done_h), device=dev)].cpu().numpy()
                for j, i in enumerate(np.flatnonzero(done_h)):
                    b = rows[i]
                    final_ids[b] = seq_h[j, plen[b] : n_h[i]].tolist()
                bar.update(int(done_h.sum()))
                keep_h = np.flatnonzero(~done_h)
                keep = torch.as_tensor(keep_h, device=dev)
                seq, n, prompt_len, committed = seq[keep], n[keep], prompt_len[keep], committed[keep]
                thr, row_cap, guess, row_cap_h = thr[keep], row_cap[keep], guess[keep], row_cap_h[keep_h]
                n_h, committed_h, rows = n_h[keep_h], committed_h[keep_h], rows[keep_h]
                if cache is not None and len(keep_h):
                    cache.select_rows(keep)
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        stats = DecodeStats(
            forwards=forwards,
            generated_tokens=0,  # filled by the caller after the shared stop rules
            seconds=seconds,
            per_row_tokens=[],
            per_row_forwards=row_forwards.tolist(),
            decoder="jacobi" if cfg.proposal == "jacobi" else "mars",
        )
        return final_ids, stats

    # ------------------------------------------------------------------------------------------
    def _proposals(self, guess: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Token for a column ``offset`` places after the last real token: the mask token for MARS,
        the current guess for Jacobi (offset 0 is the first column after the last real token)."""
        if self.cfg.proposal != "jacobi" or guess.shape[1] == 0:
            return torch.full_like(offset, self.mask_id)
        return guess.gather(1, offset.clamp(0, guess.shape[1] - 1))

    def _check_stops(self, seq, rows, plen, n_h, n_acc_h, done_h):
        """Rows whose new tokens complete a stop string: cut after the completing token and finish."""
        live = np.flatnonzero((n_acc_h > 0) & ~done_h)
        if len(live) == 0:
            return done_h
        seq_h = seq[torch.as_tensor(live, device=seq.device)].cpu().numpy()
        for j, i in enumerate(live):
            b = rows[i]
            ids = seq_h[j, plen[b] : n_h[i]].tolist()
            keep = self.stops.completion_index(ids, int(n_acc_h[i]))
            if keep is not None:
                n_h[i] = plen[b] + keep
                done_h[i] = True
        return done_h
