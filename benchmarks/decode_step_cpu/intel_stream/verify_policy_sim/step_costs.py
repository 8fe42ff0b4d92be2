"""The step costs `simulate.py` and `bound.py` price policies with: AR (the engine at threshold 1.0) and lossless
verify decode the 16 held-out prompts in one process, interleaved prompt by prompt (the order alternating), for
several rounds. Per round and decoder: the engine's seconds (``stats.seconds``, what the throughput command times),
split into the prefills' forwards, the decode steps' forwards (`ModelRunner.logits_at`) by their number of columns
and whether masks were fed (the adapter live), mean and median, and the rest (the engine outside the forward, per
step); then verify's speed-up over AR, its ratio to verify's tokens per forward (issue 17's figure), and that ratio
without the prefills and on the decode forwards alone:

    python benchmarks/decode_step_cpu/intel_stream/verify_policy_sim/step_costs.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 [rounds]
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

DECODERS = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}
PREFILL_FROM = 10  # a forward of at least this many columns is a prompt's prefill


def main(checkpoint: str, rounds: int = 3) -> None:
    configure_threads("auto")
    lm = load_model(checkpoint, dtype=torch.float32)
    mask_id = lm.model.mars_gate.mask_token_id
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:16]
    logits_at = ModelRunner.logits_at
    forwards = collections.defaultdict(list)  # the decoder being timed: (columns, masks fed) -> seconds

    def timed(self, ids, *args, **kwargs):
        start = time.perf_counter()
        out = logits_at(self, ids, *args, **kwargs)
        forwards[ids.shape[1], bool((ids == mask_id).any())].append(time.perf_counter() - start)
        return out

    ModelRunner.logits_at = timed
    for kwargs in DECODERS.values():
        generate(lm.model, lm.tokenizer, prompts[:1], max_new_tokens=8, chat_template=True, **kwargs)
    for r in range(rounds):
        runs = {name: dict(seconds=0.0, tokens=0, forwards=0, steps=collections.defaultdict(list)) for name in DECODERS}
        for i, prompt in enumerate(prompts):
            for name in list(DECODERS)[:: 1 if (i + r) % 2 == 0 else -1]:
                forwards = runs[name]["steps"]
                out = generate(
                    lm.model, lm.tokenizer, [prompt], max_new_tokens=64, chat_template=True, **DECODERS[name]
                )
                runs[name]["seconds"] += out.stats.seconds
                runs[name]["tokens"] += out.stats.generated_tokens
                runs[name]["forwards"] += out.stats.forwards
        for name, run in runs.items():
            steps = {key: v for key, v in run["steps"].items() if key[0] < PREFILL_FROM}
            run["prefill"] = sum(sum(v) for key, v in run["steps"].items() if key[0] >= PREFILL_FROM)
            run["decode"] = sum(sum(v) for v in steps.values())
            run["count"] = sum(len(v) for v in steps.values())
            rest = (run["seconds"] - run["prefill"] - run["decode"]) / run["count"]
            widths = ", ".join(
                f"{c} col{' + masks' if masked else ''}: {len(v)} x {statistics.mean(v) * 1e3:.2f} ms "
                f"(median {statistics.median(v) * 1e3:.2f})"
                for (c, masked), v in sorted(steps.items())
            )
            print(
                f"round {r} {name}: {run['seconds']:.2f} s, prefills {run['prefill'] * 1e3:.0f} ms, "
                f"{run['count']} steps ({widths}), engine {rest * 1e3:.2f} ms per step",
                flush=True,
            )
        ar, verify = runs["ar"], runs["verify"]
        per_forward = verify["tokens"] / verify["forwards"]
        speedup = ar["seconds"] / verify["seconds"]
        no_prefill = (ar["seconds"] - ar["prefill"]) / (verify["seconds"] - verify["prefill"])
        decode_per_forward = (verify["tokens"] - len(prompts)) / verify["count"]  # a prefill emits one token
        step_ratio = (ar["decode"] / ar["count"]) / (verify["decode"] / verify["count"])
        print(
            f"round {r}: verify {speedup:.4f}x AR at {per_forward:.4f} tokens per forward, ratio "
            f"{speedup / per_forward:.4f}; without the prefills {no_prefill / decode_per_forward:.4f}; AR's mean "
            f"decode forward over verify's {step_ratio:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
