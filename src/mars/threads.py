"""Thread count and OpenMP wait policy for decoding processes, decided by measurement, set at process start.

OpenMP wait policy.  With libgomp's default (threads spin for a while after each parallel region), a
decode step's ~200 small GEMMs and ~6,000 small ops hand off between threads constantly; when another
process occupies a core, the spinning thread competes with it and single 1536x576 matmuls took 2-16 ms
instead of 0.2-0.6 ms on the 2-vCPU EPYC.  ``PASSIVE`` (threads sleep at once) removes that; it costs a
few microseconds per parallel region.  libgomp reads the variable when torch loads it, so
:func:`apply_process_defaults` must run before ``import torch`` (the entry points call it first); a value
already in the environment wins.

Thread count.  :func:`configure_threads` takes an explicit count, else ``MARS_THREADS``, else every CPU
this process may run on (``os.sched_getaffinity``): on the 2-vCPU EPYC with the fast path and ``PASSIVE``,
two threads read the weights faster than one (``benchmarks/decode_step_cpu``).  A count larger than the
machine is clamped with a warning (oversubscribed OpenMP threads only wait for each other).
"""

from __future__ import annotations

import os
import sys
import warnings

WAIT_POLICY = "PASSIVE"
THREADS_ENV = "MARS_THREADS"


def apply_process_defaults() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise; False when torch is already
    imported (too late for libgomp to see it; the caller's environment then decides)."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return True


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | str | None = None) -> int:
    """The thread count to use: ``threads``, else ``$MARS_THREADS``, else all available CPUs; clamped to
    the machine with a warning; a clear error for anything that is not a positive integer."""
    source = "threads"
    if threads in (None, "", "auto"):
        threads, source = os.environ.get(THREADS_ENV) or None, THREADS_ENV
    available = available_cpus()
    if threads in (None, "", "auto"):
        return available
    try:
        count = int(threads)
    except (TypeError, ValueError):
        count = 0
    if isinstance(threads, bool) or count < 1 or str(count) != str(threads).strip():
        raise ValueError(f"{source}={threads!r}: expected a positive integer (or 'auto')")
    if count > available:
        warnings.warn(
            f"{source}={count} is more than the {available} CPUs this process may use; using {available}",
            RuntimeWarning,
            stacklevel=2,
        )
        count = available
    return count


def configure_threads(threads: int | str | None = None) -> int:
    """Resolve the thread count (see :func:`resolve_threads`) and give it to torch; returns it."""
    import torch

    count = resolve_threads(threads)
    torch.set_num_threads(count)
    return count
