"""Lightning checkpoints that can be trusted, and a run that stops cleanly on SIGTERM.

- :class:`AtomicCheckpointIO` (a Lightning ``CheckpointIO`` plugin): Lightning's own ``TorchCheckpointIO``
  serialises the whole checkpoint into memory and lets fsspec write it to a temporary file in the *system*
  temp folder, then moves it onto the target; where ``/tmp`` is another filesystem that move is a copy over
  the old file, so a full disk truncates a good ``last.ckpt``.  This plugin streams ``torch.save`` into a
  temporary file beside the target (:func:`mars.persistence.atomic_write`), hashing the bytes as they
  pass, and records the digest in ``last.ckpt.sha256``.
- Sharded checkpoints (FSDP, ``mars.training.strategies``) are folders of one file per rank: each rank
  digests the files it wrote, once, into ``sha256.rank<r>.json`` inside the folder
  (:func:`write_shard_digests`), and the folder replaces ``last.ckpt`` only when every rank has written
  (:func:`replace_checkpoint_folder`; :func:`recover_checkpoint_folder` undoes a kill between its two renames).
- :func:`verify_resume_checkpoint`: before a run resumes (before the model loads), the checkpoint is
  checked against its digests (a sharded folder: every shard, in parallel threads, by global rank 0 only);
  a bit flip is refused naming the file, instead of resuming corrupt AdamW state and exporting it as a
  finished run.
- :class:`GracefulStop`: on SIGTERM Lightning stops after the step in progress (its signal connector);
  this callback saves that step as ``last.ckpt`` (when it ended on an optimizer step, so the checkpoint
  resumes exactly) and the run exits with 128 + SIGTERM.  A step that cannot end within
  ``grace_seconds`` (a 7B step on a CPU) is cut at the deadline: the last periodic checkpoint stays,
  whole, since every save is atomic.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mars.persistence import (
    ChecksumError,
    HashingWriter,
    atomic_write,
    atomic_write_json,
    checksum_path,
    recorded_checksums,
    remove_stale_temporaries,
    remove_tree,
    sha256_of,
    verify_checksum,
    write_checksum,
)

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


# ------------------------------------------------------------------------------------------
# Saving and checking
# ------------------------------------------------------------------------------------------
class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with an atomic, same-folder, checksummed save (module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        path = Path(path)
        previous = _current_digests(path)
        with atomic_write(path, "wb") as handle:
            writer = HashingWriter(handle)
            torch.save(checkpoint, writer)
            # both digests until the rename is done: a kill between the two leaves either file valid
            write_checksum(path, writer.hexdigest(), *previous)
        write_checksum(path, writer.hexdigest())

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(path).unlink(missing_ok=True)


def _current_digests(path: Path) -> list[str]:
    if not path.is_file():
        return []
    recorded = recorded_checksums(path)
    return recorded[:2] if recorded else [sha256_of(path)]


def verify_resume_checkpoint(path: str | os.PathLike | None) -> None:
    """Refuse a checkpoint that does not match its recorded digests (``ChecksumError``, a ValueError, naming
    the file): a file against its ``.sha256``, a sharded folder against its ranks' digest files.  One without a
    record (written by another tool, or a DeepSpeed folder) is resumed with a warning.  Reads the whole
    checkpoint once: call it in one process of the job (global rank 0)."""
    if path is None or not Path(path).exists():
        return
    path = Path(path)
    if path.is_dir():
        if not verify_sharded_checkpoint(path):
            log.warning("%s has no recorded shard digests: resuming it unverified", path)
        return
    remove_stale_temporaries(path.parent, path.name)  # left by a kill during a save
    if not verify_checksum(path):
        log.warning("%s has no recorded checksum (%s): resuming it unverified", path, checksum_path(path).name)


# ------------------------------------------------------------------------------------------
# Sharded checkpoint folders
# ------------------------------------------------------------------------------------------
DIGEST_FILE = "sha256.rank{rank}.json"
_DIGEST = re.compile(r"sha256\.rank\d+\.json")
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # torch.distributed.checkpoint's file per rank (and thread)
HASH_THREADS = 8  # hashlib releases the GIL: shards are digested side by side, at the disk's pace


def staging_path(target: Path) -> Path:
    """Where a sharded checkpoint is written before it replaces ``target``."""
    return target.with_name(f".{target.name}.partial")


def _previous_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.previous")


def write_shard_digests(folder: Path, rank: int) -> None:
    """Digest the files ``rank`` wrote into a sharded checkpoint folder (its ``__<rank>_*.distcp`` shards; rank 0
    also every other file, the checkpoint's metadata) into ``sha256.rank<rank>.json``: each shard is read
    once, by the process that wrote it, while the others do the same with theirs."""
    files = [p for p in folder.iterdir() if p.is_file() and not _DIGEST.fullmatch(p.name)]
    mine = [p for p in files if (m := _SHARD.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0:
        mine += [p for p in files if not _SHARD.fullmatch(p.name)]
    atomic_write_json(folder / DIGEST_FILE.format(rank=rank), _digests(mine), sort_keys=True)


def _digests(files: list[Path]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(files)))) as pool:
        return dict(zip((p.name for p in files), pool.map(sha256_of, files)))


def verify_sharded_checkpoint(folder: Path) -> bool:
    """True when every file of a sharded checkpoint folder matches the digest its rank recorded; False when
    the folder has no digests at all; ``ChecksumError`` naming the file otherwise (a shard missing, one with no
    digest, one that changed)."""
    records = sorted(p for p in folder.iterdir() if _DIGEST.fullmatch(p.name))
    if not records:
        return False
    recorded: dict[str, str] = {}
    for record in records:
        recorded.update(json.loads(record.read_text(encoding="utf-8")))
    present = sorted(p for p in folder.iterdir() if p.is_file() and not _DIGEST.fullmatch(p.name))
    missing = sorted(set(recorded) - {p.name for p in present})
    unrecorded = [p.name for p in present if p.name not in recorded]
    if missing or unrecorded:
        raise ChecksumError(
            f"{folder} is not the checkpoint its digests describe ("
            + (f"missing {missing[:5]}" if missing else f"files without a digest: {unrecorded[:5]}")
            + "). Delete the folder to resume from an earlier run state, or retrain."
        )
    actual = _digests(present)
    wrong = [name for name, digest in actual.items() if digest != recorded[name]]
    if wrong:
        raise ChecksumError(
            f"{folder / wrong[0]} is corrupt: its sha256 differs from the one recorded when it was written "
            f"({len(wrong)} of {len(actual)} files differ). It cannot be trusted; delete {folder} to resume from an "
            "earlier checkpoint, or retrain."
        )
    return True


def replace_checkpoint_folder(staging: Path, target: Path) -> None:
    """Put a fully written checkpoint folder in the place of ``target`` (a folder or a file): the old one is
    renamed aside, the new one renamed in, then the old one removed; a kill in between leaves the old one
    aside, which :func:`recover_checkpoint_folder` puts back."""
    previous = _previous_path(target)
    if previous.exists():
        remove_tree(previous) if previous.is_dir() else previous.unlink()
    if target.exists():
        os.replace(target, previous)
    os.replace(staging, target)
    checksum_path(target).unlink(missing_ok=True)  # the sidecar of a whole-file checkpoint it replaces
    if previous.is_dir():
        remove_tree(previous)
    elif previous.exists():
        previous.unlink()


def recover_checkpoint_folder(target: Path) -> None:
    """Undo a kill during :func:`replace_checkpoint_folder` (the old checkpoint aside and none in place: put
    back) or during a sharded save (a staging folder: removed).  Global rank 0, before the run resumes."""
    previous, staging = _previous_path(target), staging_path(target)
    if previous.exists() and not target.exists():
        os.replace(previous, target)
        log.warning("%s: restored the checkpoint a kill had left aside during a save", target)
    elif previous.exists():
        remove_tree(previous) if previous.is_dir() else previous.unlink()
    if staging.exists():
        remove_tree(staging)


# ------------------------------------------------------------------------------------------
# Cadence
# ------------------------------------------------------------------------------------------
def checkpoint_callback(folder: Path, every_steps: int, every_minutes: float | None):
    """Lightning's ``ModelCheckpoint`` writing ``last.ckpt`` every ``every_steps`` optimizer steps, or every
    ``every_minutes`` of wall clock when that is set (a 26k-step stage: about one per 30 minutes, not 1,000)."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    cadence = (
        dict(train_time_interval=timedelta(minutes=every_minutes))
        if every_minutes is not None
        else dict(every_n_train_steps=every_steps)
    )
    return ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, **cadence)


class FinalCheckpoint(Callback):
    """Saves ``last.ckpt`` when training ends on a step no periodic checkpoint holds, before the export: a run
    whose export is cut by a kill or a full disk then finishes it from this checkpoint, without training the
    steps since the last periodic one again."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.saved_step: int | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved_step = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step > 0 and self.saved_step != trainer.global_step and not trainer.interrupted:
            trainer.save_checkpoint(self.path)


# ------------------------------------------------------------------------------------------
# SIGTERM
# ------------------------------------------------------------------------------------------
class _SigtermDeadline:
    """Ends the process ``grace_seconds`` after a SIGTERM, however busy the main thread is.

    Python runs a signal handler only between bytecodes of the main thread, so during one long C call (the
    backward pass of a big step) nothing would happen until it returns; the C-level handler does write the
    signal number to the wakeup fd at once, and this thread reads it."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # set_wakeup_fd works in the main thread only; Lightning's handling still applies
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="mars-sigterm-deadline", daemon=True).start()

    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return  # stopped
            if signal.SIGTERM in data:
                break
        if not self.done.wait(self.grace_seconds):
            print(
                f"SIGTERM: the step in progress did not end within {self.grace_seconds:g} s "
                "(stop_grace_seconds); exiting now, the last checkpoint is intact",
                file=sys.stderr,
                flush=True,
            )
            os._exit(SIGTERM_EXIT_CODE)

    def stop(self) -> None:
        self.done.set()
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for fd in reversed(self._pipe):
            os.close(fd)  # the reader sees EOF (or EBADF) and ends
        self._pipe = None


class GracefulStop(Callback):
    """SIGTERM: checkpoint the step Lightning stops after, then let the run exit (module docstring)."""

    def __init__(self, checkpoint_path: str | os.PathLike, grace_seconds: float):
        self.checkpoint_path = Path(checkpoint_path)
        self.deadline = _SigtermDeadline(grace_seconds)
        self.saved_step: int | None = None
        self._stepped = False  # the last finished batch ended with an optimizer step
        self._last_step = 0

    def on_train_start(self, trainer, pl_module):
        self._last_step = trainer.global_step
        self.deadline.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        if trainer.received_sigterm and self._stepped:
            # where ModelCheckpoint saves: the state every periodic checkpoint has, which resumes exactly
            self._save(trainer)

    def on_exception(self, trainer, pl_module, exception):
        if not isinstance(exception, SIGTERMException) or self.saved_step == trainer.global_step:
            return
        # SIGTERM arrived after this step's batch-end hooks (Lightning checks once more after them)
        if not self._stepped:
            log.warning("SIGTERM between optimizer steps: the last periodic checkpoint is the resume point")
        elif trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # a checkpoint taken here, after an epoch's last batch, does not resume exactly (measured)
            log.warning("SIGTERM at an epoch's end: the last periodic checkpoint is the resume point")
        else:
            self._save(trainer)  # mid-epoch this later state resumes exactly too (measured)

    def _save(self, trainer) -> None:
        trainer.save_checkpoint(self.checkpoint_path)
        self.saved_step = trainer.global_step
        log.info("SIGTERM: saved step %d to %s", trainer.global_step, self.checkpoint_path)


def fit_until_sigterm(trainer, module, datamodule, ckpt_path: str | None, stopper: GracefulStop) -> bool:
    """``trainer.fit``; False when SIGTERM stopped it (Lightning raises ``SIGTERMException``, a SystemExit).
    The SIGTERM deadline ends with ``fit`` (Lightning calls no callback teardown after an exception)."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        return False
    finally:
        stopper.deadline.stop()
    return True


def exit_after_sigterm() -> None:
    """End the process now with 128 + SIGTERM: run the exit handlers (loggers' final syncs), flush, and
    skip the interpreter's teardown of thousands of modules, which takes seconds once torch is loaded
    (a scheduler that sent SIGTERM kills the process a few seconds later)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(SIGTERM_EXIT_CODE)


__all__ = [
    "exit_after_sigterm",
    "AtomicCheckpointIO",
    "FinalCheckpoint",
    "GracefulStop",
    "SIGTERM_EXIT_CODE",
    "checkpoint_callback",
    "fit_until_sigterm",
    "recover_checkpoint_folder",
    "replace_checkpoint_folder",
    "staging_path",
    "verify_resume_checkpoint",
    "verify_sharded_checkpoint",
    "write_shard_digests",
]
