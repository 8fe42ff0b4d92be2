"""Turn a request's accepted token ids into streamed text deltas whose concatenation is exactly the final
(non-streamed) text.

The final text is what ``generate`` returns for the same ids (:func:`~mars.decoding.stopping.finalize_row`:
special tokens skipped, cut before a stop string).  While a request runs, each step's text is the decode of
all ids so far, minus what may still change: a trailing replacement character (a multi-byte character
whose remaining bytes come with the next token) and a tail that could be the start of a stop string (it
is cut if the stop string completes).  A delta is only what extends the text already sent, so the sent
text is always a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Sequence

from mars.decoding.stopping import StopStrings, finalize_row


class TextStream:
    def __init__(self, tokenizer, eos_ids: Sequence[int], stops: StopStrings | None, max_new_tokens: int):
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.stops = stops if stops is not None else StopStrings(tokenizer, None)
        self.max_new_tokens = max_new_tokens
        self.ids: list[int] = []
        self.sent = ""

    def _held_back(self, text: str) -> str:
        text = self.stops.cut_text(text)
        for s in self.stops.strings:  # longest tail that begins a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    text = text[:-k]
                    break
        return text.rstrip("\ufffd")

    def push(self, tokens: Sequence[int]) -> str:
        """Accept one step's tokens; the text that can be sent now."""
        self.ids.extend(int(t) for t in tokens)
        if not tokens:
            return ""
        text = self._held_back(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta

    def finish(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """The request's final ids (from the engine): ``(remaining delta, final text)``."""
        _, final, _ = finalize_row(token_ids, self.eos_ids, self.stops, self.max_new_tokens)
        delta = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent = final if final.startswith(self.sent) else self.sent
        return delta, final
