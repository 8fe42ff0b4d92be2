"""Time to first token of AR (the engine at threshold 1.0), lossless verify and MARS with its masks kept
(`full_window`), in one process: the 16 held-out prompts, 2 new tokens each, the three in a rotating order, several
rounds; per decoder the mean and median TTFT (`DecodeStats.first_token_seconds`), the prefill forward's share of it
(`ModelRunner.logits_at`'s first call) and the rest:

    python benchmarks/decode_step_cpu/emerald_rapids/ttft.py benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 [rounds]
"""

import json
import statistics
import sys
import time

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

DECODERS = {
    "ar": dict(decoder="mars", cache="cursor", threshold=1.0),
    "verify": VERIFIED,
    "masks": dict(decoder="mars", cache="cursor", threshold=1.0, full_window=True),
}


def main(checkpoint: str, rounds: int = 5) -> None:
    configure_threads("auto")
    lm = load_model(checkpoint, dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:16]
    logits_at, forwards = ModelRunner.logits_at, []

    def timed(self, ids, *args, **kwargs):
        start = time.perf_counter()
        out = logits_at(self, ids, *args, **kwargs)
        forwards.append(time.perf_counter() - start)
        return out

    ModelRunner.logits_at = timed
    for kwargs in DECODERS.values():
        generate(lm.model, lm.tokenizer, prompts[:2], max_new_tokens=4, chat_template=True, **kwargs)
    ttft = {name: [] for name in DECODERS}
    prefill = {name: [] for name in DECODERS}
    names = list(DECODERS)
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            turn = (i + r) % len(names)
            for name in names[turn:] + names[:turn]:
                forwards.clear()
                out = generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=2, chat_template=True, **DECODERS[name])
                ttft[name].append(out.stats.first_token_seconds)
                prefill[name].append(forwards[0])
    for name in names:
        rest = statistics.mean(a - b for a, b in zip(ttft[name], prefill[name]))
        print(
            f"{name}: TTFT mean {statistics.mean(ttft[name]) * 1e3:.1f} ms (median {statistics.median(ttft[name]) * 1e3:.1f}), "
            f"prefill forward mean {statistics.mean(prefill[name]) * 1e3:.1f}, the rest {rest * 1e3:.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
