"""The two reference runs' learning curves against training tokens: the 70-CPU-minute fp32 run on an AMD EPYC
(benchmarks/reproduce_smollm2-135m) and the 120-CPU-minute bf16-true run on an AMX Xeon (this folder).

    python benchmarks/reproduce_smollm2-135m-amx/compare_curves.py    # writes compare_curves.png here
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = {
    "EPYC, fp32, 70 min": HERE.parent / "reproduce_smollm2-135m" / "learning_curve.json",
    "AMX Xeon, bf16-true, 120 min": HERE / "learning_curve.json",
}
PANELS = (
    ("tokens_per_forward@0.9", 1.0, "tokens per forward, tau 0.9", 1.5),
    ("fidelity@0.9", 100.0, "mask fidelity at tau 0.9 (%)", 95),
    ("compare_ar_delta@0.9", 100.0, "5-task average vs base, tau 0.9 (pts)", -1),
)


def main() -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.2))
    for ax, (key, scale, title, target) in zip(axes, PANELS):
        for label, path in RUNS.items():
            rows = json.loads(path.read_text())
            x = [r["tokens_seen"] / 1e6 for r in rows]
            y = [r[key] * scale for r in rows]
            lo = [r[key.replace("@", "_lo@")] * scale for r in rows]
            hi = [r[key.replace("@", "_hi@")] * scale for r in rows]
            line = ax.plot(x, y, marker="o", label=label)[0]
            ax.fill_between(x, lo, hi, alpha=0.2, color=line.get_color())
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="issue 16 target")
        ax.set_xlabel("training tokens (M)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "compare_curves.png", dpi=120)


if __name__ == "__main__":
    main()
