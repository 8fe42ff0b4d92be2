"""The training config (``conf/train.yaml`` as Hydra composes it), declared and checked before anything loads.

:class:`TrainConfig` is the one validator of a training run: the type and range of every key it reads,
the sections that build their own objects (``objective`` -> :class:`~mars.training.objectives.Objective`,
``adapter`` -> :class:`~mars.adapters.AdapterSettings`, ``budget`` -> :class:`~mars.training.budget.BudgetSettings`,
``data`` -> :class:`~mars.training.data.DataSettings`, ``logger``/``callbacks`` -> importable targets), and the
checks across keys (a gated adapter trains mask columns only, a run must train something, ...).
:func:`validate` adds what needs this machine but no model: the model source and the data file exist,
and a compute budget holds one optimizer step.  The values themselves live in the YAML files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import AfterValidator, BeforeValidator, Field, InstanceOf, model_validator

from mars.adapters import AdapterSettings
from mars.config_schema import OpenSection, Section, built_by, known_keys, validated
from mars.figures import PlotSettings, plot_settings
from mars.training.budget import BudgetSettings, minimum_step_seconds
from mars.training.data import DataSettings, data_file
from mars.training.loggers import check_targets
from mars.training.masking import MASK_SCHEDULES, mask_ratio
from mars.training.objectives import Objective


def _two_betas(betas: list[float]) -> list[float]:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError("must be two numbers in [0, 1)")
    return betas


def _mask_schedule(schedule: dict[str, Any]) -> dict[str, Any]:
    settings = dict(schedule)
    name = settings.pop("name", None)
    if name not in MASK_SCHEDULES:
        raise ValueError(f"mask_schedule must be one of {MASK_SCHEDULES}, got {name!r}")
    try:
        mask_ratio(name, 0, 1, 1, **settings)  # range checks of the schedule's own settings
    except TypeError as err:
        raise ValueError(f"mask_schedule={name} does not take the settings {sorted(settings)}: {err}") from None
    return schedule


# sections that build their own objects, each with its own checks
BudgetSection = built_by(BudgetSettings, lambda m: BudgetSettings(**known_keys(BudgetSettings, m, "budget")))
AdapterSection = built_by(AdapterSettings, AdapterSettings.from_dict)
ObjectiveSection = built_by(Objective, lambda m: Objective(**known_keys(Objective, m, "objective")))
PlotsSection = Annotated[InstanceOf[PlotSettings], BeforeValidator(plot_settings)]  # true/false or a mapping
LoggerSection = Annotated[dict[str, Any], AfterValidator(lambda s: check_targets(s, "logger"))]
CallbackSection = Annotated[dict[str, Any], AfterValidator(lambda s: check_targets(s, "callbacks"))]


class Optim(Section):
    lr: Annotated[float, Field(gt=0)]
    weight_decay: Annotated[float, Field(ge=0)]
    betas: Annotated[list[float], AfterValidator(_two_betas)]
    warmup_ratio: Annotated[float, Field(ge=0, lt=1, description="the share of steps spent warming up")]
    master_weights: bool | Literal["auto"]


class Trainer(OpenSection):
    """The keys checked here; every key goes to ``lightning.Trainer`` as it is."""

    max_steps: Annotated[int, Field(ge=-1, description="-1: no limit, max_epochs decides")]
    max_epochs: Annotated[int, Field(ge=-1)] | None
    accumulate_grad_batches: Annotated[int, Field(ge=1)]
    strategy: str
    accelerator: str
    max_time: str | dict[str, float] | None = None  # Lightning's "DD:HH:MM:SS" or {days, hours, minutes, seconds}

    @property
    def max_time_seconds(self) -> float | None:
        return max_time_seconds(self.max_time)


class Model(OpenSection):
    name_or_path: str
    id: str
    mask_token: str | None
    allow_new_embedding_row: bool
    attn_implementation: str | None
    tiny: dict[str, Any] | None


class TrainConfig(OpenSection):
    """``train.yaml``: every key a run reads, with its type and range (values: the YAML files)."""

    block: Annotated[int, Field(ge=1, description="the training block size B")]
    seed: int
    optim: Optim
    budget: BudgetSection
    adapter: AdapterSection
    objective: ObjectiveSection
    mask_schedule: Annotated[dict[str, Any], AfterValidator(_mask_schedule)]
    gradient_checkpointing: bool
    crop_noisy_prompt: bool
    model: Model
    data: DataSettings
    trainer: Trainer
    logger: LoggerSection
    callbacks: CallbackSection
    run_name: str
    output_dir: str
    export_dir: str
    checkpoint_every: Annotated[int, Field(ge=1, description="optimizer steps")]
    resume: Literal["auto", "never"]
    ckpt_path: str | None
    overwrite: bool
    plots: PlotsSection  # the loss curve's format and dpi
    stop_grace_seconds: Annotated[float, Field(gt=0, description="how long SIGTERM waits for the step in progress")]

    @model_validator(mode="after")
    def _max_time_reads(self) -> TrainConfig:
        self.trainer.max_time_seconds  # noqa: B018 -- a malformed max_time fails here, naming the key
        return self

    @model_validator(mode="after")
    def _trains_something(self) -> TrainConfig:
        t = self.trainer
        if t.max_steps == 0 or t.max_epochs == 0:
            raise ValueError(
                f"trainer.max_steps={t.max_steps}, trainer.max_epochs={t.max_epochs}: this trains nothing, and "
                "an untrained export must not stand for a finished run. Use trainer.max_steps=-1 with "
                "max_epochs >= 1, or max_steps >= 1."
            )
        return self

    @model_validator(mode="after")
    def _adapter_fits(self) -> TrainConfig:
        objective, adapter = self.objective, self.adapter
        if adapter.gated and (objective.alpha > 0 or objective.kl_weight > 0 or not objective.uses_noisy_stream):
            raise ValueError(
                f"adapter=gated_lora trains the mask columns only (the clean stream is the frozen base): it needs "
                f"objective.alpha=0 and kl_weight=0 and a mask loss; got objective={objective.name} "
                f"alpha={objective.alpha} kl_weight={objective.kl_weight} mask_weight={objective.mask_weight}"
            )
        objective.check_clean_teacher(adapter.gated)  # clean_soft: a frozen or anchored clean stream
        strategy = self.trainer.strategy
        if adapter.enabled and (strategy == "fsdp" or "deepspeed_stage_3" in strategy):
            raise ValueError(f"adapter={adapter.kind} runs unsharded (DDP or one device); trainer.strategy={strategy}")
        return self

    @model_validator(mode="after")
    def _distill_checked(self) -> TrainConfig:
        if self.data.source == "self_distill":  # its rows are built before the model loads: check it now
            from mars.training.self_distill import distill_section

            distill_section((self.data.model_extra or {}).get("distill"))
        return self

    @model_validator(mode="after")
    def _budget_counts_steps(self) -> TrainConfig:
        if self.budget.minutes is not None and self.trainer.accumulate_grad_batches != 1:
            raise ValueError("budget.minutes counts optimizer steps' compute: use trainer.accumulate_grad_batches=1")
        return self

    @classmethod
    def of(cls, cfg: DictConfig | dict[str, Any]) -> TrainConfig:
        """The composed config, resolved and checked."""
        data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
        data.pop("hydra", None)
        return validated(cls, data)


# ------------------------------------------------------------------------------------------
# Checks that look at this machine (no model is loaded)
# ------------------------------------------------------------------------------------------
def validate(cfg: DictConfig) -> TrainConfig:
    """Every check that needs no model, before anything expensive: config values, the model source and
    the data file (its existence; its rows are read and checked by ``mars.training.run.preload_rows``)."""
    from mars.models import check_model_source

    settings = TrainConfig.of(cfg)
    data = settings.data
    if data.source != "self_distill":  # a self-distilled rows file is built later, before the model loads
        extra = data.model_extra or {}
        data_file(data.source, extra.get("path"), extra.get("split", "train"))
    check_model_source(settings.model.name_or_path)
    check_budget_fits_a_step(settings)
    return settings


def check_budget_fits_a_step(settings: TrainConfig) -> None:
    """Refuse, before anything loads, a compute budget (``budget.minutes`` or Lightning's ``trainer.max_time``)
    that cannot hold one optimizer step even at this CPU's peak (skipped on accelerators and when the model's
    config cannot be read without loading weights)."""
    import torch

    limits = {"budget.minutes": settings.budget.seconds, "trainer.max_time": settings.trainer.max_time_seconds}
    limits = {k: v for k, v in limits.items() if v is not None}
    accelerator = settings.trainer.accelerator
    if not limits or accelerator not in ("cpu", "auto") or (accelerator == "auto" and torch.cuda.is_available()):
        return
    params = estimated_parameters(settings.model.name_or_path)
    if params is None:
        return
    data = settings.data
    streams = 2 if settings.objective.mask_weight > 0 else 1
    floor = minimum_step_seconds(params, data.batch_size * data.max_length, streams, os.cpu_count() or 1)
    for key, seconds in limits.items():
        if seconds < floor:
            raise ValueError(
                f"{key} ({seconds:g} s) is too small for one training step: a step of {data.batch_size} x "
                f"{data.max_length} tokens on a {params / 1e6:.0f}M-parameter model takes at least {floor:.0f} s "
                f"on this CPU ({os.cpu_count()} cores)"
            )


def max_time_seconds(value: str | dict[str, float] | None) -> float | None:
    """Lightning's ``max_time`` ("DD:HH:MM:SS" or {days, hours, minutes, seconds}) in seconds."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parts = [float(x) for x in value.split(":")]
        except ValueError:
            parts = []
        if len(parts) != 4:
            raise ValueError(f'trainer.max_time must be "DD:HH:MM:SS", got {value!r}')
        return ((parts[0] * 24 + parts[1]) * 60 + parts[2]) * 60 + parts[3]
    units = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
    unknown = sorted(set(value) - set(units))
    if unknown:
        raise ValueError(f"trainer.max_time takes {sorted(units)}, got {unknown}")
    return float(sum(units[k] * float(v) for k, v in value.items()))


def estimated_parameters(name_or_path: str) -> int | None:
    """The parameter count of a decoder-only transformer from its config alone (no weights read).  The
    embedded model's comes from its GGUF header, so it is known on the first run too, before the GGUF is
    converted (a fresh cache), and is the same on every run."""
    from transformers import AutoConfig

    from mars.models import embedded_gguf_path, gguf_parameter_count

    name = str(name_or_path)
    if name == "tiny-random":
        return None
    if name.startswith("embedded:"):
        return gguf_parameter_count(embedded_gguf_path())
    folder = Path(name)
    if not (folder / "config.json").is_file():
        return None
    c = AutoConfig.from_pretrained(folder)
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = h * getattr(c, "num_key_value_heads", c.num_attention_heads) // c.num_attention_heads
    return vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


__all__ = ["TrainConfig", "validate", "check_budget_fits_a_step", "estimated_parameters", "max_time_seconds"]
