#!/bin/bash
# Does depth weighting's lossless gain (search: verify 1.35 vs certainty's 1.31 at 20 CPU-min) hold at 40
# CPU-minutes? Compare with benchmarks/reproduce_smollm2-135m/previous_gated_40min (certainty 0.5: verify 1.45
# [1.42, 1.48] at draft threshold 0, 30 samples per task).
set -e
cd /work/main
export OMP_WAIT_POLICY=PASSIVE
R=/work/runs/repro60/outputs/reproduce/smollm2-135m
O=/work/runs/depth40
.venv/bin/python train.py experiment=reproduce objective.certainty_weight=0.0 objective.depth_weighting=reach \
  budget.minutes=40 'budget.snapshots=[20]' run_name=depth40 output_dir=$O/train
.venv/bin/python evaluate.py checkpoint=$O/train/hf benchmarks=quality dtype=float32 output_dir=$O/eval-verify \
  limit=30 decoding=mars_verified decoding.draft_threshold=0.0 threshold=1.0 reference=false compare=[$R/eval-base]
.venv/bin/python evaluate.py checkpoint=$O/train/hf benchmarks=quality dtype=float32 output_dir=$O/eval \
  limit=30 'thresholds=[1.0,0.9]' compare=[$R/eval-base]
