#!/bin/bash
# A/B: HEAD 6ae886a (rotary through six ATen ops per tensor) vs working tree (fused rope and RMSNorm), alternating processes
cd /work/main
export GOMP_SPINCOUNT=3000
for round in 1 2 3; do
  for side in head new; do
    if [ $side = head ]; then export PYTHONPATH=/tmp/headsrc/src; else unset PYTHONPATH; fi
    .venv/bin/python -m mars.evaluation.step_cost --batch-sizes 1,8 --columns 1,3,4 --paths fast --repeats 21 --threads 2 --out /work/runs/s16/fuse_${side}_$round > /work/runs/s16/fuse_${side}_$round.log 2>&1
  done
done
