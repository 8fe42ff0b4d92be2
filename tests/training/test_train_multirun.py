"""``train.py -m``: Hydra runs every job of a sweep, and a job that fails or is refused is reported when it
happens, not only once the whole sweep is done."""

import json
import sys

import pytest


def refusing_run_folder(root, name):
    """A run folder holding a checkpoint of other settings (a fingerprint of another version): refused."""
    folder = root / "outputs" / "train" / name
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (folder / "fingerprint.json").write_text(json.dumps({"version": 0}))


def test_a_refused_multirun_job_is_reported_as_it_happens(tmp_path, monkeypatch, capfd):
    from mars.cli.train import main

    for block in (2, 4):
        refusing_run_folder(tmp_path, f"tiny-random-mars-b{block}-full")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "model=tiny-random", "block=2,4", "logger=none", "trainer=cpu"])
    with pytest.raises(SystemExit):
        main()  # Hydra raises the first failure once the sweep is done
    out = "".join(capfd.readouterr())
    first = out.index("job #0 (model=tiny-random block=2 logger=none trainer=cpu) failed, the sweep goes on")
    assert "RunMismatchError: The run folder outputs/train/tiny-random-mars-b2-full" in out[first:]
    assert first < out.index("#1 : model=tiny-random block=4")  # before the next job starts
    assert "job #1 (model=tiny-random block=4 logger=none trainer=cpu) failed" in out
