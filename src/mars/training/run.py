"""``train.py``'s body: config -> checks -> model/data -> Lightning fit -> plain HF checkpoint + run summary.

Order matters: everything that can be wrong with the request (config values, the recipe of a paper model, the
global batch, the checkpoint a stage starts from, the run folder's fingerprint, the data and its rows, the
model folder) fails before the model loads, which takes minutes at 7B; the run's plan is logged then
(:mod:`mars.training.plan`), and its cost once the first steps are timed. ``dry_run=true`` stops after the
checks and the plan, listing what this machine lacks instead of refusing it. A run folder resumes
(``checkpoints/last.ckpt``; the data loader's position is in it) or is skipped when finished, but only under
the settings it was started with (:mod:`mars.training.fingerprint`).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from mars.logs import quiet_library_notices, route_lightning_logs
from mars.metadata import is_complete
from mars.models import load_model
from mars.persistence import atomic_write_json, atomic_write_text, folder_lock
from mars.training.budget_callback import ComputeBudget
from mars.training.checkpointing import (
    AtomicCheckpointIO,
    FinalCheckpoint,
    GracefulStop,
    checkpoint_callback,
    exit_after_sigterm,
    fit_until_sigterm,
    recover_checkpoint_folder,
    verify_resume_checkpoint,
)
from mars.training.config import TrainConfig, machine_problems, validate
from mars.training.data import check_rows, data_file, load_rows, read_jsonl
from mars.training.datamodule import InstructionDataModule
from mars.training.export import export_from_trainer, export_lightning_checkpoint
from mars.training.fingerprint import check_run_folder, record_fingerprint, run_fingerprint, world_size
from mars.training.loggers import build_callbacks, build_loggers
from mars.training.loss_history import LossHistory
from mars.training.module import MarsModule
from mars.training.plan import CostEstimate, plan_lines
from mars.training.precision import resolve_precision
from mars.training.strategies import build_strategy

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------
# Export at the end of training (inside fit, while a sharded model can still be gathered)
# ------------------------------------------------------------------------------------------
def reached_end(trainer) -> bool:
    """True when fit stopped because it reached ``max_steps`` / ``max_epochs`` after at least one step."""
    if trainer.global_step < 1 or trainer.interrupted:
        return False
    if any(isinstance(cb, ComputeBudget) and cb.exhausted for cb in trainer.callbacks):
        return True
    if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    return trainer.max_epochs is not None and trainer.max_epochs > 0 and trainer.current_epoch >= trainer.max_epochs


class HFExport(Callback):
    """Writes the plain Hugging Face checkpoint when training ends, on every strategy: a sharded model
    (FSDP, DeepSpeed ZeRO-3) is gathered on all ranks and saved by global rank 0 (:mod:`mars.training.export`).
    ``complete`` is true only when the run reached its configured end (never for zero steps)."""

    def __init__(self, export_dir: Path, tokenizer, metadata: dict[str, Any]):
        self.export_dir, self.tokenizer, self.metadata = export_dir, tokenizer, metadata
        self.exported: Path | None = None
        self.complete = False

    def on_train_end(self, trainer, pl_module):
        self.complete = reached_end(trainer)
        if trainer.global_step < 1:
            log.warning("no optimizer step was taken: nothing to export")
            return
        meta = dict(self.metadata, global_step=trainer.global_step, complete=self.complete)
        self.exported = export_from_trainer(trainer, pl_module.model, self.tokenizer, self.export_dir, meta)

    def snapshot(self, trainer, pl_module, minutes: float) -> None:
        """A learning-curve point: the model as it is after ``minutes`` of the compute budget, exported beside
        the run (``snapshots/<minutes>min``; never ``complete``)."""
        folder = self.export_dir.parent / "snapshots" / f"{minutes:g}min"
        meta = dict(
            self.metadata,
            global_step=trainer.global_step,
            complete=False,
            snapshot_minutes=minutes,
            tokens_seen=getattr(pl_module, "tokens_seen", None),
        )
        export_from_trainer(trainer, pl_module.model, self.tokenizer, folder, meta)

    def finish_from_checkpoint(self, trainer, model, ckpt_path: str | None) -> bool:
        """A run resumed from a checkpoint at its end: Lightning skips the fit loop (so ``on_train_end``
        never runs) and the export that a kill or a full disk interrupted is written from the checkpoint
        here.  Global rank 0 only, after ``fit``; True when it exported."""
        if self.exported is not None or ckpt_path is None or not trainer.is_global_zero or not reached_end(trainer):
            return False
        log.info("%s ends the run: exporting it (the export did not finish last time)", ckpt_path)
        meta = dict(self.metadata, global_step=trainer.global_step, complete=True)
        self.exported = export_lightning_checkpoint(ckpt_path, model, self.tokenizer, self.export_dir, meta)
        self.complete = True
        return True


# ------------------------------------------------------------------------------------------
# Checks before anything loads
# ------------------------------------------------------------------------------------------
def preload_rows(data_cfg: dict[str, Any]):
    """Read and check every row of a file-backed source (hub datasets are read here too): malformed JSON,
    an empty file, a row without messages or without an assistant turn fail naming the file and line."""
    rows = load_rows(**{k: data_cfg.get(k) for k in ("source", "path", "hub_id", "split", "limit")})
    check_rows(rows)
    return rows


def resolve_resume(cfg: DictConfig, out_dir: Path) -> str | None:
    """The checkpoint to resume from: ``ckpt_path`` if given, else the folder's ``last.ckpt`` (a file, or a
    DeepSpeed checkpoint folder).  Lightning reads it; nothing is loaded here."""
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


def launched_as_rank_zero() -> bool:
    """Global rank 0 of the job, read from the launcher's environment (before Lightning sets ranks):
    torchrun/SLURM set ``RANK``; Lightning's own DDP launcher starts the other ranks with ``LOCAL_RANK``
    and ``NODE_RANK``."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------
def run(cfg: DictConfig, callbacks: Sequence[Callback] = ()) -> Path:
    """Train and export; returns the HF checkpoint directory.  A finished run (same settings) is skipped
    unless ``overwrite``; ``callbacks`` are added to the trainer's.  One run per folder: a second one is
    refused naming the first one's PID (rank 0 holds the lock for the job).  Ended by SIGTERM, it saves
    the step in progress and exits with 128 + SIGTERM.  ``dry_run``: the checks and the plan only
    (:func:`dry_run`)."""
    if cfg.get("dry_run"):
        return dry_run(cfg)
    settings = validate(cfg)
    if not launched_as_rank_zero():
        return _run(cfg, settings, callbacks)
    with folder_lock(cfg.output_dir, what="training run"):
        return _run(cfg, settings, callbacks)


def _run(cfg: DictConfig, settings: TrainConfig, callbacks: Sequence[Callback]) -> Path:
    """The run's phases in order: checks that need no model (folder, resume checkpoint, data rows), then
    the model, the module and the trainer, then the fit and the summary."""
    route_lightning_logs()  # each Lightning line once (Hydra's root handler), no adverts
    quiet_library_notices()  # no deprecation notice about the libraries' own calls on every run
    out_dir, export_dir = Path(cfg.output_dir), Path(cfg.export_dir)
    rank_zero = launched_as_rank_zero()
    # digests every byte of a local model and data folder (cached per file): one process of the job does it
    fingerprint = run_fingerprint(cfg) if rank_zero else None
    if _already_finished(cfg, out_dir, export_dir, fingerprint, rank_zero):
        return export_dir
    resume_from = _resume_checkpoint(cfg, out_dir, rank_zero)

    tiny = OmegaConf.to_container(cfg.model.tiny) if cfg.model.get("tiny") else None
    data_cfg, rows = _training_data(cfg, tiny)
    if rank_zero:
        for line in plan_lines(cfg, settings, len(rows), world_size(OmegaConf.to_container(cfg.trainer, resolve=True))):
            log.info(line)
    L.seed_everything(cfg.seed, workers=True)
    loaded = _load_base_model(cfg.model, tiny)
    base_params = sum(p.numel() for p in loaded.model.parameters())
    data = InstructionDataModule(loaded.tokenizer, seed=cfg.seed, rows=rows, **data_cfg)
    data.setup()  # tokenize now: an empty dataset fails before the trainer starts
    module = _build_module(cfg, settings, loaded)

    trainer_cfg = _trainer_options(cfg, settings.budget)
    strategy = build_strategy(trainer_cfg, loaded.model)
    own = _own_callbacks(cfg, settings, module, loaded, tiny, base_params)
    trainer = _build_trainer(cfg, out_dir, trainer_cfg, strategy, own.in_order(), callbacks)
    if rank_zero:  # everything loaded: from here on the folder belongs to these settings
        record_fingerprint(out_dir, fingerprint)
        atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    start = time.perf_counter()
    finished = fit_until_sigterm(trainer, module, data, resume_from, own.stopper)
    if own.exporter.finish_from_checkpoint(trainer, loaded.model, resume_from):
        own.history.start_step = trainer.global_step  # the fit loop was skipped: no step ran in this process
    seconds = time.perf_counter() - start
    if trainer.is_global_zero:
        summary = _summary(cfg, settings, trainer, module, own.exporter, own.history, own.budget, seconds, base_params)
        summary["cost_estimate"] = own.cost.estimate
        _report(summary, own.exporter, out_dir, export_dir)
    if not finished:
        exit_after_sigterm()  # stopped by SIGTERM: exit 143 now, as a scheduler expects
    return export_dir


def dry_run(cfg: DictConfig) -> Path:
    """``dry_run=true``: the config checked (its values, the recipe, the global batch on the processes present),
    the plan printed, and what this machine lacks for it listed (a missing stage-1 checkpoint, no GPU, no hub),
    without loading a model or data and without writing anything.  Returns the export folder the run would
    write."""
    settings = validate(cfg, refuse=False)
    data = settings.data
    extra = data.model_extra or {}
    rows = None
    if data.source in ("offline", "jsonl"):  # a local file: its rows are counted (hub and disk data are not read)
        try:
            rows = len(read_jsonl(data_file(data.source, extra.get("path"), extra.get("split", "train"))))
        except (OSError, ValueError):
            rows = None
        if rows is not None and data.limit is not None:
            rows = min(rows, data.limit)
    for line in plan_lines(cfg, settings, rows, world_size(OmegaConf.to_container(cfg.trainer, resolve=True))):
        print(line)
    problems = machine_problems(settings)
    for problem in problems:
        print(f"dry run: would be refused here: {problem}")
    print(
        f"dry run: {'nothing' if not problems else len(problems)} missing on this machine; "
        "nothing was loaded or written"
    )
    return Path(cfg.export_dir)


def _already_finished(cfg: DictConfig, out_dir: Path, export_dir: Path, fingerprint, rank_zero: bool) -> bool:
    """Checks the run folder against these settings (refusing another run's folder; global rank 0, which a
    refusal ends the job from); True when it already holds a finished checkpoint of them and ``overwrite`` is
    off, so the run is skipped."""
    if rank_zero:
        check_run_folder(out_dir, export_dir, fingerprint, overwrite=bool(cfg.overwrite), run_name=cfg.run_name)
    if cfg.overwrite or not is_complete(export_dir):
        return False
    log.info(
        "%s already holds a finished checkpoint of these settings; skipping (overwrite=true to retrain)", export_dir
    )
    print(f"checkpoint (already trained): {export_dir}")
    return True


def _resume_checkpoint(cfg: DictConfig, out_dir: Path, rank_zero: bool) -> str | None:
    """The checkpoint the fit resumes from (None: a fresh start); on rank 0 a folder a kill left mid sharded save
    is recovered first, and a corrupt checkpoint is refused before the model loads."""
    if rank_zero:
        recover_checkpoint_folder(out_dir / "checkpoints" / "last.ckpt")
    resume_from = resolve_resume(cfg, out_dir)
    if rank_zero:
        verify_resume_checkpoint(resume_from)
    return resume_from


def _training_data(cfg: DictConfig, tiny: dict | None) -> tuple[dict[str, Any], Any]:
    """The data settings and their checked rows, read before the model loads.  A ``self_distill`` source
    first has the base model answer its prompts (cached, fingerprinted); the rows file then trains like any
    JSONL."""
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if data_cfg.get("source") == "self_distill":
        from mars.training.self_distill import training_rows

        data_cfg = training_rows(data_cfg, model_name=cfg.model.name_or_path, tiny=tiny)
    elif data_cfg.pop("distill", None) is not None:
        log.info("data.distill is ignored: data.source=%s is not self_distill", data_cfg.get("source"))
    return data_cfg, preload_rows(data_cfg)


def _load_base_model(model_cfg: DictConfig, tiny: dict | None):
    """The base model and tokenizer with the mask token chosen by the model config's policy."""
    return load_model(
        model_cfg.name_or_path,
        tiny=tiny,
        mask_token=model_cfg.mask_token,
        allow_new_row=model_cfg.allow_new_embedding_row,
        attn_implementation=model_cfg.attn_implementation,
    )


def _build_module(cfg: DictConfig, settings: TrainConfig, loaded) -> MarsModule:
    """The LightningModule: objective, mask schedule and optimizer settings around the loaded model."""
    module = MarsModule(
        loaded.model,
        loaded.mask.id,
        block_size=cfg.block,
        objective=settings.objective,
        mask_schedule=OmegaConf.to_container(cfg.mask_schedule),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        betas=tuple(cfg.optim.betas),
        warmup_ratio=cfg.optim.warmup_ratio,
        gradient_checkpointing=cfg.gradient_checkpointing,
        crop_noisy_prompt=cfg.get("crop_noisy_prompt", True),
        seed=cfg.seed,
        adapter=settings.adapter,
    )
    module.master_weights = cfg.optim.get("master_weights", "auto")
    return module


def _trainer_options(cfg: DictConfig, budget) -> dict[str, Any]:
    """``cfg.trainer`` as ``L.Trainer`` keywords: the run length under a compute budget, the resolved
    precision, and Lightning's distributed sampler left out."""
    trainer_cfg = OmegaConf.to_container(cfg.trainer)
    if budget.minutes is not None and trainer_cfg.get("max_steps", -1) == -1:
        trainer_cfg["max_epochs"] = -1  # the budget ends the run (epochs repeat the data until then)
    # precision=auto: bf16-mixed on GPUs, bf16-true (+ fp32 master weights) on native-bf16 CPUs, else 32-true
    trainer_cfg["precision"] = resolve_precision(trainer_cfg.get("precision", "auto"), trainer_cfg.get("accelerator"))
    # the data module deals whole length-grouped batches to the ranks itself (and resumes them); Lightning's
    # sampler wrapper would split every batch across ranks and could not be resumed
    if trainer_cfg.pop("use_distributed_sampler", False):
        log.info("trainer.use_distributed_sampler is ignored: the data module shards its batches itself")
    return trainer_cfg


def _export_metadata(cfg: DictConfig, settings: TrainConfig, loaded, tiny: dict | None, base_params: int) -> dict:
    """What the exported checkpoint's ``mars_config.json`` records about the training (beside the step)."""
    objective = settings.objective
    return dict(
        block_size=cfg.block,
        objective=objective.name,
        alpha=objective.alpha,
        intra_block=objective.intra_block,
        mask_schedule=cfg.mask_schedule.name,
        mask_token=loaded.mask.token,
        mask_token_id=loaded.mask.id,
        mask_token_policy=loaded.mask.how,
        base_model=cfg.model.name_or_path,
        base_tiny=tiny,
        base_num_parameters=base_params,
    )


@dataclass
class _OwnCallbacks:
    """The callbacks every run adds, which the fit and the summary read afterwards."""

    history: LossHistory
    exporter: HFExport
    budget: ComputeBudget | None
    stopper: GracefulStop
    final: FinalCheckpoint
    cost: CostEstimate

    def in_order(self) -> list[Callback]:
        """The order the trainer runs them in: the final checkpoint before the export, which can finish from it."""
        return [
            self.history,
            *([self.budget] if self.budget else []),
            self.final,
            self.exporter,
            self.stopper,
            self.cost,
        ]


def _own_callbacks(
    cfg: DictConfig, settings: TrainConfig, module: MarsModule, loaded, tiny: dict | None, base_params: int
) -> _OwnCallbacks:
    """The run's own callbacks: loss history, HF export, compute budget, SIGTERM stop, final checkpoint, cost."""
    out_dir = Path(cfg.output_dir)
    history = LossHistory(out_dir, settings.plots)
    exporter = HFExport(
        Path(cfg.export_dir), loaded.tokenizer, _export_metadata(cfg, settings, loaded, tiny, base_params)
    )
    return _OwnCallbacks(
        history=history,
        exporter=exporter,
        budget=_attach_budget(settings.budget, module, exporter),
        stopper=GracefulStop(out_dir / "checkpoints" / "last.ckpt", settings.stop_grace_seconds),
        final=FinalCheckpoint(out_dir / "checkpoints" / "last.ckpt"),
        cost=CostEstimate(),
    )


def _attach_budget(budget, module: MarsModule, exporter: HFExport) -> ComputeBudget | None:
    """The compute-budget callback (None without ``budget.minutes``); it snapshots through the exporter
    and the module reads its progress."""
    if budget.minutes is None:
        return None
    budget_cb = ComputeBudget(budget, on_snapshot=exporter.snapshot)
    module.budget_progress = budget_cb.progress
    return budget_cb


def _build_trainer(
    cfg: DictConfig,
    out_dir: Path,
    trainer_cfg: dict[str, Any],
    strategy: Any,
    own_callbacks: list[Callback],
    callbacks: Sequence[Callback],
) -> L.Trainer:
    """The Lightning trainer: periodic checkpoints first, the run's own callbacks, the configured ones and
    the caller's; checkpoints written atomically."""
    loggers = build_loggers(cfg.logger, hyperparameters=OmegaConf.to_container(cfg, resolve=True))
    all_callbacks = [
        checkpoint_callback(out_dir / "checkpoints", cfg.checkpoint_every, cfg.get("checkpoint_minutes")),
        *own_callbacks,
        *build_callbacks(cfg.callbacks, with_logger=bool(loggers)),
        *callbacks,
    ]
    return L.Trainer(
        strategy=strategy,
        callbacks=all_callbacks,
        logger=loggers or False,
        default_root_dir=out_dir,
        enable_checkpointing=True,
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()],  # same-folder temp file + rename, with a checksum
        **trainer_cfg,
    )


def _summary(
    cfg: DictConfig,
    settings: TrainConfig,
    trainer: L.Trainer,
    module: MarsModule,
    exporter: HFExport,
    history: LossHistory,
    budget_cb: ComputeBudget | None,
    seconds: float,
    base_params: int,
) -> dict[str, Any]:
    """``train_summary.json``: what this process trained, how fast, and where the checkpoint is."""
    steps_run = trainer.global_step - history.start_step
    budget = settings.budget
    return {
        "run_name": cfg.run_name,
        "objective": settings.objective.name,
        "block": cfg.block,
        "global_step": trainer.global_step,
        "steps_this_run": steps_run,
        "tokens_seen": module.tokens_seen,
        "response_tokens_seen": module.response_tokens_seen,
        "fit_seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / max(1, steps_run), 3),
        "peak_memory_mb": round(peak_memory_mb(module.device), 1),
        "num_parameters": sum(p.numel() for p in module.model.parameters())
        if exporter.exported is None
        else _exported_parameters(exporter.exported),
        "base_num_parameters": base_params,
        "complete": exporter.complete,
        "cpu_seconds": round(time.process_time(), 1),
        "budget": None
        if budget.minutes is None
        else {"minutes": budget.minutes, "clock": budget.clock, "used_minutes": round(budget_cb.used / 60, 2)},
        "final": history.last,
        "checkpoint": str(exporter.exported) if exporter.exported else None,
    }


def _report(summary: dict[str, Any], exporter: HFExport, out_dir: Path, export_dir: Path) -> None:
    """Writes the summary beside the run and tells the user where the checkpoint is (or how to resume)."""
    atomic_write_json(out_dir / "train_summary.json", summary)
    print(json.dumps(summary, indent=2))
    if exporter.complete:
        print(f"checkpoint: {export_dir}")
    else:
        print(f"training stopped before its configured end; rerun the same command to resume ({out_dir})")


def _exported_parameters(folder: Path) -> int | None:
    from mars.models import read_mars_metadata

    return (read_mars_metadata(folder) or {}).get("num_parameters")
