"""Whether AR's prefill and lossless verify's (the prompt and its first two masks) give the prompt's last column
the same logits, bit for bit, on the first N held-out prompts (chat template) of a checkpoint.

    python benchmarks/decode_step_cpu/emerald_rapids/exact_prefill/prefill_bits.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 [N]
"""

import json
import sys

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

configure_threads("auto")
lm = load_model(sys.argv[1], dtype=torch.float32)
count = int(sys.argv[2]) if len(sys.argv) > 2 else 40
prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:count]
first: list[tuple[int, torch.Tensor]] = []
logits_at = ModelRunner.logits_at


def spy(self, input_ids, *args, **kwargs):
    out = logits_at(self, input_ids, *args, **kwargs)
    if not first:  # the prefill: its first read column is the prompt's last
        first.append((input_ids.shape[1], out[0, 0].clone()))
    return out


ModelRunner.logits_at = spy
same = 0
for prompt in prompts:
    got = []
    for kwargs in ({"decoder": "mars", "cache": "cursor", "threshold": 1.0}, VERIFIED):
        first.clear()
        generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=8, chat_template=True, **kwargs)
        got.append(first[0])
    (ar_width, ar), (verify_width, verify) = got
    if torch.equal(ar, verify):
        same += 1
    else:
        print(
            f"prompt of {ar_width} tokens (verify's prefill {verify_width} columns): largest difference "
            f"{(ar - verify).abs().max().item():.2e}"
        )
print(f"{same}/{len(prompts)} prompts: AR's and verify's prefill give the prompt's last column the same bits")
