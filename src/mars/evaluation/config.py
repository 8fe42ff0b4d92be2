"""Turn an ``evaluate.yaml`` config into a checked plan, before any model is loaded.

Everything that can be wrong with the request fails here with a message naming the bad value: a
threshold outside (0, 1] (or an empty sweep), any decoding setting (through DecodingSettings), the verify
point's settings (``verify``: its sample limit, its decoding config), an unknown task, a checkpoint folder
without a mask token, a results folder holding results of a different configuration, tasks that would run
model-written code where no sandbox can be made.  Nothing is
written before all of it has passed.  This module imports neither torch nor lm-eval at import time
(evaluate.py imports it to register the run-name resolver).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from omegaconf import DictConfig, OmegaConf
from pydantic import AfterValidator, BeforeValidator, Field, InstanceOf

from mars.config_schema import DtypeName, OpenSection, Section, about, validated
from mars.decoding.settings import decoding_block_size
from mars.figures import PlotSettings, plot_settings
from mars.metadata import (
    CheckpointError,
    MetadataError,
    checkpoint_label,
    is_generic_label,
    meaningful_label,
    model_label,
    read_checkpoint,
)
from mars.paths import bundled_path

log = logging.getLogger(__name__)

METRICS = ("probability", "entropy", "margin")


class ThresholdError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------


def block_size_mismatch(trained: Any, used: int) -> str | None:
    """A warning when decoding with another block size than the checkpoint was trained with (None if
    they agree or the training block size is unknown)."""
    if not trained or int(trained) == int(used):
        return None
    return (
        f"decoding.block_size={used} differs from the checkpoint's training block size {trained} "
        "(mars_config.json): the model learned to fill blocks of that size, so acceptance and accuracy at "
        f"other sizes are not what it was trained for (leave decoding.block_size=null to use {trained})"
    )


def _default_max_new_tokens() -> int:
    import dataclasses

    from mars.decoding.settings import DecodingSettings

    return next(f.default for f in dataclasses.fields(DecodingSettings) if f.name == "max_new_tokens")


def _number(value: Any) -> str:
    return f"{float(value):g}"


def run_name(
    model_id: Any,
    checkpoint: Any,
    block_size: Any,
    benchmarks: Any,
    decoding: Any = "mars",
    limit: Any = None,
    max_new_tokens: Any = None,
) -> str:
    """``<model or checkpoint>-b<block>-<suite>[-<decoding>][-limit<n>][-maxnew<n>]``: the default results
    folder name (a Hydra resolver).  The decoding config's name is added when it is not the default ``mars``,
    and the settings a quick run varies (``limit``, ``decoding.max_new_tokens`` off its default) when set, so
    that rerunning a command with another limit gets its own folder instead of a refusal."""
    label = checkpoint_label(str(checkpoint)) if checkpoint else str(model_id)
    meta = None
    if checkpoint and (block_size is None or is_generic_label(label)):
        try:
            meta = read_checkpoint(bundled_path(str(checkpoint)))
        except (CheckpointError, MetadataError):
            pass  # reported properly by prepare(); a name is all we need here
        label = meaningful_label(label, meta)
    block = decoding_block_size(block_size, meta)
    suffix = f"-{decoding}" if decoding and str(decoding) != "mars" else ""
    if limit is not None:
        suffix += f"-limit{_number(limit)}"
    if max_new_tokens is not None and int(max_new_tokens) != _default_max_new_tokens():
        suffix += f"-maxnew{int(max_new_tokens)}"
    return f"{label}-b{block}-{benchmarks}{suffix}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("mars_eval_name"):
        OmegaConf.register_new_resolver("mars_eval_name", run_name)


# ------------------------------------------------------------------------------------------------
# Thresholds
# ------------------------------------------------------------------------------------------------
def reference_threshold(metric: str) -> float:
    """The threshold at which MARS decoding is exactly greedy AR decoding."""
    from mars.decoding.settings import reference_threshold as _reference

    return _reference(metric)


def check_threshold(value: Any, metric: str) -> float:
    """The decoding settings' threshold rule (one copy), raised as :class:`ThresholdError`."""
    from mars.decoding.settings import validate_threshold

    if metric not in METRICS:
        raise ValueError(f"decoding.metric must be one of {list(METRICS)}, got {metric!r}")
    try:
        return validate_threshold(value, metric)
    except ValueError as err:
        raise ThresholdError(str(err)) from None


def thresholds_for(cfg: DictConfig | dict) -> tuple[list[float], bool]:
    """The thresholds to run, reference (AR) point first, and whether the reference was added.

    ``thresholds`` (a sweep) wins over ``threshold``; a sweep always includes the reference point
    (1.0; 0.0 for entropy) because accuracy deltas and agreement are measured against it, and so does a
    single ``threshold`` unless ``reference=false`` (a finished reference point on disk is reused).
    """
    metric = str((cfg.get("decoding") or {}).get("metric", "probability"))
    sweep = cfg.get("thresholds")
    if sweep is not None and not isinstance(sweep, (list, tuple)) and not OmegaConf.is_list(sweep):
        sweep = [sweep]
    if sweep is not None and len(sweep) == 0:
        raise ThresholdError(
            "thresholds=[] names no threshold: list at least one (e.g. thresholds=[1.0,0.9]), or leave "
            "thresholds=null and set threshold=<value>"
        )
    if sweep:
        values = [check_threshold(v, metric) for v in sweep]
        ref = reference_threshold(metric)
        added = ref not in values
        values = sorted(set(values) | {ref}, reverse=(metric != "entropy"))
        _refuse_near_duplicates(values)
        return values, added
    if cfg.get("threshold") is None:
        raise ThresholdError("set threshold=<value> or thresholds=[...]")
    value, ref = check_threshold(cfg.get("threshold"), metric), reference_threshold(metric)
    if value == ref or not cfg.get("reference", True):
        return [value], False
    _refuse_near_duplicates([ref, value])
    return [ref, value], True  # a point without its reference has no delta and no agreement


def _refuse_near_duplicates(values: list[float]) -> None:
    """Two thresholds that differ but share a results folder name (rounded to 6 decimals) would run into
    one samples folder and be reported twice (the reference 1.0 counts); the same number twice is merged."""
    from mars.evaluation.store import threshold_key

    seen: dict[str, float] = {}
    for value in values:
        other = seen.setdefault(threshold_key(value), value)
        if other != value:
            low, high = sorted((other, value))
            raise ThresholdError(
                f"thresholds {low!r} and {high!r} differ by less than 1e-6, the resolution of the results "
                f"folder names (both are {threshold_key(value)}): keep one of them"
            )


# ------------------------------------------------------------------------------------------------
# The config's keys
# ------------------------------------------------------------------------------------------------
def _positive_limit(limit: float) -> float:
    if limit <= 0:
        raise ValueError("must be a positive number of samples per task (or a fraction < 1)")
    return limit


class EvalDecoding(OpenSection):
    """``decoding``'s evaluation keys; the others are :class:`~mars.decoding.settings.DecodingSettings`
    fields, checked by it."""

    name: Annotated[str, about("the decoding config's name (conf/decoding/), part of the results folder's name")]
    block_size: Annotated[int, Field(ge=1, description="null: the checkpoint's training block size")] | None
    batch_size: Annotated[int, Field(ge=1), about("prompts decoded together (outputs do not depend on it)")]


class VerifySection(Section):
    """``verify``: the lossless verify point every sweep includes beside its thresholds."""

    enabled: Annotated[bool, about("false: no verify point")]
    limit: Annotated[
        Annotated[int, Field(ge=1, description="samples per task; null: as many as the sweep")] | None,
        about("samples per task it decodes (the first ones): its outputs are tau=1.0's, so a few measure its speed"),
    ]
    decoding: Annotated[
        str,
        Field(pattern=r"^[A-Za-z0-9_-]+$", description="the name of a decoding config of conf/decoding/"),
        about("the lossless verify config it decodes with (conf/decoding/): mars_verified, mars_lookup, ..."),
    ]


class EvaluateConfig(OpenSection):
    """``evaluate.yaml``: the type and range of every key an evaluation reads (values: the YAML files).  The
    descriptions are what ``python evaluate.py --help`` prints (mars.cli.help)."""

    model: Annotated[dict[str, Any], about("the base model (conf/model/): hub id or local folder, mask token")]
    checkpoint: Annotated[
        str | None,
        about(
            "a train.py export or gated adapter folder (its block size and mask token); default: the model's "
            "trained reference checkpoint; null: the model as it is (no MARS training)"
        ),
    ]
    decoding: Annotated[EvalDecoding, about("how to decode (conf/decoding/): decoder, block size, metric, cache...")]
    benchmarks: Annotated[dict[str, Any], about("the task suite (conf/benchmarks/): lm-eval tasks and their metrics")]
    threshold: Annotated[
        float | None, about("one point (tau); 1.0 is exactly greedy AR (0 for metric=entropy)")
    ]  # the threshold rule itself: thresholds_for
    thresholds: Annotated[
        list[float] | float | None, about("a sweep, e.g. [1.0,0.9,0.8] (wins over threshold; 1.0 is always added)")
    ]
    reference: Annotated[bool, about("a single threshold also runs the AR reference point (deltas, agreement)")]
    verify: Annotated[
        VerifySection | None,
        about(
            "the lossless verify point beside the thresholds: {enabled, limit (samples per task), decoding (its "
            "config)}; tau=1.0 with verified drafts, its tokens per forward and speed-up over the AR point"
        ),
    ] = None
    limit: Annotated[
        float | None,
        AfterValidator(lambda v: v if v is None else _positive_limit(v)),
        about("samples per task (a fraction < 1: that share); null: all; part of the results folder's name"),
    ]
    seed: Annotated[int, about("seed of lm-eval's few-shot sampling and of any shuffling")]
    device: Annotated[str, about("auto (cuda if available) | cpu | cuda | cuda:1 ...")]
    dtype: Annotated[DtypeName, about("auto (bfloat16 on GPUs, float32 on CPUs) | float32 | bfloat16 | float16")]
    fidelity: Annotated[bool, about("count the generated tokens that equal the model's own greedy AR choice")]
    plots: Annotated[
        InstanceOf[PlotSettings],
        BeforeValidator(plot_settings),
        about("Pareto plots: true/false or {enabled, format: png|pdf|svg, dpi}"),
    ]
    threads: Annotated[Annotated[int, Field(ge=1)] | None, about("torch CPU threads; null: torch's default")]
    compare: Annotated[list[str], about("other results folders drawn as extra curves in the Pareto plots")]
    logger: Annotated[dict[str, Any], about("logger=wandb sends tables, metrics and plots to W&B (conf/logger/)")]
    run_name: Annotated[str, about("the results folder's name (default: model, block, suite, decoding, limit)")]
    output_dir: Annotated[str | None, about("the results folder (default: outputs/eval/<run_name>)")]
    overwrite: Annotated[
        bool, about("true: evaluate from scratch (deletes the folder's points, samples, tables and plots first)")
    ]


# ------------------------------------------------------------------------------------------------
# The verify point
# ------------------------------------------------------------------------------------------------
# The settings a verify point takes from the run's decoding, so that it decodes the reference point's samples (the
# block, the acceptance metric, the token budget, greedy or not) and is timed as that point is (the cache, the cap on
# a step's columns, the batch size); every other setting comes from its own decoding config.
SHARED_DECODING_KEYS = (
    "block_size",
    "metric",
    "max_new_tokens",
    "temperature",
    "seed",
    "cache",
    "cache_block",
    "max_step_columns",
    "batch_size",
)


def is_lossless_verify(decoding: Any, threshold: float) -> bool:
    """Whether decoding settings (a mapping or DecodingSettings) at ``threshold`` are lossless verify: drafts checked
    against the greedy AR choice (not Medusa's typical acceptance), greedy, at the exact threshold: the AR output at
    more tokens per forward."""
    get = decoding.get if isinstance(decoding, dict) else lambda key: getattr(decoding, key, None)
    exact = threshold == reference_threshold(str(get("metric") or "probability"))
    return bool(get("verify")) and exact and not get("typical_epsilon") and not get("temperature")


@dataclass(frozen=True)
class VerifyPlan:
    """The lossless verify point: the reference threshold decoded with verified drafts (the settings of the decoding
    config ``config`` over the run's SHARED_DECODING_KEYS) on the first ``limit`` samples of every task (None: as
    many as the sweep), in the results folder's ``verify`` point."""

    config: str
    decoding: dict[str, Any]
    limit: int | None
    threshold: float

    def settings(self):
        from mars.decoding.settings import DecodingSettings

        return DecodingSettings.from_mapping(self.decoding, threshold=self.threshold)

    def identity(self) -> dict[str, Any]:
        """What a finished verify point must have been decoded with to be reused (its summary records it)."""
        return {"config": self.config, "settings": self.settings().as_dict(), "limit": self.limit}

    def samples(self, cut: int) -> int:
        """Samples of a task it decodes, given how many the sweep evaluates (``cut``)."""
        return cut if self.limit is None else min(cut, self.limit)


def decoding_config(name: str) -> dict[str, Any]:
    """The decoding config ``name`` (``conf/decoding/<name>.yaml`` with its defaults) as Hydra composes it: on the
    running application's search path (``--config-dir`` folders included), else on the package's configs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    from mars.paths import conf_dir

    try:
        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name=f"decoding/{name}")
        else:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                cfg = compose(config_name=f"decoding/{name}")
    except MissingConfigException:
        options = sorted(p.stem for p in (conf_dir() / "decoding").glob("*.yaml"))
        raise ValueError(
            f"verify.decoding={name!r} names no decoding config: choose one of {options} (conf/decoding/), or "
            "verify.enabled=false for no verify point"
        ) from None
    return OmegaConf.to_container(cfg.get("decoding") or {}, resolve=True)


def verify_plan(section: VerifySection | None, decoding: dict[str, Any], thresholds: list[float]) -> VerifyPlan | None:
    """The verify point of a run (None: ``verify.enabled=false``, or a run it does not apply to, logged saying why);
    its decoding config composed and every setting checked, or refused naming ``verify.decoding`` and the fix."""
    from mars.decoding.settings import DecodingSettings

    if section is None or not section.enabled:
        return None
    reference = reference_threshold(str(decoding.get("metric", "probability")))
    skip = None
    if decoding.get("verify"):
        skip = (
            f"decoding={decoding.get('name')} verifies at every point already (its τ={reference:.1f} point is verify)"
        )
    elif reference not in thresholds:
        skip = f"the sweep has no τ={reference:.1f} point (reference=false), the point it is measured against"
    elif decoding.get("temperature"):
        skip = "decoding.temperature > 0 samples, and the verify point reproduces greedy AR"
    if skip:
        log.info("no verify point: %s", skip)
        return None
    name = section.decoding
    composed = decoding_config(name)
    mapping = {**composed, **{k: decoding[k] for k in SHARED_DECODING_KEYS if k in decoding}}
    fix = "name another config with verify.decoding=..., or verify.enabled=false for no verify point"
    try:
        settings = DecodingSettings.from_mapping(mapping, threshold=reference)
        settings.check_every_row()
    except ValueError as err:
        raise ValueError(
            f"verify.decoding={name!r} (over this run's {', '.join(SHARED_DECODING_KEYS)}): {err}; {fix}"
        ) from None
    if not settings.verify:
        raise ValueError(
            f"verify.decoding={name!r} does not verify (its verify is false): the verify point needs a verify "
            f"config such as mars_verified; {fix}"
        )
    if not is_lossless_verify(settings, reference):
        raise ValueError(
            f"verify.decoding={name!r} is lossy (typical_epsilon {settings.typical_epsilon:g}): the verify point "
            f"reproduces the τ={reference:.1f} output, so its accuracy is that point's; evaluate typical acceptance as "
            f"a run of its own (decoding={name}); {fix}"
        )
    return VerifyPlan(config=name, decoding=mapping, limit=section.limit, threshold=reference)


@dataclass
class CheckedConfig:
    """What the config says once checked: the thresholds to run, the block size and decoding settings, the verify
    point."""

    settings: EvaluateConfig
    thresholds: list[float]
    reference_added: bool
    block_size: int
    decoding: dict[str, Any]
    checkpoint_meta: dict[str, Any] | None
    verify: VerifyPlan | None = None


def check_config(resolved: dict[str, Any]) -> CheckedConfig:
    """Every check of an evaluation config that needs no task index and no model: the declared keys, the
    thresholds, the checkpoint folder, and every decoding setting through the object ``generate`` uses."""
    from mars.decoding.settings import DecodingSettings

    settings = validated(EvaluateConfig, resolved)
    thresholds, added = thresholds_for(resolved)
    checkpoint_meta = read_checkpoint(resolved["checkpoint"]) if resolved.get("checkpoint") else None
    block = decoding_block_size(settings.decoding.block_size, checkpoint_meta)
    decoding = {**resolved["decoding"], "block_size": block}
    reference = reference_threshold(str(decoding.get("metric", "probability")))
    try:
        DecodingSettings.from_mapping(decoding, threshold=reference).check_every_row()
    except ValueError as err:
        raise ValueError(f"decoding: {err}") from None
    verify = verify_plan(settings.verify, decoding, thresholds)
    for warning in (
        block_size_mismatch((checkpoint_meta or {}).get("block_size"), block),
        untrained_thresholds(resolved, checkpoint_meta, thresholds, decoding),
    ):
        if warning:
            log.warning(warning)
    return CheckedConfig(settings, thresholds, added, block, decoding, checkpoint_meta, verify)


def untrained_thresholds(
    resolved: dict[str, Any], meta: dict[str, Any] | None, thresholds: list[float], decoding: dict[str, Any]
) -> str | None:
    """A warning when thresholds that accept mask predictions on their confidence (below 1.0; above 0 for
    entropy) are applied to a model whose masks had no MARS training (a base model, or a checkpoint of the AR
    objective): those points measure untrained masks.  Exact points (threshold 1.0, verify at 1.0) and the
    decoders that use no masks (ar, jacobi) get none."""
    from mars.decoding.settings import is_exact_threshold
    from mars.metadata import mars_trained

    metric = str(decoding.get("metric", "probability"))
    lossy = [t for t in thresholds if not is_exact_threshold(t, metric)]
    if mars_trained(meta) or not lossy or str(decoding.get("decoder", "mars")) != "mars":
        return None
    if resolved.get("checkpoint"):
        what = f"checkpoint {resolved['checkpoint']} (objective {(meta or {}).get('objective') or 'ar'})"
    else:
        what = f"the base model {(resolved.get('model') or {}).get('name_or_path')} (checkpoint=null)"
    return (
        f"threshold(s) {', '.join(f'{t:g}' for t in lossy)} accept mask predictions on their confidence, but "
        f"{what} has had no MARS training: its masks are untrained, so these points measure untrained masks, not "
        "MARS. Evaluate a MARS-trained checkpoint (the model's reference_checkpoint is the default; a train.py "
        "export) or keep to exact decoding (threshold 1.0, decoding=mars_verified)."
    )


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    thresholds: list[float]
    reference_added: bool
    block_size: int
    model_label: str
    output_dir: Path
    suite: Any  # tasks.Suite with leaves expanded
    decoding: dict[str, Any]
    fingerprint: dict[str, Any]
    resolved: dict[str, Any]
    checkpoint_meta: dict[str, Any] | None = None
    compare: list[Path] = field(default_factory=list)
    task_manager: Any = field(default=None, repr=False)
    verify: VerifyPlan | None = None  # the lossless verify point beside the thresholds (None: none this run)

    def verify_lossless(self, threshold: float) -> bool:
        """Whether the sweep's point at ``threshold`` is lossless verify (:func:`is_lossless_verify`: drawn and
        labelled apart in the plots)."""
        return is_lossless_verify(self.decoding, threshold)

    @property
    def curve_label(self) -> str:
        name = str(self.decoding.get("name") or "mars")
        return f"{self.model_label} B={self.block_size}" + ("" if name == "mars" else f" ({name})")

    def verify_label(self, config: str = "mars_verified") -> str:
        """The curve label of the verify point (a curve of its own: it shares the AR point's accuracy, not its
        line)."""
        return (
            f"{self.model_label} B={self.block_size} (verify"
            + ("" if config == "mars_verified" else f", {config}")
            + ")"
        )


def fingerprint_of(resolved: dict, block_size: int, suite) -> dict[str, Any]:
    """The part of the config that changes results: a results folder holds one fingerprint only."""
    model = dict(resolved.get("model") or {})
    decoding = dict(resolved.get("decoding") or {})
    decoding["block_size"] = block_size
    # batch size changes timings, never outputs (the decoder's batch invariance): resuming with
    # another batch size is allowed, and each point records the batch size it ran with
    decoding.pop("batch_size", None)
    return {
        "model": {k: model.get(k) for k in ("name_or_path", "mask_token", "allow_new_embedding_row", "tiny")},
        "checkpoint": str(Path(resolved["checkpoint"]).expanduser().resolve()) if resolved.get("checkpoint") else None,
        "decoding": decoding,
        "benchmarks": resolved.get("benchmarks"),
        "tasks": suite.leaves,
        "limit": resolved.get("limit"),
        "dtype": resolved.get("dtype"),
        "seed": resolved.get("seed"),
    }


def prepare(cfg: DictConfig | dict, check_results_dir: bool = True, check_sandbox: bool | None = None) -> Plan:
    """Validate the config and build the plan: cheap checks first, lm-eval's task index last.

    ``check_results_dir=False`` plans without looking at the results folder; ``check_sandbox`` (default:
    as ``check_results_dir``) checks that tasks running model-written code can run here (a sandbox, or the
    explicit opt-in), so a plan-only check of configs does not depend on this machine."""
    from mars.evaluation.store import ResultsDir

    resolved = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    resolved.pop("hydra", None)
    resolved["checkpoint"] = bundled_path(resolved.get("checkpoint"))
    checked = check_config(resolved)
    suite, manager = _checked_suite(resolved, check_results_dir if check_sandbox is None else check_sandbox)
    label = model_label(resolved)
    if resolved.get("checkpoint"):
        label = meaningful_label(label, checked.checkpoint_meta)
    output_dir = _output_dir(resolved, label, checked, suite.name)
    fingerprint = fingerprint_of(resolved, checked.block_size, suite)
    if check_results_dir and not resolved.get("overwrite"):  # overwrite=true: run() clears the folder first
        ResultsDir(output_dir).check_compatible(fingerprint)
    return Plan(
        thresholds=checked.thresholds,
        reference_added=checked.reference_added,
        block_size=checked.block_size,
        model_label=label,
        output_dir=output_dir,
        suite=suite,
        decoding=checked.decoding,
        fingerprint=fingerprint,
        resolved=resolved,
        checkpoint_meta=checked.checkpoint_meta,
        compare=_compare_folders(resolved),
        task_manager=manager,
        verify=checked.verify,
    )


def _checked_suite(resolved: dict[str, Any], check_sandbox: bool):
    """The benchmark suite with its groups expanded to leaf tasks, and the task index that expanded it; a bad
    ``score:`` or (with ``check_sandbox``) code tasks that cannot run here fail now, before any model runs."""
    from mars.evaluation.tasks import check_code_execution, expand_suite, score_kinds, suite_from_config, task_manager

    score_kinds(resolved.get("benchmarks"))
    suite = suite_from_config(dict(resolved.get("benchmarks") or {}))
    manager = task_manager(suite)  # indexing the built-in tasks takes ~10 s: do it once per run
    expand_suite(suite, manager)
    if check_sandbox:
        check_code_execution(suite, manager)  # model-written code runs sandboxed, or not at all
    return suite, manager


def _output_dir(resolved: dict[str, Any], label: str, checked: CheckedConfig, suite_name: str) -> Path:
    """The results folder: ``output_dir``, else one under outputs/eval/ named after the model and the run."""
    out = resolved.get("output_dir") or "outputs/eval/" + run_name(
        label,
        None,
        checked.block_size,
        suite_name,
        checked.decoding.get("name"),
        resolved.get("limit"),
        checked.decoding.get("max_new_tokens"),
    )
    return Path(out).expanduser()


def _compare_folders(resolved: dict[str, Any]) -> list[Path]:
    """The results folders named in ``compare``, each holding the points.json the comparison reads."""
    from mars.evaluation.tasks import resolve_path

    compare = [resolve_path(p) for p in (resolved.get("compare") or [])]
    for p in compare:
        if not (p / "points.json").is_file():
            raise FileNotFoundError(f"compare: {p} holds no points.json (run evaluate.py there first)")
    return compare
