"""Tiny MARS checkpoints for the integration tests, built with the project's own export: a full fine-tuned one and
a gated adapter, on the few-layer random model with the embedded tokenizer (seconds)."""

from pathlib import Path

import torch

from mars.adapters import AdapterSettings, attach_adapter
from mars.models import load_model
from mars.training.export import export_adapter, export_hf

BLOCK = 4


def _metadata(loaded, **extra):
    return dict(
        block_size=BLOCK,
        objective="mars",
        mask_token=loaded.mask.token,
        mask_token_id=loaded.mask.id,
        mask_token_policy=loaded.mask.how,
        base_model="tiny-random",
        base_num_parameters=sum(p.numel() for p in loaded.model.parameters()),
        **extra,
    )


def make_full_checkpoint(folder: Path) -> Path:
    """A full-weights MARS checkpoint folder (config.json, weights, tokenizer with its mask token, mars_config.json)."""
    loaded = load_model("tiny-random")
    return export_hf(loaded.model, loaded.tokenizer, folder, _metadata(loaded))


def give_adapter_weights(model, seed: int) -> None:
    """Random values for a fresh adapter's zero factors and delta, as training would leave them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "mask_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_gated_checkpoint(folder: Path, tiny: dict | None = None) -> Path:
    """A gated adapter folder on tiny-random (``tiny``: its shape; rank 4, alpha 8: scaling 2; every projection and
    the mask delta)."""
    loaded = load_model("tiny-random", tiny=tiny)
    base_params = sum(p.numel() for p in loaded.model.parameters())
    attach_adapter(loaded.model, AdapterSettings(kind="gated_lora", rank=4, alpha=8), loaded.mask.id)
    give_adapter_weights(loaded.model, seed=1)
    meta = _metadata(loaded, base_tiny=tiny)
    meta["base_num_parameters"] = base_params
    return export_adapter(loaded.model, loaded.tokenizer, folder, meta)
