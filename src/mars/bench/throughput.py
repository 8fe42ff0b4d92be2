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
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.bench import cli_options
from mars.bench.cli_options import check_settings, comma_list, decoding_values, positive_ints
from mars.decoding.settings import DecodingSettings, decoding_block_size
from mars.decoding.stats import acceptance_figures, sum_by_position
from mars.hardware import apply_process_defaults, describe_wait_policy

apply_process_defaults()  # the OpenMP wait before torch loads libgomp (mars.hardware says why)

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

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

ARCH_PRESETS: dict[str, dict[str, Any]] = {
    # Shapes of the released Qwen2.5-Instruct configs.
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


@dataclass
class Variant:
    name: str
    kwargs: dict[str, Any]
    is_ar: bool = False  # an AR baseline candidate (exactly greedy AR, one token per forward)
    fixed_threshold: float | None = None  # decoders whose output is exact run at the reference threshold
    eager: bool = False  # run with the decode fast path off (F.linear): the baseline without it


# the project's engine at threshold 1.0 is exactly greedy AR with a per-row KV cache (finished rows leave)
AR_CURSOR = Variant("ar-cursor", dict(decoder="mars", cache="cursor"), is_ar=True, fixed_threshold=1.0)


def build_preset(preset: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mars.models import _prepare_tokenizer, embedded_tokenizer, ensure_mask_token

    if preset not in ARCH_PRESETS:
        raise SystemExit(f"--arch-preset must be one of {sorted(ARCH_PRESETS)}, got {preset!r}")
    config = Qwen2Config(
        **ARCH_PRESETS[preset],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # build in place: a 7B model in fp32 does not fit a small host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    tokenizer = embedded_tokenizer()
    _prepare_tokenizer(tokenizer)
    ensure_mask_token(model, tokenizer)
    return model.eval(), tokenizer, None


def load(args, dtype: torch.dtype):
    if args.arch_preset:
        return build_preset(args.arch_preset, dtype, args.device)
    from mars.models import load_model

    loaded = load_model(args.checkpoint or args.model, dtype=dtype, device=args.device)
    if args.adapter_rank:
        from mars.adapters import truncate_adapter_rank

        kept = truncate_adapter_rank(loaded.model, args.adapter_rank)
        print(f"gated adapter truncated to rank {args.adapter_rank} (every product keeps >= {kept:.1%} of its energy)")
    return loaded.model.eval(), loaded.tokenizer, loaded.metadata


def variants(args) -> list[Variant]:
    """AR baselines first (the fastest of them in each run is the baseline every speedup is against:
    any speed-up that applies to AR goes to AR too), then the MARS decoders."""
    out = [Variant("ar-hf", dict(decoder="ar"), is_ar=True, fixed_threshold=1.0)]
    if args.ar_static:
        out.append(Variant("ar-hf-static", dict(decoder="ar", ar_cache="static"), is_ar=True, fixed_threshold=1.0))
    out.append(AR_CURSOR)
    if args.eager_baselines:  # the AR decoders without the fast path, to show what it gives AR
        for v in list(out):
            out.append(Variant(f"{v.name}-eager", v.kwargs, is_ar=True, fixed_threshold=1.0, eager=True))
    for cache in args.caches:
        out.append(Variant(f"mars-{cache}", dict(decoder="mars", cache=cache)))
    if args.full_window:
        out.append(Variant("mars-cursor+masks", dict(decoder="mars", cache="cursor", full_window=True)))
    if args.block_window:
        out.append(Variant("mars-block-fill", dict(decoder="mars", cache="block", window="cache_block")))
    if args.jacobi:
        out.append(Variant("jacobi-cursor", dict(decoder="jacobi", cache="cursor")))
    if args.verify:
        for fallback in args.verify_fallbacks:
            name = f"mars-verify{'' if fallback == 'none' else '-' + fallback}"
            out.append(Variant(name, {**VERIFIED, "fallback": fallback}, fixed_threshold=1.0))
        for overrides in args.verify_rows:  # the same lossless decoder with other settings, side by side
            out.append(Variant(verify_row_name(overrides), {**VERIFIED, **overrides}, fixed_threshold=1.0))
    if args.verify_tau:  # verified drafts plus the masks that meet each threshold: lossy below 1.0
        out.append(Variant("mars-verify-tau", dict(VERIFIED)))
    return out + [draft_variant(entry, args) for entry in args.draft_sources]


DRAFT_SOURCE_ROWS = ("lookup", "lookup+masks", "model", "model+masks")
# Sweeps of one verify setting: flag -> (DecodingSettings field, how its rows' names spell it).  Each value is
# a row `mars-verify-<spelling><value>`; `--verify-rows` combines several fields in one row.
VERIFY_SWEEPS = {
    "--verify-draft-thresholds": ("draft_threshold", "dt"),
    "--verify-windows": ("window", "w"),
    "--verify-chains": ("chain_drafts", "chain-"),
}
VERIFY_SPELLING = dict(VERIFY_SWEEPS.values())


def verify_row_name(overrides: dict) -> str:
    """``{"window": 3, "draft_threshold": 0.3}`` -> ``mars-verify-w3-dt0.3``."""
    parts = [
        f"{VERIFY_SPELLING.get(k, k + '=')}{format(v, 'g') if isinstance(v, float) else v}"
        for k, v in overrides.items()
    ]
    return "-".join(["mars-verify", *parts])


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


# every lossless row: the MARS engine verifying its drafts, per-row KV cache
VERIFIED = dict(decoder="mars", cache="cursor", verify=True)


def draft_variant(entry: str, args) -> Variant:
    """A verified decoder drafting from prompt lookup or a draft model: ``lookup``/``model`` alone (window 1,
    plain speculative decoding) or ``+masks`` (the checkpoint's masks draft too, as ``chain_drafts`` places them:
    with its default, on a CPU, on the steps the other source has no draft for; on an accelerator after every
    step's drafts, extending them)."""
    source = entry.split("+")[0]
    kwargs = {**VERIFIED, "draft_source": source}
    if source == "model":
        kwargs["draft_model"] = args.draft_model
    if not entry.endswith("+masks"):
        kwargs["window"] = 1
    return Variant(f"verify-{entry}", kwargs, fixed_threshold=1.0)


def run_one(model, tokenizer, prompts, common: dict, variant: Variant, threshold: float) -> dict:
    """Decode one batch of ``prompts`` with ``variant``.  ``common`` holds the run's ``settings`` (one
    DecodingSettings from the flags) and ``chat_template``; the variant replaces its fields in it."""
    from mars.decoding import generate

    threshold = variant.fixed_threshold if variant.fixed_threshold is not None else threshold
    settings = common["settings"].replace(**variant.kwargs, threshold=threshold)
    with fast_path_off(variant.eager):
        res = generate(model, tokenizer, prompts, chat_template=common["chat_template"], settings=settings)
    extra = res.stats.extra
    return dict(
        tokens=res.stats.generated_tokens,
        forwards=res.stats.forwards,
        seconds=res.stats.seconds,
        first_token_seconds=res.stats.first_token_seconds,
        ids=list(res.token_ids),
        row_rates=[t / f for t, f in zip(res.stats.per_row_tokens, res.stats.per_row_forwards) if f],
        proposed=list(extra.get("drafts_proposed") or ()),
        accepted=list(extra.get("drafts_accepted") or ()),
        draft_steps=extra.get("num_drafts") or 0,
        tree=extra.get("tree"),  # verify's draft layout (tree="auto" chooses one per run)
    )


def combine(parts: list[dict]) -> dict:
    """One decoder's totals over the batches of a repeat, with its acceptance figures (verify)."""
    firsts = [p["first_token_seconds"] for p in parts]
    acceptance = acceptance_figures(
        sum_by_position(p["proposed"] for p in parts),
        sum_by_position(p["accepted"] for p in parts),
        sum(p["draft_steps"] for p in parts),
    )
    return dict(
        tokens=sum(p["tokens"] for p in parts),
        forwards=sum(p["forwards"] for p in parts),
        seconds=sum(p["seconds"] for p in parts),
        first_token_seconds=None if None in firsts else sum(firsts),
        batches=len(parts),
        ids=[ids for p in parts for ids in p["ids"]],
        row_tpf=statistics.mean(rate for p in parts for rate in p["row_rates"]),
        draft_acceptance=acceptance["draft_acceptance_rate"],
        acceptance=acceptance,
    )


@contextmanager
def fast_path_off(off: bool):
    """``MARS_FAST_PATH=0`` inside the block when ``off`` (the decoders read it at every call)."""
    if not off:
        yield
        return
    old = os.environ.get("MARS_FAST_PATH")
    os.environ["MARS_FAST_PATH"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MARS_FAST_PATH", None)
        else:
            os.environ["MARS_FAST_PATH"] = old


def fast_path_state(model) -> str:
    """``on``, or ``off (why)``: what the decode fast path did for this run (recorded with the figures)."""
    from mars.decoding import fastpath

    if not fastpath.enabled_by_env():
        return f"off ({fastpath.ENV}=0)"
    if next(model.parameters()).device.type != "cpu":
        return "off (not a CPU model)"
    reason = fastpath.unavailable_reason(model)
    return "on" if reason is None else f"off ({reason})"


def fmt(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    args, batch_sizes, thresholds = parse_args(argv)
    model, tokenizer, metadata = load(args, getattr(torch, args.dtype))
    block_size = decoding_block_size(args.block_size or None, metadata)
    common = dict(
        settings=base_settings(args, block_size),
        chat_template=not args.no_chat_template and tokenizer.chat_template is not None,
    )
    vs = variants(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = run_config(args, model, batch_sizes, thresholds, block_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"model={args.checkpoint or args.arch_preset or args.model} dtype={args.dtype} device={args.device} "
        f"block_size={block_size} threads={torch.get_num_threads()}",
        flush=True,
    )
    pool = load_prompts(args.prompts_file)
    warm = {**common, "settings": common["settings"].replace(max_new_tokens=8)}
    for v in vs:  # warm-up: allocator, kernels, tokenizer caches
        for _ in range(args.warmup):
            run_one(model, tokenizer, pool[:2], warm, v, thresholds[0])
    rows = []
    for batch in batch_sizes:
        n = max(args.num_prompts, batch)  # small batches run several batches of the same prompts
        prompts = [pool[i % len(pool)] for i in range(n)]
        runs = time_decoders(model, tokenizer, prompts, batch, common, vs, thresholds, args.repeats)
        for t in thresholds:
            rows.extend(summarise_runs(vs, runs[t], t, batch))
        rows.sort(key=lambda r: (thresholds.index(r["sweep_threshold"]), batch_sizes.index(r["batch"])))
        write_tables(rows, out_dir, config)
    print((out_dir / "throughput.md").read_text())
    return 0


def base_settings(args, block_size: int | None = None) -> DecodingSettings:
    """The run's DecodingSettings from the decoding flags (every variant replaces its own fields in it;
    ``--draft-model`` is read by the ``model`` draft rows only)."""
    values = decoding_values(args, args.decoding_fields)
    values.pop("draft_model")
    if block_size is not None:
        values["block_size"] = block_size
    return check_settings("decoding flags", **values)


def time_decoders(model, tokenizer, prompts, batch, common, vs, thresholds, repeats) -> dict[float, dict]:
    """Every decoder on ``prompts`` at this batch size, ``repeats`` times.

    Within a repeat every batch of prompts runs through all decoders back to back, in an order that rotates
    from batch to batch and repeat to repeat, so both sides of a speed-up span the same minutes: a shared or
    virtual host's memory bandwidth drifts within the minute, so a decoder timed over the whole prompt set in
    one block would catch a different minute from the next one's.  Decoders whose output does not depend on
    the threshold (the AR baselines, verified decoding) are timed once per batch size and repeat, not once
    per threshold."""
    fixed = [v for v in vs if v.fixed_threshold is not None]
    swept = [v for v in vs if v.fixed_threshold is None]
    runs: dict[float, dict[str, list[dict]]] = {t: {v.name: [] for v in vs} for t in thresholds}
    jobs = [(v, v.fixed_threshold, thresholds) for v in fixed]
    jobs += [(v, t, [t]) for t in thresholds for v in swept]
    batches = [prompts[start : start + batch] for start in range(0, len(prompts), batch)]
    for rep in range(repeats):
        desc = f"batch {batch}, repeat {rep + 1}/{repeats}"
        parts = interleave(model, tokenizer, batches, common, [(v, t) for v, t, _ in jobs], rep, desc)
        for (v, threshold, sweep), part in zip(jobs, parts):
            r = combine(part)
            for t in sweep:
                runs[t][v.name].append(r)
            print(
                f"  threshold={threshold} batch={batch} rep={rep} {v.name}: {r['tokens']} tok "
                f"{r['tokens'] / r['seconds']:.1f} tok/s {r['tokens'] / r['forwards']:.2f} tok/fwd",
                flush=True,
            )
    return runs


def interleave(model, tokenizer, batches, common, jobs, rep: int, desc: str) -> list[list[dict]]:
    """One repeat: each batch of prompts through every (decoder, threshold) job back to back, the first job
    rotating from batch to batch and from repeat to repeat (``rep``); per job, one :func:`run_one` result per
    batch."""
    parts: list[list[dict]] = [[] for _ in jobs]
    for b, batch_prompts in enumerate(tqdm(batches, desc=desc, unit="batch", leave=False)):
        turn = (rep + b) % len(jobs)
        for j in [*range(turn, len(jobs)), *range(turn)]:
            v, threshold = jobs[j]
            parts[j].append(run_one(model, tokenizer, batch_prompts, common, v, threshold))
    return parts


def run_config(args, model, batch_sizes, thresholds, block_size) -> dict[str, Any]:
    """What the run was: its arguments, the machine, threads, dtype and fast-path state."""
    from mars.decoding import huge_pages
    from mars.hardware import describe

    return {
        **{k: v for k, v in vars(args).items()},
        "hardware": describe(),
        "batch_sizes": batch_sizes,
        "thresholds": thresholds,
        "block_size": block_size,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": describe_wait_policy(),
        "fast_path": fast_path_state(model),
        "huge_pages": huge_pages.describe(),
        "host": platform.node(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


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
    for v in variants(args):
        check_settings(f"decoder {v.name}", **{**base.as_dict(), **v.kwargs})
    apply_runtime(args)
    return args, batch_sizes, thresholds


def apply_runtime(args) -> None:
    """Before the model loads: torch's threads (``--threads``), the fast-path switch (``--no-fast-path``) and
    the dtype ``auto`` resolves to on ``--device``."""
    from mars.hardware import configure_threads

    try:
        configure_threads(args.threads or None)
    except ValueError as err:
        raise SystemExit(f"--threads: {err}") from err
    if args.no_fast_path:
        os.environ["MARS_FAST_PATH"] = "0"
    from mars.decoding.fastpath import decode_dtype_name

    args.dtype = decode_dtype_name(args.dtype, args.device)


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
        help="JSONL with a 'prompt' (or 'question') field, e.g. data/prompts/heldout.jsonl or "
        "eval/offline/quality/data/copy.jsonl; default: built-in prompts",
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


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return list(PROMPTS)
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [r.get("prompt", r.get("question")) for r in rows]
    prompts = [p for p in prompts if isinstance(p, str)]
    if not prompts:
        raise SystemExit(f"--prompts-file {path}: no rows with a 'prompt' (or 'question') string")
    return prompts


def summarise_runs(vs: list[Variant], runs: dict[str, list[dict]], threshold: float, batch: int) -> list[dict]:
    """Median tokens/s per decoder and its speedup over the fastest AR decoder of this run (ratios per
    repeat, so drift on a shared machine hits both sides alike); outputs compared with transformers'."""
    ar_names = [v.name for v in vs if v.is_ar]
    best_ar = max(ar_names, key=lambda name: statistics.median(tokens_per_s(runs[name])))
    reference_ids = runs["ar-hf"][0]["ids"]
    return [decoder_row(v, runs, best_ar, reference_ids, threshold, batch) for v in vs]


def tokens_per_s(repeats: list[dict]) -> list[float]:
    return [r["tokens"] / r["seconds"] for r in repeats]


def decode_tokens_per_s(repeats: list[dict]) -> list[float | None]:
    """Tokens/s after each row's first token (None where the time to it was not measured, or no time)."""
    spans = [None if r["first_token_seconds"] is None else r["seconds"] - r["first_token_seconds"] for r in repeats]
    return [after_first(r, "tokens") / span if span else None for r, span in zip(repeats, spans)]


def decoder_row(
    v: Variant, runs: dict[str, list[dict]], best_ar: str, reference_ids: list, threshold: float, batch: int
) -> dict:
    """One decoder's row: its speed, its ratios to ``best_ar`` per repeat, and its outputs against AR's."""
    speeds = tokens_per_s(runs[v.name])
    ratios = [t / a for t, a in zip(speeds, tokens_per_s(runs[best_ar]))]
    last = runs[v.name][-1]
    same = sum(a == b for a, b in zip(last["ids"], reference_ids))
    per_forward = last["tokens"] / last["forwards"]
    decode_ratios = [
        t / a
        for t, a in zip(decode_tokens_per_s(runs[v.name]), decode_tokens_per_s(runs[best_ar]))
        if t is not None and a
    ]
    decode_per_forward = after_first(last, "tokens") / max(after_first(last, "forwards"), 1)
    decode = statistics.median(decode_ratios) if decode_ratios else None
    firsts = [r["first_token_seconds"] / r["batches"] for r in runs[v.name] if r["first_token_seconds"] is not None]
    return dict(
        threshold=v.fixed_threshold if v.fixed_threshold is not None else threshold,
        sweep_threshold=threshold,
        batch=batch,
        decoder=v.name,
        ar_baseline=best_ar,
        tokens_per_s=statistics.median(speeds),
        tokens_per_s_min=min(speeds),
        tokens_per_s_max=max(speeds),
        speedup=statistics.median(ratios),
        speedup_min=min(ratios),
        speedup_max=max(ratios),
        # the share of the forwards saved that reaches the wall clock (1 when a step of several columns costs
        # what AR's costs, prefill and engine included)
        speedup_per_tpf=statistics.median(ratios) / per_forward,
        speedup_per_tpf_min=min(ratios) / per_forward,
        speedup_per_tpf_max=max(ratios) / per_forward,
        tokens_per_forward=per_forward,
        # the decode phase: after each batch's prefill forward (its first token), the time per output token
        # that the saved forwards act on; the prefill costs every decoder alike
        first_token_ms=1e3 * statistics.median(firsts) if firsts else None,
        decode_speedup=decode,
        decode_tokens_per_forward=decode_per_forward,
        decode_speedup_per_tpf=None if decode is None else decode / decode_per_forward,
        decode_speedup_per_tpf_min=min(decode_ratios) / decode_per_forward if decode_ratios else None,
        decode_speedup_per_tpf_max=max(decode_ratios) / decode_per_forward if decode_ratios else None,
        row_tokens_per_forward=last["row_tpf"],
        same_as_ar=f"{same}/{len(reference_ids)}",
        draft_acceptance=last["draft_acceptance"],
        **acceptance_columns(last["acceptance"]),
        generated_tokens=last["tokens"],
        forwards=last["forwards"],
    )


def acceptance_columns(figures: dict) -> dict:
    """vLLM's acceptance figures as CSV columns (docs/decoding.md, "Acceptance figures"); per position
    ``;``-separated, one value per draft depth; empty for decoders that verify no draft."""
    by_position = figures["acceptance_by_position"]
    return dict(
        mean_acceptance_length=figures["mean_acceptance_length"],
        draft_acceptance_rate=figures["draft_acceptance_rate"],
        acceptance_by_position=None if by_position is None else ";".join(f"{a:.4f}" for a in by_position),
        num_drafts=figures["num_drafts"],
    )


def after_first(run: dict, key: str) -> int:
    """A repeat's tokens or forwards after each row's first token: less one token per row, one forward (the
    prefill) per batch."""
    return run[key] - (len(run["ids"]) if key == "tokens" else run["batches"])


def write_tables(rows: list[dict], out_dir: Path, config: dict) -> None:
    """``throughput.csv`` (every row) and ``throughput.md`` (a threshold-free decoder once per batch size)."""
    tmp = out_dir / "throughput.csv.tmp"
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, out_dir / "throughput.csv")
    lines = table_preamble(config)
    listed = set()
    for r in rows:
        key = (r["batch"], r["decoder"], r["threshold"])  # a threshold-free decoder: the same key at every sweep
        if key in listed:
            continue
        listed.add(key)
        lines.append(table_row(r))
    (out_dir / "throughput.md").write_text("\n".join(lines) + "\n")


def table_preamble(config: dict) -> list[str]:
    """``throughput.md``'s title, what the run was, what each column means, and the table's header."""
    model = config.get("checkpoint") or config.get("arch_preset") or config.get("model")
    hw = config.get("hardware") or {}
    lines = [
        "# Throughput: AR (KV cache) vs MARS\n",
        f"model `{model}`, {config['dtype']} on {config['device']} ({hw.get('cuda') or hw.get('cpu') or 'cpu'}; "
        f"native bf16: {hw.get('cpu_native_bf16')}), {config['threads']} threads "
        f"(OpenMP wait {config.get('omp_wait_policy', '(unset)')}), decode fast path "
        f"{config.get('fast_path', 'off')}, weights in 2 MB pages {config.get('huge_pages', '(not recorded)')}, "
        + (f"gated adapter truncated to rank {config['adapter_rank']}, " if config.get("adapter_rank") else "")
        + f"block size {config['block_size']}, "
        f"cache block {config['cache_block']}, max {config['max_new_tokens']} new tokens, "
        f"prompts: {config.get('prompts_file') or 'built-in'}, {config['repeats']} repeats (median, [min-max]); in a "
        "repeat each batch of prompts runs through every decoder back to back, in a rotating order.\n",
        "The AR baseline of each row is the fastest AR decoder measured in the same run (`ar-hf`: transformers "
        "`generate` with its dynamic KV cache; `ar-hf-static`: its static cache; `ar-cursor`: this project's engine "
        "at threshold 1.0, exactly greedy AR with a per-row KV cache from which finished rows leave; `-eager`: the same "
        "with the decode fast path off, i.e. F.linear matmuls). "
        "*same as AR*: rows whose tokens equal `ar-hf`'s (in bf16, differently shaped inputs can flip near-tied "
        "greedy choices, so take fidelity figures from fp32 runs). `mars-verify` is lossless by construction, and so "
        "are `verify-lookup` (prompt-lookup drafts) and `verify-model` (a draft model's drafts; tok/fwd counts the "
        "target's forwards), whose `+masks` rows draft from the masks too (`chain_drafts` auto: on a CPU, on the "
        "steps without another draft). "
        "Decoders whose output does not depend on the threshold (AR, verify) are timed once per batch size and "
        "repeat and listed once, under the first threshold (the CSV repeats them under every threshold).\n",
        "*speedup / tok/fwd*: the speed-up over tokens per forward (batch), the share of the forwards saved that "
        "reaches the wall clock (1.00 when a step of several columns, prefill and engine included, costs what an AR "
        "step does).\n",
        "*TTFT*: the time to the first token (the prefill forward), ms per batch; *after the first token*: the same "
        "ratio over the decode phase alone (tokens, forwards and seconds after each batch's prefill), where the "
        "forwards saved act; the prefill, which every decoder pays alike, pulls the whole-run ratio towards "
        "1 / tok/fwd.\n",
        "*mean acc. len* and *draft acc.*: vLLM's mean acceptance length and draft acceptance rate of the verify "
        "rows (`mean_acceptance_length`, `draft_acceptance_rate`; per draft position in the CSV), defined in "
        'docs/decoding.md, "Acceptance figures".\n',
        "| tau | batch | decoder | tokens/s | speedup vs best AR | tok/fwd (batch) | speedup / tok/fwd "
        "| TTFT ms | after the first token: speedup / tok/fwd | tok/fwd (per request) | mean acc. len | draft acc. "
        "| same as AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines


def table_row(r: dict) -> str:
    """One row of ``throughput.md``: medians with their [min-max] spread."""
    acc = "–" if r.get("draft_acceptance") is None else f"{100 * r['draft_acceptance']:.0f}%"
    length = "–" if r.get("mean_acceptance_length") is None else fmt(r["mean_acceptance_length"])
    decode = (
        "–"
        if r["decode_speedup_per_tpf"] is None
        else f"{fmt(r['decode_speedup_per_tpf'], 3)} [{fmt(r['decode_speedup_per_tpf_min'], 3)}-"
        f"{fmt(r['decode_speedup_per_tpf_max'], 3)}] at {fmt(r['decode_tokens_per_forward'])}"
    )
    return (
        f"| {r['threshold']} | {r['batch']} | {r['decoder']} | {fmt(r['tokens_per_s'], 1)} "
        f"[{fmt(r['tokens_per_s_min'], 1)}-{fmt(r['tokens_per_s_max'], 1)}] | {fmt(r['speedup'])}x "
        f"[{fmt(r['speedup_min'])}-{fmt(r['speedup_max'])}] vs {r['ar_baseline']} | {fmt(r['tokens_per_forward'])} | "
        f"{fmt(r['speedup_per_tpf'], 3)} [{fmt(r['speedup_per_tpf_min'], 3)}-{fmt(r['speedup_per_tpf_max'], 3)}] | "
        f"{'–' if r['first_token_ms'] is None else fmt(r['first_token_ms'], 0)} | {decode} | "
        f"{fmt(r['row_tokens_per_forward'])} | {length} | {acc} | {r['same_as_ar']} |"
    )


if __name__ == "__main__":
    sys.exit(main())
