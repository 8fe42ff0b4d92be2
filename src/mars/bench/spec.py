"""Speculative decoding measured the way the ecosystem reports it: lossless verify against the best AR decoder,
per prompt category, at batch 1, greedy.

    mars-bench spec --checkpoint data/adapters/smollm2-135m-mars-rank8 --out outputs/bench/spec
    mars-bench spec --checkpoint <dir> --prompts-file my_prompts.jsonl --limit-per-category 16 --tree 2,1

Each prompt (a JSONL row with a ``prompt`` and a ``category``; by default the held-out set,
``data/prompts/heldout.jsonl``, the first ``--limit-per-category`` of each category) is decoded by the best AR
decoder (``ar-cursor`` of ``mars-bench throughput``: the engine at threshold 1.0 through the decode fast path,
exactly greedy AR) and by verify (``verify=True``; ``--tree``, ``--tree-masks`` and the other verify flags pass
through), back to back in an order that rotates from prompt to prompt, ``--repeats`` times.  The decoding and the
timing are :mod:`mars.bench.throughput`'s.  Per category and overall it reports vLLM's mean acceptance length
(Spec-Bench's mean accepted tokens; docs/decoding.md, "Acceptance figures"), the draft acceptance rate, tokens per
forward, both decoders' tokens/s (median over repeats), the wall-clock speed-up over AR measured in the same run
(median of the per-repeat ratios, [min-max]) and how many prompts verify decoded exactly as AR in every repeat.
Writes ``spec.csv``, ``spec.md`` and ``config.json`` (the resolved settings and the machine) under ``--out``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from mars.bench import cli_options, throughput
from mars.bench.cli_options import check_settings, decoding_values
from mars.bench.throughput import AR_CURSOR, VERIFIED, Variant
from mars.decoding.settings import DecodingSettings, decoding_block_size
from mars.paths import data_dir

VERIFY = Variant("verify", dict(VERIFIED), fixed_threshold=1.0)
DECODERS = (AR_CURSOR, VERIFY)
OVERALL = "overall"
# the decoding flags of this command: the budget, the block size and verify's own settings
DECODING_FIELDS = (
    "max_new_tokens",
    "block_size",
    "tree",
    "tree_masks",
    "draft_length",
    "draft_threshold",
    "chain_drafts",
    "verify_masks",
)


def build_parser():
    p = cli_options.parser("mars-bench spec", __doc__)
    cli_options.add_model(p)
    cli_options.add_dtype(p)
    cli_options.add_device(p)
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: $MARS_THREADS, else every CPU; clamped)"
    )
    cli_options.add_timing(p, repeats=3, warmup=1)
    p.add_argument(
        "--prompts-file",
        default=None,
        help="JSONL, one row per prompt with a 'prompt' (or 'question') and a 'category' string; default: the "
        "held-out set data/prompts/heldout.jsonl",
    )
    p.add_argument("--limit-per-category", type=int, default=8, help="the first N prompts of each category")
    p.add_argument("--no-chat-template", action="store_true")
    cli_options.add_out(p, "outputs/bench/spec")
    names = cli_options.add_decoding(p, include=DECODING_FIELDS, defaults={"max_new_tokens": 64, "block_size": None})
    # throughput.load and apply_runtime read these; this command has no flags for them
    p.set_defaults(decoding_fields=names, arch_preset=None, adapter_rank=None, no_fast_path=False)
    return p


def parse_args(argv: list[str] | None):
    """The command line and the prompts by category, all checked before any model loads."""
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.limit_per_category < 1:
        raise SystemExit("--repeats and --limit-per-category must be >= 1")
    # the default is recorded by its name in the repository and read wherever the package keeps its data
    path = Path(args.prompts_file) if args.prompts_file else data_dir() / "prompts" / "heldout.jsonl"
    args.prompts_file = args.prompts_file or "data/prompts/heldout.jsonl"
    groups = read_categories(path, args.limit_per_category)
    values = decoding_values(args, args.decoding_fields)
    check_settings("decoding flags", **values)
    for v in DECODERS:
        check_settings(f"decoder {v.name}", **{**values, **v.kwargs})
    throughput.apply_runtime(args)
    return args, groups


def read_categories(path: Path, limit: int) -> dict[str, list[str]]:
    """Prompts by category, in the file's order, at most ``limit`` per category; a row without a ``category``
    or a prompt string is refused naming its line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise SystemExit(f"--prompts-file {path}: {err.strerror}") from None
    groups: dict[str, list[str]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"--prompts-file {path}, line {number}: not JSON ({err.msg})") from None
        prompt = row.get("prompt", row.get("question")) if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not isinstance(row.get("category"), str):
            raise SystemExit(
                f"--prompts-file {path}, line {number}: every row needs a 'prompt' (or 'question') string and a "
                "'category' string (the figures are reported per category)"
            )
        kept = groups.setdefault(row["category"], [])
        if len(kept) < limit:
            kept.append(prompt)
    if not groups:
        raise SystemExit(f"--prompts-file {path}: no rows")
    return groups


def main(argv: list[str] | None = None) -> int:
    import torch  # (mars.bench.throughput, imported above, has set the OpenMP wait before torch loads)

    args, groups = parse_args(argv)
    model, tokenizer, metadata = throughput.load(args, getattr(torch, args.dtype))
    block_size = decoding_block_size(args.block_size or None, metadata)
    values = {k: v for k, v in decoding_values(args, args.decoding_fields).items() if v is not None}
    common = dict(
        settings=DecodingSettings(**{**values, "block_size": block_size}),
        chat_template=not args.no_chat_template and tokenizer.chat_template is not None,
    )
    prompts = [p for kept in groups.values() for p in kept]
    warm = {**common, "settings": common["settings"].replace(max_new_tokens=8)}
    for _ in range(args.warmup):  # allocator, kernels, tokenizer caches
        for v in DECODERS:
            throughput.run_one(model, tokenizer, prompts[:1], warm, v, 1.0)
    jobs = [(v, 1.0) for v in DECODERS]
    repeats = [
        throughput.interleave(model, tokenizer, [[p] for p in prompts], common, jobs, rep, f"repeat {rep + 1}")
        for rep in range(args.repeats)
    ]
    rows = summarise(groups, repeats)
    config = {
        **throughput.run_config(args, model, [1], [1.0], block_size),
        "settings": {v.name: common["settings"].replace(**v.kwargs).as_dict() for v in DECODERS},
        "chat_template": common["chat_template"],
        "categories": {name: len(kept) for name, kept in groups.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(rows, out, config)
    print((out / "spec.md").read_text())
    return 0


def summarise(groups: dict[str, list[str]], repeats: list[list[list[dict]]]) -> list[dict]:
    """One row per category (its prompts' span of the run, in order) and one over every prompt."""
    rows, start = [], 0
    for name, kept in groups.items():
        rows.append(category_row(name, range(start, start + len(kept)), repeats))
        start += len(kept)
    return rows + [category_row(OVERALL, range(start), repeats)]


def category_row(name: str, span: range, repeats: list[list[list[dict]]]) -> dict:
    """Both decoders' totals over the prompts in ``span``, per repeat (``repeats[rep][decoder][prompt]``), as
    throughput's rows, against ``ar-cursor``; identical: prompts whose verify output equals AR's in every repeat."""
    runs = {
        v.name: [throughput.combine([parts[j][i] for i in span]) for parts in repeats] for j, v in enumerate(DECODERS)
    }
    ar, verify = (
        throughput.decoder_row(v, runs, AR_CURSOR.name, runs[AR_CURSOR.name][-1]["ids"], 1.0, 1) for v in DECODERS
    )
    pairs = list(zip(runs[VERIFY.name], runs[AR_CURSOR.name]))
    identical = sum(all(v["ids"][k] == a["ids"][k] for v, a in pairs) for k in range(len(span)))
    trees = sorted({parts[DECODERS.index(VERIFY)][i]["tree"] for parts in repeats for i in span} - {None})
    return dict(
        category=name,
        prompts=len(span),
        tree=" ".join(trees),  # the draft layout verify ran with (what --tree auto chose)
        mean_acceptance_length=verify["mean_acceptance_length"],
        tokens_per_forward=verify["tokens_per_forward"],
        draft_acceptance_rate=verify["draft_acceptance_rate"],
        acceptance_by_position=verify["acceptance_by_position"],
        ar_tokens_per_s=ar["tokens_per_s"],
        verify_tokens_per_s=verify["tokens_per_s"],
        speedup=verify["speedup"],
        speedup_min=verify["speedup_min"],
        speedup_max=verify["speedup_max"],
        identical_outputs=identical,
        generated_tokens=verify["generated_tokens"],
        ar_first_token_ms=ar["first_token_ms"],
        verify_first_token_ms=verify["first_token_ms"],
    )


def write_outputs(rows: list[dict], out: Path, config: dict) -> None:
    """``spec.csv`` (every column), ``spec.md`` (the table) and ``config.json``."""
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    with (out / "spec.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "spec.md").write_text("\n".join([*preamble(config), *map(table_row, rows)]) + "\n")


def preamble(config: dict) -> list[str]:
    """The title, what ran where, what each column means, and the table's header."""
    hw = config.get("hardware") or {}
    verify = config["settings"][VERIFY.name]
    return [
        "# Speculative decoding: verify against AR, per category\n",
        f"model `{config.get('checkpoint') or config['model']}`, {config['dtype']} on {config['device']} "
        f"({hw.get('cuda') or hw.get('cpu') or 'cpu'}), {config['threads']} threads, decode fast path "
        f"{config['fast_path']}; batch 1, greedy, max {verify['max_new_tokens']} new tokens, block size "
        f"{verify['block_size']}, tree `{verify['tree']}` (masks: {verify['tree_masks']}); prompts: "
        f"{config['prompts_file']} (at most {config['limit_per_category']} per category); repeats: "
        f"{config['repeats']}, each prompt decoded by both decoders back to back in a rotating order.\n",
        "*tree*: the draft layout verify ran with (what `--tree auto` chose); *mean acc. len*: vLLM's mean acceptance length (Spec-Bench's mean accepted tokens: 1 + drafts accepted per "
        'draft step) and *draft acc.* its draft acceptance rate, defined in docs/decoding.md, "Acceptance '
        "figures\"; *tok/fwd*: verify's generated tokens per forward, the prefill included; *tok/s*: median over "
        "repeats; *speed-up*: verify's tokens/s over `ar-cursor`'s (the engine at threshold 1.0 through the decode "
        "fast path, the best AR decoder of `mars-bench throughput`), median of the per-repeat ratios [min-max]; "
        "*identical*: prompts whose verify output equals AR's, token for token, in every repeat.\n",
        "| category | prompts | tree | mean acc. len | draft acc. | tok/fwd | AR tok/s | verify tok/s | speed-up "
        "| identical |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]


def table_row(r: dict) -> str:
    def num(value, spec: str = ".2f") -> str:
        return "–" if value is None else f"{value:{spec}}"

    rate = "–" if r["draft_acceptance_rate"] is None else f"{100 * r['draft_acceptance_rate']:.0f}%"
    return (
        f"| {r['category']} | {r['prompts']} | {r['tree'] or '–'} | {num(r['mean_acceptance_length'])} | {rate} | "
        f"{num(r['tokens_per_forward'])} | {num(r['ar_tokens_per_s'], '.1f')} | {num(r['verify_tokens_per_s'], '.1f')} | "
        f"{num(r['speedup'])}x [{num(r['speedup_min'])}-{num(r['speedup_max'])}] | {r['identical_outputs']}/{r['prompts']} |"
    )


if __name__ == "__main__":
    sys.exit(main())
