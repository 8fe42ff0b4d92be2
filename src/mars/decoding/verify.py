"""Verification of drafts: the rules that make self-speculative MARS decoding lossless.

A verifying row feeds ``[uncommitted real tokens | drafts d1..dk | masks]``.  Under causal attention the
output at the last real token is the exact AR distribution of d1's position, the output at ``d_i`` the
exact AR distribution of the next position given that ``d1..d_i`` are right, so each draft is checked
against the model's own AR prediction in the same forward.

- Greedy: accept the longest prefix of drafts equal to the AR argmax before them, then the AR argmax
  after it (the correction, or the bonus when all drafts passed): exactly the greedy AR continuation.
  Typical acceptance (``typical_epsilon``, lossy) also passes drafts the AR distribution finds plausible.
- Sampling (temperature > 0): speculative sampling (Leviathan et al. 2023; Chen et al. 2023).  Draft
  ``d_i`` was sampled from the draft distribution ``q_i``; it is accepted with probability
  ``min(1, p_i(d_i) / q_i(d_i))``, ``p_i`` the tempered AR distribution; at the first rejection the
  token is drawn from ``norm(max(0, p_i - q_i))``, and after k accepted drafts the bonus from ``p_k``.
  The accepted tokens are then distributed exactly as AR sampling from ``p``.

Pure tensor functions, vectorised over rows; tested on hand-made distributions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .acceptance import leading_run


def _uniform(shape: tuple[int, ...], rows: int, generator, device, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, *shape]`` uniforms.  With one generator per row each row draws from its own, and only
    ``counts[r]`` of them along the first axis (ones after), so a row's draws never depend on its batch; a row
    whose generator is None draws nothing (ones: its result is not used)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand((rows, *shape), generator=generator, device=device)
    out = torch.ones((rows, *shape), device=device)
    sizes = [shape[0]] * rows if counts is None else counts.tolist()
    for r, g in enumerate(generator):
        if g is not None:
            out[r, : sizes[r]] = torch.rand((int(sizes[r]), *shape[1:]), generator=g, device=device)
    return out


def leading_matches(
    drafts: torch.Tensor, predicted: torch.Tensor, n_drafts: torch.Tensor, passing: torch.Tensor | None = None
) -> torch.Tensor:
    """How many leading drafts equal the prediction before them (or, where given, are ``passing``; at most
    ``n_drafts`` per row)."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros_like(n_drafts)
    match = drafts == predicted[:, :k]
    if passing is not None:
        match = match | passing
    # the leading run, cut at n_drafts (the same as the run of matches among the first n_drafts)
    return torch.minimum(leading_run(match), n_drafts)


def typical_drafts(logp: torch.Tensor, drafts: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Medusa's typical acceptance (Cai et al. 2024, arXiv 2401.10774): whether each draft's probability
    under the target, ``logp`` ``[rows, >= k, vocab]`` at the column before it, exceeds
    ``min(epsilon, sqrt(epsilon) * exp(-entropy))``.  Plausible drafts pass even where the target is unsure
    which token is best; the argmax always passes (its probability is at least ``exp(-entropy)``)."""
    k = drafts.shape[1]
    logp = logp[:, :k]
    entropy = torch.special.entr(logp.exp()).sum(-1)
    bound = torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)
    return logp.gather(-1, drafts.unsqueeze(-1)).squeeze(-1).exp() > bound


def sample_from(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row from ``probs`` ``[rows, vocab]`` (rows need not be normalised)."""
    probs = probs / probs.sum(-1, keepdim=True)
    u = _uniform((1,), probs.shape[0], generator, probs.device)
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def speculative_accept(
    p_logp: torch.Tensor,
    q_logp: torch.Tensor,
    drafts: torch.Tensor,
    n_drafts: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a batch of rows.

    ``p_logp`` ``[rows, k+1, vocab]``: target (AR) log-probabilities at the column before each draft and
    after the last; ``q_logp`` ``[rows, k, vocab]``: the distributions the drafts were sampled from;
    ``drafts`` ``[rows, k]``, of which the first ``n_drafts[r]`` are real.  Returns ``(accepted, token)``:
    how many drafts each row keeps and the token that follows them (resampled or bonus).  ``generator``: one for
    all rows, or one per row, where a row given None draws nothing and its results mean nothing.
    """
    rows, k = drafts.shape
    device = drafts.device
    if k:
        p_d = p_logp[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = q_logp.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(torch.clamp(p_d - q_d, max=0.0))
        u = _uniform((k,), rows, generator, device, counts=n_drafts)
        valid = torch.arange(k, device=device).unsqueeze(0) < n_drafts.unsqueeze(1)
        ok = (u < ratio) & valid
        accepted = torch.cumprod(ok.to(torch.int32), dim=1).sum(dim=1).to(torch.long)
    else:
        accepted = torch.zeros(rows, dtype=torch.long, device=device)
    at = accepted.view(-1, 1, 1).expand(-1, 1, p_logp.shape[-1])
    p_next = p_logp.gather(1, at).squeeze(1).exp()
    rejected = accepted < n_drafts
    if k and bool(rejected.any()):
        q_next = q_logp.gather(1, at.clamp_max(k - 1)).squeeze(1).exp()
        residual = torch.clamp(p_next - q_next, min=0.0)
        # p == q makes a rejection impossible, but guard the degenerate all-zero residual anyway
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_next, residual)
        p_next = torch.where(rejected.unsqueeze(-1), residual, p_next)
    return accepted, sample_from(p_next, generator)
