"""Optimizers for training in bf16 without losing small updates.

Pure bf16 weights make a CPU with native bf16 (AMX/AVX512-BF16) step about twice as fast as bf16
autocast, which keeps fp32 weights and casts them on every matmul.  But AdamW's update ``lr * m / sqrt(v)``
is often smaller than half a bf16 ulp of the weight (8 bits of mantissa: a weight of 0.05 moves in
steps of 2^-12 ~ 2.4e-4), and rounding to nearest then drops it: the model silently stops learning.
:class:`MasterWeightAdamW` keeps an fp32 master copy of every bf16 parameter, applies AdamW to the
masters (exactly torch's AdamW) and copies them back rounded, so updates accumulate in fp32 while the
forward and backward run in bf16 — the classic mixed-precision recipe with the model itself in bf16.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on fp32 master copies of (bf16/fp16) model parameters; see the module docstring.

    ``param_groups`` hold the masters, so LR schedulers and Lightning treat it as any AdamW; the masters
    travel in ``state_dict`` so a resumed run continues from the exact fp32 weights.
    """

    def __init__(self, params: Iterable[Any], **kwargs: Any):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                m = p.detach().to(torch.float32).clone().requires_grad_(p.requires_grad)
                self._pairs.append((p, m))
                masters.append(m)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, m in self._pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        super().step()
        for p, m in self._pairs:
            p.copy_(m)  # round to the model's dtype; the fp32 master keeps the bits rounding dropped
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = [m.detach().clone() for _, m in self._pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            if len(masters) != len(self._pairs):
                raise ValueError(f"checkpoint holds {len(masters)} master weights for {len(self._pairs)} parameters")
            with torch.no_grad():
                for (p, m), saved in zip(self._pairs, masters):
                    m.copy_(saved)
                    p.copy_(saved)


def build_adamw(groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], master_weights: bool):
    """torch's AdamW, or :class:`MasterWeightAdamW` when the parameters are low precision."""
    low = any(p.dtype in (torch.bfloat16, torch.float16) for g in groups for p in g["params"])
    if master_weights and low:
        return MasterWeightAdamW(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas)
