"""Write a trained model as a plain Hugging Face directory: weights, tokenizer (with its mask token)
and ``mars_config.json`` (block size, objective, mask token).  Vanilla ``from_pretrained`` loads it
with exactly the base model's parameter count: MARS's "one checkpoint, no new parameters"."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mars.models import write_mars_metadata

log = logging.getLogger(__name__)


def export_hf(model, tokenizer, out_dir: str | os.PathLike, metadata: dict[str, Any],
              dtype: torch.dtype | None = None) -> Path:
    """Save atomically: a half-written directory never appears under ``out_dir``."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_mars_metadata(tmp, **metadata, num_parameters=sum(p.numel() for p in model.parameters()))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported Hugging Face checkpoint to %s", out)
    return out


def state_dict_from_lightning(ckpt_path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights inside a Lightning checkpoint (a file, or a DeepSpeed checkpoint folder)."""
    path = Path(ckpt_path)
    if path.is_dir():  # DeepSpeed ZeRO shards
        from lightning.pytorch.utilities.deepspeed import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    prefix = "model."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def main(argv: list[str] | None = None) -> None:
    """``python -m mars.export CKPT OUT --base NAME_OR_PATH --block B --objective mars``: HF export of a
    Lightning checkpoint (e.g. after FSDP/DeepSpeed training, or from an intermediate step)."""
    from mars.models import load_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--base", required=True, help="the model the run started from (same loader as model.name_or_path)")
    p.add_argument("--block", type=int, required=True)
    p.add_argument("--objective", default="mars")
    args = p.parse_args(argv)
    loaded = load_model(args.base)
    loaded.model.load_state_dict(state_dict_from_lightning(args.ckpt))
    export_hf(loaded.model, loaded.tokenizer, args.out,
              dict(block_size=args.block, objective=args.objective, mask_token=loaded.mask.token,
                   mask_token_id=loaded.mask.id, mask_token_policy=loaded.mask.how, base_model=args.base))


if __name__ == "__main__":
    main()
