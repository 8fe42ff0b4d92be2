"""A calibrated checkpoint's temperatures move the threshold's confidence at the mask columns only: the greedy
tokens stay, fewer mask tokens clear a threshold when the masks are cooled down, and threshold 1.0 and verify are
untouched."""

import pytest
from decoding_fixtures import hf_greedy, model, random_prompts, tokenizer  # noqa: F401

from mars.calibration import Calibration
from mars.decoding import generate


@pytest.fixture
def calibrated(model):
    def attach(temperature):
        model.mars_calibration = Calibration((temperature,) * 3, block_size=4, checkpoint="test")

    yield attach
    model.mars_calibration = None


def test_temperatures_change_what_a_threshold_accepts_and_nothing_else(model, tokenizer, calibrated):
    prompts = random_prompts((6, 11), seed=7)
    kwargs = dict(threshold=0.5, block_size=4, max_new_tokens=24)
    plain = generate(model, tokenizer, prompts, **kwargs)
    calibrated(1.0)
    same = generate(model, tokenizer, prompts, **kwargs)
    assert same.token_ids == plain.token_ids and same.from_mask == plain.from_mask
    calibrated(8.0)  # a hot softmax: every mask's top probability falls, so fewer masks clear 0.5
    cooled = generate(model, tokenizer, prompts, **kwargs)
    assert sum(map(sum, cooled.from_mask)) < sum(map(sum, plain.from_mask))
    exact = generate(model, tokenizer, prompts, threshold=1.0, block_size=4, max_new_tokens=24)
    verified = generate(model, tokenizer, prompts, verify=True, block_size=4, max_new_tokens=24)
    assert exact.token_ids == verified.token_ids == hf_greedy(model, tokenizer, prompts, 24)
