"""A quick look at a MARS checkpoint: tokens per forward and fidelity on held-out prompts, in minutes.

    mars-bench probe --checkpoint outputs/train/<run>/hf
    mars-bench probe --checkpoint outputs/train/<run>/checkpoints/last.ckpt --n 32

For each threshold it decodes the first ``--n`` held-out prompts (data/prompts/heldout.jsonl, never trained
on) and reports tokens per forward per request, the share of outputs identical to the same checkpoint's
threshold-1.0 output, and the per-token fidelity (share of mask-accepted tokens equal to the model's own
greedy choice given the output's prefix; one extra forward per row).  fp32 by default: agreement figures
from bf16 runs mix in near-tie flips caused by differently shaped inputs.  A Lightning ``.ckpt`` (a run
still training) is read with the run's base model and block size from its ``config.yaml``.  For the full
picture with intervals use ``python evaluate.py checkpoint=... benchmarks=quality``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from mars.bench import cli_options
from mars.decoding.settings import decoding_block_size
from mars.paths import data_dir


def load(checkpoint: str, base: str | None, dtype: str):
    from mars.models import load_model

    path = Path(checkpoint)
    if path.is_dir():
        loaded = load_model(str(path), dtype=dtype)
        return loaded, decoding_block_size(None, loaded.metadata)
    import yaml

    from mars.training.export import state_dict_from_lightning

    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    name = base or cfg.get("model", {}).get("name_or_path")
    if not name:
        raise SystemExit(f"{checkpoint}: no config.yaml beside the run; pass --base <the model the run started from>")
    loaded = load_model(name, tiny=cfg.get("model", {}).get("tiny"), dtype="float32")
    loaded.model.load_state_dict(state_dict_from_lightning(path))
    loaded.model.to(getattr(torch, dtype))
    return loaded, int(cfg.get("block", 4))


# The decoding settings a probe may change (the threshold sweep and the greedy reference are its own).
DECODING_FLAGS = ("block_size", "max_new_tokens", "cache", "cache_block", "window", "max_accept")


def build_parser():
    p = cli_options.parser("mars-bench probe", __doc__)
    p.add_argument("--checkpoint", required=True, help="an exported HF folder or a Lightning .ckpt")
    p.add_argument("--base", help="base model of a .ckpt (default: from the run's config.yaml)")
    p.add_argument(
        "--prompts",
        default=str(data_dir() / "prompts" / "heldout.jsonl"),
        help="JSONL, a 'prompt' string or 'messages' per row",
    )
    p.add_argument("--n", type=int, default=48, help="the first n prompts")
    p.add_argument("--thresholds", default="1.0,0.9,0.8", help="comma-separated (1.0, the reference, is added)")
    p.add_argument("--batch-size", type=int, default=16)
    cli_options.add_dtype(p, default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    cli_options.add_out(p, None, help="also write the result as JSON here")
    names = cli_options.add_decoding(
        p,
        include=DECODING_FLAGS,
        defaults={"max_new_tokens": 96, "block_size": None},  # None: the checkpoint's
    )
    p.set_defaults(decoding_fields=names)
    return p


def parse_args(argv: list[str] | None):
    """The flags, the thresholds and the decoding settings checked before any model loads."""
    args = build_parser().parse_args(argv)
    thresholds = sorted(set(cli_options.comma_list(args.thresholds, "--thresholds", float)) | {1.0}, reverse=True)
    settings = cli_options.check_settings("decoding flags", **cli_options.decoding_values(args, args.decoding_fields))
    for t in thresholds:
        cli_options.check_settings("--thresholds", **{**settings.as_dict(), "threshold": t})
    return args, thresholds


def main(argv: list[str] | None = None) -> int:
    from mars.evaluation.fidelity import ar_predictions, token_fidelity

    args, thresholds = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args.prompts, args.n)
    loaded, block = load(args.checkpoint, args.base, args.dtype)
    model, tok = loaded.model.eval(), loaded.tokenizer
    values = cli_options.decoding_values(args, args.decoding_fields)
    settings = cli_options.check_settings("decoding flags", **{**values, "block_size": values["block_size"] or block})
    ids = chat_prompt_ids(tok, prompts)
    results, reference = [], None
    for thr in thresholds:
        start = time.perf_counter()
        outs, flags, rates = decode(model, tok, ids, settings.replace(threshold=thr), loaded.mask.id, args.batch_size)
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
        "block_size": settings.block_size,
        "prompts": len(prompts),
        "dtype": args.dtype,
        "max_new_tokens": settings.max_new_tokens,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def read_prompts(path: str, n: int) -> list[str]:
    """The prompts of the first ``n`` rows of the prompt file ``--prompts`` names (:mod:`mars.prompt_files`)."""
    return [row.prompt for row in cli_options.prompt_rows(path, "--prompts")[:n]]


def chat_prompt_ids(tok, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn in the model's chat template, ready for the assistant's answer."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in prompts
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def decode(model, tok, ids: list[list[int]], settings, mask_token_id: int, batch_size: int):
    """Every prompt decoded (longest first, in batches): its ids, mask flags and tokens per forward."""
    from mars.decoding import generate

    outs: list = [None] * len(ids)
    flags: list = [None] * len(ids)
    rates: list = [None] * len(ids)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        res = generate(model, tok, [ids[i] for i in batch], mask_token_id=mask_token_id, settings=settings)
        for j, i in enumerate(batch):
            outs[i], flags[i] = res.token_ids[j], res.from_mask[j]
            rates[i] = res.stats.per_row_tokens[j] / max(1, res.stats.per_row_forwards[j])
    return outs, flags, rates


if __name__ == "__main__":
    raise SystemExit(main())
