#!/bin/bash
cd /work/main
export GOMP_SPINCOUNT=3000
m=/work/runs/ref40/train/hf
for round in 1 2 3; do
  PYTHONPATH=/tmp/oldsrc/src .venv/bin/python -m mars.evaluation.step_cost --model $m --columns 1,2,4 --batch-sizes 1 --paths fast --threads 2 --repeats 25 --out /work/runs/lora_ab/old_$round > /work/runs/lora_ab/old_$round.log 2>&1
  .venv/bin/python -m mars.evaluation.step_cost --model $m --columns 1,2,4 --batch-sizes 1 --paths fast --threads 2 --repeats 25 --out /work/runs/lora_ab/new_$round > /work/runs/lora_ab/new_$round.log 2>&1
done
echo ALLDONE
