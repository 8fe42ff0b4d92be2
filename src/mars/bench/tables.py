"""The throughput figures and tables: per (threshold, batch size, decoder), its median tokens/s with the min-max
spread, the speed-up over the fastest AR decoder of the run (median of the per-repeat ratios), tokens per forward,
the speed-up over tokens per forward, the time to the first token and the decode phase after it, the outputs
equal to AR's, and vLLM's acceptance figures (docs/decoding.md, "Acceptance figures"); ``throughput.csv`` and
``throughput.md``.  Reads the runs of :func:`mars.bench.timing.time_decoders`; no torch import.
"""

from __future__ import annotations

import csv
import os
import statistics
from pathlib import Path

from mars.bench.decoders import Variant


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
        **decode_columns(runs[v.name], runs[best_ar]),
        row_tokens_per_forward=last["row_tpf"],
        same_as_ar=f"{same}/{len(reference_ids)}",
        draft_acceptance=last["draft_acceptance"],
        **acceptance_columns(last["acceptance"]),
        generated_tokens=last["tokens"],
        forwards=last["forwards"],
    )


def decode_columns(repeats: list[dict], ar_repeats: list[dict]) -> dict:
    """The decode phase: after each batch's prefill forward (its first token), the time per output token that
    the saved forwards act on (the prefill costs every decoder alike); and the time to the first token."""
    decode_ratios = [
        t / a for t, a in zip(decode_tokens_per_s(repeats), decode_tokens_per_s(ar_repeats)) if t is not None and a
    ]
    last = repeats[-1]
    decode_per_forward = after_first(last, "tokens") / max(after_first(last, "forwards"), 1)
    decode = statistics.median(decode_ratios) if decode_ratios else None
    firsts = [r["first_token_seconds"] / r["batches"] for r in repeats if r["first_token_seconds"] is not None]
    return dict(
        first_token_ms=1e3 * statistics.median(firsts) if firsts else None,
        decode_speedup=decode,
        decode_tokens_per_forward=decode_per_forward,
        decode_speedup_per_tpf=None if decode is None else decode / decode_per_forward,
        decode_speedup_per_tpf_min=min(decode_ratios) / decode_per_forward if decode_ratios else None,
        decode_speedup_per_tpf_max=max(decode_ratios) / decode_per_forward if decode_ratios else None,
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


def write_csv(rows: list[dict], path: Path) -> None:
    """Every row, its keys as the columns, replacing ``path`` whole."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def write_tables(rows: list[dict], out_dir: Path, config: dict) -> None:
    """``throughput.csv`` (every row) and ``throughput.md`` (a threshold-free decoder once per batch size)."""
    write_csv(rows, out_dir / "throughput.csv")
    lines = table_preamble(config)
    listed = set()
    for r in rows:
        key = (r["batch"], r["decoder"], r["threshold"])  # a threshold-free decoder: the same key at every sweep
        if key in listed:
            continue
        listed.add(key)
        lines.append(table_row(r))
    (out_dir / "throughput.md").write_text("\n".join(lines) + "\n")


# what the columns of throughput.md mean, after the paragraph on the run
COLUMN_NOTES = [
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


def table_preamble(config: dict) -> list[str]:
    """``throughput.md``'s title, what the run was, what each column means, and the table's header."""
    model = config.get("checkpoint") or config.get("arch_preset") or config.get("model")
    hw = config.get("hardware") or {}
    run = (
        f"model `{model}`, {config['dtype']} on {config['device']} ({hw.get('cuda') or hw.get('cpu') or 'cpu'}; "
        f"native bf16: {hw.get('cpu_native_bf16')}), {config['threads']} threads "
        f"(OpenMP wait {config.get('omp_wait_policy', '(unset)')}), decode fast path "
        f"{config.get('fast_path', 'off')}, weights in 2 MB pages {config.get('huge_pages', '(not recorded)')}, "
        + (f"gated adapter truncated to rank {config['adapter_rank']}, " if config.get("adapter_rank") else "")
        + f"block size {config['block_size']}, "
        f"cache block {config['cache_block']}, max {config['max_new_tokens']} new tokens, "
        f"prompts: {config.get('prompts_file') or 'built-in'}, {config['repeats']} repeats (median, [min-max]); in a "
        "repeat each batch of prompts runs through every decoder back to back, in a rotating order.\n"
    )
    return ["# Throughput: AR (KV cache) vs MARS\n", run, *COLUMN_NOTES]


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


def fmt(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"
