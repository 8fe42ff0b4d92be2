#!/usr/bin/env python
"""`make demo`: the whole story on the embedded default, offline, on CPU.

1. MARS-train SmolLM2-135M-Instruct (B=4) on the committed offline data  (python train.py experiment=demo)
2. evaluate thresholds {1.0, 0.95, 0.9, 0.8, 0.7} on the offline suite     (python evaluate.py checkpoint=...)
3. print the table, the Pareto plot's path and each stage's wall time.

Environment knobs: DEMO_LIMIT (samples per task, default 3; BBH has 24 subtasks, so 72 BBH prompts),
DEMO_STEPS (training steps, default from conf/experiment/demo.yaml). Reruns reuse finished work: training
skips, evaluation resumes.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THRESHOLDS = "[1.0,0.95,0.9,0.8,0.7]"


def stage(name: str, cmd: list[str]) -> float:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, *cmd], cwd=REPO, check=True)
    seconds = time.perf_counter() - start
    print(f"=== {name} took {seconds / 60:.1f} min", flush=True)
    return seconds


def main() -> None:
    limit = os.environ.get("DEMO_LIMIT", "3")
    train_cmd = ["train.py", "experiment=demo"]
    if os.environ.get("DEMO_STEPS"):
        train_cmd.append(f"trainer.max_steps={os.environ['DEMO_STEPS']}")
    ckpt = REPO / "outputs" / "train" / "demo-smollm2-135m-mars-b4" / "hf"
    times = {"train": stage("train", train_cmd)}
    out = REPO / "outputs" / "eval" / "demo"
    times["evaluate"] = stage(
        "evaluate",
        [
            "evaluate.py",
            f"checkpoint={ckpt}",
            f"thresholds={THRESHOLDS}",
            f"limit={limit}",
            "benchmarks=offline",
            f"output_dir={out}",
            "run_name=demo",
        ],
    )
    print("\n=== wall time per stage: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()))
    print(f"checkpoint:  {ckpt}")
    print(f"results:     {out}  (table.md, points.csv, samples/)")
    print(f"Pareto plot: {out / 'pareto_average.png'}  (one per task beside it)")


if __name__ == "__main__":
    main()
