"""The acceptance rule: pick a token for every window position and accept left to right while the
model's confidence meets the threshold.  Pure tensor functions, vectorised over the batch.

Metrics (the confidence of the distribution at each window position):

- ``probability``: probability of the chosen token (the top token under greedy decoding); accept while ``>= threshold``.
- ``entropy``: entropy of the distribution in nats; accept while ``<= threshold``.
- ``margin``: top-1 minus top-2 probability; accept while ``>= threshold``.

The first position is always accepted (it is the exact AR prediction from the last real token), so
every step makes progress; ``cap`` bounds the count (``max_accept``, the remaining token budget, a
cache-block end, or 0 for a row that must wait).

Exact-AR thresholds: ``threshold >= 1.0`` for probability/margin and ``<= 0`` for entropy mean "accept
only when certain", which in exact arithmetic is the greedy AR output.  In floating point a softmax can
round to exactly 1.0 (entropy to 0.0) for a token the model is not truly certain of, so such rows are
capped at one token per step: the output is then token-for-token greedy AR by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mars.decoding.kernels import op_or_none, top_tokens_op

from .settings import METRICS, validate_metric, validate_threshold  # noqa: F401  (re-exported)


def never_emitted(mask_token_id: int | None, eos_ids: Sequence[int]) -> list[int]:
    """Token ids no decoder may output: the mask token, an input placeholder that is never text (an
    under-trained head can still rank it first).  Where a model has no mask token the engine pads with
    EOS, which must stay emittable."""
    if mask_token_id is None or int(mask_token_id) in {int(e) for e in eos_ids}:
        return []
    return [int(mask_token_id)]


def suppress(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` with ``token_ids`` at -inf (in place): they can be neither chosen nor sampled, and the
    confidence of every other token is measured without them."""
    if len(token_ids) == 1:  # the usual case (the mask token): a view's fill, not an index tensor per step
        logits[..., int(token_ids[0])] = float("-inf")
    elif token_ids:
        logits[..., list(token_ids)] = float("-inf")
    return logits


def exact_ar_rows(thresholds: torch.Tensor, metric: str) -> torch.Tensor:
    """Rows whose threshold means "accept only certain tokens": capped at one token per step."""
    return thresholds <= 0 if metric == "entropy" else thresholds >= 1.0


def choose_tokens(
    logits: torch.Tensor,
    metric: str,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and confidence scores for logits ``[batch, positions, vocab]``.

    Temperature 0 is greedy (argmax).  Temperature > 0 samples by the Gumbel-max trick from
    ``softmax(logits / T)`` and scores the same tempered distribution, so the acceptance rule is unchanged.
    ``temperature`` may be one value per row (a tensor) and ``generator`` one generator per row, so
    that a row's samples depend on its own seed only, never on the batch it shares.
    """
    logp, sampled = tempered_log_probs(logits, temperature)
    tokens = torch.argmax(logp, dim=-1)
    if sampled is not None:
        noise = gumbel_noise(logp, generator)
        draws = torch.argmax(logp + noise, dim=-1)
        tokens = torch.where(sampled.unsqueeze(1), draws, tokens)
    return tokens, confidence(logp, tokens, metric)


def tempered_log_probs(
    logits: torch.Tensor, temperature: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / T)`` per row (T = 0 rows stay untempered) and which rows sample (None: none)."""
    logits = logits.float()
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if temps.ndim == 0:
        temps = temps.expand(logits.shape[0])
    sampled = temps > 0
    if not bool(sampled.any()):
        return torch.log_softmax(logits, dim=-1), None
    scale = torch.where(sampled, temps, torch.ones_like(temps)).view(-1, *([1] * (logits.ndim - 1)))
    return torch.log_softmax(logits / scale, dim=-1), sampled


def top_tokens(
    logits: torch.Tensor, token_ids: Sequence[int], top_from: int | None, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A greedy choice at every column of ``logits`` ``[..., columns, vocab]``: ``token_ids`` set to -inf (in
    place, as :func:`suppress`), each column's argmax (the first maximum, as ``max(-1)``) and, from column
    ``top_from`` on (None: no column), the argmax's probability (NaN at the columns before; see
    :func:`top_probability`).  ``fused``: fp32 CPU logits in one pass of ``mars::top_tokens`` where it is built
    (after a decode step the engine's code runs from memory, so every op it saves shortens the step), the ATen
    ops otherwise: the same indices, probabilities within rounding."""
    op = op_or_none(top_tokens_op) if fused and logits.device.type == "cpu" else None
    if op is not None and logits.dtype == torch.float32 and logits.dim() >= 2 and logits.is_contiguous():
        indices, top = op(logits, list(token_ids), logits.shape[-2] if top_from is None else top_from)
        return indices, None if top_from is None else top
    best = suppress(logits, token_ids).max(dim=-1)  # max(-1): the first maximum, as argmax, faster
    if top_from is None:
        return best.indices, None
    top = top_probability(logits[..., top_from:, :], best.values[..., top_from:])
    return best.indices, torch.nn.functional.pad(top, (top_from, 0), value=float("nan"))


def top_probability(logits: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
    """The softmax probability of each distribution's top token, from its logits ``[..., vocab]`` and their
    maximum ``[...]``: ``1 / sum(exp(logits - max))``, one read of the logits where a log-softmax writes them all."""
    return (logits - top_logits.unsqueeze(-1)).exp_().sum(-1).reciprocal_()


def gumbel_noise(logp: torch.Tensor, generator, columns: Sequence[int] | None = None) -> torch.Tensor:
    """Gumbel noise shaped like ``logp`` ``[rows, positions, vocab]``.  With one generator per row each
    row draws from its own, and only its first ``columns[r]`` positions (zeros after), so what a row
    draws never depends on the width of the batch it is in; a row whose generator is None (a greedy row)
    draws nothing."""
    if generator is None or isinstance(generator, torch.Generator):
        uniform = torch.rand(logp.shape, device=logp.device, generator=generator, dtype=logp.dtype)
    else:
        uniform = torch.ones_like(logp)
        for r, g in enumerate(generator):
            if g is None:
                continue
            width = logp.shape[1] if columns is None else int(columns[r])
            uniform[r, :width] = torch.rand((width, *logp.shape[2:]), device=logp.device, generator=g, dtype=logp.dtype)
    return -torch.log((-torch.log(uniform.clamp_min(1e-20))).clamp_min(1e-20))


def confidence(logp: torch.Tensor, tokens: torch.Tensor, metric: str) -> torch.Tensor:
    """The acceptance metric of each position's distribution (``logp``) for the chosen ``tokens``."""
    if metric == "probability":
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).exp()
    if metric == "entropy":
        probs = logp.exp()
        return -(torch.special.xlogy(probs, probs)).sum(-1)
    if metric == "margin":
        top2 = torch.topk(logp, 2, dim=-1).values.exp()
        return top2[..., 0] - top2[..., 1]
    validate_metric(metric)
    raise AssertionError("unreachable")


def meets_threshold(score: torch.Tensor, thresholds: torch.Tensor, metric: str) -> torch.Tensor:
    """Whether each position's score ``[rows, positions]`` meets its row's threshold."""
    thr = thresholds.to(score.device, score.dtype).unsqueeze(1)
    return score <= thr if metric == "entropy" else score >= thr


def leading_run(flags: torch.Tensor) -> torch.Tensor:
    """Per row, the length of the leading run of True in ``flags`` ``[rows, positions]`` (int64)."""
    return flags.cumprod(dim=1).sum(dim=1)  # (a bool cumprod counts in int64: two ops, cheap after a decode step)


def accept_counts(score: torch.Tensor, thresholds: torch.Tensor, metric: str, cap: torch.Tensor) -> torch.Tensor:
    """How many leading positions each row accepts: the run of positions meeting its threshold,
    at least one, at most ``cap`` (``cap`` 0 accepts nothing)."""
    meets = meets_threshold(score, thresholds, metric)
    meets[:, 0] = True
    return torch.minimum(leading_run(meets), cap.to(torch.long))


def unverified_counts(
    score: torch.Tensor,
    thresholds: torch.Tensor,
    metric: str,
    fed: torch.Tensor,
    room: torch.Tensor,
    followed_right_text: torch.Tensor,
) -> torch.Tensor:
    """How many masks after verified drafts each row accepts without verification: the leading run of its
    first ``fed`` masks (``score`` ``[rows, masks]``) meeting its threshold, at most ``room``; none where the
    masks did not follow the right text (a draft before them was rejected) or the threshold is exact."""
    fed_mask = torch.arange(score.shape[1], device=score.device).unsqueeze(0) < fed.unsqueeze(1)
    run = torch.minimum(leading_run(meets_threshold(score, thresholds, metric) & fed_mask), room.clamp_min(0))
    keep = followed_right_text & ~exact_ar_rows(thresholds.to(score.device), metric)
    return torch.where(keep, run, torch.zeros_like(run))


def cut_at_eos(tokens: torch.Tensor, counts: torch.Tensor, eos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shorten each row's accepted run to end at its first EOS (the EOS itself is kept, as in
    ``transformers.generate``); also returns which rows accepted an EOS."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = torch.isin(tokens, eos_ids) & (positions.unsqueeze(0) < counts.unsqueeze(1))
    hit = is_eos.any(dim=1)
    first = torch.where(hit, is_eos.to(torch.int8).argmax(dim=1), tokens.shape[1])
    return torch.minimum(counts, first + 1), hit
