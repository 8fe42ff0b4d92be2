#!/usr/bin/env python
"""Do bf16 weights learn as much as fp32 / bf16 autocast?  Loss curves of the same MARS steps per precision.

    python scripts/precision_curves.py --out benchmarks/training_cpu/precision_curves

Trains the same model on the same batches (same order, same masks) once per precision path, with the
optimizer training uses (:func:`mars.optim.build_adamw`):

- ``32-true``: fp32 weights and math (the reference),
- ``bf16-mixed``: fp32 weights, bf16 autocast (Lightning's ``bf16-mixed``, the previous CPU default),
- ``bf16-true``: bf16 weights with fp32 master weights in AdamW (``trainer.precision=auto`` on a CPU with
  native bf16),
- ``bf16-true-plain``: bf16 weights with plain AdamW (what master weights prevent: updates below half a
  bf16 ulp are rounded away).

The model is the embedded SmolLM2-135M's first ``--layers`` layers with its real weights (the size of the
weights, hence of the ulps, is the real model's; fewer layers keep emulated bf16 affordable on CPUs without
native bf16), on the committed self-distilled rows.  Writes ``curves.csv``, ``curves.png`` and
``summary.json`` (mean absolute gap to fp32 over the last half of the steps, per loss and path).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

PATHS = ("32-true", "bf16-mixed", "bf16-true", "bf16-true-plain")


def truncated_model(layers: int):
    from mars.models import load_model

    loaded = load_model("embedded:smollm2-135m")
    model = loaded.model
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model, loaded


def batches(tokenizer, n: int, batch_size: int, max_length: int, seed: int):
    from mars.data import InstructionDataModule

    dm = InstructionDataModule(tokenizer, batch_size=batch_size, max_length=max_length, seed=seed)
    dm.setup()
    out = []
    for b in dm.train_dataloader():
        out.append({k: v for k, v in b.items() if k in ("input_ids", "loss_mask")})
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} batches in the data")


def train(path: str, args, data) -> list[dict]:
    from mars.module import MarsModule
    from mars.objectives import Objective
    from mars.optim import build_adamw

    torch.manual_seed(args.seed)
    model, loaded = truncated_model(args.layers)
    if path.startswith("bf16-true"):
        model = model.to(torch.bfloat16)
    module = MarsModule(model, loaded.mask.id, block_size=4, objective=Objective("mars"), lr=args.lr)
    opt = build_adamw(
        [{"params": list(module.model.parameters())}],
        lr=args.lr,
        betas=(0.9, 0.999),
        master_weights=path == "bf16-true",
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if path == "bf16-mixed" else nullcontext()
    rows = []
    for step, batch in enumerate(data, 1):
        t0 = time.perf_counter()
        with autocast:
            out = module.losses(batch)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append(
            {
                "path": path,
                "step": step,
                "loss_mask": float(out["loss_mask"]),
                "loss_ar": float(out["loss_ar"]),
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"{path} step {step}: mask {rows[-1]['loss_mask']:.3f} ar {rows[-1]['loss_ar']:.3f} "
            f"({rows[-1]['seconds']:.1f} s)",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/training_cpu/precision_curves")
    args = p.parse_args(argv)
    from mars.hardware import describe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, loaded = truncated_model(args.layers)
    data = batches(loaded.tokenizer, args.steps, args.batch_size, args.max_length, args.seed)
    rows = []
    for path in args.paths.split(","):
        rows += train(path, args, data)
    keys = list(rows[0])
    (out / "curves.csv").write_text(
        ",".join(keys) + "\n" + "".join(",".join(str(r[k]) for k in keys) + "\n" for r in rows)
    )
    ref = {r["step"]: r for r in rows if r["path"] == "32-true"}
    half = args.steps // 2
    summary = {"args": vars(args), "hardware": describe(), "gap_to_fp32_last_half": {}}
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path and r["step"] > half]
        summary["gap_to_fp32_last_half"][path] = {
            loss: sum(abs(r[loss] - ref[r["step"]][loss]) for r in mine) / len(mine)
            for loss in ("loss_mask", "loss_ar")
        }
        summary.setdefault("final", {})[path] = {loss: mine[-1][loss] for loss in ("loss_mask", "loss_ar")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, out / "curves.png", args)
    print(json.dumps(summary["gap_to_fp32_last_half"], indent=2))
    return 0


def plot(rows, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, loss in zip(axes, ("loss_mask", "loss_ar")):
        for name in dict.fromkeys(r["path"] for r in rows):
            pts = [(r["step"], r[loss]) for r in rows if r["path"] == name]
            ax.plot(*zip(*pts), label=name, linewidth=1.2)
        ax.set_title(f"{loss} (SmolLM2-135M, first {args.layers} layers, lr {args.lr:g})")
        ax.set_xlabel("optimizer step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
