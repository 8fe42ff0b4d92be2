"""The LightningModule for AR SFT and MARS continued training (one code path for every objective)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from transformers import DynamicCache, PreTrainedModel, get_cosine_schedule_with_warmup

from mars.adapters import AdapterSettings, attach_adapter, warm_start_adapter
from mars.paths import bundled_path
from mars.training.loss_terms import IGNORE, LossTerms, NoisyLayout
from mars.training.masking import (
    attention_mask_for,
    flex_mask_mod,
    mask_ratio,
    noisy_copy,
    noisy_window_starts,
    response_positions_to_mask,
    shifted_targets,
    two_stream_mask,
)
from mars.training.objectives import Objective
from mars.training.optim import build_adamw
from mars.training.precision import wants_master_weights


def two_stream_attention(
    positions: torch.Tensor,
    clean_length: int,
    block_size: int | torch.Tensor,
    intra_block: str,
    attn_implementation: str,
    dtype: torch.dtype,
    block_offset: torch.Tensor | None = None,
    queries_from: int = 0,
):
    """The per-row 4D mask (or FlexAttention BlockMask) for ``[clean | noisy]`` inputs with ``positions``;
    ``queries_from`` keeps only the query rows from that column on (the noisy stream of a gated step)."""
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        if isinstance(block_size, torch.Tensor) or block_offset is not None or queries_from:
            raise ValueError("flex_attention takes one block size, no block offset and the full layout")
        n, t = positions.shape
        return create_block_mask(
            flex_mask_mod(positions, clean_length, block_size, intra_block), n, None, t, t, device=positions.device
        )
    mask = two_stream_mask(positions, clean_length, block_size, intra_block, block_offset)
    return attention_mask_for(mask[:, queries_from:], attn_implementation, dtype)


def _check_settings(
    block_size: int, lr: float, warmup_ratio: float, objective: Objective, adapter: AdapterSettings
) -> None:
    """Refuses settings the module cannot train with, naming the key (before anything is built)."""
    if block_size < 1:
        raise ValueError(f"block must be >= 1, got {block_size}")
    if lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {lr}")
    if not 0 <= warmup_ratio < 1:
        raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {warmup_ratio}")
    if adapter.gated and (objective.alpha > 0 or objective.kl_weight > 0):
        raise ValueError(
            "adapter=gated_lora trains the mask columns only: the clean stream is the frozen base model, so "
            f"objective.alpha ({objective.alpha}) and objective.kl_weight ({objective.kl_weight}) must be 0"
        )
    if adapter.gated and not objective.uses_noisy_stream:
        raise ValueError("adapter=gated_lora needs an objective with a mask loss (objective.mask_weight > 0)")
    if adapter.gated and objective.intra_block != "causal":
        raise ValueError("adapter=gated_lora supports intra_block=causal only")
    objective.check_clean_teacher(adapter.gated)


class MarsModule(LossTerms, L.LightningModule):
    """Wraps a Hugging Face causal LM; adds no parameters (an adapter, when configured, is a separate file).

    ``training_step`` builds ``z = [x ; x~]`` (the noisy copy ``x~`` masks response tokens according to
    the mask schedule), runs ONE forward with the structured mask and shared position ids, and scores
    right-shifted logits: ``L = mask_weight * L_mask(noisy) + alpha * L_AR(clean)`` plus the optional terms
    of :class:`mars.training.objectives.Objective`.  Logits are computed only at positions that carry loss, which
    keeps the vocabulary projection of a ``2L`` sequence from dominating memory, and (``crop_noisy_prompt``)
    each row's noisy copy starts at the block before its response: prompt-only noisy blocks carry no loss
    and nothing outside them attends to them, so dropping them changes no loss and saves their compute.

    With a gated adapter (:mod:`mars.adapters`) the clean stream is the frozen base model: it runs without
    gradient and hands its keys/values to a second forward over the noisy stream alone (the same attention
    rules, as a 4D mask over ``[clean keys | noisy keys]``), so only the noisy stream is back-propagated.

    The loss terms themselves (mask, certainty, unlikelihood, AR, KL and their weighted total) are
    :class:`~mars.training.loss_terms.LossTerms`'.
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
        adapter: AdapterSettings | None = None,
    ):
        super().__init__()
        adapter = adapter or AdapterSettings()
        _check_settings(block_size, lr, warmup_ratio, objective, adapter)
        self.model = model.train()  # from_pretrained returns eval mode; Lightning keeps module modes as found
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(block_size)
        self.objective = objective
        self.adapter = adapter
        self.mask_schedule = dict(mask_schedule or {"name": "full"})
        self.lr, self.weight_decay, self.betas, self.warmup_ratio = lr, weight_decay, tuple(betas), warmup_ratio
        self.seed = seed
        self.crop_noisy_prompt = crop_noisy_prompt
        self.save_hyperparameters(ignore=["model", "objective", "adapter"])
        self.hparams["objective"] = asdict(objective)
        self.hparams["adapter"] = asdict(adapter)
        self._reference: list[PreTrainedModel] = []  # the frozen start for kl_weight (not a submodule: no state)
        if objective.kl_weight > 0:
            import copy

            self._reference.append(copy.deepcopy(model).eval().requires_grad_(False))
        if adapter.enabled:
            attach_adapter(model, adapter, self.mask_token_id)
            if adapter.init_from:
                warm_start_adapter(model, bundled_path(adapter.init_from), block_size)
            self.strict_loading = False  # adapter checkpoints hold the trainable tensors only
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self.budget_progress = None  # set by mars.training.budget_callback.ComputeBudget: a time-driven lr schedule
        self.tokens_seen = 0  # tokens of the training rows (prompt + response), across resumes
        self.response_tokens_seen = 0  # of which response tokens (the ones with a loss)
        self._last_batch_time: float | None = None

    # ----------------------------------------------------------------------------------------
    def _attn_impl(self) -> str:
        return getattr(self.model.config, "_attn_implementation", None) or "sdpa"

    def _decoder(self):
        return getattr(self.model, self.model.base_model_prefix)

    def _hidden(self, input_ids, position_ids, attention_mask, cache=None):
        out = self._decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()

    # ----------------------------------------------------------------------------------------
    def block_grid(self, n: int, generator: torch.Generator | None, device) -> tuple[int | torch.Tensor, Any]:
        """Each row's training block size and grid offset (one fixed size and no offset by default)."""
        obj = self.objective
        if not obj.varies_blocks:
            return self.block_size, None
        draw_on = generator.device if generator is not None else device
        choices = torch.tensor(obj.block_choices or (self.block_size,), device=draw_on)
        sizes = choices[torch.randint(len(choices), (n,), generator=generator, device=draw_on)]
        offsets = None
        if obj.block_offset == "random":
            offsets = (torch.rand(n, generator=generator, device=draw_on) * sizes).long().to(device)
        return sizes.to(device), offsets

    def noisy_layout(
        self,
        ids: torch.Tensor,
        loss_mask: torch.Tensor,
        masked: torch.Tensor,
        block_size: int | torch.Tensor | None = None,
        block_offset: torch.Tensor | None = None,
    ) -> NoisyLayout:
        """Row ``r``'s noisy stream covers positions ``s_r .. s_r + W - 1`` (``s_r = 0`` without cropping); its
        target at position ``t`` is ``x[t+1]`` where that token is a masked response token."""
        n, length = ids.shape
        block_size = self.block_size if block_size is None else block_size
        starts = (
            noisy_window_starts(loss_mask, block_size, block_offset) if self.crop_noisy_prompt else ids.new_zeros(n)
        )
        width = int((length - starts).max())
        npos = starts[:, None] + torch.arange(width, device=ids.device)
        inside = npos < length  # rows whose window runs past their end get filler: no loss, attended by nothing
        idx = npos.clamp(max=length - 1)
        noisy = noisy_copy(ids, masked, self.mask_token_id).gather(1, idx).masked_fill(~inside, self.mask_token_id)
        targets = shifted_targets(ids, loss_mask.bool() & masked).gather(1, idx).masked_fill(~inside, IGNORE)
        return NoisyLayout(noisy, npos, targets, block_size, block_offset)

    def two_stream_inputs(self, ids: torch.Tensor, loss_mask: torch.Tensor, masked: torch.Tensor):
        """``z = [x ; x~]``, its position ids and the noisy stream's targets (one fixed block grid)."""
        n, length = ids.shape
        layout = self.noisy_layout(ids, loss_mask, masked)
        positions = torch.cat([torch.arange(length, device=ids.device).expand(n, -1), layout.positions], dim=1)
        return torch.cat([ids, layout.ids], dim=1), positions, layout.targets

    def losses(
        self,
        batch: dict[str, torch.Tensor],
        ratio: float | torch.Tensor = 1.0,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        n, length = ids.shape
        pos = torch.arange(length, device=ids.device).expand(n, -1)
        ar_targets = shifted_targets(ids, loss_mask)
        obj = self.objective
        if not obj.uses_noisy_stream:
            hidden = self._hidden(ids, pos, None)
            out = {"loss_ar": self._ce(hidden, ar_targets)}
            if obj.kl_weight > 0:
                out["loss_kl"] = self._kl_to_reference(ids, pos, hidden, ar_targets)
            return self._total(out)
        masked = response_positions_to_mask(loss_mask, ratio, generator=generator)
        sizes, offsets = self.block_grid(n, generator, ids.device)
        layout = self.noisy_layout(ids, loss_mask, masked, sizes, offsets)
        if self.adapter.gated:
            return self._total(self._gated_losses(ids, pos, layout))
        z = torch.cat([ids, layout.ids], dim=1)
        zpos = torch.cat([pos, layout.positions], dim=1)
        attn = two_stream_attention(
            zpos, length, sizes, obj.intra_block, self._attn_impl(), self.model.dtype, block_offset=offsets
        )
        hidden = self._hidden(z, zpos, attn)
        clean = hidden[:, :length]
        out = self.mask_losses(hidden[:, length:], layout, *self._mask_targets(clean, layout))
        if obj.alpha > 0:
            out["loss_ar"] = self._ce(clean, ar_targets)
        else:  # logged for comparison, outside the graph
            with torch.no_grad():
                out["loss_ar"] = self._ce(clean, ar_targets)
        if obj.kl_weight > 0:
            out["loss_kl"] = self._kl_to_reference(ids, pos, clean, ar_targets)
        return self._total(out)

    def _gated_losses(self, ids: torch.Tensor, pos: torch.Tensor, layout: NoisyLayout) -> dict[str, torch.Tensor]:
        """Clean stream without gradient (the frozen base: no mask token, adapters off), then the noisy stream
        alone against the clean keys/values, under the same attention rules."""
        clean, hidden = self._noisy_over_clean(ids, pos, layout)
        return self.mask_losses(hidden, layout, *self._mask_targets(clean, layout))

    def _noisy_over_clean(self, ids: torch.Tensor, pos: torch.Tensor, layout: NoisyLayout):
        """The clean stream's hidden states (no gradient) and the noisy stream's, run as a second forward over
        the clean keys/values; the same attention rules as one two-stream forward, since no clean query ever
        attends a noisy key."""
        length = ids.shape[1]
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            clean = self._hidden(ids, pos, None, cache=cache)
        zpos = torch.cat([pos, layout.positions], dim=1)
        attn = two_stream_attention(
            zpos,
            length,
            layout.block_size,
            "causal",
            self._attn_impl(),
            self.model.dtype,
            block_offset=layout.block_offset,
            queries_from=length,
        )
        return clean, self._hidden(layout.ids, layout.positions, attn, cache=cache)

    @torch.no_grad()
    def mask_predictions(
        self, ids: torch.Tensor, loss_mask: torch.Tensor, block_offset: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, NoisyLayout]:
        """Every response token masked, the noisy stream's logits ``[n, W, vocab]`` and its layout: what the
        masks of a decoding step predict after each block start of the grid (shifted by ``block_offset``),
        given the rows' own text before it.  For measuring a checkpoint, not for training."""
        n, length = ids.shape
        pos = torch.arange(length, device=ids.device).expand(n, -1)
        layout = self.noisy_layout(ids, loss_mask, loss_mask.bool(), self.block_size, block_offset)
        _, hidden = self._noisy_over_clean(ids, pos, layout)
        return self._logits(hidden), layout

    # ----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        sched = dict(self.mask_schedule)
        name = sched.pop("name", "full")
        ratio = mask_ratio(
            name,
            self.global_step,
            self._total_steps(),
            batch["input_ids"].shape[0],
            generator=self._batch_generator(batch_idx, torch.device("cpu")),
            **sched,
        )
        if isinstance(ratio, torch.Tensor):
            ratio = ratio.to(batch["input_ids"].device)
        out = self.losses(batch, ratio, generator=self._batch_generator(batch_idx, batch["input_ids"].device))
        bs = batch["input_ids"].shape[0]
        self.tokens_seen += int(batch["length"].sum()) if "length" in batch else batch["input_ids"].numel()
        self.response_tokens_seen += int(batch["loss_mask"].sum())
        for key, value in out.items():
            self.log(f"train/{key}", value.detach(), prog_bar=key == "loss", batch_size=bs, sync_dist=False)
        now = time.perf_counter()
        if self._last_batch_time is not None:
            tokens = int(batch["length"].sum()) if "length" in batch else batch["input_ids"].numel()
            self.log("train/tokens_per_s", tokens / max(1e-9, now - self._last_batch_time), batch_size=bs)
        self._last_batch_time = now
        return out["loss"]

    def _total_steps(self) -> int:
        if self._trainer is None:
            return 1
        total = self.trainer.estimated_stepping_batches
        return max(1, int(total)) if total != float("inf") else 1

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

    # ----------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """An adapter run checkpoints its trainable tensors only (MB instead of the whole frozen base)."""
        checkpoint["mars_tokens_seen"] = [self.tokens_seen, self.response_tokens_seen]
        if self.adapter.enabled:
            keep = {f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen, self.response_tokens_seen = checkpoint.get("mars_tokens_seen", [0, 0])
        if self.adapter.enabled:
            want = {f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad}
            missing = sorted(want - set(checkpoint["state_dict"]))
            if missing:
                raise RuntimeError(f"the checkpoint lacks adapter tensors this run trains: {missing[:3]}")

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # bf16-true weights keep fp32 master weights in the optimizer, or small updates round away (mars.training.optim)
        precision = str(getattr(self._trainer, "precision", "32-true")) if self._trainer is not None else "32-true"
        optimizer = build_adamw(
            groups,
            lr=self.lr,
            betas=self.betas,
            master_weights=wants_master_weights(precision, getattr(self, "master_weights", "auto")),
        )
        if self.budget_progress is not None:
            # a compute budget ends training, not a step count: warmup and cosine follow the budget's use
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, budget_lr_factor(self.budget_progress, self.warmup_ratio)
            )
        else:
            total = self._total_steps()
            scheduler = get_cosine_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def budget_lr_factor(progress, warmup_ratio: float):
    """Linear warmup over the first ``warmup_ratio`` of the budget, then cosine decay to 0 at its end;
    ``progress()`` returns the share of the budget used (0..1)."""

    def factor(_step: int) -> float:
        p = min(1.0, max(0.0, float(progress())))
        if warmup_ratio > 0 and p < warmup_ratio:
            return max(p / warmup_ratio, 1e-3)
        span = max(1e-9, 1.0 - warmup_ratio)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (p - warmup_ratio) / span)))

    return factor
