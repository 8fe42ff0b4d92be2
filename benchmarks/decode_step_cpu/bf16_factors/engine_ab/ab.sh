#!/bin/bash
# A/B: LoRA factors streamed as fp32 (MARS_BF16_FACTORS=0) vs as bf16 (default), alternating processes
cd /work/main
export GOMP_SPINCOUNT=3000
for round in 1 2; do
  for side in fp32 bf16; do
    if [ $side = fp32 ]; then export MARS_BF16_FACTORS=0; else unset MARS_BF16_FACTORS; fi
    .venv/bin/python scripts/verify_step_breakdown.py --model /work/runs/ref40/train/hf --prompts 8 --max-new-tokens 64 --repeats 3 --threads 2 --trace-prompts 0 --decoders verify --adapter-ranks 8 --out /work/runs/s17/ab_${side}_$round > /work/runs/s17/ab_${side}_$round.log 2>&1
  done
done
