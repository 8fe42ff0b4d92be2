#!/usr/bin/env python
"""The paper's sequence as one resumable command: stage 1 (AR SFT), stage 2 (MARS) from its export, then the
evaluation of both on the paper's six tasks (docs/training.md, "The paper's recipe, stage by stage").

Stages (each a command one could type, logged to <out>/commands.md; each skipped when its result is complete, and
a killed one resumes from its last checkpoint or its finished samples when this is run again):

1. stage1          AR SFT of Qwen2.5-<size>-Instruct on Dolci-Instruct-SFT, 5 epochs, global batch 384
                   (python train.py experiment=paper_<size>/ar_sft)
2. stage2-<exp>    each --stage2 experiment from stage 1's export (python train.py experiment=paper_<size>/<exp>
                   model.name_or_path=<stage-1 export>)
3. eval-stage1     the AR SFT baseline at tau 1.0, and eval-<exp>: each stage-2 checkpoint over --thresholds
                   (python evaluate.py checkpoint=<export> benchmarks=paper ...)

The paper's cost on 8x H200 (GPU-hours; docs/training.md): 0.5B stage 1 15, a MARS stage 2 33; 7B 100 and 202.

    python scripts/paper_pipeline.py --model 0.5b                                  # stage 1, MARS B=4, evaluation
    python scripts/paper_pipeline.py --model 7b --stage2 mars_b4,mars_b8,mars_b16
    python scripts/paper_pipeline.py --model 7b --hub-dir /shared/mars-hub         # nodes without the hub: the
                                                                                   # folder mars.training.fetch wrote
    python scripts/paper_pipeline.py --model 7b --dry-run                          # the commands only
    python scripts/paper_pipeline.py --model 0.5b trainer.num_nodes=2              # Hydra overrides for training
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import mars.training  # noqa: F401  (registers train.yaml's run-name resolver)
from mars.pipeline import Stages, complete_checkpoint, has_points
from mars.training.config import TrainConfig, check_recipe

REPO = Path(__file__).resolve().parents[1]
SIZES = ("0.5b", "7b")
MODELS = {"0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "7b": "Qwen/Qwen2.5-7B-Instruct"}
DATASET = "allenai/Dolci-Instruct-SFT"
# the paper's training cost on 8x H200, GPU-hours: (stage 1 AR SFT, one MARS stage 2)
PAPER_GPU_HOURS = {"0.5b": (15, 33), "7b": (100, 202)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=SIZES, help="the paper's model size")
    p.add_argument("--stage2", default="mars_b4", help="stage-2 experiments of conf/experiment/paper_<size>/")
    p.add_argument("--thresholds", default="1.0,0.95", help="thresholds of the stage-2 evaluations")
    p.add_argument("--benchmarks", default="paper", help="the evaluation suite (conf/benchmarks/)")
    p.add_argument("--eval-override", action="append", default=[], help="a Hydra override for every evaluation")
    p.add_argument("--hub-dir", type=Path, help="train from this folder (python -m mars.training.fetch --out)")
    p.add_argument("--skip-eval", action="store_true", help="training stages only")
    p.add_argument(
        "--root", type=Path, default=Path.cwd(), help="the working directory of every stage (outputs/ go there)"
    )
    p.add_argument(
        "--out", type=Path, help="where commands.md and stages.json go (default <root>/outputs/paper/<size>)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both training stages")
    return p.parse_args(argv)


def composed(experiment: str, overrides: list[str]):
    """The training config of a stage as train.py composes it, its values and recipe checked (nothing that
    needs an earlier stage's output)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}", *overrides])
    check_recipe(TrainConfig.of(cfg), processes=1)
    return cfg


def data_overrides(args) -> list[str]:
    if args.hub_dir is None:
        return []
    from mars.training.fetch import dataset_folder

    return ["data=dolci_local", f"data.path={dataset_folder(args.hub_dir, DATASET)}"]


def stage1_model(args) -> list[str]:
    if args.hub_dir is None:
        return []
    from mars.training.fetch import model_folder

    return [f"model.name_or_path={model_folder(args.hub_dir, MODELS[args.model])}"]


def script(name: str, root: Path) -> str:
    """``train.py`` / ``evaluate.py`` as the stages run them from ``root``."""
    return name if root.resolve() == REPO else str(REPO / name)


def evaluation(checkpoint: str, out: Path, thresholds: str, args) -> list[str]:
    return [
        script("evaluate.py", args.root),
        f"checkpoint={checkpoint}",
        f"benchmarks={args.benchmarks}",
        f"thresholds=[{thresholds}]",
        f"output_dir={out}",
        *args.eval_override,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    size = args.model
    stage2 = [e for e in args.stage2.split(",") if e]
    thresholds = [float(t) for t in args.thresholds.split(",")]
    common = [*data_overrides(args), *args.overrides]
    # every stage composed and checked first: a bad override stops the pipeline now, naming it
    first = composed(f"paper_{size}/ar_sft", [*common, *stage1_model(args)])
    start = [f"model.name_or_path={first.export_dir}"]
    seconds = {e: composed(f"paper_{size}/{e}", [*common, *start]) for e in stage2}
    root = args.root
    out = args.out or root / "outputs" / "paper" / size
    stages = Stages(out, args.dry_run, root)
    train = script("train.py", root)
    ar_hours, mars_hours = PAPER_GPU_HOURS[size]
    print(
        f"paper pipeline, Qwen2.5-{size}: stage 1 (the paper: {ar_hours} H200-hours), "
        f"{len(stage2)} stage-2 run(s) ({mars_hours} each for MARS), evaluation on benchmarks={args.benchmarks}"
    )
    stages.run(
        "stage1",
        [train, f"experiment=paper_{size}/ar_sft", *common, *stage1_model(args)],
        done=complete_checkpoint(root / first.export_dir),
    )
    for name, cfg in seconds.items():
        stages.run(
            f"stage2-{name}",
            [train, f"experiment=paper_{size}/{name}", *common, *start],
            done=complete_checkpoint(root / cfg.export_dir),
        )
    if not args.skip_eval:
        results = Path("outputs") / "eval"
        baseline = results / f"{first.run_name}-{args.benchmarks}"
        stages.run(
            "eval-stage1",
            evaluation(first.export_dir, baseline, "1.0", args),
            done=has_points(root / baseline, [1.0]),
        )
        for name, cfg in seconds.items():
            folder = results / f"{cfg.run_name}-{args.benchmarks}"
            stages.run(
                f"eval-{name}",
                evaluation(cfg.export_dir, folder, args.thresholds, args),
                done=has_points(root / folder, thresholds),
            )
    if args.dry_run:
        print("\n".join(stages.commands))
    else:
        stages.write_commands(out / "commands.md", f"The paper's pipeline, Qwen2.5-{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
