"""The LightningModule for AR SFT and MARS continued training (one code path for every objective)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from mars.masking import (
    attention_mask_for,
    flex_mask_mod,
    mask_ratio,
    noisy_copy,
    noisy_window_starts,
    response_positions_to_mask,
    shifted_targets,
    two_stream_mask,
)
from mars.objectives import Objective
from mars.optim import build_adamw
from mars.precision import wants_master_weights

IGNORE = -100


def two_stream_attention(
    positions: torch.Tensor,
    clean_length: int,
    block_size: int,
    intra_block: str,
    attn_implementation: str,
    dtype: torch.dtype,
):
    """The per-row 4D mask (or FlexAttention BlockMask) for ``[clean | noisy]`` inputs with ``positions``."""
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        n, t = positions.shape
        return create_block_mask(
            flex_mask_mod(positions, clean_length, block_size, intra_block), n, None, t, t, device=positions.device
        )
    return attention_mask_for(
        two_stream_mask(positions, clean_length, block_size, intra_block), attn_implementation, dtype
    )


class MarsModule(L.LightningModule):
    """Wraps a Hugging Face causal LM; adds no parameters.

    ``training_step`` builds ``z = [x ; x~]`` (the noisy copy ``x~`` masks response tokens according to
    the mask schedule), runs ONE forward with the structured mask and shared position ids, and scores
    right-shifted logits: ``L = mask_weight * L_mask(noisy) + alpha * L_AR(clean)``.
    Logits are computed only at positions that carry loss, which keeps the vocabulary projection of a
    ``2L`` sequence from dominating memory, and (``crop_noisy_prompt``) each row's noisy copy starts at
    the block before its response: prompt-only noisy blocks carry no loss and nothing outside them
    attends to them, so dropping them changes no loss and saves their compute (prompts are often longer
    than responses in instruction data).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        mask_token_id: int,
        *,
        block_size: int,
        objective: Objective,
        mask_schedule: dict[str, Any] | None = None,
        lr: float = 5e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_ratio: float = 0.03,
        gradient_checkpointing: bool = False,
        crop_noisy_prompt: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block must be >= 1, got {block_size}")
        if lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {lr}")
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {warmup_ratio}")
        self.model = model.train()  # from_pretrained returns eval mode; Lightning keeps module modes as found
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(block_size)
        self.objective = objective
        self.mask_schedule = dict(mask_schedule or {"name": "full"})
        self.lr, self.weight_decay, self.betas, self.warmup_ratio = lr, weight_decay, tuple(betas), warmup_ratio
        self.seed = seed
        self.crop_noisy_prompt = crop_noisy_prompt
        self.save_hyperparameters(ignore=["model", "objective"])
        self.hparams["objective"] = asdict(objective)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self._last_batch_time: float | None = None

    # ----------------------------------------------------------------------------------------
    def _attn_impl(self) -> str:
        return getattr(self.model.config, "_attn_implementation", None) or "sdpa"

    def _hidden(self, input_ids, position_ids, attention_mask):
        out = self.model.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        )
        return out.last_hidden_state

    def _ce(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over positions with a target; logits only where needed."""
        sel = targets != IGNORE
        if not sel.any():
            return hidden.sum() * 0.0  # keeps the graph (and DDP) happy on a batch with no target
        logits = self.model.get_output_embeddings()(hidden[sel]).float()
        return F.cross_entropy(logits, targets[sel])

    def two_stream_inputs(self, ids: torch.Tensor, loss_mask: torch.Tensor, masked: torch.Tensor):
        """``z = [x ; x~]``, its position ids and the noisy stream's targets.

        The noisy stream of row ``r`` covers positions ``s_r .. s_r + W - 1`` (``s_r = 0`` without cropping);
        its target at position ``t`` is ``x[t+1]`` where that token is a masked response token.
        """
        n, length = ids.shape
        starts = noisy_window_starts(loss_mask, self.block_size) if self.crop_noisy_prompt else ids.new_zeros(n)
        width = int((length - starts).max())
        npos = starts[:, None] + torch.arange(width, device=ids.device)
        inside = npos < length  # rows whose window runs past their end get filler: no loss, attended by nothing
        idx = npos.clamp(max=length - 1)
        noisy = noisy_copy(ids, masked, self.mask_token_id).gather(1, idx).masked_fill(~inside, self.mask_token_id)
        targets = shifted_targets(ids, loss_mask.bool() & masked).gather(1, idx).masked_fill(~inside, IGNORE)
        positions = torch.cat([torch.arange(length, device=ids.device).expand(n, -1), npos], dim=1)
        return torch.cat([ids, noisy], dim=1), positions, targets

    def losses(
        self,
        batch: dict[str, torch.Tensor],
        ratio: float | torch.Tensor = 1.0,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        n, length = ids.shape
        ar_targets = shifted_targets(ids, loss_mask)
        out: dict[str, torch.Tensor] = {}
        if not self.objective.uses_noisy_stream:
            pos = torch.arange(length, device=ids.device).expand(n, -1)
            hidden = self._hidden(ids, pos, None)
            out["loss_ar"] = self._ce(hidden, ar_targets)
            out["loss"] = self.objective.alpha * out["loss_ar"]
            return out
        masked = response_positions_to_mask(loss_mask, ratio, generator=generator)
        z, pos, noisy_targets = self.two_stream_inputs(ids, loss_mask, masked)
        attn = two_stream_attention(
            pos, length, self.block_size, self.objective.intra_block, self._attn_impl(), self.model.dtype
        )
        hidden = self._hidden(z, pos, attn)
        out["loss_mask"] = self._ce(hidden[:, length:], noisy_targets)
        out["loss_ar"] = self._ce(hidden[:, :length], ar_targets)
        out["loss"] = self.objective.mask_weight * out["loss_mask"] + self.objective.alpha * out["loss_ar"]
        return out

    # ----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        sched = dict(self.mask_schedule)
        name = sched.pop("name", "full")
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        ratio = mask_ratio(
            name,
            self.global_step,
            total,
            batch["input_ids"].shape[0],
            generator=self._batch_generator(batch_idx, torch.device("cpu")),
            **sched,
        )
        if isinstance(ratio, torch.Tensor):
            ratio = ratio.to(batch["input_ids"].device)
        out = self.losses(batch, ratio, generator=self._batch_generator(batch_idx, batch["input_ids"].device))
        bs = batch["input_ids"].shape[0]
        for key, value in out.items():
            self.log(f"train/{key}", value.detach(), prog_bar=key == "loss", batch_size=bs, sync_dist=False)
        now = time.perf_counter()
        if self._last_batch_time is not None:
            tokens = int(batch["length"].sum()) if "length" in batch else batch["input_ids"].numel()
            self.log("train/tokens_per_s", tokens / max(1e-9, now - self._last_batch_time), batch_size=bs)
        self._last_batch_time = now
        return out["loss"]

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's FSDP precision plugin refuses norm clipping (``trainer.gradient_clip_val`` of every
        trainer config): under FSDP the norm is computed over all shards by FSDP's own ``clip_grad_norm_``."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if gradient_clip_val and isinstance(self.trainer.model, FullyShardedDataParallel):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"under FSDP only norm clipping is supported, got {gradient_clip_algorithm!r}")
            self.trainer.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    def _batch_generator(self, batch_idx: int, device: torch.device) -> torch.Generator:
        """The random masks of a batch depend only on (seed, epoch, batch, rank), not on the process's RNG
        history, so a killed-and-resumed run draws exactly the masks of an uninterrupted one."""
        epoch, rank = (self.current_epoch, self.global_rank) if self._trainer is not None else (0, 0)
        key = ((int(self.seed) * 1_000_003 + epoch) * 1_000_003 + int(batch_idx)) * 65_537 + rank
        return torch.Generator(device=device).manual_seed(key % (2**63 - 1))

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # bf16-true weights keep fp32 masters in the optimizer, or small updates round away (mars.optim)
        precision = str(getattr(self._trainer, "precision", "32-true")) if self._trainer is not None else "32-true"
        optimizer = build_adamw(
            groups,
            lr=self.lr,
            betas=self.betas,
            master_weights=wants_master_weights(precision, getattr(self, "master_weights", "auto")),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
