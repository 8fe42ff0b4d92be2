#!/usr/bin/env python
"""Where a batch-1 decoding step's CPU time goes: AR (transformers generate + KV cache) vs MARS (cursor cache)
at threshold 1.0 without and with the masks kept (full_window), under torch.profiler.

    python scripts/profile_decode_step.py --threads 2 --tokens 32 > benchmarks/cpu_decode_step_profile.txt
    python scripts/profile_decode_step.py --no-fast-path ...   # the eager matmuls (F.linear), for comparison

Prints per decoder: ms per forward, the share of self CPU time in matrix multiplies (the model's own
arithmetic at batch 1: reading the weights), in attention, and in everything else (dispatch, small ops,
cache bookkeeping, Python), aten calls per forward, and the top ops.
"""

import argparse
import os
import time

from mars.threads import apply_process_defaults, describe_wait_policy

apply_process_defaults()  # the OpenMP wait for this machine's load unless set, before torch loads libgomp

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "mars::small_linear")
VARIANTS = {
    "ar": dict(decoder="ar"),
    "mars tau=1.0": dict(decoder="mars", threshold=1.0, cache="cursor"),
    "mars tau=1.0 full_window": dict(decoder="mars", threshold=1.0, cache="cursor", full_window=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m")
    p.add_argument("--threads", default="auto", help="torch threads (auto: mars.threads' choice, clamped)")
    p.add_argument("--no-fast-path", action="store_true", help="profile the eager matmuls (MARS_FAST_PATH=0)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    configure_threads(args.threads)
    if args.no_fast_path:
        os.environ["MARS_FAST_PATH"] = "0"
    print(
        f"threads {torch.get_num_threads()}, OpenMP wait {describe_wait_policy()}, "
        f"fast path {'off' if args.no_fast_path else 'on'}"
    )
    lm = load_model(args.model)
    model, tok = lm.model.eval(), lm.tokenizer
    prompt = ["Write a short note about the sea and the wind, in two sentences."]
    for name, kw in VARIANTS.items():
        generate(model, tok, prompt, max_new_tokens=8, chat_template=True, **kw)  # warm-up
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            out = generate(model, tok, prompt, max_new_tokens=args.tokens, chat_template=True, **kw)
            wall = time.perf_counter() - start
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
        attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
        calls = sum(e.count for e in events if e.key.startswith("aten::"))
        fwd = out.stats.forwards
        print(
            f"{name}: {fwd} forwards, {wall / fwd * 1e3:.1f} ms/forward (profiled); self CPU time: matmul "
            f"{mm / total:.0%}, attention {attn / total:.0%}, everything else {1 - (mm + attn) / total:.0%}; "
            f"{calls / fwd:.0f} aten calls per forward"
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
