"""AR and lossless verify on 8 held-out prompts x 64 tokens in one process with the kernels as built from the
working tree: the seconds of each, their prefills, the median forward of a decode step and the engine's time per
step.  A/B a C++ change by swapping the source between processes (each source builds once into its own cache):

    for i in 1 2 3; do for v in new old; do cp $v.cpp src/mars/kernels/decoder_step.cpp
        python benchmarks/decode_step_cpu/intel_stream/rms_norm_ab/decode_ab.py $v; done; done
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

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

CHECKPOINT = "benchmarks/reproduce_smollm2-135m-amx/adapter_rank8"


def main(label: str) -> None:
    configure_threads("auto")
    lm = load_model(CHECKPOINT, dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:8]
    forwards: list[tuple[int, float]] = []
    logits_at = ModelRunner.logits_at

    def timed(self, ids, *args, **kwargs):
        start = time.perf_counter()
        out = logits_at(self, ids, *args, **kwargs)
        forwards.append((ids.shape[1], time.perf_counter() - start))
        return out

    ModelRunner.logits_at = timed
    decoders = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}
    for kw in decoders.values():
        generate(lm.model, lm.tokenizer, prompts[:1], max_new_tokens=8, chat_template=True, **kw)
    parts = []
    for name, kw in decoders.items():
        forwards.clear()
        start = time.perf_counter()
        for p in prompts:
            generate(lm.model, lm.tokenizer, [p], max_new_tokens=64, chat_template=True, **kw)
        total = time.perf_counter() - start
        steps = [s for width, s in forwards if width < 10]
        prefill = sum(s for width, s in forwards if width >= 10)
        rest = (total - prefill - sum(steps)) / len(steps)
        parts.append(
            f"{name} total {total:.2f} prefill {prefill:.2f} fwd-med {statistics.median(steps) * 1e3:.2f} "
            f"rest/step {rest * 1e3:.2f}"
        )
    print(label, " | ".join(parts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
