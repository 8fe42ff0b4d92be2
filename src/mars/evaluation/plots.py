"""Pareto plots: accuracy against tokens per forward and, beside it, against the wall-clock speed-up over
threshold 1.0, one figure per task plus the average.

One curve per model/block label (this run, plus the runs named in ``compare``), each point labelled
with its threshold and drawn with 95% intervals on both axes: tokens per forward, bootstrap over requests;
accuracy, for the threshold 1.0 point its own interval (Wilson or bootstrap) and for the other points the
paired interval of their change from threshold 1.0 placed around them.  Each curve's threshold 1.0 (AR) accuracy
is a dashed line inside a shaded band (that point's own interval): a bar that stays clear of the dashed
line is a change beyond noise on the same documents.  The figure says which intervals it draws (a caption
under the axes), has one legend entry per drawn curve plus one for the reference lines, and keeps every
threshold label inside the axes.  The speed-up panel (where points carry a measured ``speedup``: generated
tokens per second over the same run's threshold 1.0 point's, on the machine its caption names) shows what the
forwards saved cost or gain in time; curves whose threshold 1.0 point is verify itself are left out of it (their
speed-up would be against verify, not AR).  A run's verify point (``mode: verify``, a curve of its own label) is a
star labelled ``verify (lossless)`` in both panels, at the threshold 1.0 accuracy it shares by construction, its
speed-up measured over the AR point on its own samples.  Format and resolution: ``plots`` in conf/evaluate.yaml
(mars.figures).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from mars.evaluation.aggregate import AVERAGE
from mars.evaluation.config import Plan
from mars.evaluation.report import fmt_threshold
from mars.evaluation.store import ResultsDir
from mars.figures import PlotSettings, figure_bytes, plot_settings, write_figure

MARKERS = ("o", "s", "D", "^", "v")
# decoding configs whose threshold 1.0 point is lossless verify (conf/decoding/): their runs' curve labels end so
VERIFY_DECODINGS = ("(mars_verified)", "(mars_lookup)", "(mars_draft_model)")
INTERVAL_NAMES = {
    "Wilson": "Wilson interval",
    "bootstrap": "bootstrap over documents",
    "combined": "the tasks' intervals combined",
}


def slug(name: str) -> str:
    """A file-name and metric-key form of a task label: "Math (ASDiv)" -> "math_asdiv"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_").lower() or "task"


def plot_file_name(task: str, settings: PlotSettings | None = None) -> str:
    return (settings or PlotSettings()).file_name(f"pareto_{slug(task)}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def interval_caption(curves: dict[str, list[dict[str, Any]]]) -> str:
    """What the bars and bands are, from the points' own record of how their intervals were made
    (``accuracy_interval``; a points.json without that record says nothing)."""
    found = {p.get("accuracy_interval") for pts in curves.values() for p in pts if p.get("is_reference")}
    if found == {"none"}:  # a score against the tau = 1.0 output: the reference is 100% by definition
        reference = "τ=1.0 is the reference itself (100%, no interval)"
    else:
        names = [INTERVAL_NAMES.get(m, m) for m in sorted(m for m in found if m not in (None, "none"))]
        reference = f"τ=1.0 bar and band: {' / '.join(names) or 'Wilson or bootstrap'}"
    return (
        f"95% intervals. {reference}; other τ: paired bootstrap of the change from τ=1.0 on the same "
        "documents, drawn around the point; tokens per forward: bootstrap over requests."
    )


def is_verify_point(p: dict[str, Any]) -> bool:
    """A lossless verify point (the AR output at more tokens per forward); points.json files written before
    the ``verify_lossless`` field are recognised by their decoding config's name in the curve label."""
    if "verify_lossless" in p:
        return bool(p["verify_lossless"])
    label = str(p.get("label") or "")
    return bool(p.get("is_reference")) and label.endswith(VERIFY_DECODINGS)


TOKENS, SPEEDUP = "tokens_per_forward", "speedup"  # the x axes: a point's field drawn along each
X_NAMES = {TOKENS: "tokens per forward", SPEEDUP: "wall-clock speed-up over τ=1.0 (x)"}


def speedup_curves(curves: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The curves with a measured speed-up against greedy AR: points with a finite ``speedup``, from curves whose
    threshold 1.0 point is not verify itself."""
    out = {}
    for label, pts in curves.items():
        if any(p.get("is_reference") and is_verify_point(p) for p in pts):
            continue
        kept = [p for p in pts if _finite(p.get(SPEEDUP))]
        if kept:
            out[label] = kept
    return out


def speedup_caption(curves: dict[str, list[dict[str, Any]]]) -> str:
    """What the speed-up axis measures and on which machine(s)."""
    machines = sorted({str(p["machine"]) for pts in curves.values() for p in pts if p.get("machine")})
    where = "; ".join(machines) or "a machine not recorded"
    verify = any(p.get("mode") == "verify" for pts in curves.values() for p in pts)
    return (
        "Speed-up: generated tokens per second over the same run's τ=1.0 point's"
        + (" (verify: on the samples it decoded)" if verify else "")
        + f", decoder wall clock, measured on {where}; one timing per point, no interval."
    )


def pareto_figure(task: str, curves: dict[str, list[dict[str, Any]]]):
    """The matplotlib figure of one task; ``curves`` maps a curve label to its points.  Accuracy against tokens
    per forward, and beside it against the measured wall-clock speed-up where the points carry one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = speedup_curves(curves)
    panels = [(TOKENS, curves)] + ([(SPEEDUP, speed)] if speed else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.4), squeeze=False)
    order = {label: i for i, label in enumerate(sorted(curves))}  # one colour and marker per curve in both panels
    drawn = [_draw_panel(ax, task, panel, x, order) for ax, (x, panel) in zip(axes[0], panels)]
    caption = interval_caption(drawn[0]) + (" " + speedup_caption(drawn[1]) if len(drawn) > 1 else "")
    fig.text(0.01, 0.0, caption, fontsize=6.5, ha="left", va="top", wrap=True, color="0.25")
    fig.tight_layout()
    return fig


def _draw_panel(ax, task: str, curves: dict[str, list[dict[str, Any]]], x: str, order: dict[str, int]) -> dict:
    """Accuracy against the field ``x`` of every curve on ``ax``; returns the curves drawn (finite points)."""
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labelled = []  # (color, points) per curve, annotated once the axes are final
    ylabel = "accuracy (%)"
    drawn: dict[str, list[dict[str, Any]]] = {}
    has_reference = False
    for label, pts in sorted(curves.items()):
        # a point without a finite value would draw nothing yet still get a legend entry
        pts = [p for p in pts if _finite(p.get(x)) and _finite(p.get("accuracy"))]
        if not pts:
            continue
        drawn[label] = pts
        i = order[label]
        color = colors[i % len(colors)]
        pts = sorted(pts, key=lambda p: p[x])
        _draw_curve(ax, i, label, pts, color, x)
        labelled.append((color, pts))
        if not all(is_verify_point(p) for p in pts):  # verify's accuracy is the AR line by construction
            has_reference = _draw_reference(ax, pts, color) or has_reference
        if any(p.get("score") not in (None, "metric") for p in pts):
            ylabel = f"{pts[0]['score']} vs τ=1.0 output (%)"
    if x == SPEEDUP:  # the speed of τ=1.0: points left of it are slower than AR
        ax.axvline(1.0, color="0.5", linestyle=":", linewidth=1)
    _label_axes(ax, task, ylabel, x)
    _set_limits(ax)
    for _ in range(2):  # widening the axes moves the labels closer together: place them again once
        items = [item for color, pts in labelled for item in _threshold_labels(ax, pts, color, x)]
        points = [(p[x], 100 * p["accuracy"]) for _, pts in labelled for p in pts]
        texts = _place_labels(ax, items, points)
        _fit_inside(ax, texts)
    _add_legend(ax, has_reference)
    return drawn


def _draw_curve(ax, i: int, label: str, pts: list[dict[str, Any]], color, x: str = TOKENS) -> None:
    """One curve (points sorted by tokens per forward) with its error bars.  Curves of several points get
    hollow markers of different shapes and sizes, so curves that share a point (tau 1.0) stay visible; a
    curve of one point (the base model, a verify run) gets a larger filled marker drawn beneath them, so it
    shows around a hollow marker on the same spot instead of hiding under it (a verify point: a star)."""
    xs = [p[x] for p in pts]
    ys = [100 * p["accuracy"] for p in pts]
    xerr = _errors(pts, x, 1.0)
    yerr = _errors(pts, "accuracy", 100.0, paired=True)
    single = len(pts) == 1
    marker = "*" if single and is_verify_point(pts[0]) else MARKERS[i % len(MARKERS)]
    ax.errorbar(
        xs,
        ys,
        xerr=xerr,
        yerr=yerr,
        fmt="-" + marker,
        color=color,
        label=label,
        markersize=(16 if marker == "*" else 14) if single else 6 + 2 * (i % len(MARKERS)),
        markerfacecolor=color if single else "none",
        markeredgecolor=color,
        markeredgewidth=1.5,
        alpha=0.85 if single else 1.0,
        elinewidth=1,
        capsize=2,
        zorder=1.8 if single else 2.0,
    )


def _draw_reference(ax, pts: list[dict[str, Any]], color) -> bool:
    """The curve's tau = 1.0 accuracy as a dashed line in a band of its interval; False without one."""
    ref = [p for p in pts if p.get("is_reference")]
    if not ref:
        return False
    r = ref[0]
    ax.axhline(100 * r["accuracy"], color=color, linestyle="--", linewidth=1, alpha=0.7)
    if _finite(r.get("accuracy_lo")) and _finite(r.get("accuracy_hi")):
        ax.axhspan(100 * r["accuracy_lo"], 100 * r["accuracy_hi"], color=color, alpha=0.12, linewidth=0)
    return True


def _label_axes(ax, task: str, ylabel: str, x: str = TOKENS) -> None:
    name = X_NAMES[x]
    ax.set_xlabel(name)
    ax.set_ylabel(ylabel)
    short = name.split(" over ")[0]
    ax.set_title(
        f"{task}: {ylabel.split(' (')[0]} vs {short}" if ylabel.startswith("accuracy") else f"{task} vs {short}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)


def _set_limits(ax) -> None:
    """Room around tokens per forward 1.0; a readable percentage axis that never runs past 0 or 100."""
    lo, hi = ax.get_xlim()
    ax.set_xlim(min(lo, 0.95), max(hi, 1.05))
    lo, hi = ax.get_ylim()
    if hi - lo < 2:  # a flat curve (e.g. a random model at 0%) still gets a readable axis
        mid = (hi + lo) / 2
        ax.set_ylim(max(-1, mid - 5), mid + 5)
    lo, hi = ax.get_ylim()
    ax.set_ylim(max(lo, -1.0), min(hi, 101.0))  # percentages: no empty room past 0 and 100


def _add_legend(ax, has_reference: bool) -> None:
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if has_reference:  # one entry for every curve's dashed line and band (their colours say whose)
        handles.append(Line2D([], [], color="0.4", linestyle="--", linewidth=1))
        labels.append("τ=1.0 (AR) accuracy and its interval")
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")


def render_pareto(task: str, curves: dict[str, list[dict[str, Any]]], settings: PlotSettings | None = None) -> bytes:
    """The bytes of one task's plot (PNG unless ``settings`` says pdf or svg)."""
    return figure_bytes(pareto_figure(task, curves), settings or PlotSettings())


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


def _threshold_labels(
    ax, pts: list[dict[str, Any]], color, x: str = TOKENS, width: float = 45.0, height: float = 12.0
) -> list:
    """One curve's threshold labels as (text, x, y, color), at the points' field ``x`` along the x axis; points
    whose labels would print over each other (e.g. tau 1.0, 0.95 and 0.9 of a barely trained model) share one.  A
    lossless verify point is labelled as such.  Sizes are in pixels."""
    xs, ys = [p[x] for p in pts], [100 * p["accuracy"] for p in pts]
    screen = ax.transData.transform(list(zip(xs, ys)))
    groups: list[list[int]] = []
    for i, (px, py) in enumerate(screen):
        first = screen[groups[-1][0]] if groups else None
        if first is not None and abs(px - first[0]) < width and abs(py - first[1]) < height:
            groups[-1].append(i)
        else:
            groups.append([i])
    items = []
    for group in groups:
        verify = [i for i in group if is_verify_point(pts[i])]
        rest = sorted((pts[i]["threshold"] for i in group if i not in verify), reverse=True)
        parts = (["verify (lossless)"] if verify else []) + (
            ["τ=" + ", ".join(map(fmt_threshold, rest))] if rest else []
        )
        items.append(("; ".join(parts), xs[group[0]], ys[group[0]], color))
    return items


# where a label may sit around its point (offset in points, alignment), nearest first, right before left
LABEL_SPOTS = tuple(
    ((dx, dy), "left" if dx > 0 else "right", "bottom" if dy > 0 else "top")
    for rise in (4, 14, 24)
    for dx in (4, -4)
    for dy in (rise, -rise)
)


def _place_labels(ax, items: list, points: list, marker_px: float = 4.0) -> list:
    """Draw the threshold labels so that none prints over another or over another point's marker: the same
    text at the same spot from several curves (e.g. "τ=0.95" of two runs that agree) becomes one label in a
    neutral colour; each label takes the first spot around its point that is free (LABEL_SPOTS), else the one
    that overlaps least.  Removes labels from an earlier placement first.  Returns the labels."""
    for text in [t for t in ax.texts if getattr(t, "_mars_threshold_label", False)]:
        text.remove()
    renderer = ax.figure.canvas.get_renderer()
    merged: list[list] = []
    for text, x, y, color in items:
        px, py = ax.transData.transform((x, y))
        same = next((m for m in merged if m[0] == text and abs(m[4] - px) < 20 and abs(m[5] - py) < 8), None)
        if same is not None:
            same[3] = "0.3"  # shared by several curves: no single curve's colour
        else:
            merged.append([text, x, y, color, px, py])
    markers = [tuple(ax.transData.transform(xy)) for xy in points]
    frame = ax.get_window_extent(renderer)
    placed, texts = [], []
    for text, x, y, color, px, py in merged:
        others = [_box(mx, my, marker_px) for mx, my in markers if (mx, my) != (px, py)]
        best = None
        for offset, ha, va in LABEL_SPOTS:
            label = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=offset, fontsize=7, color=color, ha=ha, va=va
            )
            box = label.get_window_extent(renderer)
            outside = box.width * box.height - _overlap(box, frame)  # past the left or bottom frame: stays cut
            cost = (sum(_overlap(box, b) for b in placed) + outside) * 10 + sum(_overlap(box, b) for b in others)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, label, box)
            else:
                label.remove()
            if cost == 0:
                break
        best[1]._mars_threshold_label = True
        placed.append(best[2])
        texts.append(best[1])
    return texts


def _box(px: float, py: float, half: float):
    from matplotlib.transforms import Bbox

    return Bbox([[px - half, py - half], [px + half, py + half]])


def _overlap(a, b) -> float:
    """The area two pixel boxes share."""
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0


def _fit_inside(ax, texts: list, pad_px: float = 4.0) -> None:
    """Widen the axes' limits until every threshold label lies inside them (a label at 100% or at the
    rightmost point would otherwise run over the frame, the title or the figure's edge)."""
    fig = ax.figure
    for _ in range(3):  # new limits move the labels: settle in a few rounds
        fig.canvas.draw()
        box = ax.get_window_extent()
        over_right = max((t.get_window_extent().x1 - box.x1 + pad_px for t in texts), default=0.0)
        over_top = max((t.get_window_extent().y1 - box.y1 + pad_px for t in texts), default=0.0)
        if over_right <= 0 and over_top <= 0:
            return
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        if over_right > 0:
            ax.set_xlim(x0, x1 + over_right * (x1 - x0) / max(box.width - over_right, 1.0))
        if over_top > 0:
            ax.set_ylim(y0, y1 + over_top * (y1 - y0) / max(box.height - over_top, 1.0))


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
    """Write ``pareto_<task>.<format>`` for each task and the average; returns the paths."""
    settings = plot_settings(plan.resolved.get("plots"))
    curves = _curves(plan, points)
    tasks = [spec.label for spec in plan.suite.tasks] + ([AVERAGE] if len(plan.suite.tasks) > 1 else [])
    paths = []
    for task in tasks:
        per_curve = {label: [p for p in pts if p["task"] == task] for label, pts in curves.items()}
        if not any(per_curve.values()):
            continue
        paths.append(
            write_figure(pareto_figure(task, per_curve), store.root / plot_file_name(task, settings), settings)
        )
    return paths
