"""Fingerprints (md5 prefixes) of what a process's first decode step computes before its first layer: the
embedding, the rotary embedding's cos and sin (from a call made just before the step's own), the position ids and
mask, and layer 0's query, key, value and attention output (the Python layer loop: run with MARS_DECODER_STEP=0).
Run it in many fresh processes and count the distinct lines:

    for i in $(seq 30); do MARS_DECODER_STEP=0 python benchmarks/decode_step_cpu/emerald_rapids/first_call/first_ops.py; done | sort | uniq -c
"""

import hashlib
import json

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding import lean as leanmod  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

configure_threads("auto")
lm = load_model("benchmarks/reproduce_smollm2-135m-amx/adapter_rank8", dtype=torch.float32)
p = json.loads(open("data/prompts/heldout.jsonl").readline())["prompt"]
rec = {}


def h(t):
    return hashlib.md5(t.contiguous().numpy().tobytes()).hexdigest()[:6]


orig_call = leanmod.LeanDecoder.__call__


def call(self, input_ids, position_ids, attention_mask, cache=None):
    if "cos" not in rec:
        x = self._embed(input_ids)
        cos, sin = self.rotary(x, position_ids)
        rec["emb"], rec["cos"], rec["sin"], rec["pos"], rec["mask"] = (
            h(x),
            h(cos),
            h(sin),
            h(position_ids),
            h(attention_mask.float()),
        )
    return orig_call(self, input_ids, position_ids, attention_mask, cache)


leanmod.LeanDecoder.__call__ = call
orig_att = leanmod.attention


def att(q, k, v, m, s):
    o = orig_att(q, k, v, m, s)
    if "q" not in rec:
        rec["q"], rec["k"], rec["v"], rec["att"] = h(q), h(k), h(v), h(o)
    return o


leanmod.attention = att
generate(lm.model, lm.tokenizer, [p], max_new_tokens=1, chat_template=True, threshold=1.0)
print(" ".join(f"{k}={v}" for k, v in rec.items()))
