"""The state of the rows a decoding engine is working on: one object instead of parallel arrays.

A :class:`Request` is what a caller asks for (prompt ids and its own knobs: threshold, budget, stop
strings, temperature, seed, verification).  :class:`RowBatch` holds every live row's state as tensors
on the model's device (for the vectorised step) with host mirrors of the integers the scheduler reads
each step, and the per-row Python objects (request, generator, stop strings).  Rows join with
:meth:`RowBatch.add` and leave with :meth:`RowBatch.keep`; every field is indexed in one place.

Per row: ``seq`` holds the prompt and the accepted tokens (``n`` of them); ``start`` is how many of
them are already in the KV cache (0 without a cache); the next step feeds ``seq[start:n]``, then the
row's drafts (verification), then its masks or Jacobi guesses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .stopping import StopStrings

_ids = itertools.count()


@dataclass
class Request:
    """One prompt to decode with its own settings (the per-request knobs of a server)."""

    prompt_ids: list[int]
    threshold: float = 1.0
    max_new_tokens: int = 256
    stops: StopStrings | None = None
    temperature: float = 0.0
    seed: int | None = None
    verify: bool = False
    exact: bool = False  # capped at one token per step (threshold 1.0): greedy AR by construction
    id: Any = field(default_factory=lambda: next(_ids))
    # filled by the engine
    cancelled: bool = False


@dataclass
class Finished:
    """A row that left the batch: its generated ids (up to and including EOS or the stop token)."""

    request: Request
    token_ids: list[int]
    forwards: int
    reason: str  # eos | stop | length | cancelled | error
    draft_proposed: list[int] = field(default_factory=list)
    draft_accepted: list[int] = field(default_factory=list)
    from_mask: list[bool] = field(default_factory=list)  # per token: accepted from a mask prediction


class RowBatch:
    """Live rows; see the module docstring."""

    def __init__(self, device: torch.device, mask_id: int, max_drafts: int, guesses: int):
        self.device = device
        self.mask_id = int(mask_id)
        self.K = int(max_drafts)  # draft slots per row (verification)
        self.G = int(guesses)  # Jacobi guess slots per row
        self.width = 1  # seq buffer width (grows)
        self.seq = torch.empty((0, self.width), dtype=torch.long, device=device)
        self.n = torch.empty(0, dtype=torch.long, device=device)
        self.start = torch.empty(0, dtype=torch.long, device=device)
        self.end = torch.empty(0, dtype=torch.long, device=device)  # prompt length + budget
        self.thr = torch.empty(0, dtype=torch.float32, device=device)
        self.cap = torch.empty(0, dtype=torch.long, device=device)  # tokens a step may accept
        self.temp = torch.empty(0, dtype=torch.float32, device=device)
        self.verify = torch.empty(0, dtype=torch.bool, device=device)
        self.drafts = torch.empty((0, self.K), dtype=torch.long, device=device)
        self.n_drafts = torch.empty(0, dtype=torch.long, device=device)
        self.draft_logq: torch.Tensor | None = None  # [rows, K, vocab] when some verifying row samples
        self.guess = torch.empty((0, self.G), dtype=torch.long, device=device)
        # host mirrors and per-row objects
        self.n_h = np.zeros(0, dtype=np.int64)
        self.start_h = np.zeros(0, dtype=np.int64)
        self.plen_h = np.zeros(0, dtype=np.int64)
        self.end_h = np.zeros(0, dtype=np.int64)
        self.cap_h = np.zeros(0, dtype=np.int64)
        self.verify_h = np.zeros(0, dtype=bool)
        self.n_drafts_h = np.zeros(0, dtype=np.int64)
        self.forwards_h = np.zeros(0, dtype=np.int64)
        self.requests: list[Request] = []
        self.generators: list[torch.Generator | None] = []
        self.proposed: list[list[int]] = []  # drafts proposed per draft position, per row
        self.accepted: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def sampling(self) -> bool:
        return bool((self.temp > 0).any()) if len(self) else False

    # ------------------------------------------------------------------ joining and leaving
    def add(self, requests: list[Request], caps: list[int], extra: int) -> None:
        """Append rows; ``extra`` is the room a step needs past a row's budget (window + drafts + trash)."""
        if not requests:
            return
        dev = self.device
        need = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + extra
        if need > self.width:
            self._grow(max(need, int(self.width * 1.5)))
        seq = torch.full((len(requests), self.width), self.mask_id, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            seq[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, dtype=torch.long, device=dev)
        plen = np.array([len(r.prompt_ids) for r in requests], dtype=np.int64)
        end = plen + np.array([r.max_new_tokens for r in requests], dtype=np.int64)
        last = seq.gather(1, torch.as_tensor(plen - 1, device=dev).unsqueeze(1))

        def cat(old: torch.Tensor, new) -> torch.Tensor:
            return torch.cat([old, torch.as_tensor(new, dtype=old.dtype, device=dev)])

        self.seq = torch.cat([self.seq, seq])
        self.n = cat(self.n, plen)
        self.start = cat(self.start, np.zeros(len(requests), dtype=np.int64))
        self.end = cat(self.end, end)
        self.thr = cat(self.thr, [r.threshold for r in requests])
        self.cap = cat(self.cap, caps)
        self.temp = cat(self.temp, [r.temperature for r in requests])
        self.verify = cat(self.verify, [r.verify for r in requests])
        self.drafts = torch.cat([self.drafts, torch.full((len(requests), self.K), self.mask_id, device=dev)])
        self.n_drafts = cat(self.n_drafts, np.zeros(len(requests), dtype=np.int64))
        if self.draft_logq is not None:
            self.draft_logq = torch.cat(
                [self.draft_logq, self.draft_logq.new_zeros((len(requests), *self.draft_logq.shape[1:]))]
            )
        # Jacobi's first guesses: the last prompt token repeated
        self.guess = torch.cat([self.guess, last.expand(-1, self.G)])
        self.n_h = np.concatenate([self.n_h, plen])
        self.start_h = np.concatenate([self.start_h, np.zeros(len(requests), dtype=np.int64)])
        self.plen_h = np.concatenate([self.plen_h, plen])
        self.end_h = np.concatenate([self.end_h, end])
        self.cap_h = np.concatenate([self.cap_h, np.asarray(caps, dtype=np.int64)])
        self.verify_h = np.concatenate([self.verify_h, [r.verify for r in requests]]).astype(bool)
        self.n_drafts_h = np.concatenate([self.n_drafts_h, np.zeros(len(requests), dtype=np.int64)])
        self.forwards_h = np.concatenate([self.forwards_h, np.zeros(len(requests), dtype=np.int64)])
        for r in requests:
            self.requests.append(r)
            self.generators.append(_generator(r.seed, dev) if r.temperature > 0 else None)
            self.proposed.append([0] * self.K)
            self.accepted.append([0] * self.K)

    def extend(self, other: RowBatch) -> None:
        """Append ``other``'s rows (a prefilled group joining the running batch)."""
        if not len(other):
            return
        if other.width > self.width:
            self._grow(other.width)
        elif self.width > other.width:
            other._grow(self.width)
        if (self.draft_logq is None) != (other.draft_logq is None):
            for batch in (self, other):
                if batch.draft_logq is None:
                    vocab = (other.draft_logq if batch is self else self.draft_logq).shape[-1]
                    batch.draft_logq = torch.zeros((len(batch), self.K, vocab), device=self.device)
        for name in ("seq", "n", "start", "end", "thr", "cap", "temp", "verify", "drafts", "n_drafts", "guess"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        if self.draft_logq is not None:
            self.draft_logq = torch.cat([self.draft_logq, other.draft_logq])
        for name in ("n_h", "start_h", "plen_h", "end_h", "cap_h", "verify_h", "n_drafts_h", "forwards_h"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        for name in ("requests", "generators", "proposed", "accepted"):
            getattr(self, name).extend(getattr(other, name))

    def _grow(self, width: int) -> None:
        pad = torch.full((self.seq.shape[0], width - self.width), self.mask_id, dtype=torch.long, device=self.device)
        self.seq = torch.cat([self.seq, pad], dim=1)
        self.width = width

    def keep(self, keep_h: np.ndarray) -> None:
        """Keep only the rows ``keep_h`` (host indices), in that order."""
        keep = torch.as_tensor(keep_h, dtype=torch.long, device=self.device)
        for name in ("seq", "n", "start", "end", "thr", "cap", "temp", "verify", "drafts", "n_drafts", "guess"):
            setattr(self, name, getattr(self, name)[keep])
        if self.draft_logq is not None:
            self.draft_logq = self.draft_logq[keep] if len(keep_h) else None
        for name in ("n_h", "start_h", "plen_h", "end_h", "cap_h", "verify_h", "n_drafts_h", "forwards_h"):
            setattr(self, name, getattr(self, name)[keep_h])
        for name in ("requests", "generators", "proposed", "accepted"):
            setattr(self, name, [getattr(self, name)[i] for i in keep_h])

    # ------------------------------------------------------------------ reading out
    def generated(self, i: int) -> list[int]:
        return self.seq[i, self.plen_h[i] : self.n_h[i]].tolist()

    def row_generators(self) -> list[torch.Generator | None] | None:
        return self.generators if self.sampling else None


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
