"""A training run survives what a busy machine and a careless or hostile user do to it: a kill or a full
disk during the final export or a checkpoint save, a bit-flipped checkpoint, a deleted fingerprint, an
``overwrite`` killed half-way, two runs started in one folder, SIGTERM.  Each on the tiny random model."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_SFT
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file
from test_train_resume import StopAfter

from mars.metadata import read_metadata
from mars.training.fingerprint import RunMismatchError
from mars.training.loss_history import read_losses
from mars.training.run import run


def base(tiny_train_overrides):
    return tiny_train_overrides + ["checkpoint_every=1", "trainer.max_steps=2"]


def _weights_of(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k[len("model.") :]: v for k, v in state.items()}


# ------------------------------------------------------------------------------------------
# The final export
# ------------------------------------------------------------------------------------------
def test_a_run_that_died_in_its_final_export_completes_it_on_rerun(
    compose_cfg, tiny_train_overrides, tmp_path, monkeypatch
):
    """Lightning skips the fit loop of a checkpoint at max_steps, so the export callback never runs again:
    the rerun must export from that checkpoint instead of printing "rerun" forever."""
    cfg = compose_cfg("train", base(tiny_train_overrides))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr("mars.training.export.export_hf", disk_full)
        with pytest.raises(OSError, match="No space left"):
            run(cfg)
    assert not (tmp_path / "run" / "hf").exists()
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2

    out = run(cfg)  # the same command: exports what the final checkpoint holds
    meta = read_metadata(out)
    assert meta is not None and meta.complete and meta.global_step == 2
    exported, saved = load_file(out / "model.safetensors"), _weights_of(tmp_path / "run" / "checkpoints" / "last.ckpt")
    for key, value in exported.items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["complete"] and summary["steps_this_run"] == 0 and summary["checkpoint"] == str(out)
    # exported with the permissions any save_pretrained folder gets (umask, not 0700)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~_umask()
    before = (out / "model.safetensors").stat().st_mtime_ns
    run(cfg)  # and now finished: skipped
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------------
# A missing fingerprint never reads as a match; an interrupted overwrite never passes
# ------------------------------------------------------------------------------------------
def test_an_export_without_its_fingerprint_is_refused_not_skipped(compose_cfg, tiny_train_overrides, tmp_path):
    run(compose_cfg("train", base(tiny_train_overrides)))
    exported = (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "run" / "fingerprint.json").unlink()
    for change in (["block=2", "optim.lr=1e-3"], []):  # other settings, and even the same ones
        with pytest.raises(RunMismatchError, match=r"no fingerprint\.json.*cannot be checked.*overwrite=true"):
            run(compose_cfg("train", base(tiny_train_overrides) + change))
    assert (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns == exported


class Killed(BaseException):
    """Stands for a kill of the process."""


class Cleared(BaseException):
    """The overwrite got through every removal: no need to train."""


class RemovalKiller:
    """Counts the removals (shutil.rmtree, Path.unlink) that check_run_folder makes while it clears a folder
    and raises Killed before the ``kill_at``-th; an overwrite that gets through all of them raises Cleared."""

    def __init__(self, monkeypatch):
        import mars.training.run

        self.real_check, self.real_rmtree = mars.training.run.check_run_folder, shutil.rmtree
        self.removals: list = []
        self.kill_at = 0
        self.clearing = False
        monkeypatch.setattr(shutil, "rmtree", self._counted(shutil.rmtree))
        monkeypatch.setattr(Path, "unlink", self._counted(Path.unlink))
        monkeypatch.setattr(mars.training.run, "check_run_folder", self._check_run_folder)

    def arm(self, kill_at: int) -> None:
        self.removals.clear()
        self.kill_at = kill_at

    def _counted(self, real):
        def removal(*args, **kwargs):
            if self.clearing:
                self.removals.append(args[0])
                if len(self.removals) == self.kill_at:
                    raise Killed(f"killed before removing {args[0]}")
            return real(*args, **kwargs)

        return removal

    def _check_run_folder(self, *args, **kwargs):  # count removals while the folder is being cleared only
        self.clearing = True
        try:
            self.real_check(*args, **kwargs)
        finally:
            self.clearing = False
        if kwargs.get("overwrite"):
            raise Cleared


def test_an_overwrite_killed_at_any_point_never_leaves_a_folder_that_passes_for_the_new_settings(
    compose_cfg, tiny_train_overrides, tmp_path, monkeypatch
):
    """overwrite=true deletes the folder's results; a kill before any one of those deletions must leave a
    folder that the next run (new settings, no overwrite) refuses or retrains, never skips."""
    finished = tmp_path / "finished"
    run(compose_cfg("train", base(tiny_train_overrides) + [f"output_dir={finished}"]))
    old = load_file(finished / "hf" / "model.safetensors")["model.embed_tokens.weight"]

    killer = RemovalKiller(monkeypatch)
    folder = tmp_path / "run"
    rerun = compose_cfg("train", base(tiny_train_overrides) + ["optim.lr=1e-3"])
    overwrite = compose_cfg("train", base(tiny_train_overrides) + ["optim.lr=1e-3", "overwrite=true"])
    for k in range(1, 20):
        killer.real_rmtree(folder, ignore_errors=True)
        shutil.copytree(finished, folder)
        killer.arm(k)
        try:
            run(overwrite)
        except Cleared:
            break  # k is past the last removal: every kill point was tried
        except Killed:
            pass
        try:
            out = run(rerun)
        except RunMismatchError:
            continue  # refused: the folder still says what it holds
        new = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
        assert not torch.equal(new, old), f"killed before removal {k}: the old export passed for the new settings"
    assert k > 3, f"the overwrite removed fewer things than expected: {killer.removals}"


# ------------------------------------------------------------------------------------------
# A corrupt checkpoint is refused on resume
# ------------------------------------------------------------------------------------------
def test_a_bit_flipped_checkpoint_is_refused_naming_the_file(compose_cfg, tiny_train_overrides, tmp_path, monkeypatch):
    cfg = compose_cfg("train", tiny_train_overrides + ["checkpoint_every=1", "trainer.max_steps=3"])
    with pytest.raises(StopAfter.Killed):
        run(cfg, callbacks=[StopAfter(1)])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit, in the middle of the tensors
    ckpt.write_bytes(bytes(data))

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the corrupt checkpoint was found")

    monkeypatch.setattr("mars.training.run.load_model", no_loading)
    with pytest.raises(ValueError, match=rf"{ckpt} is corrupt: its sha256 is [0-9a-f]{{64}}, but .* was recorded"):
        run(cfg)


# ------------------------------------------------------------------------------------------
# One run per folder
# ------------------------------------------------------------------------------------------
HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from mars.persistence import folder_lock
    with folder_lock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(120)
    """
)


def test_a_second_run_in_a_busy_folder_is_refused_with_the_holders_pid(compose_cfg, tiny_train_overrides, tmp_path):
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"in use by another training run: PID {holder.pid} on "):
            run(compose_cfg("train", base(tiny_train_overrides)))
        assert not (folder / "losses.csv").exists() and not (folder / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its lock file stays, naming a dead PID, and is taken over
    assert str(holder.pid) in (folder / ".lock").read_text()
    run(compose_cfg("train", base(tiny_train_overrides)))
    assert [r["step"] for r in read_losses(folder / "losses.csv")] == [1, 2]


# ------------------------------------------------------------------------------------------
# A save that fails (disk full) leaves the previous checkpoint intact
# ------------------------------------------------------------------------------------------
DISK_FULL_SAVE = textwrap.dedent(
    """
    import importlib, os, sys, torch
    module, name = sys.argv[1].rsplit(".", 1)
    io = getattr(importlib.import_module(module), name)()
    disk = sys.argv[2]
    path = os.path.join(disk, "last.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1 << 20)}, path)  # 4 MiB: fits
    with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:  # the disk fills up ...
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
    os.truncate(os.path.join(disk, "filler"), os.path.getsize(os.path.join(disk, "filler")) - (1 << 20))
    try:  # ... so the next, larger checkpoint cannot be written
        io.save_checkpoint({"global_step": 2, "w": torch.ones(3 << 20)}, path)
        print("saved")
    except Exception as err:
        print("save failed:", type(err).__name__)
    ckpt = torch.load(path, weights_only=True)
    print("global_step", ckpt["global_step"], float(ckpt["w"].sum()))
    print("files", sorted(f for f in os.listdir(disk) if f != "filler"))
    """
)


def _small_disk_available() -> bool:
    probe = subprocess.run(
        ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--size", "1048576", "--tmpfs", "/mnt", "true"],
        capture_output=True,
    )
    return probe.returncode == 0


class CaptureIO(Callback):
    def on_fit_start(self, trainer, pl_module):
        io = trainer.strategy.checkpoint_io
        self.name = f"{type(io).__module__}.{type(io).__qualname__}"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (make installs it) for a small disk")
def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_checkpoint(compose_cfg, tiny_train_overrides, tmp_path):
    """The checkpoint IO that training uses, saving onto a 16 MiB filesystem (a bubblewrap tmpfs) that
    fills up: the save fails, the previous checkpoint stays whole, no temporary file is left behind."""
    if not _small_disk_available():
        pytest.skip("bubblewrap cannot mount a tmpfs here")
    capture = CaptureIO()
    run(compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=1"]), callbacks=[capture])
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--size", str(16 << 20), "--tmpfs", str(disk)]
    cmd += [sys.executable, "-c", DISK_FULL_SAVE, capture.name, str(disk)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("save failed: ")
    assert lines[1] == f"global_step 1 {float(1 << 20)}"  # the old checkpoint, whole
    assert lines[2] == "files ['last.ckpt', 'last.ckpt.sha256']"


# ------------------------------------------------------------------------------------------
# SIGTERM checkpoints and exits promptly
# ------------------------------------------------------------------------------------------
def _sigterm_overrides(out: Path) -> list[str]:
    return [
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "logger=none",
        "mask_schedule=random_ratio",  # draws random numbers every step: a resume must restore them too
        f"output_dir={out}",
        "trainer.max_steps=12",
        "checkpoint_every=1000",  # no periodic checkpoint: only SIGTERM writes one
    ]


def _wait_for_steps(out: Path, proc: subprocess.Popen, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(read_losses(out / "losses.csv")) < steps:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def test_sigterm_saves_a_resumable_checkpoint_and_exits_within_ten_seconds(compose_cfg, tmp_path):
    """train.py gets SIGTERM mid-run (a scheduler's stop): it checkpoints the step it was in, exits with 143
    within 10 s, and the rerun ends with exactly the weights of an uninterrupted run."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *_sigterm_overrides(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_steps(out, proc, 2)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        proc.wait(timeout=10)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read().decode()
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert seconds < 10
    steps = [r["step"] for r in read_losses(out / "losses.csv")]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert 2 <= ckpt["global_step"] == steps[-1] < 12  # every finished step is in it
    assert json.loads((out / "train_summary.json").read_text())["complete"] is False
    assert "rerun the same command to resume" in log

    # the killed process ran on one thread; bit-equal weights need the same reduction order here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed = run(compose_cfg("train", _sigterm_overrides(out)))
        straight = run(compose_cfg("train", _sigterm_overrides(tmp_path / "straight")))
    finally:
        torch.set_num_threads(threads)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


HANGING_STEP = textwrap.dedent(
    """
    import sys, time
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.callbacks import Callback
    from mars.training.run import run

    class Hang(Callback):  # a step that takes far longer than the grace period (a 7B step on a CPU)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                time.sleep(600)

    with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
        cfg = compose(config_name="train", overrides=sys.argv[2:])
    run(cfg, callbacks=[Hang()])
    """
)


@pytest.mark.slow
def test_sigterm_during_a_step_longer_than_the_grace_period_still_exits(tmp_path):
    out = tmp_path / "run"
    overrides = [
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "logger=none",
        f"output_dir={out}",
        "trainer.max_steps=100",
        "checkpoint_every=2",
        "stop_grace_seconds=2",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING_STEP, str(REPO / "conf"), *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_steps(out, proc, 3)
        time.sleep(0.5)  # inside the hanging step
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        proc.wait(timeout=10)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout.read().decode()[-3000:]
    assert seconds < 5
    # the periodic checkpoint of step 2 is intact and verified
    from mars.persistence import verify_checksum

    assert verify_checksum(out / "checkpoints" / "last.ckpt")
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
