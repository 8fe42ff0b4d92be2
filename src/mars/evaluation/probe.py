"""A quick look at a MARS checkpoint: tokens per forward and fidelity on held-out prompts, in minutes.

    python -m mars.evaluation.probe --checkpoint outputs/train/<run>/hf
    python -m mars.evaluation.probe --checkpoint outputs/train/<run>/checkpoints/last.ckpt --n 32

For each threshold it decodes the first ``--n`` held-out prompts (data/prompts/heldout.jsonl, never trained
on) and reports tokens per forward per request, the share of outputs identical to the same checkpoint's
threshold-1.0 output, and the per-token fidelity (share of mask-accepted tokens equal to the model's own
greedy choice given the output's prefix; one extra forward per row).  fp32 by default: agreement figures
from bf16 runs mix in near-tie flips caused by differently shaped inputs.  A Lightning ``.ckpt`` (a run
still training) is read with the run's base model and block size from its ``config.yaml``.  For the full
picture with intervals use ``python evaluate.py checkpoint=... benchmarks=quality``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mars.checkpoint_meta import decoding_block_size
from mars.paths import data_dir


def load(checkpoint: str, base: str | None, dtype: str):
    from mars.models import load_model

    path = Path(checkpoint)
    if path.is_dir():
        loaded = load_model(str(path), dtype=dtype)
        return loaded, decoding_block_size(None, loaded.metadata)
    import yaml

    from mars.export import state_dict_from_lightning

    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    name = base or cfg.get("model", {}).get("name_or_path")
    if not name:
        raise SystemExit(f"{checkpoint}: no config.yaml beside the run; pass --base <the model the run started from>")
    loaded = load_model(name, tiny=cfg.get("model", {}).get("tiny"), dtype="float32")
    loaded.model.load_state_dict(state_dict_from_lightning(path))
    loaded.model.to(getattr(torch, dtype))
    return loaded, int(cfg.get("block", 4))


def main(argv: list[str] | None = None) -> int:
    from mars.decoding import generate
    from mars.decoding.fidelity import ar_predictions, token_fidelity

    p = argparse.ArgumentParser(prog="python -m mars.evaluation.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="an exported HF folder or a Lightning .ckpt")
    p.add_argument("--base", help="base model of a .ckpt (default: from the run's config.yaml)")
    p.add_argument("--prompts", default=str(data_dir() / "prompts" / "heldout.jsonl"))
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--thresholds", default="1.0,0.9,0.8")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int)
    p.add_argument("--out", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    thresholds = sorted({float(t) for t in args.thresholds.split(",")} | {1.0}, reverse=True)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.n]
    prompts = [r["prompt"] for r in rows]
    loaded, block = load(args.checkpoint, args.base, args.dtype)
    model, tok = loaded.model.eval(), loaded.tokenizer
    ids = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in prompts
    ]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ids]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    results, reference = [], None
    for thr in thresholds:
        outs: list = [None] * len(ids)
        flags: list = [None] * len(ids)
        rates: list = [None] * len(ids)
        start = time.perf_counter()
        for b in range(0, len(order), args.batch_size):
            batch = order[b : b + args.batch_size]
            res = generate(
                model,
                tok,
                [ids[i] for i in batch],
                threshold=thr,
                block_size=block,
                max_new_tokens=args.max_new_tokens,
                mask_token_id=loaded.mask.id,
            )
            for j, i in enumerate(batch):
                outs[i], flags[i] = res.token_ids[j], res.from_mask[j]
                rates[i] = res.stats.per_row_tokens[j] / max(1, res.stats.per_row_forwards[j])
        seconds = time.perf_counter() - start
        if reference is None:
            reference = outs
        fid = token_fidelity(outs, ar_predictions(model, ids, outs, suppress_ids=[loaded.mask.id]), flags)
        mask_tokens = sum(r["mask_tokens"] for r in fid)
        results.append(
            {
                "threshold": thr,
                "tokens_per_forward": round(statistics.mean(rates), 3),
                "identical_to_tau_1": round(sum(o == r for o, r in zip(outs, reference)) / len(outs), 3),
                "mask_tokens_share": round(mask_tokens / max(1, sum(r["tokens"] for r in fid)), 3),
                "mask_fidelity": round(sum(r["mask_ar_equal"] for r in fid) / mask_tokens, 3) if mask_tokens else None,
                "generated_tokens": sum(r["tokens"] for r in fid),
                "seconds": round(seconds, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    summary = {
        "checkpoint": args.checkpoint,
        "block_size": block,
        "prompts": len(prompts),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
