#!/usr/bin/env python
"""Verify below threshold 1.0 with the masks after the drafts (chain_drafts=always) or without (never), against
AR in the same engine; decoders interleaved per repeat, the first repeat dropped, medians printed.

    python benchmarks/decode_step_cpu/chain_drafts/lossy_verify/lossy_verify_ab.py <checkpoint>/hf
"""

import json
import statistics
import sys
import time

from mars.threads import apply_process_defaults, configure_threads

apply_process_defaults()  # the OpenMP wait, before torch loads libgomp

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.models import load_model  # noqa: E402

configure_threads("auto")
lm = load_model(sys.argv[1], dtype=torch.float32)
model, tok = lm.model.eval(), lm.tokenizer
lines = open("data/prompts/heldout.jsonl").read().splitlines()
prompts = [json.loads(line)["prompt"] for line in lines[:8]]
verify = dict(decoder="mars", cache="cursor", verify=True, threshold=0.9)
decoders = {
    "ar": dict(decoder="mars", cache="cursor", threshold=1.0),
    "vtau0.9-always": {**verify, "chain_drafts": "always"},
    "vtau0.9-never": {**verify, "chain_drafts": "never"},
}
speeds = {name: [] for name in decoders}
last = {}
with torch.inference_mode():
    for repeat in range(6):
        for name, kwargs in decoders.items():
            start, tokens, forwards, outputs = time.perf_counter(), 0, 0, []
            for prompt in prompts:
                r = generate(model, tok, [prompt], max_new_tokens=64, chat_template=True, **kwargs)
                tokens, forwards = tokens + r.stats.generated_tokens, forwards + r.stats.forwards
                outputs.append(r.token_ids[0])
            if repeat:
                speeds[name].append(tokens / (time.perf_counter() - start))
            last[name] = (tokens, forwards, outputs)
ar = statistics.median(speeds["ar"])
for name, (tokens, forwards, outputs) in last.items():
    same = sum(a == b for a, b in zip(outputs, last["ar"][2]))
    m = statistics.median(speeds[name])
    print(f"{name:16s} {m:6.1f} tok/s {m / ar:.3f}x tok/fwd {tokens / forwards:.3f} same-as-AR {same}/{len(outputs)}")
