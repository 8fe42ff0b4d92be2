"""scripts/reproduce.py's learning curve: every snapshot's point from its own evaluation, the last point from
the final evaluation, each figure printed with its interval."""

import json

from conftest import REPO
from module_loading import load_module

reproduce = load_module(REPO / "scripts" / "reproduce.py", "reproduce")


def _points(folder, rows):
    folder.mkdir(parents=True)
    (folder / "points.json").write_text(json.dumps(rows))


def _average(threshold, tpf, delta):
    return {
        "task": "Average",
        "threshold": threshold,
        "tokens_per_forward": tpf,
        "tokens_per_forward_lo": tpf - 0.02,
        "tokens_per_forward_hi": tpf + 0.03,
        "compare_ar_delta": delta,
        "compare_ar_delta_lo": delta - 0.04,
        "compare_ar_delta_hi": delta + 0.01,
    }


def test_the_curve_reads_snapshots_and_the_final_evaluation_with_intervals(tmp_path):
    lay = reproduce.Layout("x", tmp_path / "work", tmp_path / "bench")
    for minutes, step in ((10, 70), (20, 140)):
        snap = lay.train / "snapshots" / f"{minutes}min"
        snap.mkdir(parents=True)
        (snap / "mars_config.json").write_text(json.dumps({"global_step": step, "tokens_seen": step * 1000}))
        _points(lay.work / f"curve-{minutes}min", [_average(1.0, 1.0, 0.0), _average(0.9, 1.1 + minutes / 100, -0.1)])
    lay.hf.mkdir(parents=True)
    (lay.hf / "mars_config.json").write_text(json.dumps({"global_step": 280}))  # the export has no token count
    (lay.train / "train_summary.json").write_text(json.dumps({"global_step": 280, "tokens_seen": 450_000}))
    _points(lay.eval("final"), [_average(1.0, 1.0, 0.0), _average(0.9, 1.44, -0.2), _average(0.8, 1.6, -0.3)])
    args = reproduce.parse(["budget.minutes=40", "budget.snapshots=[10,20]"])

    rows = reproduce.learning_curve(lay, args)
    assert [(r["minutes"], r["global_step"]) for r in rows] == [(10, 70), (20, 140), (40, 280)]
    assert rows[-1]["tokens_per_forward@0.9"] == 1.44  # the final point is the final evaluation

    table = reproduce.curve_table(rows)
    assert "| 40 | 280 | 0.45M | 1.44 [1.42, 1.47] | -20.0 [-24.0, -19.0] | 0.0 [-4.0, 1.0] |" in table
    reproduce.plot_curve(rows, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_every_line_of_the_learning_curve_is_named_in_its_legend(tmp_path):
    """The dotted lines are the replication's targets and the solid one is the base model: a reader sees
    which is which without the README."""
    rows = []
    for minutes in (10, 20, 40):
        row = {"minutes": minutes}
        for t in (1.0, 0.9):
            for key, value in (("tokens_per_forward", 1.0 + minutes / 100), ("compare_ar_delta", -minutes / 1000)):
                row.update({f"{key}{suffix}@{t}": value for suffix in ("", "_lo", "_hi")})
        rows.append(row)
    fig = reproduce.curve_figure(rows)
    for ax in fig.axes:
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        reference_lines = [
            line for line in ax.get_lines() if len(set(line.get_ydata())) == 1 and len(line.get_ydata()) == 2
        ]
        assert reference_lines, "no reference line drawn"
        for line in reference_lines:
            assert line.get_label() in legend, (line.get_label(), legend)
    tpf, quality = ([t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes)
    assert "target: 1.5 tokens per forward at tau 0.9" in tpf
    assert "target: within 1 point of the base" in quality and "the base model at tau 1.0" in quality
