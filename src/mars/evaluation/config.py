"""Turn an ``evaluate.yaml`` config into a checked plan, before any model is loaded.

Everything that can be wrong with the request fails here with a message naming the bad value: a
threshold outside (0, 1] (or an empty sweep), any decoding setting (through DecodingSettings), an
unknown task, a checkpoint folder without a mask token, a results folder holding results of a different
configuration, tasks that would run model-written code where no sandbox can be made.  Nothing is
written before all of it has passed.  This module imports neither torch nor lm-eval at import time
(evaluate.py imports it to register the run-name resolver).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mars.labels import checkpoint_label, model_label

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 4
METRICS = ("probability", "entropy", "margin")


class CheckpointError(ValueError):
    pass


class ThresholdError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The MARS metadata of a checkpoint folder written by train.py, checked for a usable mask token."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(
            f"checkpoint={path}: no such folder (expected a Hugging Face directory written by train.py)"
        )
    adapter = (p / "mars_adapter.json").is_file()  # a gated adapter run's folder: base model + adapter
    if not (p / "config.json").is_file() and not adapter:
        raise CheckpointError(
            f"checkpoint={path}: no config.json, so it is not a Hugging Face model folder (nor a gated adapter "
            "folder with mars_adapter.json)"
        )
    if not adapter:
        _check_model_config(p / "config.json")
    from mars.checkpoint_meta import MetadataError, read_metadata

    try:
        saved = read_metadata(p)  # validated: a field of the wrong type is named, not an int() error later
    except MetadataError as err:
        raise CheckpointError(f"checkpoint={path}: {err}") from None
    meta = saved.to_dict() if saved is not None else {}
    mask = meta.get("mask_token")
    if not mask:
        tok_cfg = p / "tokenizer_config.json"
        if tok_cfg.is_file():
            mask = json.loads(tok_cfg.read_text()).get("mask_token")
            if isinstance(mask, dict):  # AddedToken serialised
                mask = mask.get("content")
    if not mask:
        raise CheckpointError(
            f"checkpoint={path} has no mask token: neither mars_config.json nor the tokenizer names one. "
            "MARS decoding appends mask tokens after the context; evaluate a checkpoint exported by train.py "
            "(or `python -m mars.export`), or a base model with model=<config> instead."
        )
    meta["mask_token"] = mask
    from mars.persistence import check_weight_files

    try:
        check_weight_files(p, required=False)  # a truncated copy fails now, before a results folder exists
    except ValueError as err:
        raise CheckpointError(f"checkpoint={path}: {err}") from None
    return meta


def _check_model_config(config_file: Path) -> None:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file} is not valid JSON ({err}); the checkpoint cannot be loaded") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a Hugging Face model config (a JSON object); got {config!r:.80}")


def block_size_for(cfg: DictConfig | dict) -> int:
    """``decoding.block_size`` if given, else the checkpoint's training block size, else 4."""
    dec = cfg.get("decoding") or {}
    if dec.get("block_size") is not None:
        value = dec.get("block_size")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"decoding.block_size must be an integer >= 1, got {value!r}")
        return value
    if cfg.get("checkpoint"):
        meta = checkpoint_metadata(cfg["checkpoint"])
        if meta.get("block_size"):
            return int(meta["block_size"])
    return DEFAULT_BLOCK_SIZE


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


def run_name(model_id: Any, checkpoint: Any, block_size: Any, benchmarks: Any, decoding: Any = "mars") -> str:
    """``<model or checkpoint>-b<block>-<suite>[-<decoding>]``: the default results folder name (a Hydra
    resolver); the decoding config's name is added when it is not the default ``mars``."""
    label = checkpoint_label(str(checkpoint)) if checkpoint else str(model_id)
    if block_size is None and checkpoint:
        try:
            block_size = checkpoint_metadata(checkpoint).get("block_size")
        except CheckpointError:
            block_size = None  # reported properly by prepare(); a name is all we need here
    block = block_size if block_size is not None else DEFAULT_BLOCK_SIZE
    suffix = f"-{decoding}" if decoding and str(decoding) != "mars" else ""
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

    @property
    def curve_label(self) -> str:
        name = str(self.decoding.get("name") or "mars")
        return f"{self.model_label} B={self.block_size}" + ("" if name == "mars" else f" ({name})")


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
    from mars.evaluation.tasks import check_code_execution, expand_suite, resolve_path, suite_from_config, task_manager

    resolved = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    resolved.pop("hydra", None)
    thresholds, added = thresholds_for(resolved)
    checkpoint_meta = checkpoint_metadata(resolved["checkpoint"]) if resolved.get("checkpoint") else None
    block = block_size_for(resolved)
    limit = resolved.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ValueError(f"limit must be a positive number of samples per task (or a fraction < 1), got {limit!r}")
    decoding = dict(resolved.get("decoding") or {})
    decoding["block_size"] = block
    batch = decoding.get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"decoding.batch_size must be an integer >= 1, got {batch!r}")
    # every decoding setting, validated by the object generate uses, before anything is written or loaded
    from mars.decoding.settings import DecodingSettings
    from mars.hardware import validate_dtype

    try:
        DecodingSettings.from_mapping(
            decoding, threshold=reference_threshold(str(decoding.get("metric", "probability")))
        )
    except ValueError as err:
        raise ValueError(f"decoding: {err}") from None
    validate_dtype(resolved.get("dtype"))
    from mars.figures import plot_settings

    plot_settings(resolved.get("plots"))  # format and dpi of the Pareto plots
    if not isinstance(resolved.get("fidelity", True), bool):
        raise ValueError(f"fidelity must be true or false, got {resolved.get('fidelity')!r}")
    if decoding.get("verify") and thresholds != [reference_threshold(str(decoding.get("metric", "probability")))]:
        raise ThresholdError(
            f"decoding.verify=true decodes exactly greedy, so thresholds {thresholds} mean nothing there: run it at "
            "threshold=1.0 with reference=false (sweep decoding.draft_threshold instead)"
        )
    mismatch = block_size_mismatch((checkpoint_meta or {}).get("block_size"), block)
    if mismatch:
        log.warning(mismatch)
    from mars.evaluation.tasks import score_kinds

    score_kinds(resolved.get("benchmarks"))  # a bad `score:` fails now, not after the model ran
    suite = suite_from_config(dict(resolved.get("benchmarks") or {}))
    manager = task_manager(suite)  # indexing the built-in tasks takes ~10 s: do it once per run
    expand_suite(suite, manager)
    if check_results_dir if check_sandbox is None else check_sandbox:
        check_code_execution(suite, manager)  # model-written code runs sandboxed, or not at all
    out = resolved.get("output_dir") or "outputs/eval/" + run_name(
        model_label(resolved), resolved.get("checkpoint"), block, suite.name, decoding.get("name")
    )
    output_dir = Path(out).expanduser()
    fingerprint = fingerprint_of(resolved, block, suite)
    if check_results_dir:
        ResultsDir(output_dir).check_compatible(fingerprint)
    compare = [resolve_path(p) for p in (resolved.get("compare") or [])]
    for p in compare:
        if not (p / "points.json").is_file():
            raise FileNotFoundError(f"compare: {p} holds no points.json (run evaluate.py there first)")
    return Plan(
        thresholds=thresholds,
        reference_added=added,
        block_size=block,
        model_label=model_label(resolved),
        output_dir=output_dir,
        suite=suite,
        decoding=decoding,
        fingerprint=fingerprint,
        resolved=resolved,
        checkpoint_meta=checkpoint_meta,
        compare=compare,
        task_manager=manager,
    )
