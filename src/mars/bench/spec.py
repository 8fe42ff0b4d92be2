"""Speculative decoding measured the way the ecosystem reports it: lossless verify against the best AR decoder,
per prompt category, at batch 1, greedy.

    mars-bench spec --out outputs/bench/spec          # the embedded model with its shipped MARS adapter
    mars-bench spec --checkpoint <dir> --prompts-file my_prompts.jsonl --limit-per-category 16 --tree 2,1

The checkpoint defaults to the model's shipped MARS checkpoint, as in evaluate.py and serve.py
(``--checkpoint none``: the model as it is, with a warning: its masks had no MARS training).  Each prompt (a JSONL
row with a ``prompt`` and a ``category``, read by :mod:`mars.prompt_files`; by default the held-out set,
``data/prompts/heldout.jsonl``, the first ``--limit-per-category`` of each category) is decoded by the best AR
decoder (``ar-cursor`` of ``mars-bench throughput``: the engine at threshold 1.0 through the decode fast path,
exactly greedy AR) and by verify (``verify=True``; ``--tree``, ``--tree-masks`` and the other verify flags pass
through), back to back in an order that rotates from prompt to prompt, ``--repeats`` times.  The decoding and the
timing are :mod:`mars.bench.timing`'s, the figures :mod:`mars.bench.tables`'.  Per category and overall it
reports vLLM's mean acceptance length (Spec-Bench's mean accepted tokens; docs/decoding.md, "Acceptance
figures"), the draft acceptance rate, tokens per forward, both decoders' tokens/s (median over repeats), the
wall-clock speed-up over AR measured in the same run (median of the per-repeat ratios, [min-max]) and how many
prompts verify decoded exactly as AR in every repeat.
Writes ``spec.csv``, ``spec.md`` and ``config.json`` (the resolved settings and the machine) under ``--out``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

from mars.bench import cli_options
from mars.bench.cli_options import check_settings, decoding_values
from mars.bench.decoders import AR_CURSOR, VERIFIED, Variant
from mars.bench.loading import apply_runtime, load, run_config
from mars.bench.tables import decoder_row, write_csv
from mars.bench.timing import DecodeSetup, combine, interleave, warm_up
from mars.decoding.settings import DecodingSettings, decoding_block_size
from mars.paths import bundled_path, conf_dir, data_dir

VERIFY = Variant("verify", dict(VERIFIED), fixed_threshold=1.0)
DECODERS = (AR_CURSOR, VERIFY)
OVERALL = "overall"  # the row over every prompt: no category of a prompt file may take its name
REFERENCE = "reference"  # --checkpoint's default: the model's shipped MARS checkpoint


class Prompt(NamedTuple):
    text: str
    line: int  # its line in the prompt file (1-based), named in every refusal


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
    cli_options.add_model(
        p,
        checkpoint_help="MARS checkpoint folder (overrides --model); reference: --model's shipped MARS checkpoint "
        "(reference_checkpoint of its conf/model/ file), as evaluate.py and serve.py take it; none: --model as it is",
    )
    p.set_defaults(checkpoint=REFERENCE)
    cli_options.add_dtype(p)
    cli_options.add_device(p)
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: $MARS_THREADS, else every CPU; clamped)"
    )
    cli_options.add_timing(p, repeats=3, warmup=1)
    p.add_argument(
        "--prompts-file",
        default=None,
        help="JSONL, one row per prompt with a 'prompt' (or 'question') string or 'messages', and a 'category' "
        "string; default: the "
        "held-out set data/prompts/heldout.jsonl",
    )
    p.add_argument("--limit-per-category", type=int, default=8, help="the first N prompts of each category")
    p.add_argument("--no-chat-template", action="store_true")
    cli_options.add_out(p, "outputs/bench/spec")
    names = cli_options.add_decoding(p, include=DECODING_FIELDS, defaults={"max_new_tokens": 64, "block_size": None})
    p.set_defaults(decoding_fields=names)
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
    args.checkpoint = resolve_checkpoint(args.model, args.checkpoint)
    args.mars_trained = warn_if_untrained(args.model, args.checkpoint)
    check_prompt_lengths(groups, path, args)
    args.dtype = apply_runtime(threads=args.threads, device=args.device, dtype=args.dtype)
    return args, groups


def reference_checkpoint(model: str) -> str | None:
    """The shipped MARS checkpoint of ``model`` (a conf/model/ file's name, id or name_or_path): its
    ``reference_checkpoint``, the checkpoint evaluate.py and serve.py decode by default; None where it has none."""
    import yaml

    for path in sorted((conf_dir() / "model").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if model in (path.stem, cfg.get("id"), cfg.get("name_or_path")) and cfg.get("reference_checkpoint"):
            return bundled_path(str(cfg["reference_checkpoint"]))
    return None


def resolve_checkpoint(model: str, checkpoint: str | None) -> str | None:
    """``--checkpoint`` as a folder, or None for the base model: ``reference`` is ``model``'s shipped MARS
    checkpoint (none where it ships none), ``none``/``null`` the base model, anything else a folder (checked now)."""
    from mars.metadata import CheckpointError, read_checkpoint

    if checkpoint is None or checkpoint.lower() in ("none", "null"):
        return None
    if checkpoint == REFERENCE:
        return reference_checkpoint(model)
    try:
        read_checkpoint(checkpoint, key="--checkpoint")
    except CheckpointError as err:
        raise SystemExit(str(err)) from None
    return checkpoint


def warn_if_untrained(model: str, checkpoint: str | None) -> bool:
    """Whether the masks measured had MARS training; a warning where they had none (a base model, an AR
    checkpoint): verify stays lossless, but its drafts are then mostly rejected, so the figures measure
    untrained masks rather than MARS."""
    from mars.metadata import mars_trained, read_checkpoint

    trained = checkpoint is not None and mars_trained(read_checkpoint(checkpoint, key="--checkpoint"))
    if not trained:
        what = f"checkpoint {checkpoint}" if checkpoint else f"the base model {model}"
        print(
            f"warning: {what} has had no MARS training: its masks' drafts are mostly rejected, so these figures "
            "measure untrained masks, not MARS (outputs stay identical to AR). Pass --checkpoint <a MARS checkpoint>"
            " (the default, reference, is the model's shipped one where conf/model/ names it).",
            file=sys.stderr,
        )
    return trained


def check_prompt_lengths(groups: dict[str, list[Prompt]], path: Path, args) -> None:
    """Every prompt kept, tokenized as the decoders will tokenize it, leaves room in the model's context for
    ``--max-new-tokens``: the tokenizer and the context are read without the weights, and an over-long prompt is
    refused naming its line before the model loads (skipped where they cannot be read that way: the load then
    reports why)."""
    from mars.decoding.api import encode_prompts

    tokenizer, context = tokenizer_and_context(args.checkpoint or args.model)
    if tokenizer is None or context is None:
        return
    chat = not args.no_chat_template and tokenizer.chat_template is not None
    for prompt in (p for kept in groups.values() for p in kept):
        length = len(encode_prompts(tokenizer, [prompt.text], chat)[0])
        if length + args.max_new_tokens > context:
            raise SystemExit(
                f"--prompts-file {path}, line {prompt.line}: the prompt has {length} tokens"
                f"{' with the chat template' if chat else ''}; with --max-new-tokens {args.max_new_tokens} it would "
                f"pass the model's context of {context} tokens: shorten it or lower --max-new-tokens to "
                f"{max(0, context - length)}"
            )


def tokenizer_and_context(source: str):
    """The tokenizer and context length (``max_position_embeddings``) of the model ``source`` names (a checkpoint
    or gated adapter folder, a hub id, ``embedded:*`` or ``tiny-random``), read without its weights; (None, None)
    where they cannot be read so."""
    import inspect

    from transformers import AutoConfig, AutoTokenizer

    from mars.adapters import read_adapter_meta
    from mars.models import build_tiny_random, embedded_model_dir, embedded_tokenizer

    def context_of(name: str, tiny: dict | None) -> int:
        if name == "tiny-random":
            default = inspect.signature(build_tiny_random).parameters["max_position_embeddings"].default
            return int((tiny or {}).get("max_position_embeddings", default))
        folder = embedded_model_dir() if name.startswith("embedded:") else name
        return int(AutoConfig.from_pretrained(folder).max_position_embeddings)

    try:
        adapter = read_adapter_meta(source) if Path(source).is_dir() else None
        own = source == "tiny-random" or source.startswith("embedded:")
        tokenizer = embedded_tokenizer() if own else AutoTokenizer.from_pretrained(source)
        base = str(adapter.get("base_model")) if adapter else source
        return tokenizer, context_of(base, (adapter or {}).get("base_tiny"))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None, None


def read_categories(path: Path, limit: int) -> dict[str, list[Prompt]]:
    """Prompts by category, in the file's order, at most ``limit`` per category; a bad line (:mod:`mars.prompt_files`),
    a row without a ``category`` and a category named like the overall row are refused naming the line."""
    rows = cli_options.prompt_rows(
        path,
        "--prompts-file",
        fields=("prompt", "question"),
        require={"category": "the figures are reported per category"},
    )
    groups: dict[str, list[Prompt]] = {}
    for row in rows:
        if row.category.strip().lower() == OVERALL:
            raise SystemExit(
                f"--prompts-file {path}, line {row.line}: category {row.category!r} is the name of the row over every "
                "prompt; rename it"
            )
        kept = groups.setdefault(row.category, [])
        if len(kept) < limit:
            kept.append(Prompt(row.prompt, row.line))
    return groups


def main(argv: list[str] | None = None) -> int:
    args, groups = parse_args(argv)
    model, tokenizer, metadata = load(args.checkpoint or args.model, dtype=args.dtype, device=args.device)
    block_size = decoding_block_size(args.block_size or None, metadata)
    values = {k: v for k, v in decoding_values(args, args.decoding_fields).items() if v is not None}
    chat_template = not args.no_chat_template and tokenizer.chat_template is not None
    setup = DecodeSetup(DecodingSettings(**{**values, "block_size": block_size}), chat_template)
    prompts = [p.text for kept in groups.values() for p in kept]
    warm_up(model, tokenizer, prompts[:1], setup, DECODERS, 1.0, args.warmup)
    jobs = [(v, 1.0) for v in DECODERS]
    repeats = [
        interleave(model, tokenizer, [[p] for p in prompts], setup, jobs, rep, f"repeat {rep + 1}")
        for rep in range(args.repeats)
    ]
    rows = summarise(groups, repeats)
    config = {
        **run_config(vars(args), model, device=args.device, batch_sizes=[1], thresholds=[1.0], block_size=block_size),
        "settings": {v.name: setup.settings.replace(**v.kwargs).as_dict() for v in DECODERS},
        "chat_template": chat_template,
        "categories": {name: len(kept) for name, kept in groups.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(rows, out, config)
    print((out / "spec.md").read_text())
    return 0


def summarise(groups: dict[str, list[Prompt]], repeats: list[list[list[dict]]]) -> list[dict]:
    """One row per category (its prompts' span of the run, in order) and one over every prompt."""
    rows, start = [], 0
    for name, kept in groups.items():
        rows.append(category_row(name, range(start, start + len(kept)), repeats))
        start += len(kept)
    return rows + [category_row(OVERALL, range(start), repeats)]


def category_row(name: str, span: range, repeats: list[list[list[dict]]]) -> dict:
    """Both decoders' totals over the prompts in ``span``, per repeat (``repeats[rep][decoder][prompt]``), as
    throughput's rows, against ``ar-cursor``; identical: prompts whose verify output equals AR's in every repeat."""
    runs = {v.name: [combine([parts[j][i] for i in span]) for parts in repeats] for j, v in enumerate(DECODERS)}
    ar, verify = (decoder_row(v, runs, AR_CURSOR.name, runs[AR_CURSOR.name][-1]["ids"], 1.0, 1) for v in DECODERS)
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
    write_csv(rows, out / "spec.csv")
    (out / "spec.md").write_text("\n".join([*preamble(config), *map(table_row, rows)]) + "\n")


def preamble(config: dict) -> list[str]:
    """The title, what ran where, what each column means, and the table's header."""
    hw = config.get("hardware") or {}
    verify = config["settings"][VERIFY.name]
    return [
        "# Speculative decoding: verify against AR, per category\n",
        f"model `{config.get('checkpoint') or config['model']}`"
        f"{'' if config.get('mars_trained', True) else ' (no MARS training: untrained masks)'}, "
        f"{config['dtype']} on {config['device']} "
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
