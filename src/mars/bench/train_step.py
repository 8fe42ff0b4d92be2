"""Cost of one training step: AR SFT vs MARS, and precision paths side by side.

The paper reports MARS at 2.0-2.2x the GPU-hours and ~1.5x the peak memory of AR SFT.  On a CPU the
precision decides more than the objective: ``--paths`` compares bf16 autocast (``bf16-mixed``) with what ``trainer.precision=auto`` resolves to on this machine (``bf16-true`` with fp32
master weights where the CPU has native bf16, ``32-true`` elsewhere), or any Lightning precision strings.

    mars-bench train-step --batch 8 --length 320 --steps 3                 # demo shape, auto vs bf16-mixed
    mars-bench train-step --paths 32-true,bf16-mixed,bf16-true --objectives mars
    mars-bench train-step --arch-preset qwen2.5-0.5b --device cuda --paths bf16-mixed --attn sdpa flex_attention

Each (path, objective) runs in its own process, so peak memory (CUDA max allocated, or the process's
max RSS on CPU) belongs to it alone, with the optimizer training uses (:func:`mars.training.optim.build_adamw`).
Prints the median seconds per step with its spread, tokens per second, peak memory and the ratios to
the first path and to AR; ``--json-out`` saves the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from mars.bench import cli_options
from mars.bench.loading import ARCH_PRESETS  # real Qwen2.5 shapes (random weights, no download)

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


def build(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    from mars.models import load_model

    if args.arch_preset:
        config = AutoConfig.for_model("qwen2", **ARCH_PRESETS[args.arch_preset])
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=args.attn)
        return model, config.vocab_size - 1
    loaded = load_model(args.model, attn_implementation=args.attn)
    return loaded.model.to(args.device), loaded.mask.id


def step_context(precision: str, device: str):
    """What Lightning's precision plugin does around a step: autocast for ``*-mixed``, nothing else."""
    if precision.endswith("-mixed"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
    return nullcontext()


def one_run(args) -> dict:
    """One (precision, objective) row: the module built, ``args.warmup`` untimed and ``args.steps`` timed steps
    (forward, backward and optimizer step), the step times' median and spread, and the peak memory."""
    from mars.training.optim import build_adamw
    from mars.training.precision import wants_master_weights

    torch.manual_seed(0)
    module = _training_module(args)
    master = wants_master_weights(args.precision)
    opt = build_adamw([{"params": list(module.model.parameters())}], lr=1e-5, betas=(0.9, 0.999), master_weights=master)
    times, losses = _timed_steps(args, module, opt)
    return {
        "precision": args.precision,
        "objective": args.objective,
        "attn": args.attn,
        "optimizer": type(opt).__name__,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "peak_mb": _peak_mb(args.device),
        "tokens_per_s": args.batch * args.length / statistics.median(times),
        "last_loss": losses[-1],
    }


def _training_module(args):
    """The training module of ``args.objective`` around the model, its weights in the precision's dtype."""
    from mars.training.module import MarsModule
    from mars.training.objectives import Objective

    model, mask_id = build(args)
    if args.precision.endswith("-true") and args.precision != "32-true":  # Lightning's convert_module
        model = model.to(torch.bfloat16 if args.precision.startswith("bf16") else torch.float16)
    weights = {"ar": dict(mask_weight=0.0, alpha=1.0), "mars": dict(mask_weight=1.0, alpha=1.0)}[args.objective]
    return MarsModule(
        model,
        mask_id,
        block_size=args.block,
        objective=Objective(args.objective, **weights),
        gradient_checkpointing=args.gradient_checkpointing,
    ).to(args.device)


def _timed_steps(args, module, opt) -> tuple[list[float], list[float]]:
    """Training steps on one random batch (a quarter prompt, the rest response); the seconds and loss of each
    step after the warm-up ones."""
    ids = torch.randint(100, 1000, (args.batch, args.length), device=args.device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, args.length // 4 :] = 1
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    times, losses = [], []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        with step_context(args.precision, args.device):
            out = module.losses(batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(out["loss"]))
    return times, losses


def _peak_mb(device: str) -> float:
    """Peak memory in MB: CUDA's max allocated, or the process's max RSS on CPU (the row runs alone in it)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resolve_paths(text: str, device: str) -> list[str]:
    from mars.training.precision import resolve_precision

    out = []
    for item in (p for p in text.split(",") if p):
        resolved = resolve_precision(item, "cpu" if device == "cpu" else "gpu") if item == "auto" else item
        if resolved not in PRECISIONS:
            raise SystemExit(f"--paths: unknown precision {item!r}; choose from auto or {list(PRECISIONS)}")
        if resolved not in out:
            out.append(resolved)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = cli_options.parser("mars-bench train-step", __doc__)
    cli_options.add_model(p, checkpoint=False)
    p.add_argument("--arch-preset", choices=sorted(ARCH_PRESETS), help="random-weight model with real shapes")
    cli_options.add_device(p)
    p.add_argument(
        "--paths",
        default="bf16-mixed,auto",
        help="precisions to compare, the first is the reference (auto = trainer.precision=auto here)",
    )
    p.add_argument("--objectives", default="ar,mars", help="comma-separated, from ar, mars")
    p.add_argument("--attn", nargs="+", default=["sdpa"], help="attention implementations")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=320, help="tokens per sequence")
    p.add_argument("--block", type=int, default=4, help="MARS training block size")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--precision", help=argparse.SUPPRESS)  # child process mode
    p.add_argument("--objective", choices=["ar", "mars"], help=argparse.SUPPRESS)
    p.add_argument("--json-out", help="also write the rows as JSON here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.objective:
        args.attn = args.attn[0]
        print("RESULT " + json.dumps(one_run(args)), flush=True)
        return
    paths = resolve_paths(args.paths, args.device)
    objectives = cli_options.comma_list(args.objectives, "--objectives", allowed=("ar", "mars"))
    rows = run_children(args, argv, paths, objectives)
    report(args, rows, paths)


def run_children(args, argv, paths: list[str], objectives: list[str]) -> list[dict]:
    """One process per (attention, precision, objective): its peak memory is its own."""
    rows = []
    child_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    for attn in args.attn:
        for precision in paths:
            for objective in objectives:
                cmd = [
                    sys.executable,
                    "-m",
                    "mars.bench.train_step",
                    *child_args,
                    "--objective",
                    objective,
                    "--precision",
                    precision,
                    "--attn",
                    attn,
                ]
                out = subprocess.run(cmd, capture_output=True, text=True)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"benchmark child failed: {' '.join(cmd)}")
                rows.append(json.loads(line[len("RESULT ") :]))
                print(f"  {precision} {objective} {attn}: {rows[-1]['median_s']:.2f} s/step", flush=True)
    return rows


def report(args, rows: list[dict], paths: list[str]) -> None:
    """The table, with each row's ratios to the first precision path and to AR; ``--json-out``."""
    from mars.hardware import describe

    hw = describe()
    print(
        f"\nmodel={args.arch_preset or args.model} device={args.device} ({hw['cuda'] or hw['cpu']}; native bf16: "
        f"{hw['cpu_native_bf16']}) batch={args.batch} length={args.length} block={args.block} "
        f"steps={args.steps} (+{args.warmup} warm-up)"
    )
    print(
        "| attn | precision | optimizer | objective | median s/step | min-max | tokens/s | peak MB | "
        f"time x {paths[0]} | time x AR | memory x AR |"
    )
    print("|" + "---|" * 11)
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if x["attn"] == r["attn"] and x["objective"] == r["objective"] and x["precision"] == paths[0]
            ),
            r,
        )
        ar = next(
            (x for x in rows if x["attn"] == r["attn"] and x["precision"] == r["precision"] and x["objective"] == "ar"),
            None,
        )
        vs_ar = f"{r['median_s'] / ar['median_s']:.2f} | {r['peak_mb'] / ar['peak_mb']:.2f}" if ar else "– | –"
        print(
            f"| {r['attn']} | {r['precision']} | {r['optimizer']} | {r['objective']} | {r['median_s']:.2f} | "
            f"{r['min_s']:.2f}-{r['max_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | "
            f"{r['median_s'] / ref['median_s']:.2f} | {vs_ar} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"hardware": hw, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
