#!/bin/bash
# A/B: old (HEAD 7d228b2, SDPA in decode steps) vs new (mars::decode_attention), alternating processes
cd /work/main
export GOMP_SPINCOUNT=3000
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then export PYTHONPATH=/tmp/oldsrc/src; else unset PYTHONPATH; fi
    .venv/bin/python scripts/verify_step_breakdown.py --model /work/runs/ref40/train/hf --prompts 8 --max-new-tokens 64 --repeats 3 --threads 2 --trace-prompts 0 --decoders verify --adapter-ranks 8 --out /work/runs/s16/ab_${side}_$round > /work/runs/s16/ab_${side}_$round.log 2>&1
  done
done
