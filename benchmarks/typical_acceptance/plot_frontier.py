"""The 5-task average's change from the base model against tokens per forward, for the three lossy ways of
going past lossless verify on one checkpoint: plain MARS thresholds, verify + thresholds (the paper's
composition) and verify with typical acceptance.  Reads the committed points files; writes frontier.png.

    python benchmarks/typical_acceptance/plot_frontier.py
"""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
COMPOSITION = HERE.parent / "verify_composition"


def average_rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [r for r in csv.DictReader(f) if r["task"] == "Average"]


def point(row: dict, against_base: bool) -> tuple[float, float, float, float, float, float]:
    """tok/fwd and its interval, then the change in points from the base's greedy output and its interval
    (the run's own tau 1.0 is the base's output for plain MARS and verify: the gated adapter is exact there)."""
    key = "compare_ar_delta" if against_base else "accuracy_delta"
    x, x_lo, x_hi = (float(row[k]) for k in ("tokens_per_forward", "tokens_per_forward_lo", "tokens_per_forward_hi"))
    y, y_lo, y_hi = (100 * float(row[k]) for k in (key, f"{key}_lo", f"{key}_hi"))
    return x, x_lo, x_hi, y, y_lo, y_hi


def draw(ax, label: str, points: list[tuple], names: list[str], marker: str, offset=(5, 4)) -> None:
    xs, ys = [p[0] for p in points], [p[3] for p in points]
    xerr = [[p[0] - p[1] for p in points], [p[2] - p[0] for p in points]]
    yerr = [[p[3] - p[4] for p in points], [p[5] - p[3] for p in points]]
    line = ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, marker=marker, capsize=3, label=label)
    for x, y, name in zip(xs, ys, names):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=offset, fontsize=8, color=line[0].get_color())


def main() -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mars = [r for r in average_rows(COMPOSITION / "eval_mars_points.csv")]
    draw(
        ax, "MARS, threshold tau", [point(r, False) for r in mars], [f"τ {float(r['threshold']):g}" for r in mars], "o"
    )
    verify = [r for r in average_rows(COMPOSITION / "eval_verify_points.csv")]
    names = [f"τ {float(r['threshold']):g}" for r in verify]
    draw(ax, "verify + masks meeting tau", [point(r, False) for r in verify], names, "s")
    typical = sorted(HERE.glob("eval_typical_*_points.csv"), key=lambda p: float(p.stem.split("_")[2]))
    rows = [average_rows(p)[0] for p in typical]
    names = [f"ε {p.stem.split('_')[2]}" for p in typical]
    draw(ax, "verify, typical acceptance (tau 1.0)", [point(r, True) for r in rows], names, "D", (-42, -2))
    ax.axhline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("tokens per forward (per request, 95% bootstrap interval)")
    ax.set_ylabel("5-task average vs base greedy (points, paired 95%)")
    ax.set_title("40-CPU-minute reference checkpoint, quality suite (30 per task, fp32)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "frontier.png", dpi=130)


if __name__ == "__main__":
    main()
