#!/usr/bin/env python
"""`make reproduce`: the whole MARS replication on one model, resumable, with one command.

Stages (each a command you could type, logged to <out>/commands.md; each skipped when its result exists,
so a killed run is resumed by running this again):

1. data        self-distil the committed prompt set with the base model   (python -m mars.self_distill)
2. train-ar    stage-1 AR SFT from the base                               (python train.py experiment=reproduce objective=ar)
3. train-mars  MARS B=4 from the same base, equal steps                   (python train.py experiment=reproduce)
4. eval-ar     the AR-SFT model on the quality suite at tau 1.0            (python evaluate.py ...)
5. eval-mars   the MARS model over a threshold sweep, AR-SFT as a curve   (python evaluate.py ... compare=[...])
6. throughput  wall clock vs the fastest AR decoder, batch 1 and 8, lossy and verified MARS
               on held-out prompts                                        (python -m mars.evaluation.throughput ...)
7. report      benchmarks/<name>/: README.md (summary), table.md, points.csv, Pareto PNGs, loss curves,
               resolved configs, train summaries, throughput tables, commands.md, stages.json

    python scripts/reproduce.py                          # the embedded SmolLM2-135M, CPU or GPU (auto)
    python scripts/reproduce.py --name qwen0.5b model=qwen2.5-0.5b trainer.max_steps=2000   # any Hydra overrides
    python scripts/reproduce.py --dry-run                # print the commands only
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

from mars.pipeline import Stages, complete_checkpoint, has_points

REPO = Path(__file__).resolve().parents[1]
THRESHOLDS = "[1.0,0.9,0.8]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="smollm2-135m", help="benchmarks/reproduce_<name>/ and the run names")
    p.add_argument("--thresholds", default=THRESHOLDS)
    p.add_argument("--eval-limit", type=int, default=None, help="samples per task (default: the suite's own)")
    p.add_argument("--benchmarks", default="quality")
    p.add_argument("--throughput-prompts", type=int, default=4)
    p.add_argument("--throughput-tokens", type=int, default=64)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both training runs (e.g. model=qwen2.5-0.5b)")
    args = p.parse_args(argv)

    bench = REPO / "benchmarks" / f"reproduce_{args.name}"
    work = REPO / "outputs" / "reproduce" / args.name
    stages = Stages(bench, args.dry_run, REPO)
    thresholds = [float(t) for t in args.thresholds.strip("[]").split(",")]
    runs = {obj: f"repro-{args.name}-{obj}-b4" for obj in ("ar", "mars")}
    ckpt = {obj: REPO / "outputs" / "train" / runs[obj] / "hf" for obj in runs}
    evals = {obj: work / f"eval-{obj}" for obj in runs}
    train_common = ["train.py", "experiment=reproduce", *args.overrides]

    # 1. data: the same self-distillation train.py would do, as its own stage (progress, timing)
    stages.run(
        "data",
        ["-m", "mars.self_distill", "--train", "experiment=reproduce", *args.overrides],
        done=complete_checkpoint(ckpt["ar"]) and complete_checkpoint(ckpt["mars"]),
    )
    # 2-3. training at equal steps from the same base
    stages.run(
        "train-ar", [*train_common, "objective=ar", f"run_name={runs['ar']}"], done=complete_checkpoint(ckpt["ar"])
    )
    stages.run(
        "train-mars",
        [*train_common, "objective=mars", "block=4", f"run_name={runs['mars']}"],
        done=complete_checkpoint(ckpt["mars"]),
    )
    # 4-5. evaluation: AR-SFT at its only meaningful point, MARS over the sweep with AR-SFT beside it
    limit = [f"limit={args.eval_limit}"] if args.eval_limit else []
    stages.run(
        "eval-ar",
        [
            "evaluate.py",
            f"checkpoint={ckpt['ar']}",
            f"benchmarks={args.benchmarks}",
            "threshold=1.0",
            "reference=false",
            f"output_dir={evals['ar']}",
            *limit,
        ],
        done=has_points(evals["ar"], [1.0]),
    )
    stages.run(
        "eval-mars",
        [
            "evaluate.py",
            f"checkpoint={ckpt['mars']}",
            f"benchmarks={args.benchmarks}",
            f"thresholds={args.thresholds}",
            f"output_dir={evals['mars']}",
            f"compare=[{evals['ar']}]",
            *limit,
        ],
        done=has_points(evals["mars"], thresholds),
    )
    # 6. wall clock on held-out prompts (the AR baseline is the fastest AR decoder of the same run)
    tput = work / "throughput"
    if not args.skip_throughput:
        stages.run(
            "throughput",
            [
                "-m",
                "mars.evaluation.throughput",
                "--checkpoint",
                str(ckpt["mars"]),
                "--thresholds",
                "1.0,0.9",
                "--batch-sizes",
                "1,8",
                "--repeats",
                "3",
                "--max-new-tokens",
                str(args.throughput_tokens),
                "--caches",
                "cursor",
                "--verify",
                "--prompts-file",
                "data/prompts/heldout.jsonl",
                "--num-prompts",
                str(args.throughput_prompts),
                "--out",
                str(tput),
            ],
            done=(tput / "throughput.csv").is_file(),
        )
    if args.dry_run:
        print("\n".join(stages.commands))
        return 0
    report(bench, args, runs, ckpt, evals, tput, stages)
    return 0


def report(bench: Path, args, runs, ckpt, evals, tput, stages: Stages) -> None:
    """Copy every result a reader needs into benchmarks/reproduce_<name>/ and write its README."""
    bench.mkdir(parents=True, exist_ok=True)
    for obj, run in runs.items():
        train_dir = REPO / "outputs" / "train" / run
        for name in ("config.yaml", "train_summary.json", "losses.csv", "loss_curve.png"):
            if (train_dir / name).is_file():
                shutil.copy(train_dir / name, bench / f"train_{obj}_{name}")
        for name in ("config.yaml", "table.md", "points.csv", "points.json"):
            if (evals[obj] / name).is_file():
                shutil.copy(evals[obj] / name, bench / f"eval_{obj}_{name}")
    for png in sorted(evals["mars"].glob("pareto_*.png")):
        shutil.copy(png, bench / png.name)
    for name in ("throughput.md", "throughput.csv", "config.json"):
        if (tput / name).is_file():
            shutil.copy(tput / name, bench / f"throughput_{name}")
    stages.write_commands(bench / "commands.md", "Commands run by scripts/reproduce.py")
    lines = [
        f"# MARS replication: {args.name}",
        "",
        f"Machine: {platform.node()} ({_cpu()}), {time.strftime('%Y-%m-%d')}. Produced by "
        f"`python scripts/reproduce.py --name {args.name} {' '.join(args.overrides)}`; stage times in "
        "stages.json, the recipe and how it was chosen in RECIPE.md.",
        "",
    ]
    for obj in ("ar", "mars"):
        summary = bench / f"train_{obj}_train_summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            lines.append(
                f"- train {obj}: {s.get('global_step')} steps, {s.get('seconds_per_step')} s/step, "
                f"final {json.dumps(s.get('final', {}))}"
            )
    lines.append("")
    if (bench / "eval_mars_table.md").is_file():
        lines += [
            "## Quality and tokens per forward (MARS checkpoint; AR-SFT in eval_ar_table.md and the plots)",
            "",
            (bench / "eval_mars_table.md").read_text(),
            "",
        ]
    if (bench / "throughput_throughput.md").is_file():
        lines += ["## Wall clock", "", (bench / "throughput_throughput.md").read_text()]
    (bench / "README.md").write_text("\n".join(lines) + "\n")
    print(f"\nreport: {bench / 'README.md'}")


def _cpu() -> str:
    try:
        from mars.hardware import describe

        d = describe()
        return f"{d['cuda'] or d['cpu']}, native bf16 {d['cpu_native_bf16']}, {d['threads']} threads"
    except Exception:  # the report must not fail on a description
        return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
