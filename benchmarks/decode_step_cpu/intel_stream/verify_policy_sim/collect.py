"""What the policy replay (`simulate.py`) needs: for each held-out prompt its greedy text (checked equal to lossless
verify's) and, at every position j, what a step feeding [the token before j, 3 masks] predicts there (the
argmax and its probability at the token's column and at each mask), through the engine's own forward and
KV cache.  About 3 minutes on 2 cores:

    python benchmarks/decode_step_cpu/intel_stream/verify_policy_sim/collect.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 masks.pkl 16
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import json  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from mars.decoding import generate  # noqa: E402
from mars.decoding.api import encode_prompts  # noqa: E402
from mars.decoding.attention import mars_attention  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.decoding.kv import RaggedKVCache  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

MASKS = 3


def mask_step(model, runner: ModelRunner, cache: RaggedKVCache, ids: list[int], start: int):
    """Feed ``ids`` at positions ``start...``; the argmax and its probability at the last 1 + MASKS columns."""
    width = len(ids)
    positions = (start + torch.arange(width)).unsqueeze(0)
    attention = (torch.arange(start + width).view(1, 1, -1) <= positions.unsqueeze(2)).unsqueeze(1)
    cache.prepare_step(positions, start + width)
    read = torch.arange(width - 1 - MASKS, width).unsqueeze(0)
    with mars_attention(model):
        logits = runner.logits_at(torch.tensor([ids]), positions, attention, read, cache)
    top, tokens = torch.softmax(logits[0].float(), -1).max(-1)
    return tokens.tolist(), top.tolist()


def main(checkpoint: str, out: str, count: int) -> None:
    configure_threads("auto")
    lm = load_model(checkpoint, dtype=torch.float32)
    model, tokenizer = lm.model.eval(), lm.tokenizer
    mask = model.mars_gate.mask_token_id
    runner = ModelRunner(model)
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][:count]
    records = []
    with torch.inference_mode():
        for p in prompts:
            ar = generate(
                model,
                tokenizer,
                [p],
                max_new_tokens=64,
                chat_template=True,
                decoder="mars",
                cache="cursor",
                threshold=1.0,
            )
            verified = generate(model, tokenizer, [p], max_new_tokens=64, chat_template=True, **VERIFIED)
            text = list(ar.token_ids[0])
            assert list(verified.token_ids[0]) == text
            prompt = encode_prompts(tokenizer, [p], True)[0]
            cache = RaggedKVCache(runner.num_layers)
            cache.add_rows(1)

            rows = [
                mask_step(model, runner, cache, prompt + [mask] * MASKS, 0)
            ]  # the prefill: the token column predicts text[0]
            for j in range(1, len(text)):  # a step at j: text[:j] accepted, its last token re-fed (the cursor)
                rows.append(mask_step(model, runner, cache, [text[j - 1]] + [mask] * MASKS, len(prompt) + j - 1))
            records.append(dict(prompt_length=len(prompt), text=text, rows=rows))
            print(len(records), len(prompt), len(text), "forwards of verify:", verified.stats.forwards, flush=True)
    with open(out, "wb") as f:
        pickle.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 16)
