"""Training requests refused before anything loads, each with a message that says what to run instead.

``train.py`` prints a :class:`RunRefused` as one line and exits with status 2, without a traceback: the
request was wrong, not the code.  Each subclass is also the built-in error its case is (a missing stage-1
checkpoint is a ``FileNotFoundError``, an unreachable hub a ``ConnectionError``), so callers that catch
those keep working.
"""

from __future__ import annotations


class RunRefused(Exception):
    """A training request refused before any model or data loaded; the message names the fix."""


class RecipeMissing(RunRefused, ValueError):
    """A model of the paper composed without a recipe (train.yaml's defaults are the embedded model's)."""


class BatchMismatch(RunRefused, ValueError):
    """``global_batch`` cannot be made of the batch size, the processes present and an accumulation."""


class StageMissing(RunRefused, FileNotFoundError):
    """The checkpoint a stage starts from has not been written (or not finished) by the stage before it."""


class NoAccelerator(RunRefused, RuntimeError):
    """A config that asks for GPUs on a machine where torch sees none."""


class DataUnreachable(RunRefused, ConnectionError):
    """A hub dataset that cannot be read here (no hub, nothing cached, no local copy)."""


__all__ = ["BatchMismatch", "DataUnreachable", "NoAccelerator", "RecipeMissing", "RunRefused", "StageMissing"]
