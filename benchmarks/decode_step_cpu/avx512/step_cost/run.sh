#!/bin/bash
# alternate processes: old (HEAD before this change), new AVX2, new AVX-512; gated checkpoint and bare model
cd /work/main
export GOMP_SPINCOUNT=3000
for round in 1 2; do
  for model in /work/runs/ref40/train/hf embedded:smollm2-135m; do
    tag=$( [ "$model" = embedded:smollm2-135m ] && echo bare || echo gated )
    PYTHONPATH=/tmp/oldsrc/src .venv/bin/python -m mars.evaluation.step_cost --model $model --columns 1,2,4,7 --batch-sizes 1 --paths fast --threads 2 --repeats 9 --out /work/runs/sc_ab/old_${tag}_$round > /work/runs/sc_ab/old_${tag}_$round.log 2>&1
    MARS_KERNEL_ISA=avx2 .venv/bin/python -m mars.evaluation.step_cost --model $model --columns 1,2,4,7 --batch-sizes 1 --paths fast --threads 2 --repeats 9 --out /work/runs/sc_ab/avx2_${tag}_$round > /work/runs/sc_ab/avx2_${tag}_$round.log 2>&1
    .venv/bin/python -m mars.evaluation.step_cost --model $model --columns 1,2,4,7 --batch-sizes 1 --paths fast --threads 2 --repeats 9 --out /work/runs/sc_ab/avx512_${tag}_$round > /work/runs/sc_ab/avx512_${tag}_$round.log 2>&1
  done
done
echo ALLDONE
