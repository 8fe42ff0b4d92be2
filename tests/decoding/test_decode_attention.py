"""mars::decode_attention: a decode step's attention against the cache, column-invariant, SDPA for the rest."""

import pytest
import torch
import torch.nn.functional as F

from mars.decoding import fastpath
from mars.decoding.kernels import KernelUnavailable, decode_attention_op

try:
    OP = decode_attention_op()
except KernelUnavailable as err:  # pragma: no cover - only where the kernels cannot be built
    pytest.skip(f"kernels unavailable: {err}", allow_module_level=True)


def step_inputs(batch=2, heads=6, kv_heads=2, queries=3, length=37, dim=16, seed=0):
    """Queries of a decode step and cache slices (the first `length` positions of a longer buffer, as the engine's
    cache hands them), with a causal mask whose rows see their own position and everything before it, and a
    second row of the batch left-padded (its first 5 positions hidden)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=g)
    capacity = length + 27  # the cache holds more than the step reads
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=g)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=g)
    positions = length - queries + torch.arange(queries)
    visible = (torch.arange(length).view(1, -1) <= positions.view(-1, 1)).expand(batch, 1, queries, length).clone()
    if batch > 1:
        visible[1, :, :, :5] = False
    return q, keys[:, :, :length], values[:, :, :length], visible


def additive(visible):
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("dim", [8, 16, 24, 64])
@pytest.mark.parametrize("queries", [1, 2, 4, 16])
def test_decode_attention_computes_sdpa_of_a_decode_step(dim, queries):
    q, k, v, visible = step_inputs(queries=queries, dim=dim)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(visible), scale=dim**-0.5, enable_gqa=True)
    for mask in (additive(visible), visible):
        out = OP(q, k, v, mask, dim**-0.5)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    single = OP(q[:, :, -1:], k, v, None, dim**-0.5)  # one query and no mask: every cached position
    full = F.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=dim**-0.5, enable_gqa=True)
    torch.testing.assert_close(single, full, rtol=1e-5, atol=1e-6)


def test_a_columns_output_does_not_depend_on_what_rides_along():
    """An AR step (one column, one row) and a verify step (the same column beside drafts, masks and other rows)
    give that column bit for bit the same attention: lossless verification rests on it."""
    q, k, v, visible = step_inputs(batch=3, queries=5, length=150, dim=64, heads=9, kv_heads=3)
    mask = additive(visible)
    together = OP(q, k, v, mask, 0.125)
    for b in range(3):
        for i in range(5):
            alone = OP(q[b : b + 1, :, i : i + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1, :, i : i + 1], 0.125)
            assert torch.equal(alone, together[b : b + 1, :, i : i + 1])
    # and as many threads as there are: the same bits with one
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(OP(q, k, v, mask, 0.125), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dim", [128, 40])
def test_seven_heads_per_kv_head_with_masks_per_head_match_sdpa_column_by_column(dim):
    """A KV head's query heads run together in groups of at most four (7 = 4 + 3 here), with the head dimension
    compiled in at 128 or run-time at 40; a mask that differs per head still applies to its own head only."""
    q, k, v, visible = step_inputs(batch=2, heads=14, kv_heads=2, queries=3, length=70, dim=dim)
    g = torch.Generator().manual_seed(1)
    per_head = visible.expand(2, 14, 3, 70) & (torch.rand(2, 14, 3, 70, generator=g) > 0.3)
    per_head[..., 0] = True  # every query sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(per_head), scale=0.1, enable_gqa=True)
    together = OP(q, k, v, per_head, 0.1)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-6)
    for i in range(3):
        alone = OP(q[:, :, i : i + 1], k, v, per_head[:, :, i : i + 1], 0.1)
        assert torch.equal(alone, together[:, :, i : i + 1])


def test_an_ar_step_and_a_verify_step_agree_on_their_shared_column():
    """The AR step at position p reads p + 1 cached keys; a verify step feeding that column with two drafts
    after it reads p + 3, the last two hidden from it by the mask.  Its output must not change."""
    q, k, v, visible = step_inputs(batch=1, queries=3, length=150, dim=64, heads=9, kv_heads=3)
    verify_step = OP(q, k, v, additive(visible), 0.125)
    ar_step = OP(q[:, :, :1], k[:, :, :148], v[:, :, :148], None, 0.125)
    assert torch.equal(ar_step, verify_step[:, :, :1])


def test_a_row_that_sees_nothing_gets_zeros_not_nan():
    q, k, v, visible = step_inputs()
    visible[0, :, 1] = False
    out = OP(q, k, v, visible, 0.25)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.isfinite(out).all()


def test_a_prefills_prompt_columns_do_not_depend_on_the_masks_after_them():
    """Lossless verify prefills the prompt and its first two masks in one forward, AR the prompt alone: the prompt's
    columns must come out the same bits in both (SDPA's blocked kernel gave different ones at some widths), and be
    SDPA's attention up to rounding."""
    for length in (40, 64, 100, 207):
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, h, length + 2, 64, generator=g) for h in (9, 3, 3))
        causal = torch.ones(length + 2, length + 2, dtype=torch.bool).tril().view(1, 1, length + 2, length + 2)
        verify_prefill = OP(q, k, v, additive(causal), 0.125)
        ar = (slice(None), slice(None), slice(0, length))
        ar_prefill = OP(q[ar], k[ar], v[ar], additive(causal)[..., :length, :length], 0.125)
        assert torch.equal(ar_prefill, verify_prefill[ar])
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(causal), scale=0.125, enable_gqa=True)
        torch.testing.assert_close(verify_prefill, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(OP(q, k, v, causal, 0.125), verify_prefill)  # a boolean mask: the same bits


def test_the_callers_width_decides_kernel_or_sdpa():
    """At the kernel's 1024 queries, a prompt of 1023 or 1024 tokens prefills alone through the kernel, and with
    verify's two masks (1025-1026 queries) would go to SDPA: the caller's width (AR's, the prompt's length) keeps
    both on the kernel, so the prompt's columns keep their bits; a width over the cap sends even a short step to
    SDPA."""
    length = 1024
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, h, length + 2, 64, generator=g) for h in (4, 2, 2))
    causal = torch.ones(length + 2, length + 2, dtype=torch.bool).tril().view(1, 1, length + 2, length + 2)
    prompt = (slice(None), slice(None), slice(0, length))
    alone = OP(q[prompt], k[prompt], v[prompt], causal[..., :length, :length], 0.125)
    assert torch.equal(OP(q, k, v, causal, 0.125, length)[prompt], alone)
    assert not torch.equal(OP(q, k, v, causal, 0.125)[prompt], alone)  # by its own 1026 queries: SDPA
    few = (slice(None), slice(None), slice(length - 3, length))
    mask = causal[..., length - 3 : length, :length]
    expected = F.scaled_dot_product_attention(
        q[few], k[prompt], v[prompt], attn_mask=mask, scale=0.125, enable_gqa=True
    )
    assert torch.equal(OP(q[few], k[prompt], v[prompt], mask, 0.125, 1025), expected)


@pytest.mark.parametrize("case", ["wide prefill", "float64", "causal without a mask", "head dim 512"])
def test_what_the_kernel_does_not_take_is_sdpa_exactly(case):
    q, k, v, visible = step_inputs(queries=1025 if case == "wide prefill" else 3, length=1100)
    mask = additive(visible)
    if case == "float64":
        q, k, v, mask = q.double(), k.double(), v.double(), mask.double()
    if case == "causal without a mask":
        mask = None
    if case == "head dim 512":
        q, k, v = (t.repeat(1, 1, 1, 32) for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.equal(OP(q, k, v, mask, 0.25), expected)


def test_fastpath_attention_leaves_autograd_to_sdpa():
    q, k, v, visible = step_inputs()
    q.requires_grad_(True)
    out = fastpath.attention(q, k, v, additive(visible), 0.25)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(visible), scale=0.25, enable_gqa=True)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert q.grad is not None
    with torch.no_grad():
        assert torch.equal(fastpath.attention(q, k, v, additive(visible), 0.25), OP(q, k, v, additive(visible), 0.25))


def test_bad_shapes_fail_with_a_message():
    q, k, v, visible = step_inputs()
    with pytest.raises(RuntimeError, match="value"):
        OP(q, k, v[:, :, :-1], visible, 0.25)
    with pytest.raises(RuntimeError, match="cache rows"):
        OP(q, k[:1], v[:1], visible[:1], 0.25)
