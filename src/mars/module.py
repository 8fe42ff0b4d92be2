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
    mars_attention_mask,
    mask_ratio,
    noisy_copy,
    response_positions_to_mask,
    shifted_targets,
    two_stream_position_ids,
)
from mars.objectives import Objective

IGNORE = -100


def two_stream_attention(length: int, block_size: int, intra_block: str, attn_implementation: str,
                         dtype: torch.dtype, device: torch.device):
    """The 4D mask (or FlexAttention BlockMask) for a ``[clean | noisy]`` input of ``2 * length``."""
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(flex_mask_mod(length, block_size, intra_block), None, None,
                                 2 * length, 2 * length, device=device)
    return attention_mask_for(mars_attention_mask(length, block_size, intra_block, device=device),
                              attn_implementation, dtype)


class MarsModule(L.LightningModule):
    """Wraps a Hugging Face causal LM; adds no parameters.

    ``training_step`` builds ``z = [x ; x~]`` (the noisy copy ``x~`` masks response tokens according to
    the mask schedule), runs ONE forward with the structured mask and shared position ids, and scores
    right-shifted logits: ``L = mask_weight * L_mask(noisy) + alpha * L_AR(clean)``.
    Logits are computed only at positions that carry loss, which keeps the vocabulary projection of a
    ``2L`` sequence from dominating memory.
    """

    def __init__(self, model: PreTrainedModel, mask_token_id: int, *, block_size: int, objective: Objective,
                 mask_schedule: dict[str, Any] | None = None, lr: float = 5e-6, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_ratio: float = 0.03,
                 gradient_checkpointing: bool = False, seed: int = 0):
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
        out = self.model.base_model(input_ids=input_ids, position_ids=position_ids,
                                    attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def _ce(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over positions with a target; logits only where needed."""
        sel = targets != IGNORE
        if not sel.any():
            return hidden.sum() * 0.0  # keeps the graph (and DDP) happy on a batch with no target
        logits = self.model.get_output_embeddings()(hidden[sel]).float()
        return F.cross_entropy(logits, targets[sel])

    def noisy_targets(self, input_ids, loss_mask, masked):
        """Targets of the noisy stream: ``x[t+1]`` where that token is a masked response token."""
        return shifted_targets(input_ids, loss_mask.bool() & masked)

    def losses(self, batch: dict[str, torch.Tensor], ratio: float | torch.Tensor = 1.0,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
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
        z = torch.cat([ids, noisy_copy(ids, masked, self.mask_token_id)], dim=1)
        pos = two_stream_position_ids(length, device=ids.device).expand(n, -1)
        attn = two_stream_attention(length, self.block_size, self.objective.intra_block, self._attn_impl(),
                                    self.model.dtype, ids.device)
        hidden = self._hidden(z, pos, attn)
        out["loss_mask"] = self._ce(hidden[:, length:], self.noisy_targets(ids, loss_mask, masked))
        out["loss_ar"] = self._ce(hidden[:, :length], ar_targets)
        out["loss"] = self.objective.mask_weight * out["loss_mask"] + self.objective.alpha * out["loss_ar"]
        return out

    # ----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        sched = dict(self.mask_schedule)
        name = sched.pop("name", "full")
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        ratio = mask_ratio(name, self.global_step, total, batch["input_ids"].shape[0], **sched)
        if isinstance(ratio, torch.Tensor):
            ratio = ratio.to(batch["input_ids"].device)
        out = self.losses(batch, ratio)
        bs = batch["input_ids"].shape[0]
        for key, value in out.items():
            self.log(f"train/{key}", value.detach(), prog_bar=key == "loss", batch_size=bs, sync_dist=False)
        now = time.perf_counter()
        if self._last_batch_time is not None:
            tokens = int(batch["length"].sum()) if "length" in batch else batch["input_ids"].numel()
            self.log("train/tokens_per_s", tokens / max(1e-9, now - self._last_batch_time), batch_size=bs)
        self._last_batch_time = now
        return out["loss"]

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
