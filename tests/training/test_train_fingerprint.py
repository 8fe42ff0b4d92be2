"""A run folder resumes or is skipped only under the settings it was started with; a mismatch is refused
before the model loads, with a message that says how to proceed."""

import json

import pytest
import torch
from test_train_resume import StopAfter

from mars.training.fingerprint import RunMismatchError, run_fingerprint
from mars.training.run import run


def base(tiny_train_overrides):
    return tiny_train_overrides + ["checkpoint_every=1", "trainer.max_steps=2"]


CHANGES = [
    "optim.lr=1e-3",
    "trainer.max_steps=3",
    "seed=1",
    "objective.alpha=0.5",
    "data.max_length=64",
    "data.limit=6",
    "trainer.accumulate_grad_batches=2",
    "mask_schedule=linear_ramp",
    "block=2",
]


def test_a_finished_run_with_other_settings_is_refused_not_skipped(
    compose_cfg, tiny_train_overrides, tmp_path, monkeypatch
):
    run(compose_cfg("train", base(tiny_train_overrides)))
    exported = (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the mismatch was found")

    monkeypatch.setattr("mars.training.run.load_model", no_loading)
    for change in CHANGES:
        key = change.split("=")[0].replace("mask_schedule", "mask_schedule.name")
        overrides = base(tiny_train_overrides) + [change, f"output_dir={tmp_path / 'run'}"]  # same folder
        with pytest.raises(RunMismatchError, match=rf"{key}: folder has .*, now .*run_name=.*overwrite=true"):
            run(compose_cfg("train", overrides))
    assert (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns == exported


def test_a_half_finished_run_is_not_resumed_under_other_settings_and_overwrite_starts_afresh(
    compose_cfg, tiny_train_overrides, tmp_path
):
    with pytest.raises(StopAfter.Killed):
        run(compose_cfg("train", base(tiny_train_overrides)), callbacks=[StopAfter(1)])
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(RunMismatchError, match="optim.lr"):
        run(compose_cfg("train", base(tiny_train_overrides) + ["optim.lr=1e-3"]))
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before  # the record stays true
    # overwrite=true: the old checkpoints go, training starts at step 0 under the new settings
    run(compose_cfg("train", base(tiny_train_overrides) + ["optim.lr=1e-3", "overwrite=true"]))
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["steps_this_run"] == 2 and summary["global_step"] == 2
    assert "lr: 0.001" in (tmp_path / "run" / "config.yaml").read_text()
    # and the folder now belongs to the new settings: the same command is skipped, the old one refused
    run(compose_cfg("train", base(tiny_train_overrides) + ["optim.lr=1e-3"]))
    with pytest.raises(RunMismatchError):
        run(compose_cfg("train", base(tiny_train_overrides)))


def test_the_fingerprint_ignores_how_and_where_but_not_what(compose_cfg, tiny_train_overrides, tmp_path):
    fp = run_fingerprint(compose_cfg("train", tiny_train_overrides))
    same = [
        "gradient_checkpointing=true",
        "crop_noisy_prompt=false",
        "checkpoint_every=7",
        "data.num_workers=1",
        "logger=csv",
        "model.attn_implementation=eager",
        f"output_dir={tmp_path / 'elsewhere'}",
    ]
    for override in same:
        assert run_fingerprint(compose_cfg("train", tiny_train_overrides + [override])) == fp, override
    # the data file by content: a copy elsewhere matches, an edited copy does not
    from conftest import TINY_SFT

    copy = tmp_path / "copy.jsonl"
    copy.write_text(TINY_SFT.read_text())
    assert run_fingerprint(compose_cfg("train", tiny_train_overrides + [f"data.path={copy}"])) == fp
    copy.write_text(TINY_SFT.read_text().replace("Paris", "Lyon"))
    assert run_fingerprint(compose_cfg("train", tiny_train_overrides + [f"data.path={copy}"])) != fp
    # the self-distillation settings that change the answers are in it, those that do not are not
    distill = ["data=self_distill", "data.distill.prompts.source=jsonl", f"data.distill.prompts.path={copy}"]
    d = run_fingerprint(compose_cfg("train", tiny_train_overrides + distill))
    assert run_fingerprint(compose_cfg("train", tiny_train_overrides + distill + ["data.distill.batch_size=3"])) == d
    assert (
        run_fingerprint(compose_cfg("train", tiny_train_overrides + distill + ["data.distill.max_new_tokens=9"])) != d
    )


def test_a_request_that_failed_before_training_does_not_lock_its_folder(compose_cfg, tiny_train_overrides, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi", "response": "hello"}\n{"prompt": "broken\n')
    overrides = base(tiny_train_overrides) + [f"data.path={rows}"]
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        run(compose_cfg("train", overrides))
    from conftest import TINY_SFT

    rows.write_text(TINY_SFT.read_text())  # fixed: other content, so another fingerprint
    run(compose_cfg("train", overrides))
    assert json.loads((tmp_path / "run" / "train_summary.json").read_text())["complete"]


# ------------------------------------------------------------------------------------------
# Complete digests: every byte of a weight file counts
# ------------------------------------------------------------------------------------------
def test_an_edit_anywhere_in_a_large_weight_file_changes_the_fingerprint(compose_cfg, tiny_train_overrides, tmp_path):
    """A local model folder with a 24 MiB weight file: 10,000 embedding rows changed in the middle (the
    first and last MiB untouched) must change the fingerprint."""
    from safetensors.torch import save_file

    folder = tmp_path / "stage1"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    rows = torch.zeros(49152, 128)
    save_file({"model.embed_tokens.weight": rows}, folder / "model.safetensors")
    assert (folder / "model.safetensors").stat().st_size > 16 << 20
    overrides = tiny_train_overrides + [f"model.name_or_path={folder}"]
    before = run_fingerprint(compose_cfg("train", overrides))
    rows[20000:30000] = 0.5
    save_file({"model.embed_tokens.weight": rows}, folder / "model.safetensors")
    assert run_fingerprint(compose_cfg("train", overrides)) != before


def test_an_edit_in_the_middle_of_a_large_data_file_changes_the_fingerprint(
    compose_cfg, tiny_train_overrides, tmp_path
):
    data = tmp_path / "big.jsonl"
    with open(data, "wb") as f:  # 300 MiB, sparse: cheap to make, read as zeros
        f.truncate(300 << 20)
    overrides = tiny_train_overrides + [f"data.path={data}"]
    before = run_fingerprint(compose_cfg("train", overrides))
    with open(data, "r+b") as f:
        f.seek(150 << 20)
        f.write(b'{"prompt": "edited", "response": "in the middle"}')
    assert run_fingerprint(compose_cfg("train", overrides)) != before


def test_a_digest_is_read_once_and_recomputed_after_any_change(tmp_path, monkeypatch):
    import os

    from mars import persistence

    monkeypatch.setenv("MARS_CACHE", str(tmp_path / "cache"))
    reads = []
    real = persistence.sha256_of
    monkeypatch.setattr(persistence, "sha256_of", lambda p: reads.append(p) or real(p))
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    old = os.stat(path).st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(persistence, "RACY_SECONDS", -1.0)  # as if written long ago
        first = persistence.file_sha256(path)
        assert persistence.file_sha256(path) == first and len(reads) == 1  # cached
        path.write_bytes(b"b" * 1000)  # same size ...
        os.utime(path, ns=(old, old))  # ... and the old mtime back: the ctime still tells
        assert persistence.file_sha256(path) != first and len(reads) == 2
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"c")  # modified just now: hashed every time until it settles
    persistence.file_sha256(fresh)
    persistence.file_sha256(fresh)
    assert len(reads) == 4


def test_a_rerun_of_the_quickstart_with_another_limit_gets_its_own_run_folder(compose_cfg, tmp_path, monkeypatch):
    """The settings a quick run varies are in the default run name, so another ``data.limit`` or
    ``trainer.max_steps`` trains beside the first run instead of being refused by its fingerprint."""
    from conftest import TINY_SFT

    monkeypatch.chdir(tmp_path)
    quickstart = ["model=tiny-random", "data=jsonl", f"data.path={TINY_SFT}", "data.batch_size=4", "logger=none"]
    first = compose_cfg("train", quickstart + ["data.limit=8", "trainer.max_steps=1"])
    assert first.output_dir == "outputs/train/tiny-random-mars-b4-full-limit8-steps1"
    run(first)
    again = compose_cfg("train", quickstart + ["data.limit=4", "trainer.max_steps=1"])
    assert again.run_name == "tiny-random-mars-b4-full-limit4-steps1"
    run(again)  # not refused: its own folder
    assert json.loads((tmp_path / again.output_dir / "fingerprint.json").read_text())["data"]["limit"] == 4
    names = {
        "": "tiny-random-mars-b4-full",  # the defaults: no limit, no step cap, no budget
        "trainer.max_steps=5": "tiny-random-mars-b4-full-steps5",
        "budget.minutes=20": "tiny-random-mars-b4-full-20min",
        "budget.minutes=0.5 block=8": "tiny-random-mars-b8-full-0.5min",
    }
    for overrides, name in names.items():
        assert compose_cfg("train", quickstart + overrides.split()).run_name == name
