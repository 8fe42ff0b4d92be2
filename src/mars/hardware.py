"""What this machine computes fast, and the dtypes and precisions that follow from it.

bf16 pays on a CPU only with native bf16 matrix instructions (AVX512-BF16 or AMX-BF16): there oneDNN
runs bf16 matmuls at about twice the fp32 rate and a bf16 decode step reads half the bytes.  Without
them (e.g. an AVX2-only EPYC) PyTorch emulates bf16 and a matmul runs 50-100x slower than in fp32
(measured: 1.4 vs 107 GFLOP/s on a 2-core AVX2 EPYC).  So ``auto`` means bf16 on GPUs and on CPUs with
native bf16, fp32 elsewhere, and an explicit ``bfloat16`` on a CPU without it warns.

Validation functions here import no torch (configs are checked before torch loads).
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
SLOW_BF16_WARNING = (
    "dtype=bfloat16 on a CPU without native bf16 matrix instructions (no AVX512-BF16/AMX-BF16): PyTorch "
    "emulates bf16 here and matmuls run 50-100x slower than in float32; use dtype=auto or dtype=float32"
)


def validate_dtype(name: object) -> str:
    """One of :data:`DTYPES`, or a clear error listing them (before any model loads)."""
    if name is None:
        return "auto"
    text = str(name).removeprefix("torch.")
    if text not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPES)}")
    return text


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
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


def resolve_dtype(name: str | None, device: object = "cpu"):
    """:func:`resolve_dtype_name` as a ``torch.dtype``."""
    import torch

    return getattr(torch, resolve_dtype_name(name, device))


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


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
