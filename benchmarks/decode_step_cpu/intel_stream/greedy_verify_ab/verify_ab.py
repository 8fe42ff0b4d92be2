"""AR, lossless verify with its draft check in one kernel (``mars::greedy_verify``, the default) and lossless verify
with the engine's tensor ops, in one process, interleaved per prompt in a rotating order, several rounds:

    python benchmarks/decode_step_cpu/intel_stream/greedy_verify_ab/verify_ab.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 --prompts 16 --rounds 3

Prints each round's wall clock, the median time of the engine's verify phase (``DecodeEngine._verify``) per step,
verify's speed-up over AR with each (and over its tokens per forward: issue 17's ratio), and whether all three
decoded the same tokens.
"""

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.engine import DecodeEngine  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
AR = dict(decoder="mars", cache="cursor", threshold=1.0)
JOBS = ("ar", "verify_kernel", "verify_ops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    configure_threads("auto")
    lm = load_model(args.checkpoint, dtype=torch.float32)
    lines = open(ROOT / "data/prompts/heldout.jsonl").read().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: args.prompts]
    kernel, verify = DecodeEngine._greedy_verify, DecodeEngine._verify
    phase = collections.defaultdict(list)

    def run(job, prompt, tokens=64):
        DecodeEngine._greedy_verify = kernel if job != "verify_ops" else (lambda *a: None)

        def timed(self, *a):
            start = time.perf_counter()
            out = verify(self, *a)
            phase[job].append(time.perf_counter() - start)
            return out

        DecodeEngine._verify = timed
        out = generate(
            lm.model,
            lm.tokenizer,
            [prompt],
            max_new_tokens=tokens,
            chat_template=True,
            **(AR if job == "ar" else VERIFIED),
        )
        return out.stats.seconds, out.token_ids[0], out.stats.forwards

    for job in JOBS:
        run(job, prompts[0], 8)
    phase.clear()
    rounds = []
    for r in range(args.rounds):
        wall, ids, forwards = dict.fromkeys(JOBS, 0.0), {j: [] for j in JOBS}, dict.fromkeys(JOBS, 0)
        for i, prompt in enumerate(prompts):
            for job in JOBS[i % 3 :] + JOBS[: i % 3]:
                seconds, tokens, fwd = run(job, prompt)
                wall[job] += seconds
                ids[job].append(tokens)
                forwards[job] += fwd
        same = ids["ar"] == ids["verify_kernel"] == ids["verify_ops"]
        tpf = sum(len(t) for t in ids["ar"]) / forwards["verify_kernel"]
        speedup = {j: wall["ar"] / wall[j] for j in JOBS[1:]}
        rounds.append((wall, speedup, tpf))
        walls = ", ".join(f"{j} {wall[j]:.2f} s" for j in JOBS)
        ups = ", ".join(f"{j} {speedup[j]:.4f}x ({speedup[j] / tpf:.4f})" for j in JOBS[1:])
        print(f"round {r}: {walls}; verify over AR: {ups}; {tpf:.4f} tok/fwd; same tokens: {same}", flush=True)
    print(f"{args.prompts} prompts x 64 tokens, medians of {args.rounds} rounds")
    print(
        "| verify's draft check | verify phase per step (ms) | verify wall (s) | verify over AR | / tokens per forward |"
    )
    print("|---|---|---|---|---|")
    for j in JOBS[1:]:
        v = statistics.median(w[j] for w, _, _ in rounds)
        s = statistics.median(u[j] for _, u, _ in rounds)
        tpf = statistics.median(t for _, _, t in rounds)
        ms = statistics.median(phase[j]) * 1e3
        print(f"| {j.removeprefix('verify_')} | {ms:.3f} | {v:.2f} | {s:.4f}x | {s / tpf:.4f} |")
    print(f"AR wall (s): {statistics.median(w['ar'] for w, _, _ in rounds):.2f}")


if __name__ == "__main__":
    main()
