"""The step costs `simulate.py` and `bound.py` price policies with: AR (the engine at threshold 1.0) and lossless
verify decode the 16 held-out prompts alternately in one process, 2 rounds; per step, the forward's time
(`ModelRunner.logits_at`) by its number of columns and whether masks were fed (the adapter live), medians, and the
engine's time per step outside the forward; the prefills' total:

    python benchmarks/decode_step_cpu/intel_stream/verify_policy_sim/step_costs.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8
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


def main(checkpoint: str, rounds: int = 2) -> None:
    configure_threads("auto")
    lm = load_model(checkpoint, dtype=torch.float32)
    mask_id = lm.model.mars_gate.mask_token_id
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:16]
    forwards = collections.defaultdict(list)
    logits_at = ModelRunner.logits_at

    def timed(self, ids, *args, **kwargs):
        start = time.perf_counter()
        out = logits_at(self, ids, *args, **kwargs)
        forwards[ids.shape[1], bool((ids == mask_id).any())].append(time.perf_counter() - start)
        return out

    ModelRunner.logits_at = timed
    for kwargs in DECODERS.values():
        generate(lm.model, lm.tokenizer, prompts[:1], max_new_tokens=8, chat_template=True, **kwargs)
    for _ in range(rounds):
        for name, kwargs in DECODERS.items():
            forwards.clear()
            start = time.perf_counter()
            for prompt in prompts:
                generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=64, chat_template=True, **kwargs)
            total = time.perf_counter() - start
            steps = {key: v for key, v in forwards.items() if key[0] < PREFILL_FROM}
            prefill = sum(sum(v) for key, v in forwards.items() if key[0] >= PREFILL_FROM)
            count = sum(len(v) for v in steps.values())
            rest = (total - prefill - sum(sum(v) for v in steps.values())) / count
            widths = ", ".join(
                f"{c} col{' + masks' if masked else ''}: {len(v)} x {statistics.median(v) * 1e3:.2f} ms"
                for (c, masked), v in sorted(steps.items())
            )
            print(
                f"{name}: total {total:.2f} s, prefills {prefill * 1e3:.0f} ms, {count} steps ({widths}), "
                f"engine {rest * 1e3:.2f} ms per step",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1])
