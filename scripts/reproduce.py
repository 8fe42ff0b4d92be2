#!/usr/bin/env python
"""`make reproduce`: the reference MARS run on one model, resumable, with one command.

Stages (each a command you could type, logged to <out>/commands.md; each skipped when its result exists,
so a killed run is resumed by running this again):

1. data        self-distil the committed prompt set with the base model  (python -m mars.training.self_distill)
2. train       the recipe of conf/experiment/reproduce.yaml (chosen by the equal-compute recipe search,
               results/recipe_search) for its compute budget, exporting snapshots along the way
                                                                         (python train.py experiment=reproduce)
3. eval-base   the untouched base model on the quality suite at tau 1.0 (the paired reference of everything)
4. curve-<m>   every snapshot and the final model on the quality suite (--curve-limit samples per task) at
               tau 1.0 and 0.9: the learning curve (tokens per forward and quality vs training minutes)
5. verify      the final model in lossless verify mode, against the base's greedy outputs
6. eval        the final model over the threshold sweep, the base and the verify point beside it
                                                                         (python evaluate.py ...)
7. train-ar / eval-ar  (--ar-sft) the paper's stage-1 AR SFT at the same compute, as a comparison curve
8. throughput  wall clock vs the fastest AR decoder, batch 1 and 8, lossy and verified MARS
9. report      results/replication/ (results/replication_<name>/ for another --name): README.md, tables,
               points, learning curve, Pareto plots, loss curves, resolved configs, train summary, throughput,
               the adapter (when small), commands.md

    python scripts/reproduce.py                          # the embedded SmolLM2-135M, CPU or GPU (auto)
    python scripts/reproduce.py --name qwen0.5b model=qwen2.5-0.5b budget.minutes=600   # any Hydra overrides
    python scripts/reproduce.py --dry-run                # print the commands only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from mars.persistence import atomic_write_text
from mars.pipeline import Stages, complete_checkpoint, has_points, reuse_base_reference

REPO = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "smollm2-135m"
THRESHOLDS = "[1.0,0.9,0.8]"
CURVE_THRESHOLDS = [1.0, 0.9]
# the replication's targets, drawn as the learning curve's dotted lines: tokens per forward at tau 0.9 within
# this many points of the base model's quality (results/recipe_search/README.md)
TARGET_TPF, TARGET_POINTS = 1.5, 1.0
SHIP_ADAPTER_BYTES = 10 * 2**20  # larger adapters (rank 32 on every layer: 39 MB) stay out of git


@dataclass
class Layout:
    """Where every stage writes (work: outputs/, bench: results/replication*/)."""

    name: str
    work: Path
    bench: Path

    @property
    def train(self) -> Path:
        return self.work / "train"

    @property
    def hf(self) -> Path:
        return self.train / "hf"

    def eval(self, kind: str) -> Path:
        return self.work / f"eval-{kind}"


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--name",
        default=DEFAULT_NAME,
        help="run names; report in results/replication/ (default name) or results/replication_<name>/",
    )
    p.add_argument("--thresholds", default=THRESHOLDS)
    p.add_argument("--eval-limit", type=int, default=None, help="samples per task (default: the suite's own)")
    p.add_argument("--curve-limit", type=int, default=50, help="samples per task for the learning-curve points")
    p.add_argument("--benchmarks", default="quality")
    p.add_argument("--base", default="smollm2-135m", help="the base model's config name (conf/model/)")
    p.add_argument("--ar-sft", action="store_true", help="also train and evaluate the paper's stage-1 AR SFT")
    p.add_argument("--throughput-prompts", type=int, default=4)
    p.add_argument("--throughput-tokens", type=int, default=64)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for training (e.g. model=qwen2.5-0.5b)")
    return p.parse_args(argv)


def recipe() -> dict:
    """conf/experiment/reproduce.yaml as written (the settings a command-line override can replace)."""
    return yaml.safe_load((REPO / "conf" / "experiment" / "reproduce.yaml").read_text())


def budget_setting(overrides: list[str], key: str):
    """``budget.<key>`` of the recipe (conf/experiment/reproduce.yaml), or of a command-line override."""
    for o in overrides:
        if o.startswith(f"budget.{key}="):
            return yaml.safe_load(o.split("=", 1)[1])
    return (recipe().get("budget") or {}).get(key)


def recipe_setting(overrides: list[str], group: str) -> str | None:
    """The config group option the recipe uses (``adapter=...`` on the command line, else the recipe's defaults)."""
    for o in overrides:
        if o.startswith(f"{group}="):
            return o.split("=", 1)[1]
    for entry in recipe().get("defaults") or []:
        if isinstance(entry, dict) and f"override /{group}" in entry:
            return entry[f"override /{group}"]
    return None


def evaluate(target: str, out: Path, args, extra: list[str], limit: int | None) -> list[str]:
    return [
        "evaluate.py",
        target,
        f"benchmarks={args.benchmarks}",
        "dtype=float32",
        f"output_dir={out}",
        *([f"limit={limit}"] if limit else []),
        *extra,
    ]


def run_training(stages: Stages, lay: Layout, args) -> None:
    common = ["train.py", "experiment=reproduce", f"output_dir={lay.train}", *args.overrides]
    stages.run(
        "data",
        ["-m", "mars.training.self_distill", "--train", "experiment=reproduce", *args.overrides],
        complete_checkpoint(lay.hf),
    )
    stages.run("train", [*common, f"run_name=repro-{args.name}"], done=complete_checkpoint(lay.hf))
    if args.ar_sft:
        ar = lay.work / "train-ar"
        stages.run(
            "train-ar",
            [*common, "objective=ar", "adapter=none", f"output_dir={ar}", f"run_name=repro-{args.name}-ar"],
            done=complete_checkpoint(ar / "hf"),
        )


def run_evaluations(stages: Stages, lay: Layout, args) -> None:
    base = lay.eval("base")
    stages.run(
        "eval-base",
        # checkpoint=null: the model as it is, not its shipped MARS checkpoint
        evaluate(
            f"model={args.base}", base, args, ["checkpoint=null", "threshold=1.0", "reference=false"], args.eval_limit
        ),
        done=has_points(base, [1.0]),
    )
    compare = f"compare=[{base}]"
    curve = "[" + ",".join(str(t) for t in CURVE_THRESHOLDS) + "]"
    gated = recipe_setting(args.overrides, "adapter") == "gated_lora"
    for minutes, folder in curve_checkpoints(lay, args.overrides)[:-1]:  # the last point is the final eval
        out = curve_folder(lay, minutes, folder)
        if gated and args.curve_limit == args.eval_limit and not stages.dry_run:
            reuse_base_reference(base, out)  # the curve's tau 1.0 points are the base's outputs, token for token
        stages.run(
            f"curve-{minutes:g}min",
            evaluate(f"checkpoint={folder}", out, args, [f"thresholds={curve}", compare], args.curve_limit),
            done=has_points(out, CURVE_THRESHOLDS),
        )
    verify = ["decoding=mars_verified", "threshold=1.0", "reference=false", compare]
    stages.run(
        "verify",
        evaluate(f"checkpoint={lay.hf}", lay.eval("verify"), args, verify, args.eval_limit),
        done=has_points(lay.eval("verify"), [1.0]),
    )
    # verify ran first so that the sweep's Pareto plots (the report's) draw the lossless point beside the curve
    thresholds = [float(t) for t in args.thresholds.strip("[]").split(",")]
    sweep = [f"thresholds={args.thresholds}", f"compare=[{base},{lay.eval('verify')}]"]
    stages.run(
        "eval",
        evaluate(f"checkpoint={lay.hf}", lay.eval("final"), args, sweep, args.eval_limit),
        done=has_points(lay.eval("final"), thresholds),
    )
    if args.ar_sft:
        ar = lay.eval("ar-sft")
        stages.run(
            "eval-ar",
            evaluate(
                f"checkpoint={lay.work / 'train-ar' / 'hf'}",
                ar,
                args,
                ["threshold=1.0", "reference=false", compare],
                args.eval_limit,
            ),
            done=has_points(ar, [1.0]),
        )


def curve_folder(lay: Layout, minutes: float, checkpoint: Path) -> Path:
    """Where a learning-curve point's evaluation is: the final model's is the final evaluation itself."""
    return lay.eval("final") if checkpoint == lay.hf else lay.work / f"curve-{minutes:g}min"


def curve_checkpoints(lay: Layout, overrides: list[str]) -> list[tuple[float, Path]]:
    """(budget minutes, folder) of every snapshot and of the final export, in training order."""
    snapshots = [float(m) for m in budget_setting(overrides, "snapshots") or []]
    points = [(m, lay.train / "snapshots" / f"{m:g}min") for m in snapshots]
    final = budget_setting(overrides, "minutes")
    return points + [(float(final) if final else float(len(points) + 1), lay.hf)]


def run_throughput(stages: Stages, lay: Layout, args) -> Path:
    tput = lay.work / "throughput"
    if args.skip_throughput:
        return tput
    cmd = ["-m", "mars.bench.throughput", "--checkpoint", str(lay.hf), "--thresholds", "1.0,0.9"]
    cmd += ["--batch-sizes", "1,8", "--repeats", "3", "--max-new-tokens", str(args.throughput_tokens)]
    cmd += ["--caches", "cursor", "--verify", "--prompts-file", "data/prompts/heldout.jsonl"]
    cmd += ["--num-prompts", str(args.throughput_prompts), "--out", str(tput)]
    stages.run("throughput", cmd, done=(tput / "throughput.csv").is_file())
    return tput


def report_folder(name: str) -> Path:
    """results/replication/ for the default model, results/replication_<name>/ for any other run name."""
    return REPO / "results" / ("replication" if name == DEFAULT_NAME else f"replication_{name}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for the report
    lay = Layout(args.name, REPO / "outputs" / "reproduce" / args.name, report_folder(args.name))
    stages = Stages(lay.bench, args.dry_run, REPO)
    run_training(stages, lay, args)
    run_evaluations(stages, lay, args)
    tput = run_throughput(stages, lay, args)
    if args.dry_run:
        print("\n".join(stages.commands))
        return 0
    report(lay, args, tput, stages)
    return 0


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------
def _average(folder: Path, threshold: float) -> dict | None:
    path = folder / "points.json"
    if not path.is_file():
        return None
    return next(
        (p for p in json.loads(path.read_text()) if p["task"] == "Average" and abs(p["threshold"] - threshold) < 1e-9),
        None,
    )


def learning_curve(lay: Layout, args) -> list[dict]:
    rows = []
    for minutes, folder in curve_checkpoints(lay, args.overrides):
        out = curve_folder(lay, minutes, folder)
        meta_path = folder / "mars_config.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        summary = lay.train / "train_summary.json"  # the final export's counters are the run's summary
        if folder == lay.hf and summary.is_file():
            meta = {**json.loads(summary.read_text()), **meta}
        row = {"minutes": minutes, "global_step": meta.get("global_step"), "tokens_seen": meta.get("tokens_seen")}
        for t in CURVE_THRESHOLDS:
            p = _average(out, t) or {}
            for key in ("tokens_per_forward", "compare_ar_delta", "accuracy", "agreement", "fidelity"):
                for suffix in ("", "_lo", "_hi"):
                    row[f"{key}{suffix}@{t}"] = p.get(f"{key}{suffix}")
        rows.append(row)
    return rows


def plot_curve(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = curve_figure(rows)
    if fig is not None:
        fig.savefig(path, dpi=130)
        plt.close(fig)


def curve_figure(rows: list[dict]):
    """The learning curve (None without a tau 0.9 point); every line in it, the targets' dotted lines and the
    base model's line included, has a legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("tokens_per_forward@0.9") is not None]
    if not rows:
        return None
    x = [r["minutes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for t, style in ((0.9, "o-"),):
        y = [r[f"tokens_per_forward@{t}"] for r in rows]
        err = [
            [v - r[f"tokens_per_forward_lo@{t}"] for v, r in zip(y, rows)],
            [r[f"tokens_per_forward_hi@{t}"] - v for v, r in zip(y, rows)],
        ]
        a.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=f"tau {t}")
    a.axhline(TARGET_TPF, color="grey", ls=":", lw=0.8, label=f"target: {TARGET_TPF:g} tokens per forward at tau 0.9")
    a.set_xlabel("training compute (budget minutes)")
    a.set_ylabel("tokens per forward per request")
    a.grid(alpha=0.3)
    a.legend()
    for t, style in ((1.0, "s-"), (0.9, "o-")):
        y = [100 * (r[f"compare_ar_delta@{t}"] or 0) for r in rows]
        err = [
            [v - 100 * (r[f"compare_ar_delta_lo@{t}"] or 0) for v, r in zip(y, rows)],
            [100 * (r[f"compare_ar_delta_hi@{t}"] or 0) - v for v, r in zip(y, rows)],
        ]
        b.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=f"tau {t}")
    b.axhline(0, color="grey", lw=0.8, label="the base model at tau 1.0")
    b.axhline(-TARGET_POINTS, color="grey", ls=":", lw=0.8, label=f"target: within {TARGET_POINTS:g} point of the base")
    b.set_xlabel("training compute (budget minutes)")
    b.set_ylabel("5-task average vs base at tau 1.0 (points)")
    b.grid(alpha=0.3)
    b.legend()
    fig.suptitle("Learning curve (95% intervals: bootstrap for tok/fwd, paired bootstrap for quality)", fontsize=9)
    fig.tight_layout()
    return fig


def curve_table(rows: list[dict]) -> str:
    def ci(r, key, scale=1.0, digits=2):
        if r.get(key) is None:
            return "–"
        name, at = key.split("@")  # the interval's bounds are stored as <name>_lo@<threshold>
        lo, hi = r[f"{name}_lo@{at}"], r[f"{name}_hi@{at}"]
        return f"{r[key] * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"

    lines = [
        "| budget min | steps | tokens | tok/fwd tau 0.9 | vs base tau 0.9 (pts) | vs base tau 1.0 (pts) | mask fidelity tau 0.9 |",
        "|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['minutes']:g} | {r['global_step']} | {(r['tokens_seen'] or 0) / 1e6:.2f}M | "
            f"{ci(r, 'tokens_per_forward@0.9')} | {ci(r, 'compare_ar_delta@0.9', 100, 1)} | "
            f"{ci(r, 'compare_ar_delta@1.0', 100, 1)} | {ci(r, 'fidelity@0.9', 100, 1)} |"
        )
    return "\n".join(lines) + "\n"


def copy_results(lay: Layout, tput: Path) -> None:
    bench = lay.bench
    bench.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "train_summary.json", "losses.csv", "loss_curve.png"):
        if (lay.train / name).is_file():
            shutil.copy(lay.train / name, bench / f"train_{name}")
    for kind in ("base", "final", "verify", "ar-sft"):
        for name in ("config.yaml", "table.md", "points.csv", "points.json"):
            if (lay.eval(kind) / name).is_file():
                shutil.copy(lay.eval(kind) / name, bench / f"eval_{kind}_{name}")
    for png in sorted(lay.eval("final").glob("pareto_*.png")):
        shutil.copy(png, bench / png.name)
    for name in ("throughput.md", "throughput.csv", "config.json"):
        if (tput / name).is_file():
            shutil.copy(tput / name, bench / f"throughput_{name}")
    if (lay.hf / "mars_adapter.json").is_file() and folder_bytes(lay.hf) <= SHIP_ADAPTER_BYTES:
        adapter = bench / "adapter"  # a small adapter ships with its figures, which it re-checks
        adapter.mkdir(exist_ok=True)
        for item in lay.hf.iterdir():
            shutil.copy(item, adapter / item.name)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def report(lay: Layout, args, tput: Path, stages: Stages) -> None:
    """Copy every result a reader needs into the report folder and write its README."""
    copy_results(lay, tput)
    rows = learning_curve(lay, args)
    atomic_write_text(lay.bench / "learning_curve.json", json.dumps(rows, indent=2) + "\n")
    plot_curve(rows, lay.bench / "learning_curve.png")
    stages.write_commands(lay.bench / "commands.md", "Commands run by scripts/reproduce.py")
    lines = [
        f"# MARS reference run: {args.name}",
        "",
        f"Machine: {platform.node()} ({_cpu()}), {time.strftime('%Y-%m-%d')}. Produced by "
        f"`python scripts/reproduce.py {shlex.join(args.argv)}`; stage times in stages.json, how the recipe "
        "was chosen in results/recipe_search/README.md.",
        "",
    ]
    summary = lay.bench / "train_train_summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        lines.append(
            f"Training: {s.get('global_step')} steps, {s.get('tokens_seen')} tokens, budget {s.get('budget')}, "
            f"final losses {json.dumps(s.get('final', {}))}"
        )
        lines.append("")
    lines += ["## Learning curve (learning_curve.png)", "", curve_table(rows), ""]
    for kind, title in (("final", "Quality and tokens per forward"), ("verify", "Lossless verify mode")):
        table = lay.bench / f"eval_{kind}_table.md"
        if table.is_file():
            lines += [f"## {title}", "", table.read_text(), ""]
    if (lay.bench / "throughput_throughput.md").is_file():
        lines += ["## Wall clock", "", (lay.bench / "throughput_throughput.md").read_text()]
    if (lay.bench / "adapter").is_dir():
        lines += [
            "## Re-check without training",
            "",
            "The adapter in `adapter/` is the trained artifact (the base is the embedded model): ",
            f"`python evaluate.py checkpoint={lay.bench.relative_to(REPO)}/adapter benchmarks=quality "
            "thresholds=[1.0,0.9,0.8] dtype=float32` reproduces the tables above.",
            "",
        ]
    atomic_write_text(lay.bench / "README.md", "\n".join(lines) + "\n")
    print(f"\nreport: {lay.bench / 'README.md'}")


def _cpu() -> str:
    try:
        from mars.hardware import describe

        d = describe()
        return f"{d['cuda'] or d['cpu']}, {os.cpu_count()} CPUs, native bf16 {d['cpu_native_bf16']}"
    except Exception:  # the report must not fail on a description
        return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
