"""Score every decoding step of the greedy answers to held-out prompts [n0, n1) with a checkpoint's masks
(mars.evaluation.reliability's scoring) and keep the per-step arrays for compare_rules.py.

    python benchmarks/acceptance_rules/score_steps.py <checkpoint>/hf 0 200 steps.npz
"""

import sys
import time

import numpy as np
import torch

from mars.evaluation.probe import read_prompts
from mars.evaluation.reliability import score_checkpoint

checkpoint, n0, n1, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
prompts = read_prompts("data/prompts/heldout.jsonl", n1)[n0:n1]
t = time.time()
steps, block = score_checkpoint(checkpoint, prompts, 96, 8, None)
np.savez(
    out, confidence=steps.confidence, correct=steps.correct, valid=steps.valid, prompt=steps.prompt, start=steps.start
)
print("steps", len(steps.prompt), "seconds", round(time.time() - t), flush=True)
