"""Training objectives as loss weights over the two streams.

``ar``, ``mars``, ``mars_no_sft`` and the Block Diffusion baseline run through the same code and differ
only in these fields: ``L = mask_weight * L_mask + alpha * L_AR`` and the intra-block attention pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars.masking import INTRA_BLOCK_PATTERNS

KNOWN_OBJECTIVES = ("ar", "mars", "mars_no_sft", "block_diffusion")


@dataclass(frozen=True)
class Objective:
    name: str
    mask_weight: float = 1.0  # weight of the noisy-copy (multi-token) loss
    alpha: float = 1.0  # weight of the clean-copy AR ("SFT") loss
    intra_block: str = "causal"  # causal (MARS) | bidirectional (Block Diffusion baseline)

    def __post_init__(self) -> None:
        if self.name not in KNOWN_OBJECTIVES:
            raise ValueError(f"unknown objective {self.name!r}; choose one of {KNOWN_OBJECTIVES}")
        if self.alpha < 0:
            raise ValueError(f"objective.alpha must be >= 0 (weight of the AR loss), got {self.alpha}")
        if self.mask_weight < 0:
            raise ValueError(f"objective.mask_weight must be >= 0, got {self.mask_weight}")
        if self.alpha == 0 and self.mask_weight == 0:
            raise ValueError("objective has no loss: mask_weight and alpha are both 0")
        if self.intra_block not in INTRA_BLOCK_PATTERNS:
            raise ValueError(f"objective.intra_block must be one of {INTRA_BLOCK_PATTERNS}, got {self.intra_block!r}")

    @property
    def uses_noisy_stream(self) -> bool:
        """AR SFT skips the noisy copy: its loss is exactly the clean stream's, at half the length."""
        return self.mask_weight > 0
