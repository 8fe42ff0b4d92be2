"""Lightning checkpoints that can be trusted, and a run that stops cleanly on SIGTERM.

- :class:`AtomicCheckpointIO` (a Lightning ``CheckpointIO`` plugin): Lightning's own ``TorchCheckpointIO``
  serialises the whole checkpoint into memory and lets fsspec write it to a temporary file in the *system*
  temp folder, then moves it onto the target; where ``/tmp`` is another filesystem that move is a copy over
  the old file, so a full disk truncates a good ``last.ckpt``.  This plugin streams ``torch.save`` into a
  temporary file beside the target (:func:`mars.persistence.atomic_write`), hashing the bytes as they
  pass, and records the digest in ``last.ckpt.sha256``.
- :func:`verify_resume_checkpoint`: before a run resumes (before the model loads), the checkpoint is
  checked against that digest; a bit flip is refused naming the file, instead of resuming corrupt AdamW
  state and exporting it as a finished run.
- :class:`GracefulStop`: on SIGTERM Lightning stops after the step in progress (its signal connector);
  this callback saves that step as ``last.ckpt`` (when it ended on an optimizer step, so the checkpoint
  resumes exactly) and the run exits with 128 + SIGTERM.  A step that cannot end within
  ``grace_seconds`` (a 7B step on a CPU) is cut at the deadline: the last periodic checkpoint stays,
  whole, since every save is atomic.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mars.persistence import (
    HashingWriter,
    atomic_write,
    checksum_path,
    recorded_checksums,
    remove_stale_temporaries,
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
    """Refuse a checkpoint file that does not match its recorded checksum (``ChecksumError``, a ValueError,
    naming it); a file without a record (written by another tool) is resumed with a
    warning; a sharded checkpoint folder is left to its strategy."""
    if path is None or not Path(path).is_file():
        return
    remove_stale_temporaries(Path(path).parent, Path(path).name)  # left by a kill during a save
    if not verify_checksum(path):
        log.warning("%s has no recorded checksum (%s): resuming it unverified", path, checksum_path(path).name)


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
    "GracefulStop",
    "SIGTERM_EXIT_CODE",
    "fit_until_sigterm",
    "verify_resume_checkpoint",
]
