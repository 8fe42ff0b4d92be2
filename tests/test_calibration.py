"""mars.calibration: the fit against known temperatures, the ECE by hand, the draft acceptance table from ranks, and
the stored records' round trip through mars_config.json and the model loader, with their refusals."""

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import torch

from mars import calibration as cal
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
    with pytest.raises(ValueError, match=r"3 numbers in \[0.125, 8\].*mask depth 2 has 0.0"):
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
    with caplog.at_level(logging.INFO, logger="mars.calibration"):
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


# ------------------------------------------------------------------------------------------------
# Hostile stored records: refused at load naming the file and the field
# ------------------------------------------------------------------------------------------------
def edit_stored(folder, key, change):
    """Rewrite ``key`` of the folder's mars_config.json by hand, as a user or another tool could."""
    path = folder / "mars_config.json"
    data = json.loads(path.read_text())
    data[key] = change(data[key])
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "temperatures",
    [
        [1.5, 1e39, 2.0],  # float32 overflows to inf
        [1.5, 1e-300, 2.0],  # float32 underflows to 0: every confidence NaN
        [1.5, 1e-3, 2.0],  # a float32 number, outside the fit's range: every mask accepted
        [1.5, 8.5, 2.0],
        [1.5, math.nan, 2.0],
        [1.5, math.inf, 2.0],
        [1.5, -2.0, 2.0],
        [1.5, True, 2.0],
        [1.5, "2.0", 2.0],
        [1.5, None, 2.0],
        [1.5, 2.0],  # one short
        None,
        "1.5,2,2.5",
    ],
)
def test_a_stored_temperature_outside_the_fit_range_or_not_a_number_is_refused_naming_file_and_field(
    tmp_path, temperatures
):
    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, fitted(folder))
    path = edit_stored(folder, "calibration", lambda c: {**c, "temperatures": temperatures})
    with pytest.raises(
        ValueError, match=rf"{path}: calibration\.temperatures must be a list of 3 numbers in \[0.125, 8\]"
    ):
        cal.load_calibration(folder, 4)


def test_the_fit_range_bounds_themselves_load_and_the_fit_never_leaves_them(tmp_path):
    low, high = cal.TEMPERATURE_RANGE
    assert (low, high) == (0.125, 8.0) == tuple(cal.temperature_grid()[[0, -1]].tolist())
    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, dataclasses.replace(fitted(folder), temperatures=(low, 1.0, high)))
    assert cal.load_calibration(folder, 4).temperatures == (low, 1.0, high)
    logits, correct = synthetic(1.0)
    always_right = cal.MaskScores.from_logits(logits, torch.ones_like(correct))  # wants T -> 0: the lower bound
    always_wrong = cal.MaskScores.from_logits(logits, torch.zeros_like(correct))  # wants T -> inf: the upper one
    assert low <= cal.fit_temperature(always_right.log_top, always_right.correct) <= high
    assert low <= cal.fit_temperature(always_wrong.log_top, always_wrong.correct) <= high


def table(folder, block_size: int = 4) -> cal.DraftAcceptance:
    rows = [[0.5, 0.6, 0.7, 0.75], [0.4, 0.5, 0.55, 0.6], [0.3, 0.4, 0.45, 0.5]][: block_size - 1]
    return cal.DraftAcceptance(rows, block_size=block_size, checkpoint=cal.checkpoint_identity(folder), prompts=6)


def test_the_acceptance_table_conditions_each_depth_on_the_earlier_ones():
    ranks = np.array([[0, 0], [0, 1], [1, 0], [2, -1], [0, 3]])
    table = cal.acceptance_table(ranks, width=2)
    assert table[0] == [3 / 5, 4 / 5]
    # of the 3 steps whose depth 1 is top-1 (with a depth 2), 1 is top-1
    assert table[1][0] == pytest.approx(1 / 3, abs=1e-4)
    assert table[1][1] == pytest.approx(3 / 4, abs=1e-4)  # of the 4 whose depth 1 is top-2 with a depth 2: 3 are top-2
    assert cal.stored_acceptance_table({"draft_acceptance": {"conditional": table}}) == table
    assert cal.stored_acceptance_table({"conditional": table, "prompts": 5}) == table  # the stored object itself
    assert cal.stored_acceptance_table({"draft_acceptance": None}) is None


def test_the_calibration_and_the_draft_acceptance_are_stored_in_one_write_and_load_back(tmp_path, monkeypatch):
    import mars.metadata

    folder = checkpoint_folder(tmp_path / "ckpt")
    writes = []
    real = mars.metadata.atomic_write_json
    monkeypatch.setattr(mars.metadata, "atomic_write_json", lambda *a, **k: writes.append(a[0]) or real(*a, **k))
    cal.store_calibration(folder, fitted(folder), table(folder))
    assert writes == [folder / "mars_config.json"]  # both records, one atomic replacement of the file
    assert cal.load_calibration(folder, 4) == fitted(folder)
    assert cal.load_draft_acceptance(folder, 4) == table(folder)
    stored = json.loads((folder / "mars_config.json").read_text())["draft_acceptance"]
    assert stored["checkpoint"] == fitted(folder).checkpoint and stored["block_size"] == 4
    with pytest.raises(ValueError, match="belong to different checkpoints"):
        cal.store_calibration(folder, fitted(folder), dataclasses.replace(table(folder), checkpoint="sha256:other"))


BAD_TABLES = {
    "strings": lambda t: [["0.5", "0.6", "0.7", "0.75"], *t[1:]],
    "nulls": lambda t: [t[0], [None, None, None, None], t[2]],
    "nan": lambda t: [[math.nan, 0.6, 0.7, 0.75], *t[1:]],
    "inf": lambda t: [[0.5, math.inf, 0.7, 0.75], *t[1:]],
    "negative": lambda t: [t[0], [-0.1, 0.5, 0.55, 0.6], t[2]],
    "over one": lambda t: [t[0], t[1], [0.3, 0.4, 1.2, 0.5]],
    "bool": lambda t: [[True, 0.6, 0.7, 0.75], *t[1:]],
    "flat list": lambda t: t[0][:3],
    "dict rows": lambda t: [{"top-1": 0.5}, {"top-1": 0.4}, {"top-1": 0.3}],
    "a string": lambda t: "0.5,0.6",
    "ragged rows": lambda t: [t[0], t[1][:2], t[2]],
    "an empty row": lambda t: [t[0], [], t[2]],
    "a table for block 8": lambda t: t * 2 + [t[0]],
}


@pytest.mark.parametrize("kind", sorted(BAD_TABLES))
def test_a_malformed_draft_acceptance_table_is_refused_at_load_naming_file_and_field(tmp_path, kind):
    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, fitted(folder), table(folder))
    path = edit_stored(folder, "draft_acceptance", lambda d: {**d, "conditional": BAD_TABLES[kind](d["conditional"])})
    with pytest.raises(ValueError, match=rf"{path}: draft_acceptance\.conditional must be a list of 3 rows"):
        cal.load_draft_acceptance(folder, 4)
    if kind != "a table for block 8":  # (a well-formed table of 7 depths, but not this checkpoint's 3)
        with pytest.raises(ValueError, match=r"draft_acceptance\.conditional must be"):  # never the prior instead
            cal.stored_acceptance_table(json.loads(path.read_text()))


def test_a_draft_acceptance_table_of_another_block_size_or_checkpoint_is_refused_naming_both(tmp_path):
    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, fitted(folder), table(folder))
    path = edit_stored(
        folder, "draft_acceptance", lambda d: {**d, "block_size": 8, "conditional": (d["conditional"] * 3)[:7]}
    )
    with pytest.raises(ValueError, match=rf"{path}: draft_acceptance\.block_size: .* block size 8, .* block size 4"):
        cal.load_draft_acceptance(folder, 4)
    mine = cal.checkpoint_identity(folder)
    path = edit_stored(folder, "draft_acceptance", lambda d: table(folder).to_dict() | {"checkpoint": "sha256:theirs"})
    with pytest.raises(
        ValueError, match=rf"draft_acceptance\.checkpoint: .* sha256:theirs, not to this one \({mine}\)"
    ):
        cal.load_draft_acceptance(folder, 4)
    path = edit_stored(folder, "draft_acceptance", lambda d: {"conditional": d["conditional"], "prompts": 6})
    with pytest.raises(
        ValueError, match=rf"{path}: draft_acceptance lacks the field\(s\) \['block_size', 'checkpoint'\]"
    ):
        cal.load_draft_acceptance(folder, 4)


def test_the_loader_and_the_pre_load_check_refuse_a_bad_table_and_attach_a_good_one(tmp_path):
    from mars.models import attach_calibration

    folder = checkpoint_folder(tmp_path / "ckpt")
    cal.store_calibration(folder, fitted(folder), table(folder))
    model = torch.nn.Linear(2, 2)
    attach_calibration(model, folder, read_metadata(folder).to_dict())
    assert model.mars_draft_acceptance == table(folder).to_dict()
    cal.check_stored_records(folder, read_metadata(folder).to_dict())
    edit_stored(folder, "draft_acceptance", lambda d: {**d, "conditional": [[0.5, "x"]] * 3})
    for check in (attach_calibration, cal.check_stored_records):
        with pytest.raises(ValueError, match="draft_acceptance.conditional must be"):
            args = (model, folder) if check is attach_calibration else (folder,)
            check(*args, read_metadata(folder).to_dict())


def test_the_shipped_adapters_records_load_with_their_identity():
    from mars.paths import bundled_path

    folder = bundled_path("bundled:adapters/smollm2-135m-mars-rank8")
    acceptance = cal.load_draft_acceptance(folder, 4)
    assert acceptance.checkpoint == cal.load_calibration(folder, 4).checkpoint == cal.checkpoint_identity(folder)
    assert len(acceptance.conditional) == 3 and {len(row) for row in acceptance.conditional} == {4}
