"""Training objectives as loss terms over the two streams.

``ar``, ``mars``, ``mars_no_sft`` and the Block Diffusion baseline run through the same code:
``L = mask_weight * L_mask + alpha * L_AR`` and the intra-block attention pattern.  The levers that make the
masks learn faster per training token are fields here too (all off by default, i.e. the paper's MARS):

* ``certainty_weight`` -- certainty forcing (dParallel, arXiv 2509.26488): the mean entropy of the mask
  predictions whose argmax already equals the label, reusing the same logits.  It sharpens what the masks
  already get right, which is what a confidence threshold needs (8.5x fewer decoding steps there).
* ``unlikelihood_weight`` -- the other half of a threshold's job: the mean ``-log(1 - p)`` of the argmax
  of the mask predictions that are wrong (unlikelihood training, Welleck et al., arXiv 1908.04319, applied
  to the masks' own wrong choice), so that a confident mask is more often a right one.
* ``depth_weighting`` -- weight each mask's loss by how likely decoding reaches it: ``reach`` multiplies
  the (detached) probabilities the earlier masks of its block give their own labels (PARD-2's weighting,
  with the masks themselves as the judge); ``decay`` is a fixed ``depth_decay ** k`` for the k-th mask.
* ``block_choices`` / ``block_offset`` -- each row draws its training block size from ``block_choices``
  (Kirchenbauer et al., arXiv 2602.06019: random block sizes beat a fixed large one) and, with
  ``block_offset: random``, a random alignment of the block grid, so that over epochs every response token
  is a target at every depth.
* ``mask_targets: clean_argmax`` -- the masks learn the clean stream's own greedy choice instead of the data
  token (hard self-distillation targets; identical to ``data`` on self-distilled answers of the same model).
* ``mask_targets: clean_soft`` -- the masks learn the clean stream's whole next-token distribution at their
  target position: the KL divergence from ``softmax(clean logits / soft_temperature)`` (detached) to the mask's
  prediction.  The clean stream at position ``t`` has seen the real tokens up to ``t`` that the mask has not;
  where it models the text, its distribution averaged over those tokens is the mask's own best answer: the
  minimiser of the data token's one-hot target, with less variance, and it tells a mask how unsure to be,
  which its confidence threshold reads.  ``soft_temperature`` -> 0 gives ``clean_argmax``.  The teacher must be a fixed or
  anchored language model (:meth:`Objective.check_clean_teacher`): with a gated adapter it is the frozen base;
  under full fine-tuning it is the model being trained, detached (a moving teacher: the mask loss never pulls
  the clean stream towards the masks' worse guesses), and accepted only when ``alpha`` or ``kl_weight`` ties it
  to the data or to the starting model -- with neither, nothing but the masks' own agreement with it would
  train the shared weights, and both streams could drift together away from the data.
* ``kl_weight`` -- the clean stream's KL to the frozen starting model at response positions (full
  fine-tuning only: it holds the AR behaviour where the AR loss on the data would move it).
"""

from __future__ import annotations

from dataclasses import dataclass

from mars.training.masking import INTRA_BLOCK_PATTERNS

KNOWN_OBJECTIVES = ("ar", "mars", "mars_no_sft", "block_diffusion")
DEPTH_WEIGHTINGS = ("none", "decay", "reach")
BLOCK_OFFSETS = ("fixed", "random")
MASK_TARGETS = ("data", "clean_argmax", "clean_soft")


@dataclass(frozen=True)
class Objective:
    name: str
    mask_weight: float = 1.0  # weight of the noisy-copy (multi-token) loss
    alpha: float = 1.0  # weight of the clean-copy AR ("SFT") loss
    intra_block: str = "causal"  # causal (MARS) | bidirectional (Block Diffusion baseline)
    certainty_weight: float = 0.0
    unlikelihood_weight: float = 0.0
    depth_weighting: str = "none"
    depth_decay: float = 0.7
    block_choices: tuple[int, ...] | None = None  # null: the run's `block` for every row
    block_offset: str = "fixed"
    mask_targets: str = "data"
    soft_temperature: float = 1.0  # clean_soft: the clean logits are divided by it before the softmax
    kl_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in KNOWN_OBJECTIVES:
            raise ValueError(f"unknown objective {self.name!r}; choose one of {KNOWN_OBJECTIVES}")
        for key in ("alpha", "mask_weight", "certainty_weight", "unlikelihood_weight", "kl_weight"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"objective.{key} must be >= 0 (a number), got {value!r}")
        if self.alpha == 0 and self.mask_weight == 0 and self.kl_weight == 0:
            raise ValueError("objective has no loss: mask_weight, alpha and kl_weight are all 0")
        if self.intra_block not in INTRA_BLOCK_PATTERNS:
            raise ValueError(f"objective.intra_block must be one of {INTRA_BLOCK_PATTERNS}, got {self.intra_block!r}")
        if self.depth_weighting not in DEPTH_WEIGHTINGS:
            raise ValueError(
                f"objective.depth_weighting must be one of {DEPTH_WEIGHTINGS}, got {self.depth_weighting!r}"
            )
        if isinstance(self.depth_decay, bool) or not isinstance(self.depth_decay, (int, float)):
            raise ValueError(f"objective.depth_decay must be a number in (0, 1], got {self.depth_decay!r}")
        if not 0 < self.depth_decay <= 1:
            raise ValueError(f"objective.depth_decay must be in (0, 1], got {self.depth_decay!r}")
        if self.block_choices is not None:
            choices = tuple(self.block_choices)
            if not choices or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in choices):
                raise ValueError(
                    f"objective.block_choices must be null or a list of integers >= 1, got {self.block_choices!r}"
                )
            object.__setattr__(self, "block_choices", choices)
        if self.block_offset not in BLOCK_OFFSETS:
            raise ValueError(f"objective.block_offset must be one of {BLOCK_OFFSETS}, got {self.block_offset!r}")
        if self.mask_targets not in MASK_TARGETS:
            raise ValueError(f"objective.mask_targets must be one of {MASK_TARGETS}, got {self.mask_targets!r}")
        self._check_soft_targets()

    def _check_soft_targets(self) -> None:
        """What ``clean_soft`` needs from the objective alone: a mask loss, and masks whose best answer is the
        clean stream's distribution (the adapter's part is :meth:`check_clean_teacher`)."""
        t = self.soft_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"objective.soft_temperature must be a number > 0, got {t!r}")
        if self.mask_targets != "clean_soft":
            return
        if not self.uses_noisy_stream:
            raise ValueError(
                f"objective.mask_targets=clean_soft distils the clean stream into the masks, but objective "
                f"{self.name!r} has no mask loss (mask_weight={self.mask_weight}): only the clean stream runs"
            )
        if self.intra_block != "causal":
            raise ValueError(
                f"objective.mask_targets=clean_soft needs intra_block=causal; objective {self.name!r} has "
                f"{self.intra_block!r}: its masks see later tokens of their block, which the clean stream at their "
                "position has not seen, so its distribution is not their target"
            )

    def check_clean_teacher(self, gated: bool) -> None:
        """Refuse ``clean_soft`` where the clean stream is no teacher: under full fine-tuning (``gated`` False)
        it is the model being trained, and without ``alpha`` or ``kl_weight`` nothing ties it to the data."""
        if self.mask_targets != "clean_soft" or gated or self.alpha > 0 or self.kl_weight > 0:
            return
        raise ValueError(
            f"objective.mask_targets=clean_soft without adapter=gated_lora distils the model being trained into its "
            f"own masks; objective {self.name!r} has alpha=0 and kl_weight=0, so nothing anchors that teacher to "
            "the data. Use adapter=gated_lora (the frozen base is the teacher), objective.alpha > 0 or "
            "objective.kl_weight > 0"
        )

    @property
    def uses_noisy_stream(self) -> bool:
        """AR SFT skips the noisy copy: its loss is exactly the clean stream's, at half the length."""
        return self.mask_weight > 0

    @property
    def varies_blocks(self) -> bool:
        return self.block_choices is not None or self.block_offset == "random"
