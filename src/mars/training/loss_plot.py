"""The training loss curve (``loss_curve.<format>`` beside ``losses.csv``): one colour per loss term, each
a thin line of the per-step values under a thick smoothed line, labelled with what the term is.

Per-step losses of small batches are noisy (the mask loss of a 100-step CPU run swings by 2x from step to
step), so the trend is read off an exponential moving average, debiased at the start like TensorBoard's
smoothing (the first points are not pulled towards zero).
"""

from __future__ import annotations

from pathlib import Path

from mars.figures import PlotSettings, write_figure

# what each column of losses.csv is: L = mask_weight * L_mask + alpha * L_AR (mars.training.objectives)
TERMS = {
    "loss": ("total: w·L_mask + α·L_AR + the levers (certainty, unlikelihood, KL)", "-"),
    "loss_mask": ("L_mask: mask tokens (noisy copy)", "--"),
    "loss_ar": ("L_AR: next token (clean copy)", ":"),
}


def smoothing_span(n: int) -> int:
    """Steps averaged by the smoothed line: about a tenth of the run, at least 1."""
    return max(1, n // 10)


def smooth(values: list[float], span: int) -> list[float]:
    """Debiased exponential moving average with the given span (``alpha = 2 / (span + 1)``); span 1 is
    the identity."""
    alpha = 2.0 / (span + 1)
    out, average, weight = [], 0.0, 0.0
    for v in values:
        average = (1 - alpha) * average + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(average / weight)
    return out


def readable_log_ticks(ax, values: list[float]) -> None:
    """Plain-number labels on the log y axis, dense enough to read a value off: matplotlib's default labels
    only the powers of ten, so a curve between 100 and 200 shows the single label 10^2.  Over a decade or
    more the labels are 1-2-5 steps (0.5, 1, 2, 5, 10, 20, ...); within one, evenly spaced round numbers
    (120, 140, 160, ...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    low, high = min(values), max(values)
    if high / low >= 10:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs="auto"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def loss_figure(rows: list[dict[str, float]]):
    """The matplotlib figure of ``rows`` (losses.csv); None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for key in TERMS:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] > 0]  # log axis: positive values only
        if pts:
            series[key] = pts
    if not series:
        return None
    span = smoothing_span(max(len(p) for p in series.values()))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (key, pts) in enumerate(series.items()):
        label, style = TERMS[key]
        steps, values = zip(*pts)
        color = colors[i % len(colors)]
        if span > 1:
            ax.plot(steps, values, style, color=color, linewidth=0.8, alpha=0.3)  # per step, no legend entry
        ax.plot(steps, smooth(list(values), span), style, color=color, linewidth=2.0, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (log scale)")
    ax.set_yscale("log")
    readable_log_ticks(ax, [v for pts in series.values() for _, v in pts])
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.12, which="minor")
    title = "training loss" + (f": thick = moving average over ~{span} steps, thin = per step" if span > 1 else "")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def plot_losses(rows: list[dict[str, float]], path: Path, settings: PlotSettings | None = None) -> Path | None:
    """Draw ``rows`` to ``path`` (its format and resolution from ``settings``); nothing without rows."""
    fig = loss_figure(rows)
    if fig is None:
        return None
    return write_figure(fig, path, settings or PlotSettings())
