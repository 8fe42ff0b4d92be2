"""mars.bench.mask_scores: per mask depth, the masks the reliability bench's teacher forcing scores, with the
greedy token's rank in each."""

import pytest
import torch
from test_reliability import gated_module

from mars.bench import mask_scores
from mars.bench import reliability as rel


def test_each_depth_holds_the_masks_the_reliability_bench_scores_at_that_depth():
    module = gated_module()
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(4, 97, (n,), generator=g).tolist() for n in (23, 17)]
    lengths = [6, 9]
    per_depth, ranks = mask_scores.depth_scores(module, texts, lengths, batch_size=2)
    steps = rel.score_texts(module, texts, lengths, masks_per_step=3, batch_size=2)
    assert len(per_depth) == 3
    assert ranks.shape == steps.valid.shape and ((ranks >= 0) == steps.valid).all()
    assert ((ranks == 0) == (steps.correct & steps.valid)).all()  # rank 0: the mask's argmax is the greedy token
    for d, scores in enumerate(per_depth):
        ok = steps.valid[:, d]
        assert len(scores.correct) == int(ok.sum()) > 5
        assert sorted(scores.confidence(1.0).tolist()) == pytest.approx(sorted(steps.confidence[ok, d]), rel=1e-4)
        assert int(scores.correct.sum()) == int(steps.correct[ok, d].sum())
