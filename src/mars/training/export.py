"""Write a trained model as a plain Hugging Face directory: weights, tokenizer (with its mask token),
``mars_config.json`` (:mod:`mars.metadata`), and ``custom_generate/generate.py`` with the ``config.json`` keys it
reads (:mod:`mars.custom_generate_files`).  Vanilla ``from_pretrained`` loads it with exactly the base model's
parameter count: MARS's "one checkpoint, no new parameters"; vanilla ``generate(..., custom_generate=<folder>,
trust_remote_code=True)`` decodes it with MARS verify.  A gated adapter's folder (no ``config.json``: base model +
adapter) carries ``custom_generate/`` too, for the model :func:`mars.models.load_model` builds from it.

After sharded training (FSDP, DeepSpeed ZeRO-3) no rank holds the whole model: :func:`export_from_trainer`
gathers a full state dict on every rank (a collective call, inside ``fit``) and global rank 0 saves it.
``python -m mars.training.export`` exports a Lightning checkpoint (a file, or a DeepSpeed checkpoint folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mars.custom_generate_files import write_config_keys, write_custom_generate
from mars.metadata import MarsMetadata, write_metadata
from mars.persistence import atomic_dir, verify_checksum

log = logging.getLogger(__name__)


def export_hf(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    metadata: dict[str, Any] | MarsMetadata,
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save atomically: a half-written directory never appears under ``out_dir``.  ``metadata`` is
    validated before anything is written; ``num_parameters`` is counted here."""
    if isinstance(metadata, MarsMetadata):
        metadata = metadata.to_dict()
    meta = MarsMetadata.from_dict(
        {**metadata, "num_parameters": sum(p.numel() for p in model.parameters())}, where=f"metadata of {out_dir}"
    )
    out = Path(out_dir)
    with atomic_dir(out) as tmp:  # permissions from the umask, as save_pretrained's own folders
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        write_metadata(tmp, meta)
        write_config_keys(tmp, meta.to_dict())
        write_custom_generate(tmp)
    log.info("exported Hugging Face checkpoint to %s", out)
    return out


def export_adapter(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    metadata: dict[str, Any],
    provenance: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """A gated adapter run's export: the adapter (:func:`mars.adapters.save_adapter`; its tensors in ``dtype``
    when given), the tokenizer with its mask token and ``mars_config.json`` (``adapter: gated_lora``, the base
    model), in one folder that :func:`mars.models.load_model` turns back into base + adapter.  ``provenance``
    goes into ``mars_adapter.json`` as it is.  Written atomically."""
    from mars.adapters import recorded_base_digest, write_adapter

    meta = MarsMetadata.from_dict(
        {**metadata, "adapter": "gated_lora", "num_parameters": metadata.get("base_num_parameters")},
        where=f"metadata of {out_dir}",
    )
    out = Path(out_dir)
    adapter_meta = {
        "base_model": meta.base_model,
        "base_tiny": metadata.get("base_tiny"),
        "base_digest": recorded_base_digest(model),
        "block_size": meta.block_size,
        "mask_token": meta.mask_token,
        "mask_token_id": meta.mask_token_id,
        **(provenance or {}),
    }
    with atomic_dir(out) as tmp:  # adapter, tokenizer and metadata appear together or not at all
        write_adapter(model, Path(tmp), adapter_meta, dtype=dtype)
        tokenizer.save_pretrained(tmp)
        write_metadata(tmp, meta)
        write_custom_generate(tmp)  # no config.json to carry the keys: the gate of load_model's model names the mask
    log.info("exported gated adapter to %s", out)
    return out


def export_adapter_run(model, tokenizer, out_dir: str | os.PathLike, metadata: dict[str, Any]) -> Path:
    """The export of a model trained with an adapter: the gated adapter's folder, or the plain LoRA merged."""
    if model.mars_adapter.gated:
        return export_adapter(model, tokenizer, out_dir, metadata)
    return export_hf(merged_copy(model), tokenizer, out_dir, metadata)


def merged_copy(model):
    """A plain copy of ``model`` with an ungated LoRA folded into its weights (the live model keeps training)."""
    import copy

    from mars.adapters import merge_adapter

    return merge_adapter(copy.deepcopy(model))


# ------------------------------------------------------------------------------------------
# From a live trainer (any strategy)
# ------------------------------------------------------------------------------------------
def _strip(state: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def gathered_state_dict(trainer) -> dict[str, torch.Tensor] | None:
    """The LightningModule's full state dict on global rank 0 when the strategy shards parameters
    (FSDP, DeepSpeed ZeRO-3), else None (every rank holds the whole model).  Call it on EVERY rank.

    FSDP: ``FULL_STATE_DICT`` with ``rank0_only``, the way Lightning's FSDP strategy saves full
    checkpoints, except that tensors of a CPU model are not "offloaded" to the CPU (torch fails on that);
    DeepSpeed ZeRO-3: the partitioned parameters are gathered with ``GatheredParameters``.
    """
    strategy = trainer.strategy
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=strategy.root_device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(strategy.model, StateDictType.FULL_STATE_DICT, config):
            state = strategy.model.state_dict()
        return state if trainer.is_global_zero else None
    if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        import deepspeed

        module = trainer.lightning_module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = (
                {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
                if trainer.is_global_zero
                else None
            )
        return state
    return None


def _plain_model_with(model, state: dict[str, torch.Tensor]):
    """A fresh, unwrapped copy of ``model``'s architecture holding ``state`` (keys without ``model.``)."""
    from transformers import AutoModelForCausalLM

    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    fresh.tie_weights()
    tied = (
        fresh.get_output_embeddings() is not None
        and fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    )
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"the gathered state dict does not fit {type(fresh).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = model.generation_config
    return fresh


def export_from_trainer(trainer, model, tokenizer, out_dir: str | os.PathLike, metadata: dict[str, Any]) -> Path | None:
    """Export ``model`` (the LightningModule's HF model) at the end of ``fit``, on any strategy.
    Collective: call it on every rank; global rank 0 writes and returns the folder, the others None."""
    if getattr(model, "mars_adapter", None) is not None:  # adapters run unsharded (train.py refuses FSDP/ZeRO-3)
        out = export_adapter_run(model, tokenizer, out_dir, metadata) if trainer.is_global_zero else None
        trainer.strategy.barrier("mars-export")
        return out
    state = gathered_state_dict(trainer)
    out = None
    if trainer.is_global_zero:
        plain = model if state is None else _plain_model_with(model, _strip(state))
        out = export_hf(plain, tokenizer, out_dir, metadata)
    trainer.strategy.barrier("mars-export")
    return out


# ------------------------------------------------------------------------------------------
# From a Lightning checkpoint on disk
# ------------------------------------------------------------------------------------------
def read_lightning_checkpoint(ckpt_path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model weights (keys without ``model.``) and the small fields (``global_step``, ``epoch``) of a
    Lightning checkpoint: a file (read with ``weights_only=True``: tensors and plain containers, no
    arbitrary objects), an FSDP sharded checkpoint folder (torch's own DCP-to-file conversion) or a
    DeepSpeed checkpoint folder (DeepSpeed's own ZeRO-to-fp32 conversion)."""
    path = Path(ckpt_path)
    if path.is_dir() and (path / "meta.pt").is_file():  # FSDP sharded (torch.distributed.checkpoint)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path), f"{tmp}/full.pt")
            state = torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)["model"]
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        return _strip(state), {k: meta[k] for k in ("global_step", "epoch") if isinstance(meta.get(k), int)}
    if path.is_dir():  # DeepSpeed ZeRO shards
        from lightning.pytorch.utilities.deepspeed import get_fp32_state_dict_from_zero_checkpoint

        return _strip(get_fp32_state_dict_from_zero_checkpoint(str(path))), {}
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Lightning checkpoint (a .ckpt file or a DeepSpeed folder)")
    verify_checksum(path)  # training records one beside every checkpoint: a corrupt file is refused
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    info = {k: ckpt[k] for k in ("global_step", "epoch") if isinstance(ckpt.get(k), int)}
    return _strip(ckpt["state_dict"]), info


def export_lightning_checkpoint(
    ckpt_path: str | os.PathLike, model, tokenizer, out_dir: str | os.PathLike, metadata: dict[str, Any]
) -> Path:
    """Export the weights of a Lightning checkpoint into ``model``'s architecture (a fresh, unwrapped copy,
    so any strategy's checkpoint works); ``global_step`` is the checkpoint's own."""
    state, info = read_lightning_checkpoint(ckpt_path)
    meta = dict(metadata, global_step=info.get("global_step", metadata.get("global_step")))
    if getattr(model, "mars_adapter", None) is not None:  # the checkpoint holds the adapter's tensors only
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"{ckpt_path}: tensors that are not this run's adapter: {result.unexpected_keys[:3]}")
        return export_adapter_run(model, tokenizer, out_dir, meta)
    return export_hf(_plain_model_with(model, state), tokenizer, out_dir, meta)


def state_dict_from_lightning(ckpt_path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights inside a Lightning checkpoint (a file, or a DeepSpeed checkpoint folder)."""
    return read_lightning_checkpoint(ckpt_path)[0]


def _run_config_near(ckpt: Path) -> dict[str, Any]:
    """The resolved ``config.yaml`` of the run a checkpoint belongs to (``<run>/checkpoints/<ckpt>``)."""
    import yaml

    for folder in (ckpt.parent, ckpt.parent.parent):
        path = folder / "config.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return {}


def main(argv: list[str] | None = None) -> None:
    """``python -m mars.training.export CKPT OUT``: HF export of a Lightning checkpoint (e.g. an intermediate step, or a
    DeepSpeed checkpoint folder).  Block, objective, alpha, intra-block pattern, mask schedule and base model
    are read from the run's ``config.yaml`` beside ``checkpoints/`` when there is one; flags override."""
    from mars.models import load_model

    p = _parser()
    args = p.parse_args(argv)
    run_cfg = _run_config_near(Path(args.ckpt))
    model_cfg = run_cfg.get("model") or {}
    base = args.base or model_cfg.get("name_or_path")
    block = args.block or run_cfg.get("block")
    if not base or not block:
        p.error("--base and --block are needed (no config.yaml of the run next to the checkpoint)")
    objective = _objective(args, dict(run_cfg.get("objective") or {}))
    loaded = load_model(
        base,
        tiny=model_cfg.get("tiny") if base == "tiny-random" else None,
        mask_token=args.mask_token or model_cfg.get("mask_token"),
        allow_new_row=bool(model_cfg.get("allow_new_embedding_row", False)),
    )
    base_params = sum(p.numel() for p in loaded.model.parameters())
    state, info = read_lightning_checkpoint(args.ckpt)
    loaded.model.load_state_dict(state)
    schedule = args.mask_schedule or (run_cfg.get("mask_schedule") or {}).get("name")
    export_hf(
        loaded.model,
        loaded.tokenizer,
        args.out,
        dict(
            block_size=int(block),
            objective=objective.name,
            alpha=objective.alpha,
            intra_block=objective.intra_block,
            mask_schedule=schedule,
            mask_token=loaded.mask.token,
            mask_token_id=loaded.mask.id,
            mask_token_policy=loaded.mask.how,
            base_model=base,
            base_num_parameters=base_params,
            global_step=info.get("global_step"),
            complete=bool(args.complete),
        ),
    )
    print(f"checkpoint: {args.out}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--base", help="the model the run started from (same loader as model.name_or_path)")
    p.add_argument("--block", type=int)
    p.add_argument("--objective", help="ar | mars | mars_no_sft | block_diffusion")
    p.add_argument("--alpha", type=float)
    p.add_argument("--intra-block", choices=["causal", "bidirectional"])
    p.add_argument("--mask-schedule")
    p.add_argument("--mask-token", help="the run's mask token (default: its config's, else the loader's policy)")
    p.add_argument(
        "--complete",
        action="store_true",
        help="mark the export as the finished run (only for the run's final checkpoint)",
    )
    return p


def _objective(args: argparse.Namespace, objective_cfg: dict[str, Any]):
    """The run's objective (from its config), another one named by ``--objective`` with that objective's
    defaults, and ``--alpha`` / ``--intra-block`` over either."""
    from mars.training.objectives import Objective

    if args.objective and args.objective != objective_cfg.get("name"):
        objective_cfg = {"name": args.objective}
    objective_cfg.setdefault("name", "mars")
    defaults = {
        "ar": dict(mask_weight=0.0),
        "mars_no_sft": dict(alpha=0.0),
        "block_diffusion": dict(alpha=0.0, intra_block="bidirectional"),
    }
    objective_cfg = {**defaults.get(objective_cfg["name"], {}), **objective_cfg}
    if args.alpha is not None:
        objective_cfg["alpha"] = args.alpha
    if args.intra_block:
        objective_cfg["intra_block"] = args.intra_block
    return Objective(**objective_cfg)


if __name__ == "__main__":
    main()
