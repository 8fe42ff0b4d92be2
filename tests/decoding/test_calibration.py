"""mars.decoding.calibration: the fit against known temperatures, the ECE by hand, and the stored calibration's
round trip through mars_config.json and the model loader, with its refusals."""

import dataclasses
import logging

import pytest
import torch

from mars.decoding import calibration as cal
from mars.metadata import MarsMetadata, read_metadata, write_metadata


def synthetic(true_temperature: float, n: int = 6000, seed: int = 0):
    """Logits whose argmax is right with exactly the top probability of ``softmax(logits / true_temperature)``:
    a model whose calibrating temperature is ``true_temperature``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 40, generator=g) * 4
    p_top = torch.softmax(logits / true_temperature, -1).max(-1).values
    correct = torch.rand(n, generator=g) < p_top
    return logits, correct


@pytest.mark.parametrize("true_temperature", [0.5, 2.0])
def test_the_fit_recovers_the_temperature_that_calibrates_the_logits(true_temperature):
    logits, correct = synthetic(true_temperature)
    scores = cal.MaskScores.from_logits(logits, correct)
    assert cal.fit_temperature(scores.log_top, scores.correct) == pytest.approx(true_temperature, rel=0.08)


def test_grid_probabilities_are_the_tempered_softmax_and_one_is_exactly_on_the_grid():
    logits = torch.randn(5, 30) * 3
    logits[:, 7] = float("-inf")  # a suppressed token (the mask) counts for nothing
    scores = cal.MaskScores.from_logits(logits, torch.ones(5, dtype=torch.bool))
    for t in (1.0, 1.7, 0.3):
        expected = torch.softmax(logits / t, -1).max(-1).values.double()
        torch.testing.assert_close(scores.confidence(t), expected, rtol=3e-3, atol=1e-6)
    assert 1.0 in cal.temperature_grid().tolist()


def test_the_ece_of_overconfident_logits_falls_after_the_fit_on_a_separate_split():
    logits, correct = synthetic(2.5, n=8000, seed=1)
    fit = cal.MaskScores.from_logits(logits[:4000], correct[:4000])
    held = cal.MaskScores.from_logits(logits[4000:], correct[4000:])
    result = cal.fit_calibration([fit], [held], block_size=2, checkpoint="sha256:x", fit_prompts=1, eval_prompts=1)
    (before,), (after,) = result.ece_before, result.ece_after
    assert result.temperatures[0] > 1.5  # overconfident: the fit cools the confidences
    assert before > 0.1 and after < before / 4


def test_ece_is_the_bin_weighted_gap_between_confidence_and_accuracy():
    confidence = torch.tensor([0.05, 0.95, 0.96, 0.5, 1.0])
    correct = torch.tensor([False, True, False, True, True])
    # bins of width 1/15: {0.05}, {0.5}, {0.95, 0.96, 1.0} (1.0 in the last, closed bin)
    expected = (abs(0.05 - 0) + abs(0.5 - 1) + abs(0.95 + 0.96 + 1.0 - 2)) / 5
    assert cal.expected_calibration_error(confidence, correct) == pytest.approx(expected)
    assert cal.expected_calibration_error(torch.zeros(0), torch.zeros(0, dtype=torch.bool)) is None


def test_mask_temperatures_leave_the_ar_column_alone_and_repeat_the_last_depth():
    c = cal.Calibration(temperatures=(1.5, 2.0, 3.0), block_size=4, checkpoint="sha256:x")
    assert c.mask_temperatures(1) == [1.0]
    assert c.mask_temperatures(4) == [1.0, 1.5, 2.0, 3.0]
    assert c.mask_temperatures(6) == [1.0, 1.5, 2.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="3 numbers > 0"):
        cal.Calibration(temperatures=(1.5, 0.0, 3.0), block_size=4, checkpoint="sha256:x")


def checkpoint_folder(path, block_size: int = 4):
    """A stand-in checkpoint folder: mars_config.json and a weights file (its bytes are its identity)."""
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    write_metadata(path, MarsMetadata(block_size=block_size, objective="mars", mask_token="<m>", mask_token_id=7))
    return path


def fitted(folder, block_size: int = 4) -> cal.Calibration:
    return cal.Calibration(
        temperatures=tuple(1.0 + d / 2 for d in range(1, block_size)),
        block_size=block_size,
        checkpoint=cal.checkpoint_identity(folder),
        ece_before=(0.2,) * (block_size - 1),
        ece_after=(0.05,) * (block_size - 1),
        fit_prompts=3,
        eval_prompts=3,
    )


def test_a_stored_calibration_loads_back_by_folder_and_by_metadata(tmp_path):
    folder = checkpoint_folder(tmp_path / "ckpt")
    stored = fitted(folder)
    cal.store_calibration(folder, stored)
    meta = read_metadata(folder)
    assert meta.calibration["temperatures"] == [1.5, 2.0, 2.5] and meta.objective == "mars"
    assert cal.load_calibration(folder, 4) == stored
    identity = cal.checkpoint_identity(folder)
    assert cal.load_calibration(meta.to_dict(), 4, identity=identity) == stored


def test_a_calibration_of_another_checkpoint_or_block_size_is_refused_naming_both(tmp_path):
    folder = checkpoint_folder(tmp_path / "ckpt")
    stored = fitted(folder)
    cal.store_calibration(folder, stored)
    with pytest.raises(ValueError, match="belongs to block size 4, this checkpoint decodes with block size 8"):
        cal.load_calibration(folder, 8)
    (folder / "adapter_model.safetensors").write_bytes(b"other weights")
    new = cal.checkpoint_identity(folder)
    with pytest.raises(ValueError, match=f"belongs to checkpoint {stored.checkpoint}, not to this one \\({new}\\)"):
        cal.load_calibration(folder, 4)


def test_a_checkpoint_without_calibration_decodes_uncalibrated_and_says_so_once(tmp_path, caplog):
    folder = checkpoint_folder(tmp_path / "plain")
    with caplog.at_level(logging.INFO, logger="mars.calibration_store"):
        assert cal.load_calibration(folder, 4) is None
        assert cal.load_calibration(folder, 4) is None
    said = [r for r in caplog.records if "decode uncalibrated" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_the_loader_attaches_a_mars_checkpoints_calibration_and_nothing_to_other_models(tmp_path):
    from mars.models import attach_calibration

    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, fitted(folder))
    model = torch.nn.Linear(2, 2)
    attach_calibration(model, folder, read_metadata(folder).to_dict())
    assert model.mars_calibration == fitted(folder)
    attach_calibration(model, folder, None)  # a base model, or calibration=False
    assert model.mars_calibration is None


@pytest.mark.slow
def test_the_model_loader_attaches_the_calibration_of_a_gated_adapter_checkpoint(tmp_path):
    from decoding_fixtures import give_adapter_weights

    from mars.adapters import AdapterSettings, attach_adapter
    from mars.models import load_model
    from mars.training.export import export_adapter

    trained = load_model("tiny-random")
    assert trained.model.mars_calibration is None  # not a MARS checkpoint
    attach_adapter(trained.model, AdapterSettings(kind="gated_lora", rank=2), trained.mask.id)
    give_adapter_weights(trained.model, seed=1)
    meta = dict(block_size=3, objective="mars", mask_token=trained.mask.token, mask_token_id=trained.mask.id)
    folder = export_adapter(
        trained.model, trained.tokenizer, tmp_path / "adapter", {**meta, "base_model": "tiny-random"}
    )
    assert load_model(str(folder)).model.mars_calibration is None
    cal.store_calibration(folder, fitted(folder, block_size=3))
    assert load_model(str(folder)).model.mars_calibration.mask_temperatures(3) == [1.0, 1.5, 2.0]
    assert load_model(str(folder), calibration=False).model.mars_calibration is None
    cal.store_calibration(folder, dataclasses.replace(fitted(folder, block_size=3), checkpoint="sha256:another"))
    with pytest.raises(ValueError, match="belongs to checkpoint sha256:another, not to this one"):
        load_model(str(folder))
