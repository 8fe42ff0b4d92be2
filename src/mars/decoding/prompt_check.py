"""What a prompt's token ids must be before any forward, in one wording for ``generate`` and the server: at
least one token, every id inside the embedding matrix, and room in the model's context for the prompt and its
budget.  An id out of range is an IndexError on a CPU and a device-side assert on a GPU; a position past the
context is one the model never saw.

A prompt is named by its ``label`` (``prompt 0``, ``prompt 1``, ... or the server's ``messages``) and a budget
by its ``budget`` key (``max_new_tokens``, the server's ``max_tokens``), so the same bad prompt reads the same
from either door.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptTooLong(ValueError):
    """A prompt, or a prompt with its budget, past the model's context (the server's ``context_length_exceeded``)."""


def check_prompt(ids: Sequence[int], *, vocab: int, context: int | None, label: str) -> None:
    """One prompt's ids: shorter than ``context`` (checked first: it needs only the length), not empty, each in
    ``[0, vocab)``."""
    if context is not None and len(ids) >= context:
        raise PromptTooLong(
            f"{label} has {len(ids)} tokens, longer than the model's context of {context} tokens (at least one "
            "position must remain for generation)"
        )
    if not ids:
        raise ValueError(f"{label} is empty after tokenization")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{label} has token id {bad}, outside the model's vocabulary of {vocab} ids")


def check_budget(
    length: int, max_new_tokens: int, context: int | None, *, label: str, budget: str = "max_new_tokens"
) -> None:
    """Room in ``context`` for a prompt of ``length`` tokens and ``max_new_tokens`` more."""
    if context is None or length + max_new_tokens <= context:
        return
    raise PromptTooLong(
        f"{label} has {length} tokens: with {budget}={max_new_tokens} generation would reach position "
        f"{length + max_new_tokens}, past the model's context of {context} tokens; shorten the prompt or lower "
        f"{budget} to at most {context - length}"
    )


def check_prompts(ids: Sequence[Sequence[int]], vocab: int, context: int | None, max_new_tokens: int) -> None:
    """A batch sharing one budget (``generate``'s): every prompt (``prompt 0``, ``prompt 1``, ...), then room for
    the budget after the longest."""
    for i, row in enumerate(ids):
        check_prompt(row, vocab=vocab, context=context, label=f"prompt {i}")
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    check_budget(len(ids[longest]), max_new_tokens, context, label=f"prompt {longest}")
