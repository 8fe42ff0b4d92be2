"""The tiny random fp32 model, prompts and references the decoding tests share (imported by them)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mars.decoding import generate, kernels
from mars.models import embedded_tokenizer

VOCAB = 1024
MASK_ID = 16
CACHES = ("none", "block", "cursor")


@pytest.fixture(scope="module")
def tokenizer():
    tok = embedded_tokenizer()
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    tok.mask_token = "<empty_output>"
    assert tok.mask_token_id == MASK_ID
    return tok


def give_adapter_weights(model, seed: int) -> None:
    """Give a freshly attached adapter's zero LoRA B factors and mask-embedding delta random values, as
    training would, so that it changes the logits at mask columns."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "mask_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with untied, large-ish random weights so that greedy outputs vary and
    confidences spread across (0, 1); the mask embedding is shrunk so that mask outputs depend on
    the context through attention (as after MARS training) instead of echoing the mask itself."""
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.model.embed_tokens.weight[MASK_ID].mul_(0.05)
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


RAGGED = random_prompts((5, 17, 9, 30))


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def extra_eos(model, tokenizer):
    """An extra EOS id chosen from the greedy outputs so that the ragged rows stop at different steps:
    a token that some row emits mid-way and another row never emits."""
    plain = generate(model, tokenizer, RAGGED, decoder="ar", max_new_tokens=24).token_ids
    counts = {}
    for row in plain:
        for t in set(row[2:-4]):
            counts[t] = counts.get(t, 0) + 1
    return next(t for t, c in sorted(counts.items()) if 0 < c < len(plain))


@pytest.fixture
def ragged(model, extra_eos):
    """Ragged prompts whose rows end at their own EOS (the model's EOS set is restored afterwards)."""
    model.generation_config.eos_token_id = [2, extra_eos]
    yield RAGGED
    model.generation_config.eos_token_id = 2


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    """Reference: transformers greedy generate, generated ids cut after the first EOS."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2)
    att = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        att[b, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=att,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=2,
    )
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def kernel_or_skip():
    """The small-M kernel op, or a skip where it cannot be built (no AVX2, no compiler): the fallback tests
    still run there."""
    try:
        return kernels.small_linear_op()
    except kernels.KernelUnavailable as err:
        pytest.skip(f"small-M kernel unavailable here: {err}")
