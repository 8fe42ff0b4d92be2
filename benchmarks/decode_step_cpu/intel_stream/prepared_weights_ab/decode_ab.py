"""AR and lossless verify on the held-out prompts with the C++ decoder step of an older revision and with the
working tree's, all four in one process, interleaved per prompt in a rotating order, several rounds:

    python benchmarks/decode_step_cpu/intel_stream/prepared_weights_ab/decode_ab.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 --old HEAD~3 --prompts 16 --rounds 3

The old kernels are built as in prepared_ab.py; only the decoder step (and the kernels it calls) differs between
the runs.  Prints each round's wall clock, then medians: verify's speed-up over AR with each build and that over
verify's tokens per forward (issue 17's ratio), and whether all four decoded the same tokens.
"""

import argparse
import json
import statistics
import time

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402
from prepared_ab import ROOT, old_step_class  # noqa: E402

import mars.kernels as kernels  # noqa: E402
from mars.decoding import generate  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

DECODERS = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--old", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    configure_threads("auto")
    classes = {"old": old_step_class(args.old), "new": kernels.decoder_step_class()}
    lm = load_model(args.checkpoint, dtype=torch.float32)
    lines = open(ROOT / "data/prompts/heldout.jsonl").read().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: args.prompts]
    jobs = [(b, d) for b in classes for d in DECODERS]

    def run(job, prompt, tokens=64):
        kernels.decoder_step_class = lambda: classes[job[0]]
        start = time.perf_counter()
        out = generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=tokens, chat_template=True, **DECODERS[job[1]])
        return time.perf_counter() - start, out.token_ids[0], out.stats.forwards

    for job in jobs:
        run(job, prompts[0], 8)
    rounds = []
    for r in range(args.rounds):
        wall = {job: 0.0 for job in jobs}
        ids = {job: [] for job in jobs}
        forwards = {job: 0 for job in jobs}
        for i, prompt in enumerate(prompts):
            for job in jobs[i % len(jobs) :] + jobs[: i % len(jobs)]:
                seconds, tokens, fwd = run(job, prompt)
                wall[job] += seconds
                ids[job].append(tokens)
                forwards[job] += fwd
        same = all(ids[job] == ids["new", "ar"] for job in jobs)
        tokens = sum(len(t) for t in ids["new", "ar"])
        tpf = tokens / forwards["new", "verify"]
        speedup = {b: wall[b, "ar"] / wall[b, "verify"] for b in classes}
        rounds.append((wall, speedup, tpf))
        walls = ", ".join(f"{b}/{d} {wall[b, d]:.2f} s" for b, d in jobs)
        ups = ", ".join(f"{b} {speedup[b]:.4f}x ({speedup[b] / tpf:.4f})" for b in classes)
        print(f"round {r}: {walls}; verify over AR: {ups}; {tpf:.4f} tok/fwd; same tokens: {same}", flush=True)
    print(f"old = {args.old}, new = working tree; {args.prompts} prompts x 64 tokens, medians of {args.rounds} rounds")
    print("| build | AR wall (s) | verify wall (s) | verify over AR | / tokens per forward |")
    print("|---|---|---|---|---|")
    for b in classes:
        a = statistics.median(w[b, "ar"] for w, _, _ in rounds)
        v = statistics.median(w[b, "verify"] for w, _, _ in rounds)
        s = statistics.median(u[b] for _, u, _ in rounds)
        print(f"| {b} | {a:.2f} | {v:.2f} | {s:.4f}x | {s / rounds[0][2]:.4f} |")


if __name__ == "__main__":
    main()
