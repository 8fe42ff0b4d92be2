"""``evaluate.py``'s body: a threshold sweep over a benchmark suite with the model loaded once.

Nothing is written before the whole config has been checked (config.prepare: thresholds, every
decoding setting, the verify point, tasks, checkpoint, results folder, code sandbox).  Then, for every point (the AR
reference point first, the lossless verify point next, then the other thresholds) the leaf tasks whose samples file
is not complete run through lm-eval with the MARS lm-eval model (:mod:`mars.evaluation.lm_eval_model`), which
appends every decoded batch to the point's partial cache and each finished (point, task) is written at once, so an
interrupted sweep resumes where it stopped, down to the sample.  The verify point decodes the first
``verify.limit`` samples of every task with its own settings (its outputs are the reference's by construction, so
those measure its speed); its summary records those settings, and a finished one decoded with others is decoded
again.  Then the folder's points are aggregated into points.json/csv, the paper-style table and the Pareto plots,
and optionally sent to W&B.

Data parallel (``torchrun --nproc-per-node N evaluate.py ...`` or ``accelerate launch evaluate.py ...``):
every rank loads the model, lm-eval gives each rank every N-th document, the per-request records are
gathered on rank 0, and only rank 0 writes to the results folder.  Decoder seconds are then summed over
ranks (tokens/s is per process).

(This module is not called ``run``: see the package docstring.)
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mars.evaluation.config import Plan, prepare, reference_threshold
from mars.evaluation.store import VERIFY, Point, ResultsDir, fingerprint_hash, threshold_key
from mars.evaluation.tasks import code_sandbox, primary_metric, task_manager
from mars.persistence import fingerprint_differences, folder_lock

log = logging.getLogger(__name__)


@dataclass
class EvalOutcome:
    plan: Plan
    output_dir: Path
    points: list[dict]
    table: str
    plots: list[Path]
    computed: list[tuple[Point, str]]  # (threshold or VERIFY, task) points computed by this call
    lm: Any = None


def _rank() -> int:
    """This process's rank under torchrun / accelerate launch (0 otherwise), before any process group."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _device(name: str | None) -> str:
    from mars.hardware import resolve_device

    device = resolve_device(name)
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"  # one GPU per rank
    return device


def load_for_plan(plan: Plan):
    """The model of the plan (a checkpoint overrides ``model.name_or_path``) on this rank's device."""
    from mars.decoding.loading import load_for_decoding

    return load_for_decoding(
        plan.resolved.get("model") or {},
        checkpoint=plan.resolved.get("checkpoint"),
        checkpoint_meta=plan.checkpoint_meta,
        dtype=plan.resolved.get("dtype"),
        device=_device(plan.resolved.get("device")),
    )


def build_lm(plan: Plan, loaded):
    from mars.evaluation.lm_eval_model import MarsLM

    decoding = dict(plan.decoding)
    return MarsLM(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        mask_token_id=loaded.mask.id,
        threshold=plan.thresholds[0],
        decoding=decoding,
        fidelity=bool(plan.resolved.get("fidelity", True)),
    )


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _run_lm_eval(plan: Plan, lm, leaves: list[str], samples: dict[str, list[int]] | None = None) -> dict:
    """One lm-eval pass over ``leaves`` at the lm-eval model's current point: the sweep's ``limit`` samples per
    task, or the documents ``samples`` names per task."""
    from lm_eval.evaluator import evaluate

    from mars.logs import folded_lm_eval_task_logs

    suite = plan.suite
    seed = int(plan.resolved.get("seed") or 0)
    _seed_everything(seed)  # before loading: some tasks shuffle choices while loading (GPQA)
    if suite.confirm_run_unsafe_code and code_sandbox().unsandboxed_allowed():
        # only with the explicit opt-in: lm-eval's built-in code tasks (evaluate's code_eval) run unsandboxed
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    with folded_lm_eval_task_logs():  # one line per task, not four
        loaded = (plan.task_manager or task_manager(suite)).load(leaves)
    for name, task in loaded["tasks"].items():
        override = suite.spec_of_leaf(name).num_fewshot
        if override is not None:
            task.set_config(key="num_fewshot", value=int(override))
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    lm.reset_records()
    with folded_lm_eval_task_logs():
        return evaluate(
            lm=lm,
            task_dict=loaded,
            limit=None if samples is not None else plan.resolved.get("limit"),
            samples=samples,
            bootstrap_iters=0,
            log_samples=True,
            system_instruction=suite.system_instruction,
            apply_chat_template=suite.apply_chat_template,
            fewshot_as_multiturn=suite.fewshot_as_multiturn,
            confirm_run_unsafe_code=suite.confirm_run_unsafe_code,
        )


def _samples_per_task(plan: Plan, leaves: list[str]) -> dict[str, int]:
    """How many documents each leaf task evaluates (its eval split, cut to ``limit`` as lm-eval cuts it)."""
    from lm_eval.evaluator_utils import get_sample_size

    from mars.logs import folded_lm_eval_task_logs

    with folded_lm_eval_task_logs():
        loaded = (plan.task_manager or task_manager(plan.suite)).load(leaves)
    counts = {}
    for name, task in loaded["tasks"].items():
        total = len(task.eval_docs)
        cut = get_sample_size(task, plan.resolved.get("limit"))
        counts[name] = total if cut is None else min(total, cut)
    return counts


def plan_line(
    plan: Plan, todo: dict[float, list[str]], samples: dict[str, int], verify: list[str] | None = None
) -> str:
    """One line saying what the run is about to do, before the model loads: the model or checkpoint (and
    whether its masks had MARS training), the decoding, the tasks with their samples per threshold, the
    thresholds still to run, the verify point, and where the results go."""
    from mars.metadata import mars_trained

    checkpoint = plan.resolved.get("checkpoint")
    if checkpoint:
        trained = "MARS-trained" if mars_trained(plan.checkpoint_meta) else "no MARS training"
        model = f"checkpoint {checkpoint} ({trained})"
    else:
        model = f"base model {(plan.resolved.get('model') or {}).get('name_or_path')} (no MARS training)"
    running = [t for t, leaves in todo.items() if leaves]
    per_threshold = sorted({sum(samples.get(leaf, 0) for leaf in todo[t]) for t in running})
    names = [spec.name for spec in plan.suite.tasks]
    tasks = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    limit = plan.resolved.get("limit")
    if running:
        counts = f"{per_threshold[0]:,}" + (f" to {per_threshold[-1]:,}" if len(per_threshold) > 1 else "")
        sweep = f"{counts} samples per threshold" + (f" (limit={limit:g})" if limit is not None else "")
        sweep += f"; thresholds {', '.join(threshold_key(t) for t in running)} ({len(running)} to run)"
    else:
        sweep = "every threshold finished"
    return (
        f"plan: {plan.model_label}: {model}, B={plan.block_size}, decoding {plan.decoding.get('name') or 'mars'}; "
        f"benchmarks {plan.suite.name} ({tasks}): {sweep}; "
        + _verify_words(plan, samples, verify)
        + f"results in {plan.output_dir}"
    )


def _verify_words(plan: Plan, samples: dict[str, int], verify: list[str] | None) -> str:
    """The plan line's words on the verify point."""
    if plan.verify is None:
        return ""
    if not verify:
        return "verify point finished; "
    n = sum(plan.verify.samples(samples.get(leaf, 0)) for leaf in verify)
    return f"verify point ({plan.verify.config}, lossless) on {n:,} samples; "


def _sample_rows(task: str, logged: list[dict], lm, metric: str | None, filt: str | None) -> list[dict]:
    """One row per document: prompt, raw output, per-filter extracted answers and metrics, decoder stats."""
    by_doc: dict[int, dict] = {}
    for s in logged:
        doc_id = int(s["doc_id"])
        row = by_doc.setdefault(
            doc_id,
            {
                "doc_id": doc_id,
                "prompt": s["arguments"][0][0] if s.get("arguments") else None,
                "output": s["resps"][0][0] if s.get("resps") and s["resps"][0] else None,
                "target": s.get("target"),
                "filtered": {},
                "metrics": {},
            },
        )
        key = s.get("filter", "none")
        row["filtered"][key] = s.get("filtered_resps", [None])[0]
        row["metrics"][key] = {m: s.get(m) for m in s.get("metrics", [])}
    rows = []
    for doc_id in sorted(by_doc):
        row = by_doc[doc_id]
        f = filt if filt in row["metrics"] else next(iter(row["metrics"]), None)
        values = row["metrics"].get(f, {})
        m = metric if metric in values else next(iter(values), None)
        row["score"] = values.get(m)
        record = lm.records.get((task, doc_id))
        if record is not None:
            row.update(
                tokens=record.tokens,
                forwards=record.forwards,
                finish_reason=record.finish_reason,
                output_ids=record.output_ids,
                from_mask=record.from_mask,
                resumed=record.resumed,
                seconds=record.seconds,
            )
            if record.fidelity is not None:
                row["fidelity"] = record.fidelity
        rows.append(row)
    return rows


def _write_points(
    plan: Plan, store: ResultsDir, point: Point, leaves: list[str], results: dict, lm, seconds: float
) -> None:
    from mars.hardware import describe

    threshold = plan.verify.threshold if point == VERIFY else point
    for leaf in leaves:
        spec = plan.suite.spec_of_leaf(leaf)
        task_results = results["results"].get(leaf, {})
        key, value = primary_metric(task_results, spec.metric, spec.filter)
        stats = lm.task_stats.get(leaf)
        rows = _sample_rows(leaf, results.get("samples", {}).get(leaf, []), lm, *key.split(",", 1))
        summary = {
            "task": leaf,
            "threshold": threshold,
            "metric": key,
            "accuracy": value,
            "lm_eval": {k: v for k, v in task_results.items() if k != "alias"},
            "decoder": stats.as_dict() if stats else None,
            "machine": {**describe(), "device": str(lm.device)},  # what the decoder's seconds were measured on
            "batch_size": lm.batch_size,
            "lm_eval_seconds_all_tasks": seconds,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if point == VERIFY:
            summary["verify"] = plan.verify.identity()  # what it was decoded with: reused only for the same
        store.write_point(point, leaf, rows, summary)
        store.discard_partial(point, leaf)  # the point holds every generation now


def _gather_records(lm) -> None:
    """Data parallel: every rank's per-request records and task statistics, merged on rank 0."""
    if getattr(lm, "world_size", 1) <= 1:
        return
    parts = lm.gather_object((dict(lm.records), {k: v.__dict__ for k, v in lm.task_stats.items()}), dst=0)
    if lm.rank != 0:
        return
    lm.reset_records()
    for records, stats in parts:
        lm.records.update(records)
        for task, values in stats.items():
            total = lm.task_stats[task]
            for name, value in values.items():
                setattr(total, name, getattr(total, name) + value)


def verify_done(plan: Plan, store: ResultsDir, leaf: str) -> bool:
    """Whether the verify point of ``leaf`` is finished with the settings this run decodes it with (one decoded
    with other settings or another limit is decoded again, replacing it)."""
    if plan.verify is None or not store.is_complete(VERIFY, leaf):
        return False
    try:
        saved = store.read_summary(VERIFY, leaf).get("verify")
    except (OSError, ValueError):
        return False
    if saved == plan.verify.identity():
        return True
    log.info("the verify point of %s was decoded with other settings or another limit: decoding it again", leaf)
    return False


def _running_order(plan: Plan, todo: dict[float, list[str]], verify: list[str]) -> list[tuple[Point, list[str]]]:
    """The points to decode: the reference threshold first, the verify point right after it (the two it compares are
    timed as close together as they can be), then the other thresholds."""
    order: list[tuple[Point, list[str]]] = [(thr, leaves) for thr, leaves in todo.items() if leaves]
    if verify:
        after = next((i + 1 for i, (thr, _) in enumerate(order) if thr == plan.verify.threshold), 0)
        order.insert(after, (VERIFY, verify))
    return order


def _attach_log_file(store: ResultsDir) -> logging.Handler:
    """evaluate.log in the results folder (written only once the config has passed every check)."""
    store.root.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(store.root / "evaluate.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def run(cfg: DictConfig | dict, lm=None, plan: Plan | None = None) -> EvalOutcome:
    """Run (or resume) the sweep of ``cfg``; ``lm`` reuses an lm-eval model (tests, notebooks), ``plan`` the
    one :func:`~mars.evaluation.config.prepare` made of ``cfg``.  One process per results folder (rank 0 holds its
    lock, as train.py's run does): a second one is refused naming the first one's PID, so ``overwrite=true``
    never deletes what another evaluation is writing."""
    plan = plan or prepare(cfg)  # every check; nothing has been written yet
    store = ResultsDir(plan.output_dir)
    rank = _rank()
    if rank != 0:
        return _sweep(plan, store, rank, lm)
    with folder_lock(store.root, what="evaluation"):
        handler = _claim_folder(plan, store)
        try:
            return _sweep(plan, store, rank, lm)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _claim_folder(plan: Plan, store: ResultsDir) -> logging.Handler:
    """Rank 0, holding the lock: clear the folder for ``overwrite=true`` or drop what cannot be resumed, then
    start the log file and record the config."""
    if plan.resolved.get("overwrite"):
        if store.saved_fingerprint() is not None or store.complete_points():
            log.info("overwrite=true: removing the results in %s before evaluating from scratch", store.root)
        store.clear()
    saved = store.saved_fingerprint()
    if saved is not None and fingerprint_differences(saved, plan.fingerprint):
        # prepare() let it through: no complete point, so nothing of the old config is kept
        log.info("%s held no complete point of its earlier config: starting it afresh", store.root)
        store.discard_partial()
    for point, leaf in store.partial_points():  # left behind by a kill right after a point completed
        finished = verify_done(plan, store, leaf) if point == VERIFY else store.is_complete(point, leaf)
        if finished:
            store.discard_partial(point, leaf)
    handler = _attach_log_file(store)
    store.write_config(plan.resolved, plan.fingerprint)
    return handler


def _sweep(plan: Plan, store: ResultsDir, rank: int, lm) -> EvalOutcome:
    """Decode every point not yet complete in ``store``, then (rank 0) aggregate and report the whole folder."""
    todo, verify = _pending(plan, store)
    computed: list[tuple[Point, str]] = []
    if plan.resolved.get("threads"):
        from mars.hardware import configure_threads

        configure_threads(plan.resolved["threads"])  # clamped to the machine with a warning
    if any(todo.values()) or verify:
        lm, computed = _decode_points(plan, store, rank, lm, todo, verify)
    if rank != 0:
        return EvalOutcome(plan, store.root, [], "", [], computed, lm)
    return _report(plan, store, computed, lm)


def _pending(plan: Plan, store: ResultsDir) -> tuple[dict[float, list[str]], list[str]]:
    """The leaf tasks still to decode at each threshold and at the verify point; what is complete is logged as
    skipped."""
    todo = {thr: [leaf for leaf in plan.suite.leaves if not store.is_complete(thr, leaf)] for thr in plan.thresholds}
    verify = [leaf for leaf in plan.suite.leaves if not verify_done(plan, store, leaf)] if plan.verify else []
    for point, leaves in [*todo.items(), *([(VERIFY, verify)] if plan.verify else [])]:
        done = len(plan.suite.leaves) - len(leaves)
        if done:
            log.info(
                "%s: %d of %d tasks already complete in %s, skipped",
                "verify point" if point == VERIFY else f"threshold {threshold_key(point)}",
                done,
                len(plan.suite.leaves),
                store.root,
            )
    return todo, verify


def _decode_points(
    plan: Plan,
    store: ResultsDir,
    rank: int,
    lm,
    todo: dict[float, list[str]],
    verify: list[str],
) -> tuple[Any, list[tuple[Point, str]]]:
    """Decode the pending points in their running order (the model loads here unless ``lm`` is given) and write
    each finished one on rank 0; returns the lm-eval model and the (point, task) pairs decoded."""
    needed = sorted({x for ls in [*todo.values(), verify] for x in ls})
    samples = _samples_per_task(plan, needed) if rank == 0 or verify else {}
    if rank == 0:
        log.info(plan_line(plan, todo, samples, verify))
    if lm is None:
        lm = build_lm(plan, load_for_plan(plan))
    lm.fidelity = bool(plan.resolved.get("fidelity", True))
    lm.use_results_dir(store, fingerprint_hash(plan.fingerprint))
    running = _running_order(plan, todo, verify)
    thresholds_left = sum(point != VERIFY for point, _ in running)
    computed: list[tuple[Point, str]] = []
    for point, leaves in running:
        t0 = time.perf_counter()
        results = _decode_point(plan, lm, point, leaves, samples, thresholds_left)
        if point != VERIFY:
            thresholds_left -= 1
        _gather_records(lm)
        if rank == 0:
            _write_points(plan, store, point, leaves, results, lm, time.perf_counter() - t0)
        computed.extend((point, leaf) for leaf in leaves)
    return lm, computed


def _decode_point(
    plan: Plan, lm, point: Point, leaves: list[str], samples: dict[str, int], thresholds_left: int
) -> dict:
    """One lm-eval pass at ``point``: the verify point's settings on its first samples per task, or a threshold
    over the sweep's samples (``thresholds_left``, this one included, feeds the time estimate)."""
    if point == VERIFY:
        lm.thresholds_to_run = 1  # its own estimate: it decodes a few samples per task
        lm.set_verify(plan.verify.settings())
        log.info("verify point (%s): running %s", plan.verify.config, ", ".join(leaves))
        first = {leaf: list(range(plan.verify.samples(samples[leaf]))) for leaf in leaves}
        return _run_lm_eval(plan, lm, leaves, samples=first)
    lm.thresholds_to_run = thresholds_left  # the time estimate covers every threshold left
    lm.set_threshold(point)
    log.info("threshold %s: running %s", threshold_key(point), ", ".join(leaves))
    return _run_lm_eval(plan, lm, leaves)


def _report(plan: Plan, store: ResultsDir, computed: list[tuple[Point, str]], lm) -> EvalOutcome:
    """Rank 0: the folder's points aggregated into points.json/csv, the table, the Pareto plots and, with
    ``logger=wandb``, a W&B run."""
    from mars.evaluation.aggregate import collect_points
    from mars.evaluation.plots import plot_pareto
    from mars.evaluation.report import write_reports
    from mars.figures import plot_settings

    points = collect_points(plan, store)
    table = write_reports(plan, store, points)
    plots = plot_pareto(plan, store, points) if plot_settings(plan.resolved.get("plots")).enabled else []
    wandb_cfg = (plan.resolved.get("logger") or {}).get("wandb")  # logger=wandb (conf/logger/wandb.yaml)
    if wandb_cfg:
        from mars.evaluation.wandb_log import log_to_wandb

        log_to_wandb(plan, store, points, table, plots, wandb_cfg)
    return EvalOutcome(plan, store.root, points, table, plots, computed, lm)


__all__ = ["run", "EvalOutcome", "reference_threshold"]
