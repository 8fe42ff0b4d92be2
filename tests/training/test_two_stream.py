"""The semantics of the two-stream forward, pinned against plain causal forwards of a real (tiny) model."""

import pytest
import torch

from mars.models import build_tiny_random
from mars.training.masking import noisy_copy, response_positions_to_mask
from mars.training.module import MarsModule, two_stream_attention
from mars.training.objectives import Objective

MASK_ID = 3


def make_module(arch="llama", block=4, objective="mars", intra="causal", attn="sdpa", crop=True, **obj):
    model = build_tiny_random(
        arch=arch,
        vocab_size=97,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        attn_implementation=attn,
    )
    weights = {
        "ar": dict(mask_weight=0.0, alpha=1.0),
        "mars": {},
        "mars_no_sft": dict(alpha=0.0),
        "block_diffusion": dict(alpha=0.0),
    }[objective]
    return MarsModule(
        model,
        MASK_ID,
        block_size=block,
        crop_noisy_prompt=crop,
        objective=Objective(objective, intra_block=intra, **{**weights, **obj}),
    )


def two_stream_logits(module, ids, loss_mask):
    """Logits of the full layout z = [x ; x~] (noisy stream not cropped), both copies at positions 0..L-1."""
    module.crop_noisy_prompt = False
    length = ids.shape[1]
    z, pos, _ = module.two_stream_inputs(ids, loss_mask, response_positions_to_mask(loss_mask))
    assert torch.equal(pos[:, length:], pos[:, :length])
    attn = two_stream_attention(
        pos, length, module.block_size, module.objective.intra_block, module._attn_impl(), torch.float32
    )
    with torch.no_grad():
        hidden = module._hidden(z, pos, attn)
        return module.model.get_output_embeddings()(hidden)


def batch(length=11, prompt=3, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 97, (n, length), generator=g)
    loss_mask = torch.zeros(n, length, dtype=torch.long)
    loss_mask[:, prompt:] = 1
    return ids, loss_mask


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("length,block", [(11, 4), (8, 4), (9, 1), (10, 3)])
def test_clean_stream_equals_plain_causal_forward(arch, attn, length, block):
    module = make_module(arch, block, attn=attn)
    ids, loss_mask = batch(length)
    logits = two_stream_logits(module, ids, loss_mask)
    with torch.no_grad():
        plain = module.model(input_ids=ids).logits
    torch.testing.assert_close(logits[:, :length], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("length,block,prompt", [(11, 4, 3), (12, 4, 5), (9, 2, 1), (10, 3, 4)])
def test_noisy_block_equals_causal_forward_of_earlier_clean_blocks_then_masks(arch, length, block, prompt):
    module = make_module(arch, block)
    ids, loss_mask = batch(length, prompt)
    noisy = noisy_copy(ids, response_positions_to_mask(loss_mask), MASK_ID)
    logits = two_stream_logits(module, ids, loss_mask)
    for start in range(0, length, block):
        end = min(start + block, length)
        context = torch.cat([ids[:, :start], noisy[:, start:end]], dim=1)
        with torch.no_grad():
            plain = module.model(input_ids=context).logits
        torch.testing.assert_close(logits[:, length + start : length + end], plain[:, start:end], atol=1e-5, rtol=1e-5)


def test_block_diffusion_pattern_lets_a_mask_see_later_masks_of_its_block():
    causal, bidir = make_module(block=4), make_module(block=4, objective="block_diffusion", intra="bidirectional")
    bidir.model.load_state_dict(causal.model.state_dict())
    ids, loss_mask = batch(8, prompt=2)
    a, b = two_stream_logits(causal, ids, loss_mask), two_stream_logits(bidir, ids, loss_mask)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # the clean stream is unaffected
    for t in range(8, 16):  # every noisy position now sees its whole block (directly or through layer 1)
        assert not torch.allclose(a[:, t], b[:, t], atol=1e-4), t


def test_objectives_differ_only_in_loss_terms():
    ids, loss_mask = batch(11, 3)
    mods = {name: make_module(objective=name) for name in ("ar", "mars", "mars_no_sft")}
    for m in mods.values():
        m.model.load_state_dict(mods["mars"].model.state_dict())
    with torch.no_grad():
        out = {name: m.losses({"input_ids": ids, "loss_mask": loss_mask}) for name, m in mods.items()}
    torch.testing.assert_close(out["ar"]["loss_ar"], out["mars"]["loss_ar"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["mars"]["loss"], out["mars"]["loss_mask"] + out["mars"]["loss_ar"])
    torch.testing.assert_close(out["mars_no_sft"]["loss"], out["mars"]["loss_mask"])
    torch.testing.assert_close(out["ar"]["loss"], out["ar"]["loss_ar"])
    assert "loss_mask" not in out["ar"]
    alpha_half = make_module(alpha=0.5)
    alpha_half.model.load_state_dict(mods["mars"].model.state_dict())
    with torch.no_grad():
        half = alpha_half.losses({"input_ids": ids, "loss_mask": loss_mask})
    torch.testing.assert_close(half["loss"], out["mars"]["loss_mask"] + 0.5 * out["mars"]["loss_ar"])


@pytest.mark.parametrize("block", [1, 3, 4])
@pytest.mark.parametrize("objective,intra", [("mars", "causal"), ("block_diffusion", "bidirectional")])
def test_cropping_prompt_only_noisy_blocks_changes_no_loss_or_gradient(block, objective, intra):
    """Ragged prompts and right padding: the cropped noisy stream gives the full layout's losses and gradients."""
    full, crop = (
        make_module(block=block, objective=objective, intra=intra, crop=False),
        make_module(block=block, objective=objective, intra=intra, crop=True),
    )
    crop.model.load_state_dict(full.model.state_dict())
    ids, loss_mask = batch(20, 0, n=4, seed=3)
    for row, (prompt, end) in enumerate([(3, 20), (9, 15), (13, 18), (6, 11)]):
        loss_mask[row] = 0
        loss_mask[row, prompt:end] = 1
        ids[row, end:] = 2  # right padding
    b = {"input_ids": ids, "loss_mask": loss_mask}
    out_full, out_crop = full.losses(b), crop.losses(b)
    for key in ("loss_mask", "loss_ar", "loss"):
        torch.testing.assert_close(out_full[key], out_crop[key], atol=1e-5, rtol=1e-5)
    out_full["loss"].backward()
    out_crop["loss"].backward()
    for (name, p), q in zip(full.model.named_parameters(), crop.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    # and the cropped input really is shorter: each row starts at the block before its response
    z, pos, _ = crop.two_stream_inputs(ids, loss_mask, response_positions_to_mask(loss_mask))
    starts = [((p - 1) // block) * block for p in (3, 9, 13, 6)]
    assert pos[:, 20].tolist() == starts and z.shape[1] == 20 + 20 - min(starts)


def test_a_few_mars_steps_lower_the_mask_loss():
    torch.manual_seed(0)
    module = make_module(block=4)
    ids, loss_mask = batch(16, 4, n=4)
    b = {"input_ids": ids, "loss_mask": loss_mask}
    opt = torch.optim.AdamW(module.model.parameters(), lr=3e-3)
    with torch.no_grad():
        before = module.losses(b)["loss_mask"].item()
    for _ in range(11):  # the mask loss is below 0.7x its start by step 11 (seeded)
        opt.zero_grad()
        module.losses(b)["loss"].backward()
        opt.step()
    with torch.no_grad():
        after = module.losses(b)["loss_mask"].item()
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(name="nope"), "unknown objective"),
        (dict(name="mars", alpha=-1.0), "alpha"),
        (dict(name="mars", mask_weight=0.0, alpha=0.0), "no loss"),
    ],
)
def test_bad_objectives_fail_fast(bad, match):
    with pytest.raises(ValueError, match=match):
        Objective(**bad)


def test_block_zero_fails_fast():
    with pytest.raises(ValueError, match="block must be >= 1"):
        make_module(block=0)


@pytest.mark.slow
def test_flex_attention_block_mask_gives_the_same_losses_as_the_dense_mask():
    """The GPU path (FlexAttention BlockMask) against SDPA with the dense mask; forward only (no CPU backward)."""
    dense, flex = make_module(block=4), make_module(block=4, attn="flex_attention")
    flex.model.load_state_dict(dense.model.state_dict())
    ids, loss_mask = batch(16, 4)
    with torch.no_grad():
        a = dense.losses({"input_ids": ids, "loss_mask": loss_mask})
        b = flex.losses({"input_ids": ids, "loss_mask": loss_mask})
    for key in ("loss_mask", "loss_ar"):
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)
