"""One process's first `generate` call against a reference: the first held-out prompt's AR prefill logits (the
prompt's last column) on the AMX reference, compared bit for bit with a file of them (written by the first run),
then the same call twice more in the same process.  Run it in many fresh processes to see how often the first call
differs (see README.md):

    for i in $(seq 30); do python benchmarks/decode_step_cpu/emerald_rapids/first_call/first_call.py ref.pt; done

WARM=1: the process computes a cos and a sin on a 49 x 64 tensor before loading the model (the twenty-ninth
session's A/B, run at d133d00, before the decoders made that call themselves).
"""

import json
import os
import sys

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

configure_threads("auto")
if os.environ.get("WARM") == "1":  # a cos and a sin first (as mars.decoding.forward.warm_vector_math now does)
    torch.cos(torch.arange(3136, dtype=torch.float32).view(49, 64) * 0.01)
    torch.sin(torch.arange(3136, dtype=torch.float32).view(49, 64) * 0.01)
lm = load_model("benchmarks/reproduce_smollm2-135m-amx/adapter_rank8", dtype=torch.float32)
prompt = json.loads(open("data/prompts/heldout.jsonl").readline())["prompt"]
first: list[torch.Tensor] = []
logits_at = ModelRunner.logits_at


def spy(self, input_ids, *args, **kwargs):
    out = logits_at(self, input_ids, *args, **kwargs)
    if not first:  # the prefill: its first read column is the prompt's last
        first.append(out[0, 0].clone())
    return out


ModelRunner.logits_at = spy
path = sys.argv[1]
calls = []
for _ in range(3):
    first.clear()
    generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=8, chat_template=True, threshold=1.0)
    calls.append(first[0])
if not os.path.exists(path):
    torch.save(calls[0], path)
reference = torch.load(path)
print(" ".join("same" if torch.equal(c, reference) else f"differs({(c - reference).abs().max():.3e})" for c in calls))
