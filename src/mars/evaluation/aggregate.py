"""From the per-(threshold, task) files of a results folder to one row per table cell ("point").

A suite entry that is a group (BBH, MMLU-Pro) scores the size-weighted mean of its leaves, and its
decoder statistics are summed over the leaves.  ``agreement`` is the share of samples whose output
text equals the reference-threshold (AR, tau = 1.0) output: a fidelity figure the paper does not report.
The ``Average`` row is the unweighted mean over the suite's entries, as in the paper's Avg column.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from mars.evaluation.config import Plan, reference_threshold
from mars.evaluation.store import ResultsDir, write_json, atomic_write_text

AVERAGE = "Average"
FIELDS = (
    "label", "model", "block_size", "threshold", "task", "lm_eval_task", "metric", "accuracy", "accuracy_delta",
    "tokens_per_forward", "batch_tokens_per_forward", "tokens_per_second", "wall_seconds", "generated_tokens",
    "n_samples", "agreement", "is_reference",
)


def _nanmean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def agreement(store: ResultsDir, threshold: float, reference: float, leaves: list[str]) -> float | None:
    """Share of samples (over ``leaves``) whose output text equals the reference point's output."""
    same = total = 0
    for leaf in leaves:
        if not store.is_complete(reference, leaf):
            return None
        ref = {r["doc_id"]: r.get("output") for r in store.read_samples(reference, leaf)}
        for row in store.read_samples(threshold, leaf):
            if row["doc_id"] in ref:
                total += 1
                same += int(row.get("output") == ref[row["doc_id"]])
    return same / total if total else None


def _entry_point(plan: Plan, store: ResultsDir, threshold: float, spec, reference: float) -> dict[str, Any] | None:
    if not all(store.is_complete(threshold, leaf) for leaf in spec.leaves):
        return None
    summaries = [store.read_summary(threshold, leaf) for leaf in spec.leaves]
    n = sum(s["n_samples"] for s in summaries)
    acc = sum(s["accuracy"] * s["n_samples"] for s in summaries) / n if n else float("nan")
    dec = [s.get("decoder") or {} for s in summaries]
    tokens = sum(d.get("generated_tokens", 0) for d in dec)
    row_fw = sum(d.get("row_forwards", 0) for d in dec)
    batch_fw = sum(d.get("batch_forwards", 0) for d in dec)
    seconds = sum(d.get("seconds", 0.0) for d in dec)
    return {
        "label": plan.curve_label,
        "model": plan.model_label,
        "block_size": plan.block_size,
        "threshold": threshold,
        "task": spec.label,
        "lm_eval_task": spec.name,
        "metric": summaries[0]["metric"],
        "accuracy": acc,
        "accuracy_delta": None,
        "tokens_per_forward": tokens / row_fw if row_fw else None,
        "batch_tokens_per_forward": tokens / batch_fw if batch_fw else None,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "wall_seconds": seconds,
        "generated_tokens": tokens,
        "n_samples": n,
        "agreement": agreement(store, threshold, reference, spec.leaves),
        "is_reference": threshold == reference,
    }


def collect_points(plan: Plan, store: ResultsDir) -> list[dict[str, Any]]:
    """Every complete point in the folder (this run's thresholds and earlier ones), plus averages;
    writes points.json and points.csv."""
    metric = str(plan.decoding.get("metric", "probability"))
    reference = reference_threshold(metric)
    thresholds = sorted(set(store.thresholds_on_disk()) | set(plan.thresholds), reverse=(metric != "entropy"))
    points: list[dict[str, Any]] = []
    for thr in thresholds:
        row = [p for spec in plan.suite.tasks if (p := _entry_point(plan, store, thr, spec, reference))]
        if not row:
            continue
        points.extend(row)
        if len(row) == len(plan.suite.tasks) and len(row) > 1:
            points.append({
                **{k: row[0][k] for k in ("label", "model", "block_size", "threshold", "is_reference")},
                "task": AVERAGE, "lm_eval_task": None, "metric": "mean over tasks",
                "accuracy": _nanmean([p["accuracy"] for p in row]),
                "accuracy_delta": None,
                "tokens_per_forward": _nanmean([p["tokens_per_forward"] for p in row]),
                "batch_tokens_per_forward": _nanmean([p["batch_tokens_per_forward"] for p in row]),
                "tokens_per_second": (sum(p["generated_tokens"] for p in row) / s
                                      if (s := sum(p["wall_seconds"] for p in row)) > 0 else None),
                "wall_seconds": sum(p["wall_seconds"] for p in row),
                "generated_tokens": sum(p["generated_tokens"] for p in row),
                "n_samples": sum(p["n_samples"] for p in row),
                "agreement": _nanmean([p["agreement"] for p in row]),
            })
    ref_acc = {p["task"]: p["accuracy"] for p in points if p["threshold"] == reference}
    for p in points:
        if p["task"] in ref_acc and p["accuracy"] is not None and ref_acc[p["task"]] is not None:
            p["accuracy_delta"] = p["accuracy"] - ref_acc[p["task"]]
    write_json(store.root / "points.json", points)
    atomic_write_text(store.root / "points.csv", points_csv(points))
    return points


def points_csv(points: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(FIELDS), extrasaction="ignore")
    writer.writeheader()
    for p in points:
        writer.writerow({k: ("" if p.get(k) is None else p.get(k)) for k in FIELDS})
    return buf.getvalue()
