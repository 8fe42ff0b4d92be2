"""Where verified drafts come from: the masks, a draft model, or prompt lookup.

A verifying row feeds ``[real tokens | drafts | W-1 masks]`` and the target checks every draft against its
own AR prediction in the same forward (:mod:`mars.decoding.verify`), so the output is the target's greedy
(or exactly sampled) AR output whatever the drafts are: a source only decides how many tokens a forward
yields.  When every draft passed, the masks after them were conditioned on the right text, and their
predictions become the first drafts of the next step (the checkpoint's masks extend the drafts); a
:class:`DraftSource` then tops them up at the plan phase of the next step, to the step's draft budget.
(With ``chain_drafts=never``, and ``auto`` for lossless rows on a CPU, the masks ride only on steps that
carry no draft: every column costs there, and the masks after drafts pay only when all of them pass; with
``verify_masks=auto`` such rows also feed at most two masks, since the deepest drafts rarely pass.)

- ``masks`` (:class:`DraftSource` itself): nothing more; the drafts are the masks' (self-speculation).
- ``lookup`` (:class:`PromptLookup`): the tokens that followed the latest earlier occurrence of the last
  ``lookup_ngram`` tokens of prompt + output (+ drafts so far); no second model (prompt-lookup decoding).
- ``model`` (:class:`DraftModel`): a causal LM sharing the tokenizer continues the text one token per
  forward, from its own per-row KV cache whose cursor moves by what the target accepted (the paper's
  Section 4.6, "speculative composition").  With ``window=1`` no masks ride along: plain speculative decoding.

Sampling rows (temperature > 0) verify by speculative sampling, which needs the distribution ``q`` each
draft was drawn from: the masks' and the draft model's tempered softmax; a lookup draft is deterministic,
so its ``q`` is one-hot.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import numpy as np
import torch

from .acceptance import gumbel_noise
from .attention import mars_attention
from .forward import ModelRunner
from .kv import RaggedKVCache
from .rows import DraftProposal, RowBatch
from .settings import DecodingSettings

LogProbs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class DraftSource:
    """The masks' drafts and nothing more; the hooks the engine calls, empty here, are what other sources fill."""

    name = "masks"
    forwards = 0  # forwards of a draft model

    def propose(self, rows: RowBatch, verifying: np.ndarray, room: np.ndarray) -> DraftProposal | None:
        """New drafts for the ``verifying`` rows, to follow those the masks carried over (``rows.host.drafts``,
        ``draft_count``), at most ``room`` in all per row (the engine places them: :meth:`RowBatch.append_drafts`);
        None for none."""
        return None

    def advance(self, right_until: np.ndarray) -> None:
        """After a step's acceptance: every row's text is right up to ``right_until`` (before the step's
        length plus its verified drafts)."""

    def add_rows(self, count: int) -> None:
        """Rows joined the batch (at its end)."""

    def keep(self, keep_host: np.ndarray) -> None:
        """Only the rows ``keep_host`` remain, in that order."""

    def extend(self, other: DraftSource) -> None:
        """``other``'s rows (a group prefilled on its own) joined the batch."""

    def fork(self) -> DraftSource:
        """The same source for a group of rows prefilled on their own (sharing any model, not the rows)."""
        return self


class PromptLookup(DraftSource):
    """Drafts copied from the row's own text: the continuation of the latest earlier occurrence of its
    last ``ngram`` tokens."""

    name = "lookup"

    def __init__(self, ngram: int):
        self.ngram = int(ngram)

    def _ngram(self, request) -> int:
        """The request's own n-gram size (a per-request setting), else the source's."""
        return request.settings.lookup_ngram if request.settings is not None else self.ngram

    def propose(self, rows: RowBatch, verifying: np.ndarray, room: np.ndarray) -> DraftProposal | None:
        host, records = rows.host, rows.records
        need = np.zeros(len(rows), dtype=np.int64)
        found_by_row = {}
        for i in np.flatnonzero(verifying & (room > host.draft_count)):
            carried = int(host.draft_count[i])
            text = [records.requests[i].prompt_ids, records.outputs[i], host.drafts[i, :carried]]
            context = np.concatenate([np.asarray(part, dtype=np.int64) for part in text])
            found = lookup_continuation(context, self._ngram(records.requests[i]), int(room[i]) - carried)
            if len(found):
                need[i], found_by_row[i] = len(found), found
        if not found_by_row:
            return None
        tokens = np.zeros((len(rows), int(need.max())), dtype=np.int64)
        for i, found in found_by_row.items():
            tokens[i, : len(found)] = found
        tokens = torch.as_tensor(tokens, device=rows.device)
        log_q = rows.tensors.draft_log_q
        if log_q is not None:  # a copied draft is certain: its q is one-hot
            log_q = one_hot_log_q(tokens, log_q.shape[-1])
        return DraftProposal(need, tokens, log_q)


def one_hot_log_q(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """``log q`` of drafts that were certain (copied, not sampled): 0 at the draft, -inf elsewhere."""
    log_q = torch.full((*tokens.shape, vocab), float("-inf"), device=tokens.device)
    return log_q.scatter_(-1, tokens.unsqueeze(-1), 0.0)


def draw(logp: torch.Tensor, sampled: torch.Tensor | None, generators, drafting: np.ndarray) -> torch.Tensor:
    """One token per row from ``logp`` ``[rows, vocab]``: the argmax, or for ``sampled`` rows a Gumbel-max
    draw (so distributed as ``softmax(logp)``) from the row's own generator; rows not ``drafting`` draw
    nothing and leave their generator untouched."""
    token = torch.argmax(logp, dim=-1)
    if sampled is None:
        return token
    noise = gumbel_noise(logp.unsqueeze(1), generators, drafting.astype(np.int64))[:, 0]
    return torch.where(sampled, torch.argmax(logp + noise, dim=-1), token)


def lookup_continuation(context: np.ndarray, ngram: int, limit: int) -> np.ndarray:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of ``context``'s last ``ngram``
    tokens (empty when they never occurred before)."""
    if limit <= 0 or len(context) <= ngram:
        return context[:0]
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], ngram)
    hits = np.flatnonzero((windows == context[-ngram:]).all(axis=1))
    if not len(hits):
        return context[:0]
    start = int(hits[-1]) + ngram
    return context[start : start + limit]


class DraftModel(DraftSource):
    """Drafts from a second causal LM sharing the tokenizer: one catch-up forward over what its cache
    lacks (the target's accepted tokens, then the drafts the masks carried over), then one forward per
    further draft.  ``vocab``: the target's vocabulary size (drafts and their distributions are over it);
    ``log_probs``: the target engine's logits-to-distribution rule, so both choose tokens alike."""

    name = "model"

    def __init__(self, runner: ModelRunner, vocab: int, log_probs: LogProbs):
        self.runner, self.vocab, self.log_probs = runner, int(vocab), log_probs
        self.cache = RaggedKVCache(runner.num_layers)
        self.cached = np.zeros(0, dtype=np.int64)  # per row: tokens in the draft cache, all of them right
        self.fed_until: np.ndarray | None = None  # per row, this step: where the tokens it fed (right or not) end
        self.forwards = 0

    def fork(self) -> DraftModel:
        return DraftModel(self.runner, self.vocab, self.log_probs)

    def add_rows(self, count: int) -> None:
        self.cache.add_rows(count)
        self.cached = np.concatenate([self.cached, np.zeros(count, dtype=np.int64)])

    def keep(self, keep_host: np.ndarray) -> None:
        if len(keep_host) < len(self.cached):
            self.cache.select_rows(torch.as_tensor(keep_host, dtype=torch.long, device=self.runner.device))
        self.cached = self.cached[keep_host]

    def extend(self, other: DraftSource) -> None:
        assert isinstance(other, DraftModel)
        self.cache.extend(other.cache)
        self.cached = np.concatenate([self.cached, other.cached])
        self.forwards += other.forwards

    def advance(self, right_until: np.ndarray) -> None:
        if self.fed_until is not None:  # the draft model ran this step
            self.cached = np.minimum(self.fed_until, right_until)
            self.fed_until = None

    def propose(self, rows: RowBatch, verifying: np.ndarray, room: np.ndarray) -> DraftProposal | None:
        need = np.where(verifying, np.maximum(room - rows.host.draft_count, 0), 0)
        if not need.any():
            return None
        drafted = []
        with mars_attention(self.runner.model):
            logits, next_position = self._catch_up(rows, need)
            for step in range(int(need.max())):
                if step:
                    logits = self._extend_drafts(drafted[-1][0], next_position + step - 1, need > step)
                drafted.append(self._choose(rows, logits, need > step))
        self.fed_until = np.where(need > 0, next_position + need - 1, self.cached)
        tokens = torch.stack([token for token, _ in drafted], dim=1)
        log_q = None if drafted[0][1] is None else torch.stack([q for _, q in drafted], dim=1)
        return DraftProposal(need, tokens, log_q)

    def _catch_up(self, rows: RowBatch, need: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """One forward over each drafting row's accepted tokens its cache lacks, then its carried drafts;
        the logits after them and where the row's next column goes."""
        dev, tensors = rows.device, rows.tensors
        feed = np.where(need > 0, rows.host.length - self.cached + rows.host.draft_count, 0)
        width = int(feed.max())
        columns = torch.arange(width, device=dev)
        positions = torch.as_tensor(self.cached, device=dev).unsqueeze(1) + columns
        length = tensors.length.unsqueeze(1)
        from_text = tensors.tokens.gather(1, positions.clamp_max(rows.width - 1))
        from_drafts = tensors.drafts.gather(1, (positions - length).clamp(0, rows.max_drafts - 1))
        ids = torch.where(positions < length, from_text, from_drafts)
        fed = torch.as_tensor(feed, device=dev).unsqueeze(1)
        read = (fed - 1).clamp_min(0)
        live = columns.unsqueeze(0) < fed
        kv_length = int(self.cached.max()) + width
        return self._forward(ids, positions, read, kv_length, live, need > 0), self.cached + feed

    def _extend_drafts(self, last: torch.Tensor, position: np.ndarray, drafting: np.ndarray) -> torch.Tensor:
        """One more column per row: its latest draft, predicting the one after."""
        dev = last.device
        positions = torch.as_tensor(position, device=dev).unsqueeze(1)
        live = torch.as_tensor(drafting, device=dev).unsqueeze(1)
        read = torch.zeros_like(positions)
        return self._forward(last.unsqueeze(1), positions, read, int(position.max()) + 1, live, drafting)

    def _forward(self, ids, positions, read, kv_length: int, live, drafting: np.ndarray) -> torch.Tensor:
        dev = ids.device
        attention = torch.arange(kv_length, device=dev).view(1, 1, -1) <= positions.unsqueeze(2)
        self.cache.prepare_step(positions, kv_length)
        self.forwards += 1
        live_read = torch.as_tensor(drafting, device=dev).unsqueeze(1)
        logits = self.runner.logits_at(
            ids, positions, attention.unsqueeze(1), read, self.cache, live=live, live_columns=live_read
        )
        return self._target_vocabulary(logits[:, 0])

    def _target_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's ids (a draft with fewer rows never proposes the others)."""
        if logits.shape[-1] >= self.vocab:
            return logits[..., : self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))

    def _choose(self, rows: RowBatch, logits: torch.Tensor, drafting: np.ndarray):
        """The next draft per row (argmax, or a draw from the row's own generator) and, for sampling rows,
        the distribution it came from."""
        logp, sampled = self.log_probs(logits, rows.tensors.temperature)
        token = draw(logp, sampled, rows.row_generators(), drafting)
        return token, (logp if rows.tensors.draft_log_q is not None else None)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {"self:N": its first N layers}
_LOADED: dict[tuple[str, str, str], torch.nn.Module] = {}  # loaded draft models, reused by later engines


def draft_source_for(
    settings: DecodingSettings, target: ModelRunner, log_probs: LogProbs, tokenizer=None
) -> DraftSource:
    """The source ``settings.draft_source`` names (a draft model is loaded once per process)."""
    if settings.draft_source == "lookup":
        return PromptLookup(settings.lookup_ngram)
    if settings.draft_source == "model":
        model = load_draft_model(settings.draft_model, target.model, tokenizer)
        runner = target if model is target.model else ModelRunner(model, fast=target.fast)
        return DraftModel(runner, target.vocab_size, log_probs)
    return DraftSource()


def load_draft_model(name: str, target: torch.nn.Module, tokenizer=None) -> torch.nn.Module:
    """``self`` (the target: every draft is what the target would choose, the acceptance upper bound),
    ``self:N`` (the target's first N decoder layers with its embeddings, final norm and head, weights
    shared), or a model name or path for :func:`mars.models.load_model` in the target's dtype and device,
    checked to share the target's tokenizer."""
    if name == "self":
        return target
    if name.startswith("self:"):
        views = _VIEWS.setdefault(target, {})
        if name not in views:
            views[name] = first_layers(target, int(name.split(":", 1)[1]))
        return views[name]
    device = next(target.parameters()).device
    key = (name, str(target.dtype), str(device))
    if key not in _LOADED:
        from mars.models import load_model

        loaded = load_model(name, dtype=target.dtype, device=device)
        check_same_tokenizer(loaded.tokenizer, tokenizer, name)
        _LOADED.clear()  # one loaded draft model at a time
        _LOADED[key] = loaded.model.eval()
    return _LOADED[key]


def first_layers(model: torch.nn.Module, count: int) -> torch.nn.Module:
    """A Llama-family ``model`` cut after its first ``count`` decoder layers (no copy of any weight)."""
    from .lean import ARCHITECTURES

    if type(model).__name__ not in ARCHITECTURES or hasattr(model, "mars_gate"):
        raise ValueError(
            f"draft_model='self:{count}' cuts the target's layers: it needs a plain {'/'.join(ARCHITECTURES)} "
            f"model, got {type(model).__name__}{' with a gated adapter' if hasattr(model, 'mars_gate') else ''}"
        )
    base = model.model
    if not 1 <= count <= len(base.layers):
        raise ValueError(
            f"draft_model='self:{count}': the target has {len(base.layers)} layers; use 1..{len(base.layers)}"
        )
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:count]
    with torch.device("meta"):
        draft = type(model)(config)
    draft.model.embed_tokens, draft.model.norm, draft.model.rotary_emb = base.embed_tokens, base.norm, base.rotary_emb
    draft.model.layers = torch.nn.ModuleList(list(base.layers)[:count])
    draft.lm_head = model.lm_head
    return draft.eval()


def check_same_tokenizer(draft, target, name: str) -> None:
    """Every token the target knows has the same id in the draft's tokenizer, else refused naming both
    tokenizers and the first token (by target id) that differs: a draft with another vocabulary proposes
    ids that mean other text, and the target's ids past the draft's vocabulary would index outside its
    embedding.  The target's mask token is left out: it is never text, so never fed to the draft."""
    if target is None or draft is None:
        return
    theirs = draft.get_vocab()
    for token, index in sorted(target.get_vocab().items(), key=lambda item: item[1]):
        if token == target.mask_token or theirs.get(token) == index:
            continue
        found = f"has it as id {theirs[token]}" if token in theirs else "lacks it"
        raise ValueError(
            f"draft_model {name!r} does not share the target's tokenizer: the target's tokenizer "
            f"({_tokenizer_name(target)}, {len(target)} tokens) has {token!r} as id {index}, the draft's "
            f"({_tokenizer_name(draft)}, {len(draft)} tokens) {found}; a draft model needs the target's "
            "tokenizer (else draft_source=lookup or masks)"
        )


def _tokenizer_name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)
