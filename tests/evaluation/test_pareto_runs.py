"""Pareto plots of several runs at once (``compare=``): threshold labels that never print over each other, a
one-point run (the base model) visible on the point it shares, and the lossless verify point drawn and named."""

from __future__ import annotations


def _points(label: str, rows: list[tuple[float, float, float]]) -> list[dict]:
    """(threshold, accuracy, tokens per forward) rows of one curve, with intervals."""
    return [
        {
            "label": label,
            "task": "Average",
            "threshold": t,
            "accuracy": a,
            "accuracy_lo": a - 0.07,
            "accuracy_hi": a + 0.06,
            "accuracy_interval": "combined",
            "accuracy_delta_lo": -0.05,
            "accuracy_delta_hi": 0.04,
            "tokens_per_forward": x,
            "tokens_per_forward_lo": x - 0.02,
            "tokens_per_forward_hi": x + 0.02,
            "is_reference": t == 1.0,
        }
        for t, a, x in rows
    ]


def _runs() -> dict[str, list[dict]]:
    """The reference adapter's figure: two runs that agree at tau 1.0 and 0.95, the base model's one point
    under their tau 1.0 points, and the lossless verify point."""
    train, r8 = "ref40-train B=4", "ref40_r8 B=4"
    base, verify = "smollm2-135m B=4", "ref40-train B=4 (mars_verified)"
    return {
        train: _points(train, [(1.0, 0.633, 1.0), (0.99, 0.553, 1.183), (0.95, 0.453, 1.365), (0.9, 0.40, 1.528)]),
        r8: _points(r8, [(1.0, 0.633, 1.0), (0.95, 0.454, 1.366), (0.9, 0.387, 1.515)]),
        base: _points(base, [(1.0, 0.633, 1.0)]),
        verify: [{**p, "verify_lossless": True} for p in _points(verify, [(1.0, 0.633, 1.56)])],
    }


def _threshold_texts(ax) -> list:
    return [t for t in ax.texts if t.get_text().startswith(("τ=", "verify"))]


def test_threshold_labels_of_several_runs_never_print_over_each_other():
    from mars.evaluation.plots import pareto_figure

    fig = pareto_figure("Average", _runs())
    (ax,) = fig.axes
    fig.canvas.draw()
    texts = _threshold_texts(ax)
    boxes = [t.get_window_extent() for t in texts]
    for i, a in enumerate(boxes):
        for j in range(i):
            assert not a.overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    frame = ax.get_window_extent()
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    words = [t.get_text() for t in texts]
    # two runs that agree at a threshold share its label instead of printing it twice on one spot
    assert words.count("τ=0.95") == 1 and words.count("τ=1.0") == 1
    assert words.count("τ=0.9") == 2  # 1.3 points apart: each run keeps its own, placed apart


def test_a_one_point_curve_shows_around_the_point_it_shares_instead_of_hiding_under_it():
    from mars.evaluation.plots import pareto_figure

    fig = pareto_figure("Average", _runs())
    (ax,) = fig.axes
    lines = {c.get_label(): c.lines[0] for c in ax.containers}  # each curve's data line (its markers)
    base, curve = lines["smollm2-135m B=4"], lines["ref40_r8 B=4"]
    assert base.get_markerfacecolor() != "none" and curve.get_markerfacecolor() == "none"
    hollow = [line.get_markersize() for line in lines.values() if line.get_markerfacecolor() == "none"]
    assert base.get_markersize() > max(hollow)
    assert base.get_zorder() < curve.get_zorder()  # beneath the hollow markers: its rim shows around them


def test_the_lossless_verify_point_is_drawn_and_named_on_the_pareto_plot():
    from mars.evaluation.plots import is_verify_point, pareto_figure

    runs = _runs()
    fig = pareto_figure("Average", runs)
    (ax,) = fig.axes
    assert "verify (lossless)" in [t.get_text() for t in _threshold_texts(ax)]
    star = next(c.lines[0] for c in ax.containers if c.get_label() == "ref40-train B=4 (mars_verified)")
    assert star.get_marker() == "*"
    # points.json written before the verify_lossless field: known by the decoding config in the label
    old = {k: v for k, v in runs["ref40-train B=4 (mars_verified)"][0].items() if k != "verify_lossless"}
    assert is_verify_point(old) and not is_verify_point({**old, "is_reference": False})
    assert not is_verify_point({**old, "verify_lossless": False})
