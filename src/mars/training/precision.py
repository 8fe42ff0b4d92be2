"""Which training precision a machine should use (``trainer.precision=auto``).

- GPU: ``bf16-mixed`` (Lightning's autocast; fp32 weights and optimizer).
- CPU with native bf16 (AMX/AVX512-BF16): ``bf16-true`` — weights, activations and gradients in bf16,
  about 2x faster per step than autocast there — with fp32 master weights in the optimizer
  (:class:`mars.training.optim.MasterWeightAdamW`) so that small AdamW updates are not rounded away.
- CPU without native bf16 (e.g. AVX2-only): ``32-true``.  There bf16 matmuls are emulated and run
  50-100x slower than fp32, so bf16 autocast is the slowest choice there.

An explicit precision (``32-true``, ``bf16-mixed``, ``bf16-true`` ...) is used as given; with a
``*-true`` low precision the optimizer keeps master weights unless ``optim.master_weights=false``.
"""

from __future__ import annotations

import warnings

LOW_TRUE = ("bf16-true", "16-true")


def resolve_precision(precision: object, accelerator: object) -> str:
    """Lightning's precision string for ``precision`` (``auto`` resolved) on ``accelerator``."""
    from mars.hardware import SLOW_BF16_WARNING, cpu_has_native_bf16

    text = str(precision)
    on_cpu = _on_cpu(accelerator)
    if text == "auto":
        if not on_cpu:
            return "bf16-mixed"
        return "bf16-true" if cpu_has_native_bf16() else "32-true"
    if on_cpu and ("bf16" in text or text.startswith("16")) and not cpu_has_native_bf16():
        warnings.warn(f"trainer.precision={text}: " + SLOW_BF16_WARNING.split(": ", 1)[1], RuntimeWarning, stacklevel=2)
    return text


def wants_master_weights(precision: str, setting: object = "auto") -> bool:
    """fp32 master weights for the optimizer: with pure low-precision weights, unless turned off."""
    if setting in (True, False):
        return bool(setting)
    return precision in LOW_TRUE


def _on_cpu(accelerator: object) -> bool:
    text = str(accelerator)
    if text == "cpu":
        return True
    if text in ("gpu", "cuda", "mps", "tpu"):
        return False
    import torch  # auto: the accelerator Lightning would pick

    return not torch.cuda.is_available()
