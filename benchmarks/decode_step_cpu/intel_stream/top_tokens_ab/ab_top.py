"""The greedy choice in one kernel pass (mars::top_tokens) against the ATen ops, in one process: for each prompt,
AR (the engine at threshold 1.0) and lossless verify each with MARS_TOP_TOKENS=0 and =1, the order rotating per
prompt and round so that the host's drift falls on all four alike. Prints each round's wall clock, the engine's
time per step outside the forward, verify's speed-up over AR per round, and whether all four decoded the same:

    python benchmarks/decode_step_cpu/intel_stream/top_tokens_ab/ab_top.py 16 3   # prompts, rounds
"""

import collections
import json
import os
import statistics
import sys
import time

import torch

import mars.decoding.api as api
from mars.decoding.engine import DecodeEngine
from mars.evaluation.throughput import VERIFIED
from mars.models import load_model
from mars.threads import apply_process_defaults, configure_threads

apply_process_defaults()
configure_threads("auto")
PROMPTS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
MODES = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}
COMBOS = [(mode, switch) for mode in MODES for switch in ("0", "1")]

lm = load_model("benchmarks/reproduce_smollm2-135m-amx/adapter_rank8", dtype=torch.float32)
prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:PROMPTS]

# time per step, and in the forward, summed over one generate
clock = {"step": 0.0, "forward": 0.0, "steps": 0}
step_rows, forward = DecodeEngine._step_rows, DecodeEngine._forward


def timed_step(self):
    t = time.perf_counter()
    out = step_rows(self)
    clock["step"] += time.perf_counter() - t
    clock["steps"] += 1
    return out


def timed_forward(self, plan):
    t = time.perf_counter()
    out = forward(self, plan)
    clock["forward"] += time.perf_counter() - t
    return out


DecodeEngine._step_rows, DecodeEngine._forward = timed_step, timed_forward


def run(mode: str, switch: str, prompt: str, new_tokens: int = 64):
    os.environ["MARS_TOP_TOKENS"] = switch
    return api.generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=new_tokens, chat_template=True, **MODES[mode])


for mode, switch in COMBOS:  # warm-up (and the kernel built)
    run(mode, switch, prompts[0], 8)
outside = collections.defaultdict(float)
steps = collections.Counter()
tokens = collections.defaultdict(list)
rounds = collections.defaultdict(list)
for r in range(ROUNDS):
    wall = collections.defaultdict(float)
    for i, prompt in enumerate(prompts):
        shift = (i + r) % len(COMBOS)
        for combo in COMBOS[shift:] + COMBOS[:shift]:
            clock.update(step=0.0, forward=0.0, steps=0)
            t = time.perf_counter()
            out = run(*combo, prompt)
            wall[combo] += time.perf_counter() - t
            outside[combo] += clock["step"] - clock["forward"]
            steps[combo] += clock["steps"]
            if r == 0:
                tokens[combo].append(out.token_ids)
    for combo, seconds in wall.items():
        rounds[combo].append(seconds)
    print(f"round {r}: " + "  ".join(f"{m}/{s} {wall[(m, s)]:.2f}s" for m, s in COMBOS), flush=True)
for combo in COMBOS:
    mode, switch = combo
    print(
        f"{mode} MARS_TOP_TOKENS={switch}: wall median {statistics.median(rounds[combo]):.3f} s; engine outside the "
        f"forward {outside[combo] / steps[combo] * 1e3:.3f} ms/step over {steps[combo]} steps"
    )
for switch in ("0", "1"):
    ratios = [a / v for a, v in zip(rounds[("ar", switch)], rounds[("verify", switch)])]
    print(
        f"MARS_TOP_TOKENS={switch}: verify vs AR per round {[round(x, 4) for x in ratios]}, median {statistics.median(ratios):.4f}"
    )
print("same tokens:", all(tokens[c] == tokens[COMBOS[0]] for c in COMBOS))
