"""What a decoding run returns: texts, token ids and run statistics."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The speculative-decoding figures in vLLM's terms (docs/decoding.md, "Acceptance figures"): the keys
# acceptance_figures returns, the counts 0 and the rates None where no step verified a draft
ACCEPTANCE_KEYS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_by_position",
)


def acceptance_figures(proposed: Sequence[int], accepted: Sequence[int], draft_steps: int) -> dict[str, Any]:
    """vLLM's spec-decode figures from draft counts per depth (``proposed[d]``: draft tokens proposed at depth
    ``d``, every candidate of a tree counted; ``accepted[d]``: steps whose depth-``d`` draft passed) and the
    steps that verified at least one draft.  ``mean_acceptance_length`` counts the AR token every draft step
    adds after its accepted drafts (the bonus or corrected token), so a step whose drafts all fail counts 1."""
    drafted, passed = int(sum(proposed)), int(sum(accepted))
    return {
        "num_drafts": int(draft_steps),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": passed,
        "mean_acceptance_length": 1 + passed / draft_steps if draft_steps else None,
        "draft_acceptance_rate": passed / drafted if drafted else None,
        "acceptance_by_position": [a / draft_steps for a in accepted] if draft_steps else None,
    }


def sum_by_position(counts: Iterable[Sequence[int]]) -> list[int]:
    """Per-depth counts of several rows or runs added depth by depth (the lists may differ in length)."""
    counts = list(counts)
    width = max((len(c) for c in counts), default=0)
    return [sum(int(c[d]) for c in counts if d < len(c)) for d in range(width)]


@dataclass
class DecodeStats:
    """Run statistics of one ``generate`` call.

    ``generated_tokens`` counts generated tokens only (an EOS that ends a row counts, as in
    ``transformers.generate``; prompt tokens, padding and tokens past a stop string never count).
    ``forwards`` counts batched model forward passes (one batched forward is one pass, whatever the
    batch size), so ``tokens_per_forward = generated_tokens / forwards`` is the batch's throughput per
    pass; ``mean_row_tokens_per_forward`` averages each row's own tokens / forwards it took part in,
    which is the paper's "tokens accepted per forward pass" for a single request.
    ``first_token_seconds``: from the call's start to the forward that gave every row its first token (the
    prefill: time to first token), so ``seconds - first_token_seconds`` is the decode phase.
    """

    forwards: int
    generated_tokens: int
    seconds: float
    per_row_tokens: list[int]
    per_row_forwards: list[int]
    decoder: str = "mars"
    extra: dict[str, Any] = field(default_factory=dict)
    first_token_seconds: float | None = None

    @property
    def num_drafts(self) -> int | None:
        """Draft steps: steps on which a row verified at least one draft, over the run's rows (verify only;
        per row: ``extra["per_row_num_drafts"]``)."""
        return self.extra.get("num_drafts")

    @property
    def num_draft_tokens(self) -> int | None:
        """Draft tokens proposed, every candidate of a tree counted (verify only; per row:
        ``extra["per_row_num_draft_tokens"]``)."""
        return self.extra.get("num_draft_tokens")

    @property
    def num_accepted_tokens(self) -> int | None:
        """Draft tokens accepted and emitted (verify only; per row: ``extra["per_row_num_accepted_tokens"]``)."""
        return self.extra.get("num_accepted_tokens")

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's mean acceptance length over the run's draft steps (verify only; None without a draft step)."""
        return self.extra.get("mean_acceptance_length")

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Draft tokens accepted / proposed (verify only)."""
        return self.extra.get("draft_acceptance_rate")

    @property
    def acceptance_by_position(self) -> list[float] | None:
        """Per draft depth: draft steps that accepted the depth's draft / draft steps (verify only)."""
        return self.extra.get("acceptance_by_position")

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forwards if self.forwards else 0.0

    @property
    def mean_row_tokens_per_forward(self) -> float:
        rates = [t / f for t, f in zip(self.per_row_tokens, self.per_row_forwards) if f]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "forwards": self.forwards,
            "generated_tokens": self.generated_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "mean_row_tokens_per_forward": self.mean_row_tokens_per_forward,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "first_token_seconds": self.first_token_seconds,
            **{key: getattr(self, key) for key in ACCEPTANCE_KEYS},
            "per_row_tokens": list(self.per_row_tokens),
            "per_row_forwards": list(self.per_row_forwards),
            **self.extra,
        }


@dataclass
class GenerationResult:
    """Per prompt (in input order): the generated ``texts`` (special tokens skipped, cut before a stop
    string) and ``token_ids`` (generated ids only, up to and including the EOS or the token that
    completed a stop string); ``stats`` for the whole call; ``finish_reasons`` per row
    (``eos`` | ``stop`` | ``length``); ``from_mask`` per row and token."""

    texts: list[str]
    token_ids: list[list[int]]
    stats: DecodeStats
    finish_reasons: list[str]
    # per row and token: True where the token was accepted from a mask prediction (MARS below threshold
    # 1.0), False where it was an exact AR prediction or a verified draft; None for decoder="ar"
    from_mask: list[list[bool]] | None = None

    def __len__(self) -> int:
        return len(self.texts)
