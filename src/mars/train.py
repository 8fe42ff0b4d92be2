"""``train.py``'s body: config -> model/data -> Lightning fit -> plain HF checkpoint + run summary."""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from mars.data import InstructionDataModule
from mars.export import export_hf
from mars.loggers import build_logger
from mars.masking import MASK_SCHEDULES
from mars.models import load_model, read_mars_metadata
from mars.module import MarsModule
from mars.objectives import Objective
from mars.precision import resolve_precision

log = logging.getLogger(__name__)


class LossHistory(Callback):
    """Keeps the per-step losses; writes ``losses.csv`` and ``loss_curve.png`` when training ends."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.rows = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        row = {"step": trainer.global_step}
        for key in ("loss", "loss_mask", "loss_ar", "tokens_per_s"):
            if f"train/{key}" in metrics:
                row[key] = float(metrics[f"train/{key}"])
        self.rows.append(row)

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero or not self.rows:
            return
        keys = sorted({k for r in self.rows for k in r}, key=lambda k: (k != "step", k))
        lines = [",".join(keys)] + [",".join(str(r.get(k, "")) for k in keys) for r in self.rows]
        (self.out_dir / "losses.csv").write_text("\n".join(lines) + "\n")
        plot_losses(self.rows, self.out_dir / "loss_curve.png")


def plot_losses(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style in (("loss", "-"), ("loss_mask", "--"), ("loss_ar", ":")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=key)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def validate(cfg: DictConfig) -> Objective:
    """Every check that needs no model, before anything expensive."""
    if not isinstance(cfg.block, int) or cfg.block < 1:
        raise ValueError(f"block must be an integer >= 1, got {cfg.block!r}")
    objective = Objective(**OmegaConf.to_container(cfg.objective))
    if cfg.mask_schedule.name not in MASK_SCHEDULES:
        raise ValueError(f"mask_schedule must be one of {MASK_SCHEDULES}, got {cfg.mask_schedule.name!r}")
    if cfg.optim.lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    if cfg.resume not in ("auto", "never"):
        raise ValueError(f"resume must be auto | never, got {cfg.resume!r}")
    return objective


def build_strategy(trainer_cfg: dict[str, Any], model) -> Any:
    """Lightning's own strategies; FSDP wraps the model's decoder-layer class."""
    strategy = trainer_cfg.pop("strategy", "auto")
    fsdp = trainer_cfg.pop("fsdp", None)
    if strategy != "fsdp":
        return strategy
    from lightning.pytorch.strategies import FSDPStrategy

    layers = {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
    return FSDPStrategy(auto_wrap_policy=layers, **(fsdp or {}))


def resolve_resume(cfg: DictConfig, out_dir: Path) -> str | None:
    if cfg.ckpt_path:
        if not Path(cfg.ckpt_path).exists():
            raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path} does not exist")
        return str(cfg.ckpt_path)
    last = out_dir / "checkpoints" / "last.ckpt"
    if cfg.resume == "auto" and last.exists():
        log.info("resuming from %s", last)
        return str(last)
    return None


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(cfg: DictConfig) -> Path:
    """Train and export; returns the HF checkpoint directory. A finished run is skipped unless overwrite."""
    objective = validate(cfg)
    out_dir, export_dir = Path(cfg.output_dir), Path(cfg.export_dir)
    if (read_mars_metadata(export_dir) or {}).get("complete") and not cfg.overwrite:
        log.info("%s already holds a finished checkpoint; skipping (overwrite=true to retrain)", export_dir)
        print(f"checkpoint (already trained): {export_dir}")
        return export_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    L.seed_everything(cfg.seed, workers=True)

    m = cfg.model
    loaded = load_model(m.name_or_path, tiny=OmegaConf.to_container(m.tiny) if m.tiny else None,
                        mask_token=m.mask_token, allow_new_row=m.allow_new_embedding_row,
                        attn_implementation=m.attn_implementation)
    base_params = sum(p.numel() for p in loaded.model.parameters())
    data = InstructionDataModule(loaded.tokenizer, seed=cfg.seed, **OmegaConf.to_container(cfg.data))
    data.setup()  # tokenize now: bad rows or an empty dataset fail before the trainer starts
    module = MarsModule(loaded.model, loaded.mask.id, block_size=cfg.block, objective=objective,
                        mask_schedule=OmegaConf.to_container(cfg.mask_schedule), lr=cfg.optim.lr,
                        weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas),
                        warmup_ratio=cfg.optim.warmup_ratio, gradient_checkpointing=cfg.gradient_checkpointing,
                        crop_noisy_prompt=cfg.get("crop_noisy_prompt", True), seed=cfg.seed)

    trainer_cfg = OmegaConf.to_container(cfg.trainer)
    # precision=auto: bf16-mixed on GPUs, bf16-true (+ fp32 master weights) on native-bf16 CPUs, else 32-true
    trainer_cfg["precision"] = resolve_precision(trainer_cfg.get("precision", "auto"), trainer_cfg.get("accelerator"))
    module.master_weights = cfg.optim.get("master_weights", "auto")
    strategy = build_strategy(trainer_cfg, loaded.model)
    history = LossHistory(out_dir)
    callbacks = [
        ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every, save_last=True,
                        save_top_k=0),
        TQDMProgressBar(refresh_rate=1),
        history,
    ]
    logger = build_logger(OmegaConf.to_container(cfg.logger), out_dir, cfg.run_name,
                          OmegaConf.to_container(cfg, resolve=True))
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, logger=logger, default_root_dir=out_dir,
                        enable_checkpointing=True, **trainer_cfg)
    start = time.perf_counter()
    steps_before = 0
    ckpt = resolve_resume(cfg, out_dir)
    if ckpt:
        steps_before = int(torch.load(ckpt, map_location="cpu", weights_only=False).get("global_step", 0))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    seconds = time.perf_counter() - start

    if trainer.is_global_zero:
        params = sum(p.numel() for p in module.model.parameters())
        export_hf(module.model, loaded.tokenizer, export_dir, dict(
            block_size=cfg.block, objective=objective.name, alpha=objective.alpha,
            intra_block=objective.intra_block, mask_schedule=cfg.mask_schedule.name,
            mask_token=loaded.mask.token, mask_token_id=loaded.mask.id, mask_token_policy=loaded.mask.how,
            base_model=m.name_or_path, base_num_parameters=base_params, global_step=trainer.global_step,
            complete=True))
        steps_run = trainer.global_step - steps_before
        summary = {
            "run_name": cfg.run_name, "objective": objective.name, "block": cfg.block,
            "global_step": trainer.global_step, "steps_this_run": steps_run, "fit_seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / max(1, steps_run), 3),
            "peak_memory_mb": round(peak_memory_mb(module.device), 1),
            "num_parameters": params, "base_num_parameters": base_params,
            "final": history.rows[-1] if history.rows else {}, "checkpoint": str(export_dir),
        }
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        print(f"checkpoint: {export_dir}")
    return export_dir
