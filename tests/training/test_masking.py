"""The training mask against every rule of docs/method.md, position ids, noisy copy, shifted targets."""

import itertools

import pytest
import torch

from mars.training.masking import (
    flex_mask_mod,
    mars_attention_mask,
    mask_ratio,
    noisy_copy,
    response_positions_to_mask,
    shifted_targets,
    two_stream_position_ids,
)

CASES = [(1, 1), (5, 1), (7, 3), (8, 4), (9, 4), (10, 16), (13, 5), (16, 8)]


def rule(length: int, block: int, i: int, j: int, intra: str = "causal") -> bool:
    """The rules written out literally, one pair at a time."""
    qi_noisy, kj_noisy = i >= length, j >= length
    pi, pj = i % length if qi_noisy else i, j % length if kj_noisy else j
    bi, bj = pi // block, pj // block
    if not qi_noisy and not kj_noisy:
        return pj <= pi
    if qi_noisy and kj_noisy:
        return bi == bj and (pj <= pi or intra == "bidirectional")
    if qi_noisy and not kj_noisy:
        return bj < bi
    return False  # clean -> noisy: never


@pytest.mark.parametrize("length,block", CASES)
@pytest.mark.parametrize("intra", ["causal", "bidirectional"])
def test_mask_matches_every_rule(length, block, intra):
    mask = mars_attention_mask(length, block, intra_block=intra)
    assert mask.shape == (2 * length, 2 * length) and mask.dtype == torch.bool
    for i, j in itertools.product(range(2 * length), repeat=2):
        assert bool(mask[i, j]) == rule(length, block, i, j, intra), (i, j)


@pytest.mark.parametrize("length,block", CASES)
def test_flex_mask_mod_equals_dense_mask(length, block):
    q = torch.arange(2 * length)[:, None]
    k = torch.arange(2 * length)[None, :]
    positions = torch.cat([torch.arange(length), torch.arange(length)])[None]
    dense = flex_mask_mod(positions, length, block)(0, 0, q, k)
    assert torch.equal(dense, mars_attention_mask(length, block))


def test_every_query_sees_something_and_clean_never_sees_noisy():
    mask = mars_attention_mask(11, 4)
    assert mask.any(dim=1).all()  # no empty softmax row
    assert not mask[:11, 11:].any()


def test_block_one_noisy_sees_all_earlier_clean_and_only_itself():
    mask = mars_attention_mask(6, 1)
    assert torch.equal(mask[6:, :6], torch.ones(6, 6, dtype=torch.bool).tril(-1))
    assert torch.equal(mask[6:, 6:], torch.eye(6, dtype=torch.bool))


@pytest.mark.parametrize(
    "bad",
    [dict(length=0, block_size=2), dict(length=4, block_size=0), dict(length=4, block_size=2, intra_block="diagonal")],
)
def test_bad_arguments_fail_clearly(bad):
    with pytest.raises(ValueError, match="length|block_size|intra_block"):
        mars_attention_mask(**bad)


def test_position_ids_are_shared():
    assert two_stream_position_ids(4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_noisy_copy_masks_only_response_tokens_and_targets_shift_right():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1]])
    noisy = noisy_copy(ids, response_positions_to_mask(loss_mask), mask_token_id=99)
    assert noisy.tolist() == [[5, 6, 99, 99, 99]]
    assert shifted_targets(ids, loss_mask).tolist() == [[-100, 7, 8, 9, -100]]


def test_partial_ratio_masks_a_subset_of_response_tokens():
    loss_mask = torch.zeros(64, 100, dtype=torch.long)
    loss_mask[:, 20:] = 1
    g = torch.Generator().manual_seed(0)
    masked = response_positions_to_mask(loss_mask, 0.5, generator=g)
    assert not masked[:, :20].any()
    share = masked[:, 20:].float().mean().item()
    assert 0.45 < share < 0.55


def test_mask_schedules():
    assert mask_ratio("full", 0, 10, 4) == 1.0
    r = mask_ratio(
        "random_ratio", 0, 10, 1000, min_ratio=0.2, max_ratio=0.6, generator=torch.Generator().manual_seed(0)
    )
    assert r.shape == (1000,) and r.min() >= 0.2 and r.max() <= 0.6
    assert mask_ratio("linear_ramp", 0, 100, 4, start_ratio=0.25, ramp_fraction=0.5) == 0.25
    assert mask_ratio("linear_ramp", 25, 100, 4, start_ratio=0.25, ramp_fraction=0.5) == pytest.approx(0.625)
    assert mask_ratio("linear_ramp", 90, 100, 4, start_ratio=0.25, ramp_fraction=0.5) == 1.0
    with pytest.raises(ValueError, match="mask_schedule must be one of"):
        mask_ratio("cosine", 0, 1, 1)
