"""Figures: the evaluation's Pareto plots and the training loss curve (mars.evaluation.plots,
mars.training.loss_plot), their format and resolution from the config (mars.figures)."""

from __future__ import annotations

import math
import struct

import pytest

from mars.figures import PlotSettings, plot_settings


def _points(label: str, rows: list[tuple[float, float, float]], method: str = "Wilson") -> list[dict]:
    """(threshold, accuracy, tokens per forward) rows of one curve, with intervals."""
    return [
        {
            "label": label,
            "task": "QA",
            "threshold": t,
            "accuracy": a,
            "accuracy_lo": None if a is None or math.isnan(a) else max(0.0, a - 0.05),
            "accuracy_hi": None if a is None or math.isnan(a) else min(1.0, a + 0.05),
            "accuracy_interval": method if t == 1.0 else "bootstrap",
            "tokens_per_forward": x,
            "tokens_per_forward_lo": x - 0.02,
            "tokens_per_forward_hi": x + 0.02,
            "is_reference": t == 1.0,
        }
        for t, a, x in rows
    ]


def _curves() -> dict[str, list[dict]]:
    return {
        # the reference at 100%: its label would sit above the frame, on the title
        "a model with a long name B=4": _points("a", [(1.0, 1.0, 1.0), (0.9, 0.9, 1.4), (0.5, 0.7, 3.9)]),
        "b B=8": _points("b", [(1.0, 0.95, 1.0), (0.9, 0.8, 1.6)]),
        # lm-eval reported no value: nothing to draw, so no legend entry either
        "broken B=4": _points("broken", [(1.0, float("nan"), 1.0), (0.9, float("nan"), 1.2)]),
    }


def test_pareto_legend_has_an_entry_per_drawn_curve_and_labels_stay_inside():
    from mars.evaluation.plots import pareto_figure

    fig = pareto_figure("QA", _curves())
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["a model with a long name B=4", "b B=8", "τ=1.0 (AR) accuracy and its interval"]
    assert all(text.strip() for text in legend)
    fig.canvas.draw()
    frame = ax.get_window_extent()
    labels = [t for t in ax.texts if t.get_text().startswith("τ=")]
    assert len(labels) >= 4
    for label in labels:  # every threshold label inside the axes (not over the title or the edge)
        box = label.get_window_extent()
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, label
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "95% intervals" in caption and "Wilson interval" in caption and "bootstrap over requests" in caption


def test_pareto_draws_the_measured_speedup_beside_tokens_per_forward():
    from mars.evaluation.plots import pareto_figure, render_pareto

    curves = _curves()
    for p, speed in zip(curves["a model with a long name B=4"], (1.0, 0.62, 1.35)):
        p.update(speedup=speed, machine="AMD EPYC (AVX2, 1 threads)")
    # a verify run's tau=1.0 is verify itself: a speed-up against it is not one against AR, so it is left out
    verify = _points("v", [(1.0, 0.95, 1.4)])
    verify[0].update(speedup=1.0, verify_lossless=True, machine="AMD EPYC (AVX2, 1 threads)")
    fig = pareto_figure("QA", {**curves, "v B=4 (mars_verified)": verify})
    forwards, speed = fig.axes
    assert forwards.get_xlabel() == "tokens per forward"
    assert speed.get_xlabel() == "wall-clock speed-up over τ=1.0 (x)"
    assert [t.get_text() for t in speed.get_legend().get_texts()][0] == "a model with a long name B=4"
    assert "v B=4 (mars_verified)" not in [t.get_text() for t in speed.get_legend().get_texts()]
    assert "v B=4 (mars_verified)" in [t.get_text() for t in forwards.get_legend().get_texts()]
    curve = [list(line.get_xdata()) for line in speed.get_lines() if len(line.get_xdata()) == 3]
    assert curve and all(xs == [0.62, 1.0, 1.35] for xs in curve)  # the points at their speed-ups, in order
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "measured on AMD EPYC (AVX2, 1 threads)" in caption
    assert (
        _png_size(render_pareto("QA", curves, PlotSettings(dpi=60)))[0]
        > _png_size(render_pareto("QA", _curves(), PlotSettings(dpi=60)))[0]
    )  # two panels side by side


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_pareto_format_and_dpi():
    from mars.evaluation.plots import render_pareto

    small = _png_size(render_pareto("QA", _curves(), PlotSettings(dpi=60)))
    large = _png_size(render_pareto("QA", _curves(), PlotSettings(dpi=180)))
    assert large[0] == pytest.approx(3 * small[0], rel=0.05) and large[1] == pytest.approx(3 * small[1], rel=0.05)
    assert render_pareto("QA", _curves(), PlotSettings(format="pdf"))[:5] == b"%PDF-"
    assert b"<svg" in render_pareto("QA", _curves(), PlotSettings(format="svg"))[:2000]


@pytest.mark.parametrize(
    "value, match",
    [
        ({"format": "jpg"}, "plots.format must be one of png|pdf|svg, got 'jpg'"),
        ({"dpi": 0}, r"plots.dpi must be an integer in \[10, 1200\], got 0"),
        ({"dpi": "high"}, "plots.dpi must be an integer"),
        ({"enabled": "yes"}, "plots.enabled must be true or false"),
        ({"fmt": "png"}, r"plots has unknown keys \['fmt'\]"),
        ("png", "plots must be true, false or a mapping"),
    ],
)
def test_bad_plot_settings_are_named(value, match):
    with pytest.raises(ValueError, match=match):
        plot_settings(value)


def test_plot_settings_from_both_configs(compose_cfg):
    train = plot_settings(compose_cfg("train", ["plots.format=svg", "plots.dpi=72"]).plots)
    assert train == PlotSettings(enabled=True, format="svg", dpi=72)
    assert plot_settings(compose_cfg("evaluate", ["plots=false"]).plots).enabled is False
    assert plot_settings(compose_cfg("evaluate", ["plots.format=pdf"]).plots).format == "pdf"


def test_bad_plot_format_fails_before_training_or_evaluating(compose_cfg, tiny_train_overrides):
    from mars.evaluation.config import prepare
    from mars.training.run import validate

    with pytest.raises(ValueError, match="plots.format"):
        validate(compose_cfg("train", tiny_train_overrides + ["plots.format=gif"]))
    with pytest.raises(ValueError, match="plots.format"):
        prepare(compose_cfg("evaluate", ["model=tiny-random", "plots.format=gif"]), check_results_dir=False)


def test_loss_history_draws_in_the_configured_format(tmp_path):
    from mars.training.loss_history import LossHistory

    history = LossHistory(tmp_path, PlotSettings(format="pdf", dpi=90))
    assert history.png == tmp_path / "loss_curve.pdf"


def test_the_loss_curve_is_drawn_once_per_step_it_ends_at(compose_cfg, tiny_train_overrides, monkeypatch):
    """A checkpoint every step and the end of training: the save at the last step and the end draw one curve."""
    from mars.training import loss_history
    from mars.training.run import run

    drawn = []

    def counted(rows, path, settings):
        drawn.append([r["step"] for r in rows])
        return plot_losses(rows, path, settings)

    plot_losses = loss_history.plot_losses
    monkeypatch.setattr(loss_history, "plot_losses", counted)
    run(compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "checkpoint_every=1"]))
    assert drawn == [[1], [1, 2]]


# ------------------------------------------------------------------------------------------------
# the loss curve
# ------------------------------------------------------------------------------------------------
def _rows(n: int = 60) -> list[dict]:
    import random

    rng = random.Random(0)
    rows = []
    for step in range(1, n + 1):
        mask = 8.0 / math.sqrt(step) * (1 + 0.4 * rng.uniform(-1, 1))
        ar = 0.6 * (1 + 0.5 * rng.uniform(-1, 1))
        rows.append({"step": step, "loss": mask + ar, "loss_mask": mask, "loss_ar": ar, "tokens_per_s": 100.0})
    return rows


def test_smoothing_is_a_debiased_moving_average():
    from mars.training.loss_plot import smooth

    assert smooth([3.0, 3.0, 3.0], 5) == pytest.approx([3.0, 3.0, 3.0])  # no pull towards zero at the start
    assert smooth([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    out = smooth([0.0, 10.0] * 20, 9)
    assert max(out[10:]) - min(out[10:]) < 3  # a 10-point swing flattened


def test_loss_curve_labels_each_term_and_draws_a_smoothed_line():
    from mars.training.loss_plot import TERMS, loss_figure, smooth, smoothing_span

    rows = _rows()
    fig = loss_figure(rows)
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [TERMS[k][0] for k in ("loss", "loss_mask", "loss_ar")]
    assert "mask tokens" in legend[1] and "next token" in legend[2]
    span = smoothing_span(len(rows))
    assert span > 1 and f"moving average over ~{span} steps" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines()}
    raw = [r["loss_mask"] for r in rows]
    smoothed = lines[TERMS["loss_mask"][0]]
    assert list(smoothed.get_ydata()) == pytest.approx(smooth(raw, span))
    # the per-step values are drawn too, thinner, without a legend entry of their own
    thin = [line for line in ax.get_lines() if list(line.get_ydata()) == pytest.approx(raw)]
    assert len(thin) == 1 and thin[0].get_linewidth() < smoothed.get_linewidth()
    assert thin[0].get_label().startswith("_")


def test_loss_curve_of_an_ar_run_has_no_mask_entry(tmp_path):
    from mars.training.loss_plot import TERMS, loss_figure, plot_losses

    rows = [{k: v for k, v in r.items() if k != "loss_mask"} for r in _rows(5)]
    legend = [t.get_text() for t in loss_figure(rows).axes[0].get_legend().get_texts()]
    assert legend == [TERMS["loss"][0], TERMS["loss_ar"][0]]
    path = plot_losses(rows, tmp_path / "loss_curve.svg", PlotSettings(format="svg"))
    assert b"<svg" in path.read_bytes()[:2000]
    assert plot_losses([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
