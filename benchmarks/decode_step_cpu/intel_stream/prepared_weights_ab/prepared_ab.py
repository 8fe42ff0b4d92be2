"""The C++ decoder step of an older revision against the working tree's, in one process: one lossless-verify mask
step ([token, 2 masks] on a real KV cache) and one AR step (1 column) captured from a held-out prompt, replayed
through both builds, the mask step with its mask rows (the gated adapter live) and without (a 3-column step without
it), the six runs in a rotating order:

    python benchmarks/decode_step_cpu/intel_stream/prepared_weights_ab/prepared_ab.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 --old HEAD~1 --rounds 150

The old kernels' sources are read from git at `--old`, built under the operator namespace `ab_old` and given the
same constructor arguments as the working tree's step.  Both must return the same bits (checked).  Prints the medians
(ms) of the native step alone (the decoder layers: no embedding, no LM head).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

import mars.kernels as kernels  # noqa: E402
from mars.decoding import generate  # noqa: E402
from mars.decoding.lean import LeanDecoder  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
MASK_ROWS = 7  # DecoderStep.step's arguments after x: cos, sin, mask, keys, values, start, kv_length, mask_rows, ...


def old_step_class(rev: str):
    """`DecoderStep` as the kernels' sources were at `rev`, built under the namespace ab_old."""
    kernels.load_revision(rev)
    return torch.classes.ab_old.DecoderStep


def capture(lm):
    """The working tree's step, its constructor arguments, and the arguments of the first 3-column mask step of
    lossless verify and of the first decode step of AR."""
    made, steps = {}, {}
    step_class = kernels.decoder_step_class

    def recording_class():
        cls = step_class()

        def make(*args):
            made.setdefault("args", args)
            return cls(*args)

        return make

    class Recorded:
        def __init__(self, inner):
            self.inner = inner

        def step(self, x, *args):
            key = "mask" if x.shape[1] == 3 and args[MASK_ROWS] is not None else "ar" if x.shape[1] == 1 else None
            if key is not None and key not in steps:
                steps[key] = (x.clone(), *args)
                steps.setdefault("native", self.inner)
            return self.inner.step(x, *args)

    native_step = LeanDecoder._native_step
    kernels.decoder_step_class = recording_class
    LeanDecoder._native_step = lambda self: (lambda n: None if n is None else Recorded(n))(native_step(self))
    try:
        prompt = json.loads(open(ROOT / "data/prompts/heldout.jsonl").readline())["prompt"]
        generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=24, chat_template=True, **VERIFIED)
        generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=4, chat_template=True, threshold=1.0)
    finally:
        kernels.decoder_step_class, LeanDecoder._native_step = step_class, native_step
    return steps["native"], made["args"], steps["mask"], steps["ar"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--old", required=True, help="git revision of the kernels to compare with")
    p.add_argument("--rounds", type=int, default=150)
    args = p.parse_args()
    configure_threads("auto")
    old_class = old_step_class(args.old)
    lm = load_model(args.checkpoint, dtype=torch.float32)
    new, constructor, (x, *rest), (x1, *rest1) = capture(lm)
    steps = {"old": old_class(*constructor), "new": new}
    inputs = {
        "adapter": (x, rest),
        "none": (x, [*rest[:MASK_ROWS], None, *rest[MASK_ROWS + 1 :]]),
        "ar": (x1, rest1),
    }
    jobs = [(b, m) for b in steps for m in inputs]
    with torch.inference_mode():
        outs = {job: steps[job[0]].step(inputs[job[1]][0], *inputs[job[1]][1]).clone() for job in jobs}
        assert all(torch.equal(outs["old", m], outs["new", m]) for m in inputs), "the builds disagree"
        times = {job: [] for job in jobs}
        for i in range(args.rounds):
            for job in jobs[i % len(jobs) :] + jobs[: i % len(jobs)]:
                step_x, step_args = inputs[job[1]]
                start = time.perf_counter()
                steps[job[0]].step(step_x, *step_args)
                times[job].append(time.perf_counter() - start)
    ms = {job: statistics.median(v) * 1e3 for job, v in times.items()}
    print(f"old = {args.old}, new = working tree; {args.rounds} rounds, {torch.get_num_threads()} threads; same bits")
    print("| build | AR step, 1 column | verify mask step, 3 columns | the same without the adapter | adapter's cost |")
    print("|---|---|---|---|---|")
    for b in steps:
        print(
            f"| {b} | {ms[b, 'ar']:.3f} | {ms[b, 'adapter']:.3f} | {ms[b, 'none']:.3f} | "
            f"{ms[b, 'adapter'] - ms[b, 'none']:.3f} |"
        )


if __name__ == "__main__":
    main()
