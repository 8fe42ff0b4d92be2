"""The two-stream MARS training layout as pure tensor functions.

A training sequence ``x`` (length ``L``) is fed together with a copy ``x~`` whose response tokens
are replaced by the mask token: ``z = [x ; x~]`` (length ``2L``), both copies with position ids
``0..L-1``.  Positions are grouped into blocks ``block(t) = t // B``.  Attention rules (query ``i``,
key ``j``, ``p()`` = position inside its own copy):

* clean -> clean: ``p(j) <= p(i)`` (ordinary causal attention)
* noisy -> noisy: same block and ``p(j) <= p(i)`` (``bidirectional``: same block only)
* noisy -> clean: ``block(j) < block(i)``
* clean -> noisy: never

Nothing here touches a model, so every rule is unit-testable on its own.
"""

from __future__ import annotations

import torch

INTRA_BLOCK_PATTERNS = ("causal", "bidirectional")


def _check_block(length: int, block_size: int | torch.Tensor, intra_block: str) -> None:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    smallest = int(block_size.min()) if isinstance(block_size, torch.Tensor) else block_size
    if smallest < 1:
        raise ValueError(f"block_size must be >= 1, got {smallest}")
    if intra_block not in INTRA_BLOCK_PATTERNS:
        raise ValueError(f"intra_block must be one of {INTRA_BLOCK_PATTERNS}, got {intra_block!r}")


def allowed(q_pos, k_pos, q_noisy, k_noisy, block_size: int, intra_block: str = "causal"):
    """The four rules on (broadcastable) tensors of positions and stream flags; True = may attend.

    Written on positions rather than indices so that the same rules serve the full layout, a noisy
    stream that starts later (prompt-only blocks dropped) and FlexAttention's ``mask_mod``.
    """
    q_blk, k_blk = q_pos // block_size, k_pos // block_size
    causal = k_pos <= q_pos
    in_block = (q_blk == k_blk) & causal if intra_block == "causal" else (q_blk == k_blk)
    clean_clean = ~q_noisy & ~k_noisy & causal
    noisy_noisy = q_noisy & k_noisy & in_block
    noisy_clean = q_noisy & ~k_noisy & (k_blk < q_blk)
    return clean_clean | noisy_noisy | noisy_clean


def mars_attention_mask(
    length: int, block_size: int, intra_block: str = "causal", device: torch.device | str | None = None
) -> torch.BoolTensor:
    """Boolean attention mask of shape ``[2*length, 2*length]``; True = query (row) may attend key (column).

    The clean copy comes first (rows/columns ``0..length-1``), the noisy copy second.
    ``intra_block="bidirectional"`` gives the Block Diffusion baseline (noisy tokens see their whole block).
    """
    _check_block(length, block_size, intra_block)
    pos = two_stream_position_ids(length, device=device)
    noisy = torch.arange(2 * length, device=device) >= length
    return allowed(pos[:, None], pos[None, :], noisy[:, None], noisy[None, :], block_size, intra_block)


def two_stream_mask(
    positions: torch.Tensor,
    clean_length: int,
    block_size: int | torch.Tensor,
    intra_block: str = "causal",
    block_offset: torch.Tensor | None = None,
) -> torch.BoolTensor:
    """Per-row mask ``[N, T, T]`` for inputs ``[clean (clean_length) | noisy]`` with position ids ``[N, T]``.

    ``block_size`` may be one size per row (``[N]``) and ``block_offset`` (``[N]``) shifts a row's block
    grid: ``block(t) = (t + offset) // B``.  Causality only compares positions, so the shift moves the
    block boundaries and nothing else."""
    _check_block(clean_length, block_size, intra_block)
    noisy = torch.arange(positions.shape[1], device=positions.device) >= clean_length
    if block_offset is not None:
        positions = positions + block_offset[:, None]
    if isinstance(block_size, torch.Tensor):
        block_size = block_size.reshape(-1, 1, 1)
    return allowed(
        positions[:, :, None], positions[:, None, :], noisy[:, None], noisy[None, :], block_size, intra_block
    )


def noisy_window_starts(
    loss_mask: torch.Tensor, block_size: int | torch.Tensor, block_offset: torch.Tensor | None = None
) -> torch.LongTensor:
    """Where each row's noisy stream may start: the block holding the position just before its first
    response token (the first noisy position with a target).  Earlier noisy blocks hold prompt tokens
    only, carry no loss and are attended by nothing outside themselves, so dropping them changes no loss.
    Per-row block sizes and grid offsets (see :func:`two_stream_mask`) are taken into account."""
    has = loss_mask.bool().any(dim=1)
    first = torch.where(has, loss_mask.bool().long().argmax(dim=1), torch.zeros_like(has, dtype=torch.long))
    offset = block_offset if block_offset is not None else torch.zeros_like(first)
    start = (((first - 1).clamp(min=0) + offset) // block_size) * block_size - offset
    return start.clamp(min=0)


def two_stream_position_ids(length: int, device: torch.device | str | None = None) -> torch.LongTensor:
    """Position ids ``[0..L-1, 0..L-1]``: both copies share positions."""
    pos = torch.arange(length, device=device)
    return torch.cat([pos, pos])


def noisy_copy(input_ids: torch.Tensor, mask_positions: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """``x~``: ``input_ids`` with ``mask_positions`` (bool, same shape) replaced by the mask token."""
    return torch.where(mask_positions, torch.full_like(input_ids, mask_token_id), input_ids)


def shifted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Right-shifted targets: the output at ``t`` predicts ``x[t+1]``; positions whose target
    carries no loss (prompt, padding, or the last position) get ``ignore_index``."""
    targets = torch.full_like(input_ids, ignore_index)
    targets[:, :-1] = torch.where(loss_mask[:, 1:].bool(), input_ids[:, 1:], ignore_index)
    return targets


def response_positions_to_mask(
    loss_mask: torch.Tensor, ratio: float | torch.Tensor = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Which response tokens to mask in the noisy copy.

    ``ratio=1`` (the paper's ``full`` schedule) masks every response token; a ratio below one masks
    each response token independently with that probability (a scalar, or one ratio per row).
    """
    response = loss_mask.bool()
    if isinstance(ratio, (int, float)) and ratio >= 1.0:
        return response
    ratio_t = torch.as_tensor(ratio, dtype=torch.float32, device=loss_mask.device)
    if ratio_t.ndim == 1:
        ratio_t = ratio_t[:, None]
    draws = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
    return response & (draws < ratio_t)


def attention_mask_for(
    bool_mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Turn a ``[Q, K]`` (or per-row ``[N, Q, K]``) boolean mask into the 4D form an HF attention backend expects.

    SDPA takes booleans (True = attend); the eager path adds the mask to the scores, so it needs
    an additive float mask (it would misread booleans).
    """
    mask4d = bool_mask[:, None] if bool_mask.ndim == 3 else bool_mask[None, None]
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=bool_mask.device)
        neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=bool_mask.device)
        return torch.where(mask4d, zero, neg)
    return mask4d


# ------------------------------------------------------------------------------------------
# Mask schedules: how many response tokens of the noisy copy are masked at a given step
# ------------------------------------------------------------------------------------------
MASK_SCHEDULES = ("full", "random_ratio", "linear_ramp")


def mask_ratio(
    schedule: str,
    step: int,
    total_steps: int,
    batch_size: int,
    *,
    min_ratio: float = 0.0,
    max_ratio: float = 1.0,
    start_ratio: float = 0.25,
    ramp_fraction: float = 0.5,
    generator: torch.Generator | None = None,
) -> float | torch.Tensor:
    """Masking ratio for the noisy copy.

    * ``full`` (the paper): every response token is masked.
    * ``random_ratio``: one ratio per sequence drawn from U(min_ratio, max_ratio) (diffusion-style noise levels).
    * ``linear_ramp``: a curriculum from ``start_ratio`` to 1 over the first ``ramp_fraction`` of training,
      so early steps see mostly clean context before the full multi-token task.
    """
    if schedule == "full":
        return 1.0
    if schedule == "random_ratio":
        if not 0.0 <= min_ratio <= max_ratio <= 1.0:
            raise ValueError(f"random_ratio needs 0 <= min_ratio <= max_ratio <= 1, got {min_ratio}, {max_ratio}")
        return min_ratio + (max_ratio - min_ratio) * torch.rand(batch_size, generator=generator)
    if schedule == "linear_ramp":
        if not 0.0 <= start_ratio <= 1.0 or not 0.0 < ramp_fraction <= 1.0:
            raise ValueError(
                f"linear_ramp needs start_ratio in [0, 1] and ramp_fraction in (0, 1], "
                f"got {start_ratio}, {ramp_fraction}"
            )
        progress = min(1.0, step / max(1.0, ramp_fraction * total_steps))
        return start_ratio + (1.0 - start_ratio) * progress
    raise ValueError(f"mask_schedule must be one of {MASK_SCHEDULES}, got {schedule!r}")


def flex_mask_mod(positions: torch.Tensor, clean_length: int, block_size: int, intra_block: str = "causal"):
    """The rules of :func:`two_stream_mask` as a FlexAttention ``mask_mod`` (GPU path); ``positions`` is ``[N, T]``."""
    _check_block(clean_length, block_size, intra_block)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(
            positions[b, q_idx],
            positions[b, kv_idx],
            q_idx >= clean_length,
            kv_idx >= clean_length,
            block_size,
            intra_block,
        )

    return mask_mod
