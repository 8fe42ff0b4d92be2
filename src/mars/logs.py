"""The log output of the libraries mars drives, made readable: each line once, no adverts, one line per task.

- Lightning puts a console handler of its own on the ``lightning`` logger and still lets its records
  propagate to the root logger, where Hydra's handler prints every line a second time.  When the root
  logger has handlers (Hydra's, or any the caller set up), :func:`route_lightning_logs` removes Lightning's
  own console handlers, so each line is printed once, in the root's format, and reaches the run's log file.
  It also drops Lightning's "try installing litlogger" tip, printed on every fit.
- lm-eval logs, per task, a two-line "Custom kwargs can be passed to `--metadata`" warning (for every task
  with its own loader, i.e. all of ours) and a "Building contexts for <task> on rank 0..." line followed by
  a progress bar.  :func:`folded_lm_eval_task_logs` folds these into one line per task:
  ``<task>: contexts built for <n> documents (rank 0)``.
- W&B runs (training's logger, evaluation's tables) are offline unless credentials exist, so W&B never
  prompts for a key (:func:`wandb_mode`), and an offline run names its ``wandb sync`` command
  (:func:`wandb_sync_hint`).
- Deprecation notices the libraries print on every run about calls no user makes (torchdata's ``set_vital``,
  Lightning's ``LeafSpec``, transformers' ``past_key_values``) are dropped by :func:`quiet_library_notices`,
  which the entry points and training call; each is matched by its message, so every other warning shows.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# (category, start of the message): notices about the libraries' own calls, or about keywords mars passes because
# the older transformers versions it supports know no other name (``cache`` is 5.x's), so nothing a user can act on
LIBRARY_NOTICES = (
    (UserWarning, r"'set_vital' is deprecated"),  # torchdata's StatefulDataLoader calling torch.set_vital
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),  # Lightning's _pytree on newer torch
    (FutureWarning, r"`past_key_values` is deprecated and will be removed in version [\d.]+ for `\w+\.forward`"),
)
LIGHTNING_TIPS = "lightning.pytorch.utilities.rank_zero"  # the logger of Lightning's rank-zero messages
LM_EVAL_TASK_LOGGER = "lm_eval.api.task"


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg).lower()


_DROP_ADVERTS = _DropAdverts()


def route_lightning_logs() -> None:
    """Lightning's lines once, through the root logger's handlers when it has any; no LitLogger tip."""
    import lightning  # noqa: F401  (importing it installs the handlers this removes)

    tips = logging.getLogger(LIGHTNING_TIPS)
    if _DROP_ADVERTS not in tips.filters:
        tips.addFilter(_DROP_ADVERTS)
    if not logging.getLogger().handlers:
        return  # nothing else prints them: Lightning's own handlers stay
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's console handlers (never a file handler)
                logger.removeHandler(handler)
        logger.propagate = True


def quiet_library_notices() -> None:
    """Drop the :data:`LIBRARY_NOTICES` (once per process is enough; repeating a filter does not stack it)."""
    for category, message in LIBRARY_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category)


_BUILDING = re.compile(r"Building contexts for (?P<task>.+) on rank (?P<rank>\d+)\.\.\.$")
_CUSTOM_KWARGS = "Custom kwargs can be passed to `--metadata`"


class _TaskLines(logging.Filter):
    """On lm-eval's task logger: drops the custom-kwargs advice and holds back the "Building contexts"
    line until the progress bar that follows it says how many documents there are."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: logging.LogRecord | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _CUSTOM_KWARGS in message:
            return False
        if _BUILDING.match(message):
            self.pending = record
            return False
        return True

    def built(self, total: int | None) -> None:
        """Emit the held line as ``<task>: contexts built for <n> documents (rank r)``."""
        record, self.pending = self.pending, None
        if record is None:
            return
        found = _BUILDING.match(record.getMessage())
        count = "?" if total is None else total
        record.msg, record.args = f"{found['task']}: contexts built for {count} documents (rank {found['rank']})", None
        logging.getLogger(record.name).handle(record)


@contextmanager
def folded_lm_eval_task_logs() -> Iterator[None]:
    """Within the block, lm-eval's per-task setup prints one line per task (module docstring)."""
    import lm_eval.api.task as task_module

    lines = _TaskLines()
    logger = logging.getLogger(LM_EVAL_TASK_LOGGER)
    bar = getattr(task_module, "tqdm", None)  # the context-building bar (lm-eval 0.4.x: the only one there)

    def no_bar(iterable: Any = None, total: int | None = None, **_: Any):
        lines.built(total if total is not None else _len(iterable))
        return iterable

    logger.addFilter(lines)
    if bar is not None:
        task_module.tqdm = no_bar
    try:
        yield
    finally:
        if bar is not None:
            task_module.tqdm = bar
        logger.removeFilter(lines)
        lines.built(None)


def _len(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


def wandb_mode(requested: str = "auto") -> str:
    """``online`` only with credentials; ``offline`` otherwise, so W&B never prompts for a key."""
    if requested in ("online", "offline", "disabled"):
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


def wandb_sync_hint(run) -> str | None:
    """For a W&B run kept offline, the line that says how to upload it (W&B itself is silenced)."""
    if run is None or not getattr(run, "offline", False):
        return None
    return f"W&B run saved offline; upload it with: wandb sync {Path(run.dir).parent}"
