"""The training loss curve's log axis: readable numbers at every scale, not a lone 10^2."""

import pytest

from mars.training.loss_plot import loss_figure


def y_labels(rows):
    fig = loss_figure(rows)
    fig.canvas.draw()
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    shown = [t for t in ax.yaxis.get_major_ticks() if low <= t.get_loc() <= high and t.label1.get_visible()]
    return [t.label1.get_text() for t in shown if t.label1.get_text()]


@pytest.mark.parametrize(
    "low,high,expect",
    [
        (125.0, 140.0, {"125", "130", "135", "140"}),  # a tiny model's first steps: within one decade
        (95.0, 180.0, {"100", "120", "140", "160", "180"}),
        (2.0, 300.0, {"2", "5", "10", "20", "50", "100", "200"}),  # over two decades: 1-2-5 steps
    ],
)
def test_the_loss_axis_labels_plain_numbers_close_enough_to_read_a_value_off(low, high, expect):
    steps = 40
    rows = [
        {"step": s, "loss": high - (high - low) * s / (steps - 1), "loss_mask": high - (high - low) * s / (steps - 1)}
        for s in range(steps)
    ]
    labels = y_labels(rows)
    assert len(labels) >= 3, labels
    assert expect <= set(labels), labels
    assert not any("10^" in label or "times" in label for label in labels), labels  # no math-text powers
