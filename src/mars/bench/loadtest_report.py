"""The load test's figures and files: per (policy, offered rate) the completed requests/s and tokens/s, latency
and time-to-first-token percentiles, rejections and failures, served threshold and tokens per forward, agreement
with the threshold 1.0 outputs; ``levels.csv``, ``requests.csv``, ``outputs.jsonl``, ``burst.json``,
``traces.json``, ``table.md``, ``serving_load.png`` and ``config.json``.  ``run`` is the run's arguments by name.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars.bench.loadtest_client import Result


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarise(results: list[Result], reference: dict[int, list[int]]) -> dict:
    ok = [r for r in results if r.status == 200]
    rejected = sum(r.status in (429, 503) for r in results)
    failed = sum(r.status not in (200, 429, 503) for r in results)
    span = (max(r.end for r in ok) - min(r.start for r in results)) if ok else float("nan")
    tokens = sum(r.completion_tokens for r in ok)
    forwards = sum(r.forwards for r in ok)
    compared = [r for r in ok if r.prompt in reference]
    exact = [r.token_ids == reference[r.prompt] for r in compared]
    prefix = [common_prefix(r.token_ids, reference[r.prompt]) / max(1, len(reference[r.prompt])) for r in compared]
    thresholds = [r.served_threshold for r in ok if r.served_threshold is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "rejected": rejected,
        "failed": failed,
        "achieved_rps": len(ok) / span if ok else 0.0,
        "tokens_per_s": tokens / span if ok else 0.0,
        "latency_p50": pct([r.latency for r in ok], 50),
        "latency_p95": pct([r.latency for r in ok], 95),
        "ttft_p50": pct([r.ttft for r in ok if r.ttft is not None], 50),
        "ttft_p95": pct([r.ttft for r in ok if r.ttft is not None], 95),
        "mean_tau": sum(thresholds) / len(thresholds) if thresholds else None,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "mean_completion_tokens": tokens / len(ok) if ok else None,
        "agreement_exact": sum(exact) / len(exact) if exact else None,
        "agreement_prefix": sum(prefix) / len(prefix) if prefix else None,
    }


def fmt(x, d=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def write_outputs(
    out: Path,
    rows: list[dict],
    results: list[Result],
    traces: dict,
    bursts: dict,
    run: Mapping[str, Any],
    machine: dict,
    consistency: dict,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "levels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_requests(out, results)
    (out / "burst.json").write_text(json.dumps(bursts, indent=2) + "\n")
    (out / "traces.json").write_text(json.dumps(traces) + "\n")
    (out / "config.json").write_text(
        json.dumps({"args": dict(run), "machine": machine, "tau1_consistency": consistency}, indent=2) + "\n"
    )
    (out / "table.md").write_text(table_md(rows, bursts, run, machine, consistency))
    plot(out / "serving_load.png", rows, traces)


# requests.csv columns (file keys kept as published: served_tau is the served threshold)
REQUEST_COLUMNS = (
    "policy",
    "offered_rps",
    "k",
    "prompt",
    "offset_s",
    "status",
    "latency_s",
    "ttft_s",
    "completion_tokens",
    "forwards",
    "served_tau",
    "finish_reason",
    "error",
)


def write_requests(out: Path, results: list[Result]) -> None:
    """``requests.csv`` (every request) and ``outputs.jsonl`` (the answered ones' tokens and text)."""
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for r in results:
            w.writerow(
                [
                    r.policy,
                    r.rate,
                    r.k,
                    r.prompt,
                    f"{r.offset:.3f}",
                    r.status,
                    f"{r.latency:.3f}",
                    fmt(r.ttft, 3),
                    r.completion_tokens,
                    r.forwards,
                    r.served_threshold,
                    r.finish_reason,
                    r.error,
                ]
            )
    with open(out / "outputs.jsonl", "w") as f:
        for r in results:
            if r.status == 200:
                row = {"policy": r.policy, "offered_rps": r.rate, "prompt": r.prompt, "served_tau": r.served_threshold}
                f.write(json.dumps({**row, "token_ids": r.token_ids, "text": r.text}) + "\n")


def saturation_check(rows: list[dict], duration: float | None = None) -> str:
    """The first level at which tau=1.0 completes less than 0.9x what arrived (the requests a level's Poisson
    stream actually sent over ``duration``, not its nominal rate: 35 arrivals in 30 s at a nominal 1.5 req/s
    is 1.17), and how the other policies did at that level."""
    base = [r for r in rows if r["policy"] == "tau1.0"]
    if not base:
        return ""

    def arrived(r: dict) -> float:
        return r["requests"] / duration if duration and r.get("requests") else r["offered_rps"]

    sat = next((r for r in base if r["achieved_rps"] < 0.9 * arrived(r)), None)
    if sat is None:
        return f"tau=1.0 kept up with every level (up to an offered {base[-1]['offered_rps']:g} req/s)."
    lines = [
        f"tau=1.0 saturates at an offered {sat['offered_rps']:g} req/s ({arrived(sat):.2f} arrived per second; "
        f"it completes {sat['achieved_rps']:.3f} req/s)."
    ]
    for name in ("adaptive", "tau0.9", "verify"):
        other = next((r for r in rows if r["policy"] == name and r["offered_rps"] == sat["offered_rps"]), None)
        if other and sat["achieved_rps"]:
            lines.append(
                f"At that load {name} completes {other['achieved_rps'] / sat['achieved_rps']:.2f}x the requests/s "
                f"({other['tokens_per_s'] / max(sat['tokens_per_s'], 1e-9):.2f}x the tokens/s) at p95 latency "
                f"{fmt(other['latency_p95'], 1)} s vs {fmt(sat['latency_p95'], 1)} s; its outputs are identical to "
                f"tau=1.0's for {fmt(100 * other['agreement_exact'] if other['agreement_exact'] is not None else None, 0)}% "
                f"of the requests (mean shared prefix {fmt(100 * other['agreement_prefix'] if other['agreement_prefix'] is not None else None, 0)}%)."
            )
    return " ".join(lines)


def table_cells(r: dict) -> list[str]:
    """One level's row of ``table.md``."""
    return [
        r["policy"],
        f"{r['offered_rps']:g}",
        str(r["requests"]),
        str(r["completed"]),
        str(r["rejected"]),
        str(r["failed"]),
        fmt(r["achieved_rps"], 3),
        fmt(r["tokens_per_s"], 1),
        fmt(r["latency_p50"], 1),
        fmt(r["latency_p95"], 1),
        fmt(r["ttft_p50"], 2),
        fmt(r["ttft_p95"], 2),
        fmt(r["mean_tau"], 3),
        fmt(r["tokens_per_forward"], 2),
        fmt(r["mean_completion_tokens"], 1),
        fmt(None if r["agreement_exact"] is None else 100 * r["agreement_exact"], 0) + "%",
        fmt(None if r["agreement_prefix"] is None else 100 * r["agreement_prefix"], 0) + "%",
    ]


def table_md(rows: list[dict], bursts: dict, run: Mapping[str, Any], machine: dict, consistency: dict) -> str:
    head = (
        "| policy | offered req/s | requests | done | 429/503 | failed | req/s | tokens/s | p50 latency s | "
        "p95 latency s | p50 TTFT s | p95 TTFT s | mean tau | tok/fwd | tokens/req | identical to tau=1.0 | "
        "shared prefix |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    b = bursts
    text = [
        f"# Serving load test ({run['model']}{', checkpoint ' + run['checkpoint'] if run['checkpoint'] else ''})",
        "",
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_capability')}, native bf16: {machine.get('cpu_native_bf16')}), "
        f"{os.cpu_count()} cores shared with other jobs; server dtype {run['dtype']}, {run['threads']} torch thread(s), "
        f"max_batch={run['max_batch']}, max_queue={run['max_queue']}, block size 4, cache=cursor, max_step_columns="
        f"{run['max_step_columns'] or 'auto'}.",
        f"Each level: Poisson arrivals for {run['duration']:g} s (same arrivals and prompts for every policy), streaming "
        f"chat requests of at most {run['max_tokens']} new tokens, greedy, prompts from data/prompts/heldout.jsonl of at "
        f"most {run['max_prompt_tokens']} tokens; a level is cut {run['level_limit']:g} s after it started. req/s and "
        "tokens/s are completed work over the span from the first arrival to the last completion. "
        f"Adaptive: tau between {run['threshold_min']} and 1.0, {run['adaptive_signal']} signal, target_queue "
        f"{run['target_queue'] or max(1, run['max_batch'] // 2)} (other adaptive settings: conf/serve.yaml defaults). "
        "Verify: threshold 1.0, every request with `verify: true` (lossless: its outputs must equal tau=1.0's).",
        "",
        *lines,
        "",
        saturation_check(rows, run["duration"]),
        "",
        f"tau=1.0 outputs identical across load levels: {consistency.get('identical')}/{consistency.get('prompts')} "
        "prompts served more than once.",
        "",
        burst_line(b, run["max_queue"]),
        "",
    ]
    return "\n".join(text)


def burst_line(b: dict, max_queue: int) -> str:
    if not b:
        return "Burst: not run (--no-burst, or no tau1.0 server)."
    return (
        f"Burst: {b.get('requests')} simultaneous requests (4x max_queue={max_queue}) at tau=1.0: answers "
        f"{b.get('codes')}, all 200/429/503: {b.get('all_answered_200_429_503')}, healthy after: "
        f"{b.get('healthy_after')}, server RSS {b.get('rss_mb_before')} MB before, {b.get('rss_mb_peak')} MB peak, "
        f"{b.get('rss_mb_after')} MB after ({b.get('seconds')} s)."
    )


def plot(path: Path, rows: list[dict], traces: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colors = {"tau1.0": "#1f5f99", "tau0.9": "#d9822b", "adaptive": "#2e8b57", "verify": "#8e44ad"}
    panels = [
        ("achieved_rps", None, "completed requests / s"),
        ("tokens_per_s", None, "generated tokens / s"),
        ("latency_p50", "latency_p95", "latency s (p50 solid, p95 dashed)"),
        ("ttft_p50", "ttft_p95", "time to first token s (p50 solid, p95 dashed)"),
        ("agreement_exact", None, "outputs identical to tau=1.0"),
    ]
    for ax, (key, key2, title) in zip(axes.flat, panels):
        for p in policies:
            pts = [r for r in rows if r["policy"] == p]
            x = [r["offered_rps"] for r in pts]
            c = colors.get(p)
            ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in pts], "o-", color=c, label=p)
            if key2:
                ax.plot(x, [r[key2] if r[key2] is not None else float("nan") for r in pts], "s--", color=c)
        if key == "achieved_rps":
            lim = max(r["offered_rps"] for r in rows)
            ax.plot([0, lim], [0, lim], ":", color="grey", label="offered")
        ax.set_title(title)
        ax.set_xlabel("offered requests / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[5]
    for key, trace in traces.items():
        if key.startswith("adaptive") and trace:
            ax.plot([t["t"] for t in trace], [t["tau"] for t in trace], label=key.replace("adaptive@", "offered "))
    ax.set_title("adaptive: server tau during each level")
    ax.set_xlabel("seconds into the level")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference_outputs(results: list[Result]) -> tuple[dict[int, list[int]], dict]:
    """Threshold 1.0 outputs are the reference (they do not depend on the load); whether they agree across
    the levels where a prompt was served more than once."""
    reference: dict[int, list[int]] = {}
    seen: dict[int, set] = {}
    served: dict[int, int] = {}
    for r in results:
        if r.policy == "tau1.0" and r.status == 200:
            reference.setdefault(r.prompt, r.token_ids)
            seen.setdefault(r.prompt, set()).add(tuple(r.token_ids))
            served[r.prompt] = served.get(r.prompt, 0) + 1
    multi = [p for p in seen if served[p] > 1]
    return reference, {"prompts": len(multi), "identical": sum(len(seen[p]) == 1 for p in multi)}
