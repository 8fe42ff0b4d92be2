"""The lean decoder forward: bit-identical to the model's own forward under the fast path (Llama and Qwen2,
with and without the per-row cache, padding columns skipped or not), and refused where it would differ."""

import functools
import gc

import pytest
import torch
from decoding_fixtures import build_model, kernel_or_skip, tokenizer  # noqa: F401  (fixture)
from transformers import Qwen2Config, Qwen2ForCausalLM

from mars.decoding import fastpath
from mars.decoding.attention import mars_attention
from mars.decoding.forward import ModelRunner
from mars.decoding.kv import RaggedKVCache
from mars.decoding.lean import LeanDecoder, lean_reason


def tiny_qwen2():
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the q/k/v biases must matter
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.config._attn_implementation = "sdpa"
    return model


def gated_model():
    """The tiny Llama with a gated LoRA (rank 4) whose B factors and mask-embedding delta are nonzero, so the
    adapter changes the logits at mask columns."""
    from decoding_fixtures import MASK_ID, give_adapter_weights

    from mars.adapters import AdapterSettings, attach_adapter

    model = build_model()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    give_adapter_weights(model, seed=2)
    return model


def gated_bf16_model():
    """:func:`gated_model` with its LoRA factors rounded to bf16 numbers (an adapter saved in bf16 and loaded into
    the fp32 model), which the kernels stream as bf16."""
    from mars.decoding.fastpath import streamed_factor

    model = gated_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(p.to(torch.bfloat16))
    factor = next(p for n, p in model.named_parameters() if "lora_A" in n)
    assert streamed_factor(factor).dtype == torch.bfloat16
    return model


MODELS = {"llama": build_model, "qwen2": tiny_qwen2, "gated": gated_model, "gated_bf16": gated_bf16_model}


def step_inputs(batch, context, columns, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = (context + torch.arange(columns)).expand(batch, -1).contiguous()
    kv = context + columns
    mask = (torch.arange(kv).view(1, 1, -1) <= pos.unsqueeze(2)).unsqueeze(1)
    return torch.randint(0, vocab, (batch, columns), generator=g), pos, mask, kv


@pytest.mark.parametrize("make", [build_model, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("cached", [True, False])
def test_lean_forward_is_bit_identical_to_the_models_forward(make, cached):
    kernel_or_skip()
    model = make()
    assert lean_reason(model) is None
    vocab = model.config.vocab_size
    outputs = {}
    with torch.inference_mode(), mars_attention(model):
        for name in ("lean", "hf"):
            runner = ModelRunner(model)
            if name == "hf":
                runner._lean = False
            cache = RaggedKVCache(runner.num_layers) if cached else None
            if cached:  # prefill 7 tokens per row, then a 3-column step on top
                ids, pos, mask, kv = step_inputs(2, 0, 7, vocab, seed=3)
                cache.prepare_step(pos, kv)
                runner.logits_at(ids, pos, mask, pos - pos[:, :1], cache)
                ids, pos, mask, kv = step_inputs(2, 7, 3, vocab, seed=4)
                cache.prepare_step(pos, kv)
            else:
                ids, pos, mask, kv = step_inputs(2, 0, 9, vocab, seed=5)
            columns = torch.tensor([[0, 1, 2], [1, 2, 2]]) + (0 if cached else 6)
            live = torch.ones(ids.shape, dtype=torch.bool)
            live[1, -1] = False  # row 1's last column is padding
            live_preds = torch.tensor([[True, True, True], [True, True, False]])
            outputs[name] = runner.logits_at(ids, pos, mask, columns, cache, live=live, live_columns=live_preds)
    assert torch.equal(outputs["lean"], outputs["hf"])


def test_lean_forward_refuses_what_it_does_not_mirror():
    model = build_model()
    model.config._attn_implementation = "eager"
    assert "attention 'eager'" in lean_reason(model)
    model = build_model()
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "forward hook" in lean_reason(model)
    handle.remove()
    model.model.layers[1].mlp.up_proj = torch.nn.Sequential(model.model.layers[1].mlp.up_proj)
    assert "not a plain nn.Linear" in lean_reason(model)
    model = build_model()
    model.config.hidden_act = "gelu"
    assert "activation 'gelu'" in lean_reason(model)


def test_lean_forward_is_used_by_decode_steps(monkeypatch):
    kernel_or_skip()
    calls = []
    call = LeanDecoder.__call__
    monkeypatch.setattr(LeanDecoder, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    model = build_model()
    with torch.inference_mode(), mars_attention(model):
        runner = ModelRunner(model)
        ids, pos, mask, _ = step_inputs(1, 0, 4, model.config.vocab_size)
        runner.logits_at(ids, pos, mask, pos)
        monkeypatch.setenv(fastpath.ENV, "0")  # fast path off: the model's own forward
        runner.logits_at(ids, pos, mask, pos)
    assert calls == [1]


def test_decode_steps_ask_about_the_kernel_once_not_per_step(monkeypatch):
    """Whether the kernel can serve a model walks all its modules (a few ms on a real model, more with an
    adapter): a runner asks once, and a lean step patches no module."""
    kernel_or_skip()
    asked = []
    reason = fastpath.unavailable_reason
    monkeypatch.setattr(fastpath, "unavailable_reason", lambda m: asked.append(1) or reason(m))
    model = build_model()
    with torch.inference_mode(), mars_attention(model):
        runner = ModelRunner(model)
        ids, pos, mask, _ = step_inputs(1, 0, 4, model.config.vocab_size)
        for _ in range(3):
            runner.logits_at(ids, pos, mask, pos)
            assert not any("forward" in m.__dict__ for m in model.modules())
    assert asked == [1]


@pytest.mark.parametrize("padded, rank", [(False, None), (True, None), (False, 2)])
def test_lean_forward_mirrors_a_gated_adapter_bit_for_bit(padded, rank):
    """A gated LoRA (mars.adapters) under the lean forward (one fused kernel pass per group of projections):
    the same logits as the model's own forward with its peft layers and gate hooks, with mask columns in
    some rows and none in others, and with a row's padding columns skipped; also with the adapter truncated
    to a lower rank for decoding."""
    from decoding_fixtures import MASK_ID

    from mars.adapters import truncate_adapter_rank

    kernel_or_skip()
    model = gated_model()
    if rank is not None:
        truncate_adapter_rank(model, rank)
    assert lean_reason(model) is None
    ids, pos, mask, kv = step_inputs(2, 0, 9, model.config.vocab_size, seed=5)
    outputs = {}
    for masked in (False, True):
        step = ids.clone()
        if masked:
            step[0, 6:] = MASK_ID  # row 0 ends in three masks, row 1 has none
        with torch.inference_mode(), mars_attention(model):
            for name in ("lean", "hf"):
                runner = ModelRunner(model)
                if name == "hf":
                    runner._lean = False
                columns = torch.arange(6, 9).expand(2, -1)
                live = torch.ones(step.shape, dtype=torch.bool)
                live[1, -2:] = not padded  # row 1's last two columns are padding when padded
                live_preds = torch.tensor([[True, True, True], [True, not padded, not padded]])
                outputs[name, masked] = runner.logits_at(
                    step, pos, mask, columns, None, live=live, live_columns=live_preds
                )
        assert torch.equal(outputs["lean", masked], outputs["hf", masked])
    assert not torch.equal(outputs["lean", True][0, 1:], outputs["lean", False][0, 1:])  # the adapter acted
    assert torch.equal(outputs["lean", True][1], outputs["lean", False][1])  # not on a row without masks


def _runner(model, native: bool | None) -> ModelRunner:
    """A runner whose steps take the lean forward's C++ pass (``native=True``), its Python loop (False) or
    transformers' forward (None)."""
    runner = ModelRunner(model)
    if native is None:
        runner._lean = False
    else:
        runner._lean = LeanDecoder(model)
        if not native:
            runner._lean._native = False
    return runner


def _assert_paths_agree(decode, model, masks: bool) -> list:
    """``decode(model, native, masks)`` through the C++ pass, the Python loop and transformers' forward: the
    same logits at every step from all three, the same cache from the first two.  Returns the C++ logits."""
    cpp, cpp_keys = decode(model, True, masks)
    loop, loop_keys = decode(model, False, masks)
    hf, _ = decode(model, None, masks)
    for a, b, c in zip(cpp, loop, hf):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(torch.equal(a, b) for a, b in zip(cpp_keys, loop_keys))
    return cpp


def _decode_three_steps(model, native: bool, masks: bool):
    """Logits of a batch-1 prefill and two decode steps on the per-row cache (the last columns of the decode
    steps masks when ``masks``), through the lean forward with or without its C++ pass, or transformers'
    forward (``native=None``); and the cache's keys afterwards."""
    from decoding_fixtures import MASK_ID

    runner = _runner(model, native)
    cache = RaggedKVCache(runner.num_layers, capacity=8)  # the second step grows the buffers
    vocab, logits, done = model.config.vocab_size, [], 0
    with torch.inference_mode(), mars_attention(model):
        for seed, width in ((3, 7), (4, 3), (5, 4)):
            ids, pos, mask, kv = step_inputs(1, done, width, vocab, seed=seed)
            if masks and done:
                ids[0, 1:] = MASK_ID
            cache.prepare_step(pos, kv)
            logits.append(runner.logits_at(ids, pos, mask, pos - done, cache))
            done += 1 if done else width  # the prompt, then one token a step
    if native:
        assert isinstance(runner._lean._native, torch.ScriptObject), "the C++ decoder step did not run"
    return logits, [layer.keys[:, :, :done] for layer in cache.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gated", "gated_bf16"])
def test_cpp_decoder_step_is_bit_identical_to_the_python_loop(kind):
    """The batch-1 lean step in C++ (mars.decoding.kernels' DecoderStep) against the lean forward's Python loop and
    transformers' forward: the same logits at every step, the same cache contents, with q/k/v biases (Qwen2)
    and a gated adapter acting at mask columns (its factors streamed as fp32, or as bf16 where they are bf16
    numbers)."""
    kernel_or_skip()
    model = MODELS[kind]()
    masks = kind.startswith("gated")
    cpp = _assert_paths_agree(_decode_three_steps, model, masks)
    if masks:  # the adapter acted in the C++ pass
        plain, _ = _decode_three_steps(model, True, False)
        assert not torch.equal(plain[1][0, 1:], cpp[1][0, 1:])


NARROW = ((6, (5, 6)), (3, (3, 1)), (3, (3, 1)))  # (input width, real or read columns of each row) per step
_W = fastpath.MAX_COLUMNS // 2 + 4  # 12 where the kernel takes 16 columns, 36 where it takes 64
WIDE = ((_W, (_W - 1, _W)), (_W - 3, (_W - 3, _W - 3)), (_W - 3, (_W - 3, 1)))  # wider than the kernel takes


def _decode_ragged_batch(model, native: bool | None, masks: bool, steps=NARROW, runner=None):
    """Two rows of different lengths on the per-row cache: a prefill (row 0's prompt one token shorter, its
    last column padding), then decode steps in which row 0 feeds its last token and masks (or real tokens)
    and row 1 its last token and real tokens or padding; through the C++ pass, the lean Python loop or
    transformers' forward (or ``runner``, one of those).  Returns the logits at every step's live columns and
    the cache's keys."""
    from decoding_fixtures import MASK_ID

    runner = runner or _runner(model, native)
    cache = RaggedKVCache(runner.num_layers, capacity=8)  # the decode steps grow the buffers
    vocab, logits = model.config.vocab_size, []
    start = torch.tensor([0, 0])
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode(), mars_attention(model):
        for i, (width, used) in enumerate(steps):
            used = torch.tensor(used)
            ids = torch.randint(0, vocab, (2, width), generator=g)
            if masks and i:
                ids[0, 1:] = MASK_ID
            pos = start.unsqueeze(1) + torch.arange(width)
            kv = int(start.max()) + width
            mask = (torch.arange(kv).view(1, 1, -1) <= pos.unsqueeze(2)).unsqueeze(1)
            live = torch.arange(width).unsqueeze(0) < used.unsqueeze(1)
            cache.prepare_step(pos, kv)
            columns = torch.arange(width).expand(2, -1)
            logits.append(runner.logits_at(ids, pos, mask, columns, cache, live=live, live_columns=live)[live])
            start = start + (used if i == 0 else 1)  # the prompts, then one token a step
    if native:
        assert isinstance(runner._lean._native, torch.ScriptObject), "the C++ decoder step did not run"
    return logits, [layer.keys[b, :, : int(start[b])] for layer in cache.layers for b in range(2)]


@pytest.mark.parametrize("steps", [NARROW, WIDE], ids=["narrow", "wide"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gated", "gated_bf16"])
def test_cpp_decoder_step_takes_a_ragged_batch_bit_for_bit(kind, steps):
    """Several rows at their own cache positions (a scatter, not a copy), padding columns left out of the
    matmuls (narrow) or steps wider than the kernel takes (wide: F.linear), and a gated adapter acting at one
    row's masks: the C++ pass gives the logits and cache of the lean Python loop and of transformers'
    forward, bit for bit."""
    kernel_or_skip()
    model = MODELS[kind]()
    masks = kind.startswith("gated")
    cpp = _assert_paths_agree(functools.partial(_decode_ragged_batch, steps=steps), model, masks)
    if masks:  # the adapter acted at row 0's masks in the C++ pass (row 0's columns come first)
        plain, _ = _decode_ragged_batch(model, True, False, steps)
        width = steps[1][1][0]
        assert not torch.equal(plain[1][1:width], cpp[1][1:width])


def test_the_cpp_decoder_step_keeps_the_weights_it_was_built_with():
    """The C++ pass resolves its weights to addresses once, when it is built (not at each of a step's passes): a
    layer's parameters given new storage afterwards (``param.data = ...``) leave it computing with the memory it
    was built on, kept alive, in its kernel passes and in a step wider than the kernel alike; a pass built
    afterwards reads the new parameters."""
    kernel_or_skip()
    model = MODELS["gated"]()
    runner = _runner(model, True)
    before, _ = _decode_ragged_batch(model, True, True, WIDE, runner=runner)
    torch.manual_seed(0)
    for layer in model.model.layers:
        for p in layer.parameters():
            p.data = torch.randn_like(p) * 0.05
    gc.collect()
    again, _ = _decode_ragged_batch(model, True, True, WIDE, runner=runner)
    assert all(torch.equal(a, b) for a, b in zip(before, again))
    rebuilt, _ = _decode_ragged_batch(model, True, True, WIDE)
    assert not any(torch.equal(a, b) for a, b in zip(before, rebuilt))


def test_a_step_wider_than_the_kernel_computes_the_adapter_at_its_masks_only(monkeypatch):
    """In a step wider than the kernel takes (F.linear for the weights) the lean Python loop runs a gated LoRA's
    down products on the mask columns alone, not on every column with a zero gate (the C++ pass does the same
    and agrees bit for bit: the ``wide`` cases above)."""
    import mars.decoding.lean as lean

    kernel_or_skip()
    rows = []
    down = lean.down_linear
    monkeypatch.setattr(lean, "down_linear", lambda x, w: rows.append(x.shape[0]) or down(x, w))
    logits, _ = _decode_ragged_batch(MODELS["gated"](), False, True, WIDE)
    assert logits and rows, "the adapter did not act"
    assert set(rows) == {WIDE[1][1][0] - 1}  # step 1: row 0's masks (its columns after the first)


def test_batched_decoding_runs_the_cpp_step(monkeypatch, tokenizer):  # noqa: F811
    """A batch of ragged prompts decoded by the engine (cursor cache, masks below threshold 1.0): the prefill
    and the batched decode steps all take the C++ pass, none the Python loop."""
    from decoding_fixtures import RAGGED

    from mars.decoding import generate

    kernel_or_skip()
    shapes = {"cpp": [], "python": []}
    native_step, fits = LeanDecoder._native_step, LeanDecoder._native_fits

    def recording(self):
        native = native_step(self)
        return None if native is None else _Recorded(native, shapes["cpp"])

    def fits_or_record(self, x, cache):
        if fits(self, x, cache):
            return True
        shapes["python"].append(tuple(x.shape))
        return False

    monkeypatch.setattr(LeanDecoder, "_native_step", recording)
    monkeypatch.setattr(LeanDecoder, "_native_fits", fits_or_record)
    generate(build_model(), tokenizer, RAGGED, threshold=0.3, max_new_tokens=12)
    assert not shapes["python"], shapes["python"]
    assert shapes["cpp"][0][0] == len(RAGGED) and shapes["cpp"][0][1] > 4  # the prefill
    assert any(rows > 1 and 1 < columns <= 4 for rows, columns, _ in shapes["cpp"][1:])  # batched masked steps


class _Recorded:
    """A C++ step that records the input shape of every call."""

    def __init__(self, native, shapes):
        self.native, self.shapes = native, shapes

    def step(self, x, *args):
        self.shapes.append(tuple(x.shape))
        return self.native.step(x, *args)


def test_the_cpp_decoder_step_has_an_off_switch(monkeypatch):
    """MARS_DECODER_STEP=0 keeps the Python loop; a value that is neither on nor off is refused, as for
    MARS_FAST_PATH."""
    kernel_or_skip()
    model = build_model()
    monkeypatch.setenv("MARS_DECODER_STEP", "0")
    assert LeanDecoder(model)._native_step() is None
    monkeypatch.setenv("MARS_DECODER_STEP", "maybe")
    with pytest.raises(ValueError, match="MARS_DECODER_STEP='maybe'"):
        LeanDecoder(model)._native_step()
    monkeypatch.setenv("MARS_DECODER_STEP", "1")
    assert isinstance(LeanDecoder(model)._native_step(), torch.ScriptObject)
