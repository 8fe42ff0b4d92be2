"""AR and lossless verify with the weights in 4 KB pages and in 2 MB pages (mars.decoding.huge_pages), two copies
of the model in one process, alternating per round; per step, the forward's time (`ModelRunner.logits_at`) by its
number of columns and whether masks were fed, medians; each decoder's total; tokens compared:

    python benchmarks/decode_step_cpu/intel_stream/huge_pages_ab/huge_pages_ab.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 --prompts 8 --rounds 3
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.decoding import generate, huge_pages  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

DECODERS = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}
PREFILL_FROM = 10  # a forward of at least this many columns is a prompt's prefill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    configure_threads("auto")
    small, huge = load_model(args.checkpoint, dtype=torch.float32), load_model(args.checkpoint, dtype=torch.float32)
    os.environ[huge_pages.ENV] = "0"
    huge_pages.place_weights(small.model)  # remembered as not placed: it stays in 4 KB pages
    del os.environ[huge_pages.ENV]
    print(f"2 MB pages: {huge_pages.place_weights(huge.model) / 1e6:.0f} MB ({huge_pages.describe()})")
    mask_id = small.model.mars_gate.mask_token_id
    prompts = [json.loads(line)["prompt"] for line in open("data/prompts/heldout.jsonl")][: args.prompts]
    forwards = collections.defaultdict(list)
    logits_at = ModelRunner.logits_at

    def timed(self, ids, *a, **kw):
        start = time.perf_counter()
        out = logits_at(self, ids, *a, **kw)
        forwards[ids.shape[1], bool((ids == mask_id).any())].append(time.perf_counter() - start)
        return out

    ModelRunner.logits_at = timed
    models = {"4 KB": small, "2 MB": huge}
    for lm in models.values():
        for kwargs in DECODERS.values():
            generate(lm.model, lm.tokenizer, prompts[:1], max_new_tokens=8, chat_template=True, **kwargs)
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    tokens = collections.defaultdict(dict)
    for r in range(args.rounds):
        for pages in list(models)[:: 1 if r % 2 == 0 else -1]:
            lm = models[pages]
            for name, kwargs in DECODERS.items():
                forwards.clear()
                start = time.perf_counter()
                out = [
                    generate(lm.model, lm.tokenizer, [p], max_new_tokens=64, chat_template=True, **kwargs).token_ids
                    for p in prompts
                ]
                times[name, "total (s)"][pages].append(time.perf_counter() - start)
                tokens[name][pages] = out
                prefills = sum(sum(v) for (columns, _), v in forwards.items() if columns >= PREFILL_FROM)
                times[name, "prefills (s)"][pages].append(prefills)
                for (columns, masked), v in forwards.items():
                    if columns < PREFILL_FROM:
                        times[name, f"{columns} col{' + masks' if masked else ''}"][pages].append(
                            statistics.median(v) * 1e3
                        )
    print("| decoder | what | 4 KB pages | 2 MB pages | ratio |\n|---|---|---|---|---|")
    for (name, key), by in sorted(times.items()):
        a, b = statistics.median(by["4 KB"]), statistics.median(by["2 MB"])
        unit = "" if "(s)" in key else " ms"
        print(f"| {name} | {key} | {a:.3f}{unit} | {b:.3f}{unit} | {b / a:.3f} |")
    same = all(t["4 KB"] == t["2 MB"] for t in tokens.values())
    print(f"same tokens: {same}")


if __name__ == "__main__":
    main()
