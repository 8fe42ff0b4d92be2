"""Cost of one training step, AR SFT vs MARS, at the same batch and length (the paper reports MARS at
2.0-2.2x the GPU-hours and ~1.5x the peak memory of AR SFT).

    python -m mars.train_bench --model embedded:smollm2-135m --batch 4 --length 256 --steps 5
    python -m mars.train_bench --arch-preset qwen2.5-0.5b --device cuda --dtype bfloat16 --attn sdpa flex_attention

Each objective runs in its own process so that peak memory (CUDA max allocated, or the process's max
RSS on CPU) belongs to that objective alone.  Prints a table with the median step time and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

# Real shapes of the Qwen2.5 models (random weights: per-step cost only, no download).
ARCH_PRESETS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}


def build(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    from mars.models import load_model

    dtype = getattr(torch, args.dtype)
    if args.arch_preset:
        spec = dict(ARCH_PRESETS[args.arch_preset])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=args.attn)
        return model, config.vocab_size - 1
    loaded = load_model(args.model, attn_implementation=args.attn)
    return loaded.model.to(args.device), loaded.mask.id


def one_objective(args) -> dict:
    from mars.module import MarsModule
    from mars.objectives import Objective

    torch.manual_seed(0)
    model, mask_id = build(args)
    weights = {"ar": dict(mask_weight=0.0, alpha=1.0), "mars": dict(mask_weight=1.0, alpha=1.0)}[args.objective]
    module = MarsModule(model, mask_id, block_size=args.block, objective=Objective(args.objective, **weights),
                        gradient_checkpointing=args.gradient_checkpointing).to(args.device)
    opt = torch.optim.AdamW(module.model.parameters(), lr=1e-5)
    ids = torch.randint(100, 1000, (args.batch, args.length), device=args.device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, args.length // 4:] = 1  # a quarter prompt, the rest response
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    autocast = torch.autocast(device_type=torch.device(args.device).type, dtype=getattr(torch, args.dtype),
                              enabled=args.dtype != "float32")
    times = []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = module.losses(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"objective": args.objective, "attn": args.attn, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "peak_mb": peak,
            "tokens_per_s": args.batch * args.length / statistics.median(times)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m")
    p.add_argument("--arch-preset", choices=sorted(ARCH_PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="autocast dtype (float32 disables autocast)")
    p.add_argument("--attn", nargs="+", default=["sdpa"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--objective", choices=["ar", "mars"], help=argparse.SUPPRESS)  # child process mode
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if args.objective:
        args.attn = args.attn[0]
        print("RESULT " + json.dumps(one_objective(args)), flush=True)
        return
    rows = []
    for attn in args.attn:
        for objective in ("ar", "mars"):
            child = [a for a in (argv or sys.argv[1:])]
            cmd = [sys.executable, "-m", "mars.train_bench", *child, "--objective", objective, "--attn", attn]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"benchmark child failed: {' '.join(cmd)}")
            rows.append(json.loads(line[len("RESULT "):]))
    header = f"| attn | objective | median s/step | min-max | tokens/s | peak MB | time x AR | memory x AR |"
    print(f"\nmodel={args.arch_preset or args.model} device={args.device} dtype={args.dtype} "
          f"batch={args.batch} length={args.length} block={args.block} steps={args.steps}")
    print(header + "\n|" + "---|" * 8)
    for r in rows:
        ar = next(x for x in rows if x["attn"] == r["attn"] and x["objective"] == "ar")
        print(f"| {r['attn']} | {r['objective']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | {r['median_s'] / ar['median_s']:.2f} | "
              f"{r['peak_mb'] / ar['peak_mb']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
