"""Thread count and OpenMP wait policy for decoding processes, decided by measurement, set at process start.

OpenMP wait policy.  A decode step opens ~120 parallel regions (the fused GEMM passes), with a little
Python between them.  How long an idle OpenMP thread spins before it sleeps decides two things
(2-vCPU EPYC, SmolLM2-135M fp32, 1-column step, 2 threads; benchmarks/decode_step_cpu/wait_policy_spin):

- on an idle machine a short spin (``GOMP_SPINCOUNT=30000``, tens of microseconds) hands work over without a
  futex wake-up: 32.9 ms a step against 35.4 ms with ``PASSIVE`` (sleep at once) at 3000 spins there; on a
  2-vCPU AMX Xeon (KVM) 3000 spins were too short to bridge the Python between two passes, and 30000 took a
  1-column step from 32.5-35.2 to 27.2-30.6 ms, as fast as ``ACTIVE`` (benchmarks/decode_step_cpu/intel_stream);
- when other processes keep the cores busy, spinning competes with them: 130 ms against 90 ms with
  ``PASSIVE``, and a spin without end (``ACTIVE``) 300 ms; single 1536x576 matmuls took 2-16 ms
  instead of 0.2-0.6 ms.

So :func:`apply_process_defaults` looks at the machine when the process starts: the short spin when fewer
than :data:`IDLE_LOAD` other tasks are running on average over a tenth of a second, ``PASSIVE`` otherwise.
libgomp reads these variables when torch loads it, so it must run before ``import torch`` (the entry points
call it first); an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already in the environment wins.

Thread count.  :func:`configure_threads` takes an explicit count, else ``MARS_THREADS``, else every CPU
this process may run on (``os.sched_getaffinity``): on the 2-vCPU EPYC with the fast path and ``PASSIVE``,
two threads read the weights faster than one (``benchmarks/decode_step_cpu``).  A count larger than the
machine is clamped with a warning (oversubscribed OpenMP threads only wait for each other).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

WAIT_POLICY = "PASSIVE"
SHORT_SPIN = "30000"  # GOMP_SPINCOUNT on an idle machine: tens of microseconds of spinning
IDLE_LOAD = 0.5  # other running tasks (see _load_now) below which the machine counts as idle
THREADS_ENV = "MARS_THREADS"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp's wait settings; a caller's value wins


def wait_policy(load: float | None) -> dict[str, str]:
    """The OpenMP variables for a machine with ``load`` other tasks running (:func:`_load_now`; None: unknown)."""
    if load is not None and load < IDLE_LOAD:
        return {"GOMP_SPINCOUNT": SHORT_SPIN}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def _load_now(samples: int = 10, interval: float = 0.01) -> float | None:
    """How many other tasks are running now: the mean of ``samples`` readings of the kernel's runnable count
    (``procs_running`` in ``/proc/stat``) less this process.  The 1-minute load average lags by minutes: a run
    started just after another job ended decoded ``PASSIVE`` on an idle machine (``make demo``: AR at 26 instead
    of 35 tokens/s).  Where there is no ``/proc/stat``, the 1-minute load average; None where neither exists."""
    readings = []
    for i in range(samples):
        running = _procs_running()
        if running is None:
            break
        readings.append(running - 1)
        if i + 1 < samples:
            time.sleep(interval)
    if readings:
        return max(0.0, sum(readings) / len(readings))
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
        return None


def _procs_running() -> int | None:
    """The kernel's count of runnable tasks at this moment, this one included (Linux), else None."""
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def wait_policy_chosen() -> bool:
    """True when the environment already sets an OpenMP wait (then nothing here overrides it)."""
    return any(k in os.environ for k in WAIT_VARIABLES)


def apply_process_defaults() -> bool:
    """Set the OpenMP wait policy for this machine's load (see the module docstring) unless the environment
    already sets one; False when torch is already imported (too late for libgomp to see it; the caller's
    environment then decides)."""
    if "torch" in sys.modules:
        return False
    if wait_policy_chosen():
        return True
    os.environ.update(wait_policy(_load_now()))
    return True


def describe_wait_policy() -> str:
    """The OpenMP wait setting this process runs with, for result tables."""
    parts = [f"{k}={os.environ[k]}" for k in WAIT_VARIABLES if os.environ.get(k)]
    return ", ".join(parts) or "OMP_WAIT_POLICY=(unset)"


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
