#!/usr/bin/env python
"""`make demo`: the whole story on the embedded default, offline, on CPU, in about 20 minutes.

1. train a gated MARS adapter (B=4) on SmolLM2-135M-Instruct's own committed self-distilled answers
   for 10 minutes of wall clock                          (python train.py experiment=demo)
2. evaluate thresholds 1.0 / 0.95 / 0.9 on the quality suite (held-out agreement, short-answer tasks),
   every figure with its interval                        (python evaluate.py checkpoint=... benchmarks=quality)
3. time the same checkpoint against the fastest AR decoder at batch 1, lossy (tau 0.95) and lossless
   (verified) MARS                                       (python -m mars.bench.throughput ...)
4. print the table, the wall-clock speed-ups and each stage's time.

Environment knobs: DEMO_LIMIT (samples per quality task, default 24), DEMO_MINUTES (training minutes of
wall clock, default from conf/experiment/demo.yaml), DEMO_STEPS (a step cap inside that budget).
Reruns reuse finished work: training skips, evaluation resumes.
"""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THRESHOLDS = "[1.0,0.95,0.9]"  # certainty forcing makes the masks confident: 0.8 costs far more than it buys
LOSSY_THRESHOLD = "0.95"


def stage(name: str, cmd: list[str]) -> float:
    print(f"\n=== {name}: python {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, *cmd], cwd=REPO, check=True)
    seconds = time.perf_counter() - start
    print(f"=== {name} took {seconds / 60:.1f} min", flush=True)
    return seconds


def speedups(path: Path) -> list[str]:
    rows = list(csv.DictReader(path.open()))
    out = []
    for r in rows:
        if r["decoder"] in ("mars-cursor", "mars-verify"):
            what = "lossless (verified)" if r["decoder"] == "mars-verify" else f"tau {r['threshold']}"
            out.append(
                f"  MARS {what}, batch {r['batch']}: {float(r['tokens_per_s']):.1f} tokens/s = "
                f"{float(r['speedup']):.2f}x the fastest AR decoder ({r['ar_baseline']}), "
                f"{float(r['row_tokens_per_forward']):.2f} tokens per forward, outputs equal to AR: {r['same_as_ar']}"
            )
    return out


def main() -> None:
    limit = os.environ.get("DEMO_LIMIT", "24")
    train_cmd = ["train.py", "experiment=demo"]
    if os.environ.get("DEMO_MINUTES"):
        train_cmd.append(f"budget.minutes={os.environ['DEMO_MINUTES']}")
    if os.environ.get("DEMO_STEPS"):
        train_cmd.append(f"trainer.max_steps={os.environ['DEMO_STEPS']}")
    ckpt = REPO / "outputs" / "train" / "demo-smollm2-135m-gated-b4" / "hf"
    out = REPO / "outputs" / "eval" / "demo"
    times = {"train": stage("train", train_cmd)}
    times["evaluate"] = stage(
        "evaluate",
        [
            "evaluate.py",
            f"checkpoint={ckpt}",
            f"thresholds={THRESHOLDS}",
            f"limit={limit}",
            "benchmarks=quality",
            f"output_dir={out}",
            "run_name=demo",
        ],
    )
    times["wall clock"] = stage(
        "wall clock",
        [
            "-m",
            "mars.bench.throughput",
            "--checkpoint",
            str(ckpt),
            "--thresholds",
            LOSSY_THRESHOLD,
            "--batch-sizes",
            "1",
            "--repeats",
            "3",
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "64",
            "--caches",
            "cursor",
            "--verify",
            "--prompts-file",
            "data/prompts/heldout.jsonl",
            "--out",
            str(out / "throughput"),
        ],
    )
    print("\n" + (out / "table.md").read_text())
    print("=== wall clock at batch 1, same checkpoint, same prompts (median of 3):")
    print("\n".join(speedups(out / "throughput" / "throughput.csv")))
    print("\n=== wall time per stage: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()))
    print(f"checkpoint:  {ckpt}")
    print(f"results:     {out}  (table.md, points.csv, samples/, throughput/)")
    print(f"Pareto plot: {out / 'pareto_average.png'}  (one per task beside it)")


if __name__ == "__main__":
    main()
