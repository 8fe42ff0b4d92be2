"""The training config (``conf/train.yaml`` as Hydra composes it), declared and checked before anything loads.

:class:`TrainConfig` is the one validator of a training run: the type and range of every key it reads,
the sections that build their own objects (``objective`` -> :class:`~mars.training.objectives.Objective`,
``adapter`` -> :class:`~mars.adapters.AdapterSettings`, ``budget`` -> :class:`~mars.training.budget.BudgetSettings`,
``data`` -> :class:`~mars.training.data.DataSettings`, ``logger``/``callbacks`` -> importable targets), and the
checks across keys (a gated adapter trains mask columns only, a run must train something, ...).
:func:`validate` adds what needs this machine but no model: the model source and the data file exist
(the checkpoint a stage starts from, the hub for a hub dataset), a model of the paper comes with a recipe,
``global_batch`` is made of the processes present, GPUs asked for are there, and a compute budget holds one
optimizer step.  The values themselves live in the YAML files.
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
from mars.training.data import DataSettings, check_hub_dataset, data_file
from mars.training.loggers import check_targets
from mars.training.masking import MASK_SCHEDULES, mask_ratio
from mars.training.objectives import Objective
from mars.training.refusals import BatchMismatch, NoAccelerator, RecipeMissing, RunRefused, StageMissing


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
    # the learning-rate schedule after the linear warmup (the module's, and the paper's): cosine decay to 0
    schedule: Literal["cosine"] = "cosine"


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
    # the experiment folder of the paper's recipe for this model (conf/experiment/<paper_recipe>/)
    paper_recipe: str | None = None
    # the command that writes name_or_path when it is the export of an earlier stage (named when it is missing)
    made_by: str | None = None


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
    recipe: str | None = None
    global_batch: Annotated[int, Field(ge=1, description="rows per optimizer step over all processes")] | None = None
    checkpoint_every: Annotated[int, Field(ge=1, description="optimizer steps")]
    checkpoint_minutes: Annotated[float, Field(gt=0, description="minutes of wall clock")] | None = None
    dry_run: bool = False
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
def validate(cfg: DictConfig, *, refuse: bool = True) -> TrainConfig:
    """Every check that needs no model, before anything expensive: config values, the recipe of a paper model,
    ``global_batch`` (derived into ``trainer.accumulate_grad_batches`` of ``cfg``), the checkpoint a stage starts
    from, the model source, the data (a file's existence, the hub for a hub dataset; rows are read and checked by
    ``mars.training.run.preload_rows``), the GPUs asked for and a compute budget's first step.  With
    ``refuse=False`` (a dry run) the checks that look at this machine are returned as messages instead of raised:
    :func:`machine_problems`."""
    from mars.training.fingerprint import world_size

    settings = TrainConfig.of(cfg)
    processes = world_size(OmegaConf.to_container(cfg.trainer, resolve=True))
    check_recipe(settings, processes)
    derive_accumulation(cfg, settings, processes)
    settings = TrainConfig.of(cfg)  # with the derived accumulation
    if refuse:
        for check in MACHINE_CHECKS:
            check(settings)
    return settings


def machine_problems(settings: TrainConfig) -> list[str]:
    """What :func:`validate` would refuse on this machine (a missing stage-1 checkpoint, no GPU, no hub, ...)."""
    problems = []
    for check in MACHINE_CHECKS:
        try:
            check(settings)
        except (RunRefused, OSError, ValueError) as err:
            problems.append(str(err))
    return problems


def check_data_source(settings: TrainConfig) -> None:
    data = settings.data
    extra = data.model_extra or {}
    if data.source == "hub":
        check_hub_dataset(extra.get("hub_id"), extra.get("split", "train"))
    elif data.source != "self_distill":  # a self-distilled rows file is built later, before the model loads
        data_file(data.source, extra.get("path"), extra.get("split", "train"))


def check_stage(settings: TrainConfig) -> None:
    check_start_checkpoint(settings.model)


def check_model(settings: TrainConfig) -> None:
    from mars.models import check_model_source

    model = settings.model
    if model.made_by and not Path(model.name_or_path).expanduser().exists():
        return  # an earlier stage's export, not written yet: check_stage names the command that writes it
    check_model_source(model.name_or_path)


# ------------------------------------------------------------------------------------------
# The paper's recipe, its stages and its batch
# ------------------------------------------------------------------------------------------
def paper_experiment(paper: str, objective: str, block: int) -> str:
    """The experiment of ``conf/experiment/<paper>/`` closest to ``objective`` at ``block``."""
    from mars.paths import conf_dir

    folder = conf_dir() / "experiment" / paper
    for name in (f"{objective}_b{block}", "ar_sft" if objective == "ar" else f"{objective}_b4", "mars_b4"):
        if (folder / f"{name}.yaml").is_file():
            return f"{paper}/{name}"
    return f"{paper}/mars_b4"


def check_recipe(settings: TrainConfig, processes: int) -> None:
    """Refuse a model of the paper composed without a recipe: train.yaml's defaults are made for the embedded
    model on a CPU, and would train it silently on 400 answers of a 135M model at a batch of 8."""
    model, paper = settings.model, settings.model.paper_recipe
    if not paper or settings.recipe is not None:
        return
    data = settings.data
    extra = data.model_extra or {}
    source = data.source + (f" ({extra['hub_id']})" if extra.get("hub_id") else "")
    accumulate = settings.trainer.accumulate_grad_batches
    batch = data.batch_size * processes * accumulate
    stage2 = paper_experiment(paper, settings.objective.name, settings.block)
    stage1 = paper_experiment(paper, "ar", settings.block)
    size = paper.removeprefix("paper_")
    stages = (
        f"python train.py experiment={stage1} (stage 1)"
        if stage2 == stage1
        else f"python train.py experiment={stage2} (stage 2, after stage 1: experiment={stage1})"
    )
    raise RecipeMissing(
        f"model={model.id} is a model of the paper, but no recipe is composed: this would train train.yaml's "
        f"defaults, made for the embedded model on a CPU (data {source}, a global batch of {batch} = "
        f"{data.batch_size} rows x {processes} process(es) x {accumulate}, gradient checkpointing "
        f"{'on' if settings.gradient_checkpointing else 'off'}, "
        f"from {model.name_or_path} rather than a stage-1 AR SFT checkpoint). The paper's recipe: {stages}; both "
        f"stages and the evaluation: python scripts/paper_pipeline.py --model {size}. To train these settings "
        "anyway, add recipe=custom."
    )


def derive_accumulation(cfg: DictConfig, settings: TrainConfig, processes: int) -> None:
    """``global_batch`` as ``data.batch_size`` x the processes present x ``trainer.accumulate_grad_batches``:
    the accumulation is derived here and written into ``cfg`` (so the run's config.yaml and fingerprint hold it),
    or refused when the batch does not divide or an accumulation given beside it disagrees."""
    if settings.global_batch is None:
        return
    rows = settings.data.batch_size
    per_step = rows * processes
    given = settings.trainer.accumulate_grad_batches
    if settings.global_batch % per_step:
        fits = [b for b in range(1, rows + 1) if settings.global_batch % (b * processes) == 0]
        fix = (
            f"use data.batch_size={fits[-1]}"
            if fits
            else f"no batch size makes it on {processes} processes: use a global_batch that is a multiple of "
            f"{processes} (e.g. {settings.global_batch // processes * processes or processes}) or other devices"
        )
        raise BatchMismatch(
            f"global_batch={settings.global_batch} is not a multiple of data.batch_size={rows} x {processes} "
            f"process(es) (devices x num_nodes) = {per_step}: {fix}"
        )
    derived = settings.global_batch // per_step
    if given not in (1, derived):
        raise BatchMismatch(
            f"global_batch={settings.global_batch} needs trainer.accumulate_grad_batches={derived} on {processes} "
            f"process(es) with data.batch_size={rows}, but {given} is set: leave the accumulation at 1 (derived), "
            "or set global_batch=null to choose it yourself"
        )
    cfg.trainer.accumulate_grad_batches = derived


def check_start_checkpoint(model: Model) -> None:
    """A run that starts from an earlier stage's export (``model.made_by`` names the command that writes it)
    is refused while that export is missing or unfinished, naming the command, before anything loads."""
    from mars.metadata import is_complete

    if not model.made_by or model.name_or_path in ("tiny-random",) or model.name_or_path.startswith("embedded:"):
        return
    path = Path(model.name_or_path).expanduser()
    if not path.exists():
        raise StageMissing(
            f"model.name_or_path={model.name_or_path} is the checkpoint this run starts from, and it does not exist "
            f"yet: make it first with {model.made_by}"
        )
    if (path / "mars_config.json").is_file() and not is_complete(path):
        raise StageMissing(
            f"model.name_or_path={model.name_or_path} is the checkpoint this run starts from, but the run that "
            f"writes it has not finished: rerun {model.made_by} (it resumes from its last checkpoint)"
        )


def check_accelerator(settings: TrainConfig) -> None:
    """GPUs asked for (``trainer.accelerator=gpu``, as trainer=ddp/fsdp/deepspeed and the paper's experiments
    do) on a machine where torch sees none: refused now, not after the model has loaded."""
    import torch

    accelerator = settings.trainer.accelerator
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise NoAccelerator(
            f"trainer.accelerator={accelerator}, but torch {torch.__version__} sees no CUDA device on this machine: "
            "run it on a GPU node, or here on the CPU with trainer.accelerator=cpu trainer.devices=1"
        )


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
    from mars.models import embedded_gguf_path, gguf_parameter_count, model_config

    name = str(name_or_path)
    if name == "tiny-random":
        return None
    if name.startswith("embedded:"):
        return gguf_parameter_count(embedded_gguf_path())
    folder = Path(name)
    if not (folder / "config.json").is_file():
        return None
    c = model_config(folder)
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = h * getattr(c, "num_key_value_heads", c.num_attention_heads) // c.num_attention_heads
    return vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


# in this order: the stage before this one first (nothing else matters until it has run), then the data, ...
MACHINE_CHECKS = (check_stage, check_data_source, check_model, check_accelerator, check_budget_fits_a_step)


def check_train_overrides(jobs: dict[str, list[str]], conf: Path) -> None:
    """Compose each job's ``train.py`` overrides (``{label: overrides}``) and run train.py's own checks on it, so
    that a bad one is refused now, naming its job, not when a long search reaches it hours later."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    problems = []
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for label, overrides in jobs.items():
            try:
                validate(compose(config_name="train", overrides=overrides))
            except (HydraException, OmegaConfBaseException, ValueError) as err:
                problems.append(f"- {label}: {err}")
    if problems:
        raise SystemExit("variant(s) whose training config train.py would refuse:\n" + "\n".join(problems))


__all__ = [
    "check_train_overrides",
    "TrainConfig",
    "check_budget_fits_a_step",
    "check_recipe",
    "check_start_checkpoint",
    "derive_accumulation",
    "estimated_parameters",
    "machine_problems",
    "max_time_seconds",
    "paper_experiment",
    "validate",
]
