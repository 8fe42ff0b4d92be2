"""Pareto plots: accuracy against tokens per forward, one PNG per task plus the average.

One curve per model/block label (this run, plus the runs named in ``compare``), each point labelled
with its threshold and drawn with 95% intervals on both axes: tokens per forward, bootstrap over requests;
accuracy, for the tau = 1.0 point its own interval (Wilson or bootstrap) and for the other points the
paired interval of their change from tau = 1.0 placed around them.  Each curve's tau = 1.0 (AR) accuracy
is a dashed line inside a shaded band (that point's own interval): a bar that stays clear of the dashed
line is a change beyond noise on the same documents.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mars.evaluation.aggregate import AVERAGE
from mars.evaluation.config import Plan
from mars.evaluation.report import fmt_threshold
from mars.evaluation.store import ResultsDir, atomic_write_bytes


def slug(name: str) -> str:
    """A file-name and metric-key form of a task label: "Math (ASDiv)" -> "math_asdiv"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_").lower() or "task"


def plot_file_name(task: str) -> str:
    return f"pareto_{slug(task)}.png"


def render_pareto(task: str, curves: dict[str, list[dict[str, Any]]]) -> bytes:
    """PNG bytes of one task's plot; ``curves`` maps a curve label to its points."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labelled = []  # (color, xs, ys, thresholds) per curve, annotated once the axes are final
    ylabel = "accuracy (%)"
    for i, (label, pts) in enumerate(sorted(curves.items())):
        pts = [p for p in pts if p.get("tokens_per_forward") is not None and p.get("accuracy") is not None]
        if not pts:
            continue
        color = colors[i % len(colors)]
        pts = sorted(pts, key=lambda p: p["tokens_per_forward"])
        xs = [p["tokens_per_forward"] for p in pts]
        ys = [100 * p["accuracy"] for p in pts]
        xerr = _errors(pts, "tokens_per_forward", 1.0)
        yerr = _errors(pts, "accuracy", 100.0, paired=True)
        ax.errorbar(
            xs, ys, xerr=xerr, yerr=yerr, fmt="-o", color=color, label=label, markersize=5, elinewidth=1, capsize=2
        )
        labelled.append((color, xs, ys, [p["threshold"] for p in pts]))
        ref = [p for p in pts if p.get("is_reference")]
        if ref:
            r = ref[0]
            ax.axhline(
                100 * r["accuracy"],
                color=color,
                linestyle="--",
                linewidth=1,
                alpha=0.7,
                label=f"{label}: AR (τ={fmt_threshold(r['threshold'])})",
            )
            if r.get("accuracy_lo") is not None and r.get("accuracy_hi") is not None:
                ax.axhspan(100 * r["accuracy_lo"], 100 * r["accuracy_hi"], color=color, alpha=0.12, linewidth=0)
        if any(p.get("score") not in (None, "metric") for p in pts):
            ylabel = f"{pts[0]['score']} vs τ=1.0 output (%)"
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel(ylabel)
    ax.set_title(
        f"{task}: {ylabel.split(' (')[0]} vs tokens per forward"
        if ylabel.startswith("accuracy")
        else f"{task} vs tokens per forward",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, 0.95), max(hi, 1.05)
    ax.set_xlim(lo, hi + 0.1 * (hi - lo))  # room for the threshold labels of the rightmost points
    lo, hi = ax.get_ylim()
    if hi - lo < 2:  # a flat curve (e.g. a random model at 0%) still gets a readable axis
        mid = (hi + lo) / 2
        ax.set_ylim(max(-1, mid - 5), mid + 5)
    lo, hi = ax.get_ylim()
    ax.set_ylim(max(lo, -1.0), min(hi, 101.0))  # percentages: no empty room past 0 and 100
    for color, xs, ys, thresholds in labelled:
        _annotate_thresholds(ax, xs, ys, thresholds, color)
    ax.legend(fontsize=7, loc="best", title="bars: 95% CI; below τ=1.0 paired vs τ=1.0", title_fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _errors(pts: list[dict[str, Any]], key: str, scale: float, paired: bool = False):
    """Asymmetric error bars (2 x n) from ``<key>_lo``/``<key>_hi``; None when no point has an interval.

    ``paired``: a point below the reference threshold gets the paired interval of its change from
    tau = 1.0 (``<key>_delta_lo/hi``) around it instead of its own, so a bar that stays clear of the AR
    line is a change beyond noise on the same documents (its own interval is much wider, since most
    documents are shared)."""
    if not any(p.get(f"{key}_lo") is not None for p in pts):
        return None
    low, high = [], []
    for p in pts:
        v, lo, hi = p[key], p.get(f"{key}_lo"), p.get(f"{key}_hi")
        d, dlo, dhi = p.get(f"{key}_delta"), p.get(f"{key}_delta_lo"), p.get(f"{key}_delta_hi")
        if paired and not p.get("is_reference") and None not in (d, dlo, dhi):
            v, lo, hi = d, dlo, dhi
        low.append(0.0 if lo is None else max(0.0, scale * (v - lo)))
        high.append(0.0 if hi is None else max(0.0, scale * (hi - v)))
    return [low, high]


def _annotate_thresholds(ax, xs, ys, thresholds, color, label_width: float = 45.0, label_height: float = 12.0) -> None:
    """Label each point with its threshold; points whose labels would print over each other (e.g. tau 1.0,
    0.95 and 0.9 of a barely trained model) share one label.  Sizes are in pixels."""
    screen = ax.transData.transform(list(zip(xs, ys)))
    groups: list[list[int]] = []
    for i, (px, py) in enumerate(screen):
        first = screen[groups[-1][0]] if groups else None
        if first is not None and abs(px - first[0]) < label_width and abs(py - first[1]) < label_height:
            groups[-1].append(i)
        else:
            groups.append([i])
    for group in groups:
        text = "τ=" + ", ".join(fmt_threshold(t) for t in sorted((thresholds[i] for i in group), reverse=True))
        ax.annotate(
            text, (xs[group[0]], ys[group[0]]), textcoords="offset points", xytext=(4, 5), fontsize=7, color=color
        )


def _curves(plan: Plan, points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    runs = [points]
    for other in plan.compare:
        runs.append(json.loads((Path(other) / "points.json").read_text()))
    curves: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for p in run:
            curves.setdefault(p["label"], []).append(p)
    return curves


def plot_pareto(plan: Plan, store: ResultsDir, points: list[dict[str, Any]]) -> list[Path]:
    """Write ``pareto_<task>.png`` for each task and the average; returns the paths."""
    curves = _curves(plan, points)
    tasks = [spec.label for spec in plan.suite.tasks] + ([AVERAGE] if len(plan.suite.tasks) > 1 else [])
    paths = []
    for task in tasks:
        per_curve = {label: [p for p in pts if p["task"] == task] for label, pts in curves.items()}
        if not any(per_curve.values()):
            continue
        path = store.root / plot_file_name(task)
        atomic_write_bytes(path, render_pareto(task, per_curve))
        paths.append(path)
    return paths
