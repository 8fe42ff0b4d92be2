"""Prefill of a prompt of L tokens, with and without 2 mask columns after it, on the rank-8 reference (gated LoRA)."""
from mars.threads import apply_process_defaults
apply_process_defaults()
import sys, time, statistics, torch
from mars.threads import configure_threads
configure_threads("auto")
from mars.models import load_model
from mars.decoding.forward import ModelRunner
from mars.decoding.kv import RaggedKVCache
from mars.decoding.attention import mars_attention
lm = load_model(sys.argv[1], dtype=torch.float32)
model = lm.model.eval()
mask = model.mars_gate.mask_token_id
runner = ModelRunner(model)
def prefill(L, masks):
    ids = torch.randint(0, 40000, (1, L + masks), generator=torch.Generator().manual_seed(L)); ids[0, L:] = mask
    W = L + masks
    pos = torch.arange(W).unsqueeze(0)
    cache = RaggedKVCache(runner.num_layers); cache.add_rows(1)
    att = (torch.arange(W).view(1, 1, -1) <= pos.unsqueeze(2)).unsqueeze(1)
    cache.prepare_step(pos, W)
    with mars_attention(model):
        return runner.logits_at(ids, pos, att, torch.arange(L - 1, W).unsqueeze(0), cache)
with torch.inference_mode():
    for L in (60, 120, 200):
        t = {0: [], 2: []}
        for _ in range(2): prefill(L, 0); prefill(L, 2)
        for _ in range(9):
            for m in (0, 2):
                s = time.perf_counter(); prefill(L, m); t[m].append((time.perf_counter() - s) * 1e3)
        a, b = statistics.median(t[0]), statistics.median(t[2])
        print(f"L={L} prompt {a:.1f} ms, +2 masks {b:.1f} ms, masks cost {b - a:+.1f} ms")
