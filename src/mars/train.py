"""``train.py``'s body: config -> checks -> model/data -> Lightning fit -> plain HF checkpoint + run summary.

Order matters: everything that can be wrong with the request (config values, the run folder's
fingerprint, the data file and its rows, the model folder) fails before the model loads, which takes
minutes at 7B.  A run folder resumes (``checkpoints/last.ckpt``; the data loader's position is in it) or is
skipped when finished, but only under the settings it was started with (:mod:`mars.run_fingerprint`).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from mars.adapters import AdapterSettings
from mars.budget import BudgetSettings, ComputeBudget, minimum_step_seconds
from mars.checkpoint_meta import is_complete
from mars.checkpointing import (
    AtomicCheckpointIO,
    GracefulStop,
    exit_after_sigterm,
    fit_until_sigterm,
    verify_resume_checkpoint,
)
from mars.data import InstructionDataModule, check_data_config, check_rows, data_file, load_rows
from mars.export import export_from_trainer, export_lightning_checkpoint
from mars.figures import plot_settings
from mars.loggers import build_logger
from mars.logs import route_lightning_logs
from mars.loss_history import LossHistory
from mars.masking import MASK_SCHEDULES, mask_ratio
from mars.models import check_model_source, load_model
from mars.module import MarsModule
from mars.objectives import Objective
from mars.persistence import atomic_write_json, atomic_write_text, folder_lock
from mars.precision import resolve_precision
from mars.run_fingerprint import check_run_folder, record_fingerprint, run_fingerprint

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
    (FSDP, DeepSpeed ZeRO-3) is gathered on all ranks and saved by global rank 0 (:mod:`mars.export`).
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
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run_settings(cfg: DictConfig) -> tuple[Objective, AdapterSettings, BudgetSettings]:
    """The objective, adapter and compute-budget settings of a run, validated."""
    objective = Objective(**OmegaConf.to_container(cfg.objective))
    adapter = AdapterSettings.from_dict(OmegaConf.to_container(cfg.adapter) if cfg.get("adapter") else None)
    budget = BudgetSettings(**(OmegaConf.to_container(cfg.budget) if cfg.get("budget") else {}))
    if adapter.gated and (objective.alpha > 0 or objective.kl_weight > 0 or not objective.uses_noisy_stream):
        raise ValueError(
            f"adapter=gated_lora trains the mask columns only (the clean stream is the frozen base): it needs "
            f"objective.alpha=0 and kl_weight=0 and a mask loss; got objective={objective.name} "
            f"alpha={objective.alpha} kl_weight={objective.kl_weight} mask_weight={objective.mask_weight}"
        )
    strategy = str(cfg.trainer.get("strategy", "auto"))
    if adapter.enabled and (strategy == "fsdp" or "deepspeed_stage_3" in strategy):
        raise ValueError(f"adapter={adapter.kind} runs unsharded (DDP or one device); trainer.strategy={strategy}")
    if budget.minutes is not None and cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ValueError("budget.minutes counts optimizer steps' compute: use trainer.accumulate_grad_batches=1")
    return objective, adapter, budget


def check_budget_fits_a_step(cfg: DictConfig, budget: BudgetSettings) -> None:
    """Refuse, before anything loads, a compute budget (``budget.minutes`` or Lightning's ``trainer.max_time``)
    that cannot hold one optimizer step even at this CPU's peak (skipped on accelerators and when the model's
    config cannot be read without loading weights)."""
    limits = {"budget.minutes": budget.seconds, "trainer.max_time": max_time_seconds(cfg.trainer.get("max_time"))}
    limits = {k: v for k, v in limits.items() if v is not None}
    if not limits or str(cfg.trainer.get("accelerator", "cpu")) not in ("cpu", "auto"):
        return
    if str(cfg.trainer.get("accelerator")) == "auto" and torch.cuda.is_available():
        return
    params = estimated_parameters(cfg.model)
    if params is None:
        return
    tokens = int(cfg.data.batch_size) * int(cfg.data.max_length)
    streams = 2 if cfg.objective.get("mask_weight", 1.0) > 0 else 1
    floor = minimum_step_seconds(params, tokens, streams, os.cpu_count() or 1)
    for key, seconds in limits.items():
        if seconds < floor:
            raise ValueError(
                f"{key} ({seconds:g} s) is too small for one training step: a step of {cfg.data.batch_size} x "
                f"{cfg.data.max_length} tokens on a {params / 1e6:.0f}M-parameter model takes at least {floor:.0f} s "
                f"on this CPU ({os.cpu_count()} cores)"
            )


def max_time_seconds(value) -> float | None:
    """Lightning's ``max_time`` ("DD:HH:MM:SS" or {days, hours, minutes, seconds}) in seconds."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = [float(x) for x in value.split(":")]
        if len(parts) != 4:
            raise ValueError(f'trainer.max_time must be "DD:HH:MM:SS", got {value!r}')
        return ((parts[0] * 24 + parts[1]) * 60 + parts[2]) * 60 + parts[3]
    units = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
    return float(sum(units[k] * float(v) for k, v in dict(value).items()))


def estimated_parameters(model_cfg) -> int | None:
    """The parameter count of a decoder-only transformer from its config alone (no weights read)."""
    from transformers import AutoConfig

    from mars.models import cache_root

    name = str(model_cfg.name_or_path)
    if name == "tiny-random":
        return None
    folder = cache_root() / "smollm2-135m-instruct" if name.startswith("embedded:") else Path(name)
    if not (folder / "config.json").is_file():
        return None
    c = AutoConfig.from_pretrained(folder)
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = h * getattr(c, "num_key_value_heads", c.num_attention_heads) // c.num_attention_heads
    return vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


def validate(cfg: DictConfig) -> Objective:
    """Every check that needs no model, before anything expensive: config values, the model source and
    the data file (its existence; its rows are read and checked by :func:`preload_rows`)."""
    if not _int(cfg.block) or cfg.block < 1:
        raise ValueError(f"block must be an integer >= 1, got {cfg.block!r}")
    objective, _, budget = run_settings(cfg)
    schedule = OmegaConf.to_container(cfg.mask_schedule)
    name = schedule.pop("name", None)
    if name not in MASK_SCHEDULES:
        raise ValueError(f"mask_schedule must be one of {MASK_SCHEDULES}, got {name!r}")
    try:
        mask_ratio(name, 0, 1, 1, **schedule)  # range checks of the schedule's own settings
    except TypeError as err:
        raise ValueError(f"mask_schedule={name} does not take the settings {sorted(schedule)}: {err}") from None
    optim = cfg.optim
    if not _number(optim.lr) or optim.lr <= 0:
        raise ValueError(f"optim.lr must be a number > 0, got {optim.lr!r}")
    if not _number(optim.get("weight_decay", 0.0)) or optim.get("weight_decay", 0.0) < 0:
        raise ValueError(f"optim.weight_decay must be a number >= 0, got {optim.get('weight_decay')!r}")
    if not _number(optim.warmup_ratio) or not 0 <= optim.warmup_ratio < 1:
        raise ValueError(
            f"optim.warmup_ratio must be in [0, 1) (the share of steps spent warming up), got {optim.warmup_ratio!r}"
        )
    betas = list(optim.get("betas", [0.9, 0.999]))
    if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {betas!r}")
    if cfg.resume not in ("auto", "never"):
        raise ValueError(f"resume must be auto | never, got {cfg.resume!r}")
    if not _int(cfg.checkpoint_every) or cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1 (optimizer steps), got {cfg.checkpoint_every!r}")
    trainer = cfg.trainer
    max_steps, max_epochs = trainer.get("max_steps", -1), trainer.get("max_epochs", None)
    if max_steps == 0 or max_epochs == 0:
        raise ValueError(
            f"trainer.max_steps={max_steps}, trainer.max_epochs={max_epochs}: this trains nothing, and "
            "an untrained export must not stand for a finished run. Use trainer.max_steps=-1 with "
            "max_epochs >= 1, or max_steps >= 1."
        )
    if not _int(max_steps) or max_steps < -1:
        raise ValueError(f"trainer.max_steps must be -1 (no limit: max_epochs decides) or >= 1, got {max_steps!r}")
    if max_epochs is not None and (not _int(max_epochs) or max_epochs < -1):
        raise ValueError(f"trainer.max_epochs must be -1, null or >= 1, got {max_epochs!r}")
    check_stop_grace(cfg)
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if not _int(accumulate) or accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate!r}")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    if data.get("source") == "self_distill":
        check_data_config({**data, "source": "jsonl"})  # the rows file is built later, before the model loads
    else:
        check_data_config(data)
        data_file(data["source"], data.get("path"), data.get("split", "train"))
    check_model_source(cfg.model.name_or_path)
    check_budget_fits_a_step(cfg, budget)
    plot_settings(cfg.get("plots"))  # the loss curve's format and dpi
    return objective


def check_stop_grace(cfg: DictConfig) -> float:
    grace = cfg.get("stop_grace_seconds", 8)
    if not _number(grace) or not grace > 0:
        raise ValueError(
            f"stop_grace_seconds must be a number > 0 (how long SIGTERM waits for the step in progress), got {grace!r}"
        )
    return float(grace)


def preload_rows(data_cfg: dict[str, Any]):
    """Read and check every row of a file-backed source (hub datasets are read here too): malformed JSON,
    an empty file, a row without messages or without an assistant turn fail naming the file and line."""
    rows = load_rows(**{k: data_cfg.get(k) for k in ("source", "path", "hub_id", "split", "limit")})
    check_rows(rows)
    return rows


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
    the step in progress and exits with 128 + SIGTERM."""
    objective = validate(cfg)
    if not launched_as_rank_zero():
        return _run(cfg, objective, callbacks)
    with folder_lock(cfg.output_dir, what="training run"):
        return _run(cfg, objective, callbacks)


def _run(cfg: DictConfig, objective: Objective, callbacks: Sequence[Callback]) -> Path:
    route_lightning_logs()  # each Lightning line once (Hydra's root handler), no adverts
    _, adapter, budget = run_settings(cfg)
    out_dir, export_dir = Path(cfg.output_dir), Path(cfg.export_dir)
    rank_zero = launched_as_rank_zero()
    fingerprint = run_fingerprint(cfg)
    check_run_folder(
        out_dir, export_dir, fingerprint, overwrite=bool(cfg.overwrite), clear=rank_zero, run_name=cfg.run_name
    )
    if not cfg.overwrite and is_complete(export_dir):
        log.info(
            "%s already holds a finished checkpoint of these settings; skipping (overwrite=true to retrain)", export_dir
        )
        print(f"checkpoint (already trained): {export_dir}")
        return export_dir

    resume_from = resolve_resume(cfg, out_dir)
    verify_resume_checkpoint(resume_from)  # a corrupt checkpoint is refused before the model loads

    m = cfg.model
    tiny = OmegaConf.to_container(m.tiny) if m.get("tiny") else None
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if data_cfg.get("source") == "self_distill":
        from mars.self_distill import training_rows

        # the model answers its prompts once (cached, fingerprinted); the rows file then trains like any JSONL
        data_cfg = training_rows(data_cfg, model_name=m.name_or_path, tiny=tiny)
    elif data_cfg.pop("distill", None) is not None:
        log.info("data.distill is ignored: data.source=%s is not self_distill", data_cfg.get("source"))
    rows = preload_rows(data_cfg)

    L.seed_everything(cfg.seed, workers=True)
    loaded = load_model(
        m.name_or_path,
        tiny=tiny,
        mask_token=m.mask_token,
        allow_new_row=m.allow_new_embedding_row,
        attn_implementation=m.attn_implementation,
    )
    base_params = sum(p.numel() for p in loaded.model.parameters())
    data = InstructionDataModule(loaded.tokenizer, seed=cfg.seed, rows=rows, **data_cfg)
    data.setup()  # tokenize now: an empty dataset fails before the trainer starts
    module = MarsModule(
        loaded.model,
        loaded.mask.id,
        block_size=cfg.block,
        objective=objective,
        mask_schedule=OmegaConf.to_container(cfg.mask_schedule),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        betas=tuple(cfg.optim.betas),
        warmup_ratio=cfg.optim.warmup_ratio,
        gradient_checkpointing=cfg.gradient_checkpointing,
        crop_noisy_prompt=cfg.get("crop_noisy_prompt", True),
        seed=cfg.seed,
        adapter=adapter,
    )

    trainer_cfg = OmegaConf.to_container(cfg.trainer)
    if budget.minutes is not None and trainer_cfg.get("max_steps", -1) == -1:
        trainer_cfg["max_epochs"] = -1  # the budget ends the run (epochs repeat the data until then)
    # precision=auto: bf16-mixed on GPUs, bf16-true (+ fp32 master weights) on native-bf16 CPUs, else 32-true
    trainer_cfg["precision"] = resolve_precision(trainer_cfg.get("precision", "auto"), trainer_cfg.get("accelerator"))
    module.master_weights = cfg.optim.get("master_weights", "auto")
    # the data module deals whole length-grouped batches to the ranks itself (and resumes them); Lightning's
    # sampler wrapper would split every batch across ranks and could not be resumed
    if trainer_cfg.pop("use_distributed_sampler", False):
        log.info("trainer.use_distributed_sampler is ignored: the data module shards its batches itself")
    strategy = build_strategy(trainer_cfg, loaded.model)
    history = LossHistory(out_dir, plot_settings(cfg.get("plots")))
    exporter = HFExport(
        export_dir,
        loaded.tokenizer,
        dict(
            block_size=cfg.block,
            objective=objective.name,
            alpha=objective.alpha,
            intra_block=objective.intra_block,
            mask_schedule=cfg.mask_schedule.name,
            mask_token=loaded.mask.token,
            mask_token_id=loaded.mask.id,
            mask_token_policy=loaded.mask.how,
            base_model=m.name_or_path,
            base_tiny=tiny,
            base_num_parameters=base_params,
        ),
    )
    extra_callbacks: list[Callback] = []
    if budget.minutes is not None:
        budget_cb = ComputeBudget(budget, on_snapshot=exporter.snapshot)
        module.budget_progress = budget_cb.progress
        extra_callbacks.append(budget_cb)
    stopper = GracefulStop(out_dir / "checkpoints" / "last.ckpt", check_stop_grace(cfg))
    all_callbacks = [
        ModelCheckpoint(
            dirpath=out_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every, save_last=True, save_top_k=0
        ),
        TQDMProgressBar(refresh_rate=1),
        history,
        *extra_callbacks,
        exporter,
        stopper,
        *callbacks,
    ]
    logger = build_logger(
        OmegaConf.to_container(cfg.logger), out_dir, cfg.run_name, OmegaConf.to_container(cfg, resolve=True)
    )
    if logger:
        all_callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer = L.Trainer(
        strategy=strategy,
        callbacks=all_callbacks,
        logger=logger,
        default_root_dir=out_dir,
        enable_checkpointing=True,
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()],  # same-folder temp file + rename, with a checksum
        **trainer_cfg,
    )
    if rank_zero:  # everything loaded: from here on the folder belongs to these settings
        record_fingerprint(out_dir, fingerprint)
        atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    start = time.perf_counter()
    finished = fit_until_sigterm(trainer, module, data, resume_from, stopper)
    if exporter.finish_from_checkpoint(trainer, loaded.model, resume_from):
        history.start_step = trainer.global_step  # the fit loop was skipped: no step ran in this process
    seconds = time.perf_counter() - start

    if trainer.is_global_zero:
        steps_run = trainer.global_step - history.start_step
        summary = {
            "run_name": cfg.run_name,
            "objective": objective.name,
            "block": cfg.block,
            "global_step": trainer.global_step,
            "steps_this_run": steps_run,
            "tokens_seen": module.tokens_seen,
            "response_tokens_seen": module.response_tokens_seen,
            "fit_seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / max(1, steps_run), 3),
            "peak_memory_mb": round(peak_memory_mb(module.device), 1),
            "num_parameters": sum(p.numel() for p in loaded.model.parameters())
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
        atomic_write_json(out_dir / "train_summary.json", summary)
        print(json.dumps(summary, indent=2))
        if exporter.complete:
            print(f"checkpoint: {export_dir}")
        else:
            print(f"training stopped before its configured end; rerun the same command to resume ({out_dir})")
    if not finished:
        exit_after_sigterm()  # stopped by SIGTERM: exit 143 now, as a scheduler expects
    return export_dir


def _exported_parameters(folder: Path) -> int | None:
    from mars.models import read_mars_metadata

    return (read_mars_metadata(folder) or {}).get("num_parameters")
