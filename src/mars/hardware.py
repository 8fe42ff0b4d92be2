"""What this machine computes fast, the dtypes and precisions that follow from it, and how many threads
decoding uses.

bf16 pays on a CPU only with native bf16 matrix instructions (AVX512-BF16 or AMX-BF16): there oneDNN
runs bf16 matmuls at about twice the fp32 rate and a bf16 decode step reads half the bytes.  Without
them PyTorch emulates bf16 and a matmul runs 50-100x slower than in fp32.  So ``auto`` means bf16 on GPUs
and on CPUs with native bf16, fp32 elsewhere, and an explicit ``bfloat16`` on a CPU without it warns.

OpenMP wait policy.  A decode step opens about 120 parallel regions (the fused GEMM passes), with a little
Python between them.  How long an idle OpenMP thread spins before it sleeps decides two things:

- on an idle machine a short spin (``GOMP_SPINCOUNT=30000``, tens of microseconds) hands work over without a
  futex wake-up, which bridges the Python between two passes and makes a step as fast as ``ACTIVE``;
- when other processes keep the cores busy, spinning competes with them, and a sleeping thread
  (``PASSIVE``) is several times faster than a spinning one.

So :func:`apply_process_defaults` looks at the machine when the process starts: the short spin when fewer
than :data:`IDLE_LOAD` other tasks are running on average over a tenth of a second, ``PASSIVE`` otherwise.
libgomp reads these variables when torch loads it, so it must run before ``import torch`` (the entry points
call it first); an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already in the environment wins.

Thread count.  :func:`configure_threads` takes an explicit count, else ``MARS_THREADS``, else every CPU
this process may run on (``os.sched_getaffinity``): two threads read the weights faster than one.  A count
larger than the machine is clamped with a warning (oversubscribed OpenMP threads only wait for each other).

Nothing here imports torch at module level: configs are checked, and the OpenMP policy set, before torch
loads.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
SLOW_BF16_WARNING = (
    "dtype=bfloat16 on a CPU without native bf16 matrix instructions (no AVX512-BF16/AMX-BF16): PyTorch "
    "emulates bf16 here and matmuls run 50-100x slower than in float32; use dtype=auto or dtype=float32"
)
WAIT_POLICY = "PASSIVE"
SHORT_SPIN = "30000"  # GOMP_SPINCOUNT on an idle machine: tens of microseconds of spinning
IDLE_LOAD = 0.5  # other running tasks (see _load_now) below which the machine counts as idle
THREADS_ENV = "MARS_THREADS"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp's wait settings; a caller's value wins


# ------------------------------------------------------------------------------------------
# What this machine has
# ------------------------------------------------------------------------------------------
def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpuinfo_flags() -> set[str]:
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU has AVX512-BF16 or AMX-BF16 (PyTorch's own probe, else /proc/cpuinfo)."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        if any(p() for p in probes if p is not None):
            return True
    except RuntimeError:  # pragma: no cover - very old builds
        pass
    return bool(_cpuinfo_flags() & set(BF16_CPU_FLAGS))


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def describe() -> dict[str, object]:
    """Facts worth recording beside a benchmark: CPU model, native bf16, threads."""
    import platform

    import torch

    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------------------
# Devices and dtypes
# ------------------------------------------------------------------------------------------
def validate_dtype(name: object) -> str:
    """One of :data:`DTYPES`, or a clear error listing them (before any model loads)."""
    if name is None:
        return "auto"
    text = str(name).removeprefix("torch.")
    if text not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPES)}")
    return text


def device_type(device: object) -> str:
    return str(device).split(":", 1)[0]


def resolve_device(name: str | None) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(name)


def resolve_dtype_name(name: str | None, device: object = "cpu") -> str:
    """The dtype ``name`` means on ``device``: ``auto`` is bfloat16 on GPUs and native-bf16 CPUs, else
    float32.  An explicit bfloat16 on a CPU without native bf16 is honoured with a warning."""
    name = validate_dtype(name)
    is_cpu = device_type(device) == "cpu"
    if name == "auto":
        return "bfloat16" if (not is_cpu or cpu_has_native_bf16()) else "float32"
    if name in ("bfloat16", "float16") and is_cpu and not cpu_has_native_bf16():
        warnings.warn(
            SLOW_BF16_WARNING if name == "bfloat16" else SLOW_BF16_WARNING.replace("bf16", "fp16"),
            RuntimeWarning,
            stacklevel=2,
        )
    return name


# ------------------------------------------------------------------------------------------
# OpenMP wait policy (before torch loads)
# ------------------------------------------------------------------------------------------
def wait_policy(load: float | None) -> dict[str, str]:
    """The OpenMP variables for a machine with ``load`` other tasks running (:func:`_load_now`; None: unknown)."""
    if load is not None and load < IDLE_LOAD:
        return {"GOMP_SPINCOUNT": SHORT_SPIN}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def _load_now(samples: int = 10, interval: float = 0.01) -> float | None:
    """How many other tasks are running now: the mean of ``samples`` readings of the kernel's runnable count
    (``procs_running`` in ``/proc/stat``) less this process.  Not the 1-minute load average: it lags by minutes,
    so a run started just after another job ends would take an idle machine for a busy one and decode
    ``PASSIVE``.  Where there is no ``/proc/stat``, the 1-minute load average; None where neither exists."""
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


# ------------------------------------------------------------------------------------------
# Thread count
# ------------------------------------------------------------------------------------------
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
