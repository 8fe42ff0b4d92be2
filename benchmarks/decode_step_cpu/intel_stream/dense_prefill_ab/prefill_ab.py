"""Prefill of a random L-token prompt, alone and with 2 mask columns after it, on a gated-adapter checkpoint
(median of 9 interleaved repeats):

    python benchmarks/decode_step_cpu/intel_stream/dense_prefill_ab/prefill_ab.py \\
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8
"""

from mars.threads import apply_process_defaults

apply_process_defaults()  # the OpenMP wait, before torch loads

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.decoding.attention import mars_attention  # noqa: E402
from mars.decoding.forward import ModelRunner  # noqa: E402
from mars.decoding.kv import RaggedKVCache  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

configure_threads("auto")
model = load_model(sys.argv[1], dtype=torch.float32).model.eval()
MASK = model.mars_gate.mask_token_id
runner = ModelRunner(model)


def prefill(length: int, masks: int) -> torch.Tensor:
    width = length + masks
    ids = torch.randint(0, 40000, (1, width), generator=torch.Generator().manual_seed(length))
    ids[0, length:] = MASK
    positions = torch.arange(width).unsqueeze(0)
    cache = RaggedKVCache(runner.num_layers)
    cache.add_rows(1)
    attention = (torch.arange(width).view(1, 1, -1) <= positions.unsqueeze(2)).unsqueeze(1)
    cache.prepare_step(positions, width)
    read = torch.arange(length - 1, width).unsqueeze(0)
    with mars_attention(model):
        return runner.logits_at(ids, positions, attention, read, cache)


with torch.inference_mode():
    for length in (60, 120, 200):
        times = {0: [], 2: []}
        for _ in range(2):
            prefill(length, 0)
            prefill(length, 2)
        for _ in range(9):
            for masks in times:
                start = time.perf_counter()
                prefill(length, masks)
                times[masks].append((time.perf_counter() - start) * 1e3)
        alone, with_masks = statistics.median(times[0]), statistics.median(times[2])
        print(
            f"L={length} prompt {alone:.1f} ms, +2 masks {with_masks:.1f} ms, masks cost {with_masks - alone:+.1f} ms"
        )
