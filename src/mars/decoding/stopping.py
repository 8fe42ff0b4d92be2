"""Stop conditions shared by every decoder, so MARS, AR and Jacobi outputs are cut identically.

A row stops at its first EOS (kept in the ids and counted, as ``transformers.generate`` does), at the
token that completes a stop string (tokens after it are dropped and not counted; the text is cut just
before the stop string, the lm-eval ``until`` convention), or at ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The union of the generation config's EOS ids and the tokenizer's EOS id."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.extend(configured if isinstance(configured, (list, tuple)) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    unique = sorted({int(i) for i in ids})
    if not unique:
        raise ValueError("the model and tokenizer define no EOS token; decoding needs one to stop rows")
    return unique


class StopStrings:
    """Finds where a stop string completes in a row's generated ids and cuts texts before it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: str | Sequence[str] | None):
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:  # bytes would iterate as ints ("got 120"), a number not at all
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r} ({type(stop).__name__})")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r} ({type(s).__name__})")
        self.tokenizer = tokenizer
        self.strings = stop
        # A stop string of c characters spans at most c tokens, plus one for a token whose bytes only
        # become a character together with the next one.
        self.tail_tokens = max((len(s) for s in stop), default=0) + 2

    def __bool__(self) -> bool:
        return bool(self.strings)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _contains(self, ids: Sequence[int]) -> bool:
        text = self._decode(ids)
        return any(s in text for s in self.strings)

    def completion_index(self, ids: Sequence[int], new: int) -> int | None:
        """If a stop string appears in ``ids`` (whose last ``new`` tokens are new this step), the number
        of tokens to keep: up to and including the token that completes the first stop string."""
        if not self.strings:
            return None
        tail = ids[max(0, len(ids) - new - self.tail_tokens) :]
        if not self._contains(tail):  # cheap trigger on the tail; the exact search below is rare
            return None
        lo, hi = max(1, len(ids) - new - self.tail_tokens), len(ids)
        if not self._contains(ids[:hi]):
            return None
        while lo < hi:  # smallest prefix whose text contains a stop string
            mid = (lo + hi) // 2
            if self._contains(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def cut_text(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]


def finalize_row(
    ids: Sequence[int], eos_ids: Sequence[int], stops: StopStrings, max_new_tokens: int
) -> tuple[list[int], str, str]:
    """Apply the shared stop rules to one row's generated ids: ``(ids, text, finish_reason)``."""
    ids = [int(i) for i in ids]
    eos = set(eos_ids)
    reason = "length"
    for i, tok in enumerate(ids):
        if tok in eos:
            ids, reason = ids[: i + 1], "eos"
            break
    keep = stops.completion_index(ids, len(ids)) if stops else None
    if keep is not None:
        ids, reason = ids[:keep], "stop"
    ids = ids[:max_new_tokens]
    text = stops.tokenizer.decode(ids, skip_special_tokens=True)
    return ids, stops.cut_text(text), reason
