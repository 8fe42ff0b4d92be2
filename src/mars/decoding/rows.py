"""The state of the rows a decoding engine is working on: one object instead of parallel arrays.

A :class:`Request` is what a caller asks for (prompt ids and its own knobs: threshold, budget, stop
strings, temperature, seed, verification).  :class:`RowBatch` holds every live row's state in three
groups, each a dataclass whose fields are declared once: :class:`RowTensors` on the model's device (for
the vectorised step), :class:`RowMirrors`, host copies of the integers the scheduler reads every step
(no device sync), and :class:`RowRecords`, the per-row Python objects (request, generator, outputs, draft
statistics).  Rows join with :meth:`RowBatch.add` / :meth:`RowBatch.extend` and leave with
:meth:`RowBatch.keep`, which walk those declarations, so a new per-row field is one line in its group.

Per row: ``tokens`` holds the prompt and the accepted tokens (``length`` of them); ``cached`` is how many
of them are already in the KV cache (0 without a cache); the next step feeds ``tokens[cached:length]``,
then the row's drafts (verification), then its masks or Jacobi guesses.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    settings: Any = None  # the request's DecodingSettings (the engine's with its per-request fields)
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
    draft_steps: int = 0  # steps on which the row verified at least one draft


@dataclass
class DraftProposal:
    """New drafts a draft source proposes for a step, to follow each row's carried ones: ``need[i]`` for row ``i``
    (``tokens[i, :need[i]]``, ``[rows, steps]`` on the rows' device) and, once a row samples (``draft_log_q``), the
    distributions they were drawn from (``log_q``: ``[rows, steps, vocab]``)."""

    need: np.ndarray
    tokens: torch.Tensor
    log_q: torch.Tensor | None = None


@dataclass
class RowTensors:
    """Per-row state on the model's device, one entry (first axis) per row."""

    tokens: torch.Tensor  # [rows, width]: the prompt, the accepted tokens, then padding (the mask token)
    length: torch.Tensor  # tokens held: prompt + accepted
    cached: torch.Tensor  # of them already in the KV cache: the next step feeds tokens[cached:length]
    end: torch.Tensor  # prompt length + budget
    threshold: torch.Tensor  # float32
    cap: torch.Tensor  # tokens a step may accept
    temperature: torch.Tensor  # float32
    verify: torch.Tensor  # bool
    drafts: torch.Tensor  # [rows, max_drafts]: what the next step verifies
    draft_count: torch.Tensor  # how many of ``drafts`` are real
    guesses: torch.Tensor  # [rows, guess_slots]: Jacobi's current guesses
    draft_log_q: torch.Tensor | None  # [rows, max_drafts, vocab] once a verifying row samples: each draft's source
    candidates: torch.Tensor | None = None  # [rows, depth, width] under tree drafts: each depth's top tokens


@dataclass
class RowMirrors:
    """Host copies of what the scheduler reads every step, refreshed by the step's one host sync."""

    length: np.ndarray
    cached: np.ndarray
    prompt_length: np.ndarray
    end: np.ndarray
    cap: np.ndarray
    verify: np.ndarray  # bool
    exact: np.ndarray  # bool: the request's threshold is exact (Request.exact)
    draft_count: np.ndarray
    drafts: np.ndarray  # [rows, max_drafts]
    forwards: np.ndarray  # forwards the row took part in
    proposed: np.ndarray  # [rows, max_drafts]: drafts proposed, per draft position
    accepted: np.ndarray  # [rows, max_drafts]: drafts accepted, per draft position
    draft_steps: np.ndarray  # steps on which the row verified at least one draft


@dataclass
class RowRecords:
    """Per-row Python objects."""

    requests: list[Request]
    generators: list[torch.Generator | None]
    outputs: list[list[int]]  # generated ids after the stop rules (what streaming has sent)
    from_mask: list[list[bool]]  # per generated id: accepted from a mask prediction (neither AR nor verified)


Group = TypeVar("Group", RowTensors, RowMirrors, RowRecords)


def _concat(first: Group, second: Group, first_rows: int, second_rows: int) -> Group:
    """Rows of ``first`` then ``second``, field by field (an optional tensor missing on one side is zeros)."""
    values = {}
    for f in dataclasses.fields(first):
        a, b = getattr(first, f.name), getattr(second, f.name)
        if a is None and b is None:
            values[f.name] = None
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a = b.new_zeros((first_rows, *b.shape[1:])) if a is None else a
            b = a.new_zeros((second_rows, *a.shape[1:])) if b is None else b
            values[f.name] = torch.cat([a, b])
        elif isinstance(a, np.ndarray):
            values[f.name] = np.concatenate([a, b])
        else:
            values[f.name] = [*a, *b]
    return type(first)(**values)


def _select(group: Group, keep_host: np.ndarray, keep_device: torch.Tensor) -> Group:
    """The rows ``keep`` of ``group``, in that order (an optional tensor stays None, or None with no rows)."""
    values = {}
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        if value is None or (f.name in ("draft_log_q", "candidates") and not len(keep_host)):
            values[f.name] = None
        elif isinstance(value, torch.Tensor):
            values[f.name] = value[keep_device]
        elif isinstance(value, np.ndarray):
            values[f.name] = value[keep_host]
        else:
            values[f.name] = [value[i] for i in keep_host]
    return type(group)(**values)


class RowBatch:
    """Live rows; see the module docstring.  ``max_drafts`` draft slots (verification) and ``guess_slots``
    Jacobi guesses per row."""

    def __init__(self, device: torch.device, mask_id: int, max_drafts: int, guess_slots: int):
        self.device = device
        self.mask_id = int(mask_id)
        self.max_drafts = int(max_drafts)
        self.guess_slots = int(guess_slots)
        self.width = 1  # tokens buffer width (grows)
        self.tensors, self.host, self.records = self._new_rows([], [])

    def __len__(self) -> int:
        return len(self.records.requests)

    @property
    def sampling(self) -> bool:
        return any(r.temperature > 0 for r in self.records.requests)  # (host side: no device op per ask)

    @property
    def host_sampling(self) -> np.ndarray:
        """Per row, whether it samples (temperature > 0: it has a generator)."""
        return np.array([g is not None for g in self.records.generators], dtype=bool)

    # ------------------------------------------------------------------ joining and leaving
    def add(self, requests: list[Request], caps: list[int], extra: int) -> None:
        """Append rows; ``extra`` is the room a step needs past a row's budget (window + drafts + trash)."""
        if not requests:
            return
        need = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + extra
        if need > self.width:
            self._grow(max(need, int(self.width * 1.5)))
        joining = RowBatch(self.device, self.mask_id, self.max_drafts, self.guess_slots)
        joining.width = self.width
        joining.tensors, joining.host, joining.records = joining._new_rows(requests, caps)
        self.extend(joining)

    def _new_rows(self, requests: list[Request], caps: list[int]) -> tuple[RowTensors, RowMirrors, RowRecords]:
        """The three groups for fresh rows (nothing accepted, nothing cached, no drafts)."""
        prompt_length = np.array([len(r.prompt_ids) for r in requests], dtype=np.int64)
        end = prompt_length + np.array([r.max_new_tokens for r in requests], dtype=np.int64)
        tensors = self._new_tensors(requests, caps, prompt_length, end)
        host = self._new_mirrors(requests, caps, prompt_length, end)
        records = RowRecords(
            requests=list(requests),
            generators=[_generator(r.seed, self.device) if r.temperature > 0 else None for r in requests],
            outputs=[[] for _ in requests],
            from_mask=[[] for _ in requests],
        )
        return tensors, host, records

    def _new_tensors(
        self, requests: list[Request], caps: list[int], prompt_length: np.ndarray, end: np.ndarray
    ) -> RowTensors:
        """Fresh rows' device state: the prompts followed by mask tokens, no drafts, Jacobi's first guesses."""
        dev, count = self.device, len(requests)
        zeros = np.zeros(count, dtype=np.int64)
        tokens = torch.full((count, self.width), self.mask_id, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            tokens[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, dtype=torch.long, device=dev)
        last_prompt_token = tokens.gather(1, torch.as_tensor(prompt_length - 1, device=dev).unsqueeze(1))
        drafts = torch.full((count, self.max_drafts), self.mask_id, dtype=torch.long, device=dev)

        def on_device(values, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype, device=dev)

        return RowTensors(
            tokens=tokens,
            length=on_device(prompt_length, torch.long),
            cached=on_device(zeros, torch.long),
            end=on_device(end, torch.long),
            threshold=on_device([r.threshold for r in requests], torch.float32),
            cap=on_device(caps, torch.long),
            temperature=on_device([r.temperature for r in requests], torch.float32),
            verify=on_device([r.verify for r in requests], torch.bool),
            drafts=drafts,
            draft_count=on_device(zeros, torch.long),
            guesses=last_prompt_token.expand(-1, self.guess_slots),  # Jacobi's first guesses: the last prompt token
            draft_log_q=None,
        )

    def _new_mirrors(
        self, requests: list[Request], caps: list[int], prompt_length: np.ndarray, end: np.ndarray
    ) -> RowMirrors:
        """Fresh rows' host mirrors: their lengths, caps and modes, and zero counters."""
        count = len(requests)
        zeros = np.zeros(count, dtype=np.int64)
        return RowMirrors(
            length=prompt_length.copy(),
            cached=zeros.copy(),
            prompt_length=prompt_length,
            end=end,
            cap=np.asarray(caps, dtype=np.int64),
            verify=np.array([r.verify for r in requests], dtype=bool),
            exact=np.array([r.exact for r in requests], dtype=bool),
            draft_count=zeros.copy(),
            drafts=np.full((count, self.max_drafts), self.mask_id, dtype=np.int64),
            forwards=zeros.copy(),
            proposed=np.zeros((count, self.max_drafts), dtype=np.int64),
            accepted=np.zeros((count, self.max_drafts), dtype=np.int64),
            draft_steps=zeros.copy(),
        )

    def extend(self, other: RowBatch) -> None:
        """Append ``other``'s rows (a prefilled group joining the running batch)."""
        if not len(other):
            return
        if other.width > self.width:
            self._grow(other.width)
        elif self.width > other.width:
            other._grow(self.width)
        mine, theirs = len(self), len(other)
        self.tensors = _concat(self.tensors, other.tensors, mine, theirs)
        self.host = _concat(self.host, other.host, mine, theirs)
        self.records = _concat(self.records, other.records, mine, theirs)

    def keep(self, keep_host: np.ndarray) -> None:
        """Keep only the rows ``keep_host`` (host indices), in that order."""
        keep_device = torch.as_tensor(keep_host, dtype=torch.long, device=self.device)
        self.tensors = _select(self.tensors, keep_host, keep_device)
        self.host = _select(self.host, keep_host, keep_device)
        self.records = _select(self.records, keep_host, keep_device)

    def _grow(self, width: int) -> None:
        tokens = self.tensors.tokens
        pad = torch.full((tokens.shape[0], width - self.width), self.mask_id, dtype=torch.long, device=self.device)
        self.tensors.tokens = torch.cat([tokens, pad], dim=1)
        self.width = width

    def ensure_draft_distributions(self, vocab: int) -> None:
        """Room for the distribution each draft was sampled from (speculative sampling needs it)."""
        if self.tensors.draft_log_q is None and self.max_drafts:
            shape = (len(self), self.max_drafts, vocab)
            self.tensors.draft_log_q = torch.zeros(shape, device=self.device)

    def ensure_candidates(self, depth: int, width: int) -> None:
        """Room for each row's tree candidates (every depth's top ``width`` tokens of the masks)."""
        if self.tensors.candidates is None:
            shape = (len(self), depth, width)
            self.tensors.candidates = torch.full(shape, self.mask_id, dtype=torch.long, device=self.device)

    def append_drafts(self, proposal: DraftProposal | None) -> None:
        """Place a draft source's new drafts after each row's carried ones on the device (``host.drafts`` follows at
        the step's one host sync, as every mirror does) and count them on both, with the distributions they came
        from once a row samples (``draft_log_q``)."""
        if proposal is None:
            return
        tensors, host, need = self.tensors, self.host, proposal.need
        carried = host.draft_count
        steps = np.arange(proposal.tokens.shape[1])
        slots = np.where(steps[None, :] < need[:, None], carried[:, None] + steps[None, :], self.max_drafts)
        padded = torch.cat([tensors.drafts, tensors.drafts[:, :1]], dim=1)  # the last column takes the unused
        slots_device = torch.as_tensor(slots, device=self.device)
        tensors.drafts = padded.scatter_(1, slots_device, proposal.tokens)[:, : self.max_drafts]
        host.draft_count = carried + need
        tensors.draft_count = torch.tensor(host.draft_count, dtype=torch.long, device=self.device)
        if tensors.draft_log_q is None or proposal.log_q is None:
            return
        for i in np.flatnonzero(need > 0):
            start = int(carried[i])
            tensors.draft_log_q[i, start : start + int(need[i])] = proposal.log_q[i, : int(need[i])]

    # ------------------------------------------------------------------ reading out
    def generated(self, i: int) -> list[int]:
        return self.tensors.tokens[i, self.host.prompt_length[i] : self.host.length[i]].tolist()

    def cut_at_stop(self, i: int, new: list[int]) -> tuple[list[int], str | None]:
        """Row ``i``'s new tokens cut at a stop string, and ``stop`` (or ``error``) when it ends there."""
        outputs = self.records.outputs[i]
        reason = "stop"
        try:
            keep = self.records.requests[i].stops.completion_index(outputs + new, len(new))
        except Exception:  # a request's own failure must not stop the others
            keep, reason = 0, "error"
        if keep is None:
            return new, None
        new = new[: max(keep - len(outputs), 0)]
        self.host.length[i] = self.host.prompt_length[i] + len(outputs) + len(new)
        return new, reason

    def finished(self, i: int, reason: str) -> Finished:
        """Row ``i``'s record as it leaves for ``reason``: its output, forwards and draft counts."""
        host, records = self.host, self.records
        return Finished(
            records.requests[i],
            list(records.outputs[i]),
            int(host.forwards[i]),
            reason,
            host.proposed[i].tolist(),
            host.accepted[i].tolist(),
            list(records.from_mask[i]),
            int(host.draft_steps[i]),
        )

    def row_generators(self) -> list[torch.Generator | None] | None:
        return self.records.generators if self.sampling else None


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
