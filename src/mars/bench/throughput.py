"""Wall-clock throughput: AR with KV cache vs MARS under each cache strategy (the paper's Table 5).

    mars-bench throughput --batch-sizes 1,4,8,16 --repeats 3 --max-new-tokens 64 \
        --thresholds 1.0,0.95 --out results/decoding_speed_cpu

Every decoder runs on the same prompts in one process; within each repeat every batch of prompts runs
through all of them back to back, in a rotating order, so that load drift on a shared machine hits all
of them alike.  For each (threshold, batch size, decoder) it
reports the median tokens/s with its min-max spread, the speedup over AR (median of the per-repeat
ratios), tokens per forward (generated tokens of the batch / batched forwards, and the per-request
mean), the speed-up over tokens per forward (how much of the forwards saved reaches the wall clock), the
time to first token and that ratio over the decode phase alone (after each batch's prefill), and
how many rows equal the AR output token for token (fidelity; at threshold 1.0 it must be all of them), and for
verify rows vLLM's mean acceptance length, draft acceptance rate and acceptance per draft position (defined in
docs/decoding.md, "Acceptance figures").  Writes ``throughput.csv``, ``throughput.md`` and ``config.json`` under
``--out``.

Models: ``--model`` (``embedded:smollm2-135m``, a hub id or a local directory), ``--checkpoint DIR``
(a MARS checkpoint; its block size is read from ``mars_config.json``), or ``--arch-preset
qwen2.5-0.5b|qwen2.5-7b``: a model with the real Qwen2.5 shapes and random weights built from a config
(no download; timing only), with the embedded tokenizer.

Decoding flags (``--max-new-tokens``, ``--metric``, ``--block-size``, ``--cache-block``, ``--lookup-ngram``,
``--draft-model``, ``--max-accept``, ...) are the fields of :class:`~mars.decoding.settings.DecodingSettings`
that the timed decoders do not set themselves, derived by :mod:`mars.bench.cli_options` (help and defaults from the
dataclass); every decoder runs with one DecodingSettings built from them.

Draft sources (``--draft-sources lookup,lookup+masks,model,model+masks``): verified decoding whose drafts come
from prompt lookup or a draft model (``--draft-model``, e.g. ``self:8``, the target's first 8 layers), alone
(plain speculative decoding) or extended by the checkpoint's masks; lossless, listed like the other decoders::

    mars-bench throughput --batch-sizes 1 --caches cursor --verify \
        --draft-sources lookup,lookup+masks --prompts-file eval/offline/quality/data/copy.jsonl

This module is the command line; the decoders it times, the loading, the timing loop and the tables are
:mod:`mars.bench.decoders`, :mod:`~mars.bench.loading`, :mod:`~mars.bench.timing` and :mod:`~mars.bench.tables`,
functions with typed arguments that other tools and scripts call directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mars.bench import cli_options
from mars.bench.cli_options import check_settings, comma_list, decoding_values, positive_ints
from mars.bench.decoders import (
    DRAFT_SOURCE_ROWS,
    VERIFIED,
    VERIFY_SWEEPS,
    DecoderChoice,
    Variant,
    variants,
)
from mars.bench.loading import ARCH_PRESETS, apply_runtime, load, run_config
from mars.bench.tables import summarise_runs, write_tables
from mars.bench.timing import DecodeSetup, time_decoders, warm_up
from mars.decoding.settings import DecodingSettings, decoding_block_size
from mars.hardware import apply_process_defaults

apply_process_defaults()  # the OpenMP wait before torch loads libgomp (mars.hardware says why)

# what scripts time with this command's decoders, prompts and loop (the library's names, importable from here)
__all__ = ["ARCH_PRESETS", "PROMPTS", "VERIFIED", "Variant", "main", "summarise_runs", "time_decoders"]

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "What is the capital of Japan? Answer and then name two famous landmarks there.",
    "Give three tips for staying productive when working from home.",
    "A train travels 60 miles per hour for 3 hours. How far does it go? Show your reasoning.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that returns the factorial of n.",
    "List the planets of the solar system in order from the sun.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the story of Cinderella in a few sentences.",
    "If I have 5 apples and eat 2, then buy 7 more, how many apples do I have?",
    "Describe how to make a cup of tea, step by step.",
    "Why do leaves change color in autumn?",
    "Write an email asking a colleague to reschedule a meeting to Friday.",
    "What is 12 multiplied by 15? Explain how you computed it.",
]


def main(argv: list[str] | None = None) -> int:
    args, batch_sizes, thresholds = parse_args(argv)
    pool = load_prompts(args.prompts_file)
    model, tokenizer, metadata = load(
        args.checkpoint or args.model,
        dtype=args.dtype,
        device=args.device,
        arch_preset=args.arch_preset,
        adapter_rank=args.adapter_rank,
    )
    block_size = decoding_block_size(args.block_size or None, metadata)
    chat_template = not args.no_chat_template and tokenizer.chat_template is not None
    setup = DecodeSetup(base_settings(args, block_size), chat_template)
    vs = variants(decoder_choice(args))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = run_config(
        vars(args), model, device=args.device, batch_sizes=batch_sizes, thresholds=thresholds, block_size=block_size
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"model={args.checkpoint or args.arch_preset or args.model} dtype={args.dtype} device={args.device} "
        f"block_size={block_size} threads={config['threads']}",
        flush=True,
    )
    warm_up(model, tokenizer, pool[:2], setup, vs, thresholds[0], args.warmup)
    rows = []
    for batch in batch_sizes:
        n = max(args.num_prompts, batch)  # small batches run several batches of the same prompts
        prompts = [pool[i % len(pool)] for i in range(n)]
        runs = time_decoders(model, tokenizer, prompts, batch, setup, vs, thresholds, args.repeats)
        for t in thresholds:
            rows.extend(summarise_runs(vs, runs[t], t, batch))
        rows.sort(key=lambda r: (thresholds.index(r["sweep_threshold"]), batch_sizes.index(r["batch"])))
        write_tables(rows, out_dir, config)
    print((out_dir / "throughput.md").read_text())
    return 0


def parse_args(argv: list[str] | None):
    """The command line, checked before any model loads; threads and the fast-path switch applied."""
    args = build_parser().parse_args(argv)
    batch_sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    thresholds = comma_list(args.thresholds, "--thresholds", float)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    from mars.decoding import CACHES

    args.caches = comma_list(args.caches, "--caches", allowed=CACHES)
    args.verify_fallbacks = comma_list(args.verify_fallbacks, "--verify-fallbacks")
    if args.adapter_rank is not None and args.adapter_rank < 1:
        raise SystemExit(f"--adapter-rank must be >= 1, got {args.adapter_rank}")
    args.draft_sources = [d for d in args.draft_sources.split(",") if d]
    for d in args.draft_sources:
        if d not in DRAFT_SOURCE_ROWS:
            raise SystemExit(f"unknown draft source {d!r} in --draft-sources; choose from {list(DRAFT_SOURCE_ROWS)}")
    base = base_settings(args)  # the decoding settings, checked now: the base, each threshold, each variant
    args.verify_rows = parse_verify_rows(args, base)
    for t in thresholds:
        check_settings("--thresholds", **{**base.as_dict(), "threshold": t})
    for v in variants(decoder_choice(args)):
        check_settings(f"decoder {v.name}", **{**base.as_dict(), **v.kwargs})
    args.dtype = apply_runtime(
        threads=args.threads, device=args.device, dtype=args.dtype, fast_path=not args.no_fast_path
    )
    return args, batch_sizes, thresholds


def decoder_choice(args: argparse.Namespace) -> DecoderChoice:
    """The decoders the flags ask for (after :func:`parse_args` has parsed their lists)."""
    return DecoderChoice(
        caches=tuple(args.caches),
        ar_static=args.ar_static,
        eager_baselines=args.eager_baselines,
        full_window=args.full_window,
        block_window=args.block_window,
        jacobi=args.jacobi,
        verify=args.verify,
        verify_fallbacks=tuple(args.verify_fallbacks),
        verify_rows=tuple(args.verify_rows),
        verify_tau=args.verify_tau,
        draft_sources=tuple(args.draft_sources),
        draft_model=args.draft_model,
    )


def base_settings(args: argparse.Namespace, block_size: int | None = None) -> DecodingSettings:
    """The run's DecodingSettings from the decoding flags (every variant replaces its own fields in it;
    ``--draft-model`` is read by the ``model`` draft rows only)."""
    values = decoding_values(args, args.decoding_fields)
    values.pop("draft_model")
    if block_size is not None:
        values["block_size"] = block_size
    return check_settings("decoding flags", **values)


def parse_verify_rows(args, base: DecodingSettings) -> list[dict]:
    """The extra lossless verify rows: one per value of each sweep flag, then each `--verify-rows` entry
    (``field=value,field=value`` entries separated by ``;``).  Values are read as a decoding config's are
    (:meth:`DecodingSettings.from_mapping`) and checked on the run's settings, an error naming the flag."""
    rows: list[tuple[str, dict]] = []
    for flag, (field_name, _) in VERIFY_SWEEPS.items():
        text = getattr(args, flag[2:].replace("-", "_"))
        rows += [(flag, {field_name: v}) for v in comma_list(text, flag)] if text else []
    for entry in filter(None, (e.strip() for e in args.verify_rows.split(";"))):
        pairs = [item.partition("=") for item in entry.split(",") if item.strip()]
        if not pairs or any(not sep or not key.strip() for key, sep, _ in pairs):
            raise SystemExit(f"--verify-rows takes field=value[,field=value] entries separated by ';', got {entry!r}")
        rows.append(("--verify-rows", {key.strip(): value.strip() for key, _, value in pairs}))
    parsed = []
    for flag, text in rows:
        try:
            settings = DecodingSettings.from_mapping({**base.as_dict(), **VERIFIED}, **text)
        except ValueError as err:
            raise SystemExit(f"{flag}: {err}") from None
        if settings.typical_epsilon > 0:
            raise SystemExit(
                f"{flag}: typical_epsilon makes verification lossy, and these rows are the lossless decoder; "
                "evaluate.py decoding=mars_typical measures it beside its quality"
            )
        parsed.append({k: getattr(settings, k) for k in text})
    return parsed


def load_prompts(path: str | None) -> list[str]:
    """The prompts of ``--prompts-file`` (a 'prompt' or 'question' string, or 'messages'), else the built-in ones."""
    if not path:
        return list(PROMPTS)
    return [row.prompt for row in cli_options.prompt_rows(path, "--prompts-file", fields=("prompt", "question"))]


# The decoding settings each timed decoder sets itself (its row name says which); every other field of
# DecodingSettings is a flag of this command, with its help and default declared in the dataclass.
VARIANT_FIELDS = ("decoder", "cache", "window", "verify", "fallback", "draft_source", "full_window", "ar_cache")


def build_parser() -> argparse.ArgumentParser:
    p = cli_options.parser("mars-bench throughput", __doc__)
    cli_options.add_model(p)
    p.add_argument(
        "--arch-preset", default=None, choices=sorted(ARCH_PRESETS), help="random-weight model with real shapes"
    )
    cli_options.add_dtype(p)
    cli_options.add_device(p)
    p.add_argument("--batch-sizes", default="1,4,8,16", help="comma-separated")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="prompts per configuration, at least the batch size (8: the same 8 prompts at batch 1, 4, 8)",
    )
    cli_options.add_timing(p, repeats=3, warmup=1)
    p.add_argument("--thresholds", default="1.0", help="comma-separated: the MARS decoders run at each")
    p.add_argument(
        "--prompts-file",
        default=None,
        help="JSONL with a 'prompt' (or 'question') string or 'messages' per row, e.g. data/prompts/heldout.jsonl "
        "or eval/offline/quality/data/copy.jsonl; default: built-in prompts",
    )
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: $MARS_THREADS, else every CPU; clamped)"
    )
    p.add_argument(
        "--adapter-rank",
        type=int,
        default=None,
        help="decode with the gated adapter truncated to this rank (its top singular directions; fewer factor "
        "bytes per step with masks; threshold 1.0 and verify outputs unchanged, mask predictions move)",
    )
    cli_options.add_out(p, "results/throughput")
    add_decoder_arguments(p)
    p.set_defaults(
        decoding_fields=cli_options.add_decoding(
            p,
            exclude=("threshold", *VARIANT_FIELDS),
            # short outputs, the checkpoint's block size (else 4), a draft model that needs no download
            defaults={"max_new_tokens": 64, "block_size": None, "draft_model": "self:8"},
        )
    )
    return p


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    """Which decoders run beside the AR baselines."""
    p.add_argument("--caches", default="none,block,cursor", help="MARS decoders to time, one per cache strategy")
    p.add_argument("--block-window", action="store_true", help="also time cache=block with window='cache_block'")
    p.add_argument(
        "--full-window",
        action="store_true",
        help="also time cursor with the masks appended even at threshold 1.0 (their cost)",
    )
    p.add_argument("--jacobi", action="store_true", help="also time the Jacobi decoder (cursor cache)")
    add_verify_arguments(p)
    p.add_argument(
        "--ar-static",
        action="store_true",
        help="also time transformers generate with its static cache as an AR baseline candidate",
    )
    p.add_argument(
        "--eager-baselines",
        action="store_true",
        help="also time every AR decoder with the decode fast path off (`<name>-eager`: what the fast path gives AR)",
    )
    p.add_argument(
        "--no-fast-path",
        action="store_true",
        help="time the eager matmuls (F.linear) instead of the decode fast path (same as MARS_FAST_PATH=0)",
    )


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    """The verified decoders: lossless verify, its sweeps and extra rows, verify at every threshold, other drafts."""
    p.add_argument(
        "--verify",
        action="store_true",
        help="also time lossless verified decoding (verify=True, cursor cache; exact greedy output)",
    )
    p.add_argument(
        "--verify-tau",
        action="store_true",
        help="also time verified decoding at every threshold (row `mars-verify-tau`: below 1.0 the masks after "
        "drafts that all passed are accepted while they meet the threshold, the paper's speculative composition)",
    )
    p.add_argument("--verify-fallbacks", default="none", help="fallbacks after a rejected draft: none,jacobi")
    for flag, (field_name, spelling) in VERIFY_SWEEPS.items():
        p.add_argument(
            flag,
            default="",
            help=f"with --verify, also time verified decoding at each of these {field_name} values, comma-separated "
            f"(rows `mars-verify-{spelling}<value>`; --{field_name.replace('_', '-')} sets the plain `mars-verify` row's)",
        )
    p.add_argument(
        "--verify-rows",
        default="",
        help="with --verify, also time verified decoding with these settings combined, entries "
        "`field=value[,field=value]` separated by ';' (e.g. 'window=3,draft_threshold=0.3;window=2': rows "
        "`mars-verify-w3-dt0.3`, `mars-verify-w2`)",
    )
    p.add_argument(
        "--draft-sources",
        default="",
        help=f"also time verified decoding with other drafts, comma-separated from {', '.join(DRAFT_SOURCE_ROWS)} "
        "(`lookup`: prompt-lookup drafts, `model`: a draft model; alone they are plain speculative decoding, "
        "with `+masks` the checkpoint's masks draft too, where `--chain-drafts` puts them: by default, on a CPU, on "
        "the steps the other source has no draft for); rows `verify-<entry>`",
    )


if __name__ == "__main__":
    sys.exit(main())
