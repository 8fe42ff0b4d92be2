"""The markdown table, laid out like the paper's Tables 4/8: one column per benchmark plus the average;
per threshold the accuracy with its change from threshold 1.0, the 95% intervals of both (the change as a
paired bootstrap over the same documents), the tokens per forward with its interval, beside it the wall-clock
speed-up over threshold 1.0 (measured, on the machine the preamble names), and the agreement with the threshold
1.0 output.  Then an agreement section (exact, chrF, token F1, per-token fidelity, each
with its interval), the paired comparisons with the runs named in ``compare``, and throughput."""

from __future__ import annotations

from typing import Any

from mars.evaluation.aggregate import AVERAGE
from mars.evaluation.config import Plan, reference_threshold
from mars.evaluation.store import ResultsDir
from mars.persistence import atomic_write_text


def fmt_threshold(thr: float) -> str:
    """1.0, 0.95, 0.5 (never "1")."""
    text = f"{thr:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def fmt_interval(
    value: float | None, lo: float | None, hi: float | None, spec: str = ".1f", scale: float = 100.0, sign: bool = False
) -> str:
    """``31.2 [29.8, 32.5]`` (``-0.4 [-1.1, 0.2]`` with ``sign``); the bracket is left out when the
    interval is unknown, and "–" stands for an unknown value."""
    if value is None:
        return "–"
    s = f"{scale * value:+{spec}}" if sign else f"{scale * value:{spec}}"
    if lo is None or hi is None:
        return s
    return f"{s} [{scale * lo:{spec}}, {scale * hi:{spec}}]"


def _fmt_acc(p: dict[str, Any] | None) -> str:
    if p is None or p.get("accuracy") is None:
        return "–"
    text = f"{100 * p['accuracy']:.1f}"
    if p.get("accuracy_delta") is not None and not p.get("is_reference"):
        text += f" ({100 * p['accuracy_delta']:+.1f})"
    return text


def _fmt_ci(p: dict[str, Any] | None) -> str:
    """The intervals of the accuracy and (paired) of its change: ``[29.8, 32.5] (Δ [-1.1, 0.2])``."""
    if p is None or p.get("accuracy_lo") is None:
        return "–"
    text = f"[{100 * p['accuracy_lo']:.1f}, {100 * p['accuracy_hi']:.1f}]"
    if not p.get("is_reference") and p.get("accuracy_delta_lo") is not None:
        text += f" (Δ [{100 * p['accuracy_delta_lo']:+.1f}, {100 * p['accuracy_delta_hi']:+.1f}])"
    return text


def _get(cell: dict, key: tuple, field: str):
    return (cell.get(key) or {}).get(field)


def _interval_cell(
    p: dict[str, Any] | None, key: str, spec: str = ".1f", scale: float = 100.0, suffix: str = ""
) -> str:
    if p is None or p.get(key) is None:
        return "–"
    return fmt_interval(p.get(key), p.get(f"{key}_lo"), p.get(f"{key}_hi"), spec, scale) + suffix


def render_table(plan: Plan, points: list[dict[str, Any]]) -> str:
    metric = str(plan.decoding.get("metric", "probability"))
    reference = reference_threshold(metric)
    ref = fmt_threshold(reference)
    columns = [spec.label for spec in plan.suite.tasks] + ([AVERAGE] if len(plan.suite.tasks) > 1 else [])
    cell = {(p["threshold"], p["task"]): p for p in points}
    thresholds = sorted({p["threshold"] for p in points}, reverse=(metric != "entropy"))
    lines = _preamble(plan, points, metric, ref)
    lines += _main_table(columns, thresholds, cell, reference, _reference_label(plan.decoding))
    lines += _agreement_section(columns, thresholds, cell, ref)
    lines += _compare_section(columns, thresholds, cell, points, ref)
    lines += _throughput_section(columns, thresholds, cell)
    n = {p["task"]: p["n_samples"] for p in points}
    lines += ["", "Samples per task: " + ", ".join(f"{c} {n.get(c, 0)}" for c in columns if c != AVERAGE) + "."]
    return "\n".join(lines) + "\n"


def _preamble(plan: Plan, points: list[dict[str, Any]], metric: str, ref: str) -> list[str]:
    """The title, what was evaluated and how, what each row means, and which columns are scored against
    the reference output instead of a gold answer."""
    res = plan.resolved
    dec = plan.decoding
    source = f"checkpoint `{res['checkpoint']}`" if res.get("checkpoint") else f"model `{res['model']['name_or_path']}`"
    similarity_cols = sorted({p["task"] for p in points if p.get("score") not in (None, "metric")})
    lines = [
        f"# MARS evaluation — {plan.curve_label}",
        "",
        f"{source}; block size {plan.block_size}; acceptance metric `{metric}`; cache `{dec.get('cache')}`; "
        f"max {dec.get('max_new_tokens')} new tokens; greedy; suite `{plan.suite.name}` "
        f"({'chat template' if plan.suite.apply_chat_template else 'no chat template'})"
        + (f"; dtype `{res['dtype']}`" if res.get("dtype") else "")
        + (f"; limit {res['limit']} samples per task" if res.get("limit") else "")
        + ".",
        "",
        f"τ = {ref} is plain greedy AR decoding: the reference point. *acc* = accuracy in %, its change from "
        f"τ = {ref} in brackets; *95% CI* = interval of the accuracy (Wilson for right/wrong scores, else "
        f"bootstrap) and, as Δ, of its change from τ = {ref} (paired bootstrap over the same documents); "
        f"*tok/fwd* = generated tokens accepted per forward pass over all steps, with its bootstrap interval "
        f"over requests; *speed-up* = generated tokens per second over the τ = {ref} point's of the same task, "
        f"{_speedup_reference(plan, reference_threshold(metric), ref)}, the decoder's wall clock (a busy machine moves it; – where the two points "
        "ran on different machines); *accept. len* (verify only) = vLLM's mean acceptance length, 1 + drafts "
        'accepted per draft step (docs/decoding.md, "Acceptance figures"); *agree* = share of outputs whose text is '
        f"identical to the τ = {ref} output (a fidelity check the paper does not report).",
        "",
        f"Timed on: {_machines(points)}.",
    ]
    if _reference_label(dec) != "AR":
        lines += [
            "",
            f"Here τ = {ref} decodes with verified drafts under typical acceptance (`typical_epsilon` "
            f"{float(dec['typical_epsilon']):g}): lossy, so it is not greedy AR; its change from the base model's "
            "greedy output is in the comparison section (`compare=`), and *AR-equal* below counts its tokens "
            "equal to the greedy AR choice.",
        ]
    if similarity_cols:
        lines += [
            "",
            "Columns scored against the τ = "
            + ref
            + " output (no gold answer; 100 at τ = "
            + ref
            + " by definition; left out of the Average's accuracy): "
            + ", ".join(f"{c} ({next(p['score'] for p in points if p['task'] == c)})" for c in similarity_cols)
            + ".",
        ]
    if plan.reference_added:
        lines += ["", f"(τ = {ref} was added to the requested sweep: deltas and agreement need it.)"]
    return lines


def _speedup_reference(plan: Plan, reference: float, ref: str) -> str:
    """What the speed-up is against: greedy AR, or verify itself where the run's reference point verifies."""
    if plan.verify_lossless(reference):
        return f"here verify itself at τ = {ref} (its speed-up over AR: `mars-bench throughput` or `spec`)"
    return "timed in this run" if _reference_label(plan.decoding) != "AR" else "greedy AR, timed in this run"


def _machines(points: list[dict[str, Any]]) -> str:
    """The machines the points were decoded on (mars.hardware.describe, recorded with each point)."""
    names = sorted({str(p["machine"]) for p in points if p.get("machine") and p["machine"] != "several machines"})
    return "; ".join(names) or "not recorded"


def _fmt_speedup(p: dict[str, Any] | None) -> str:
    return "–" if p is None or p.get("speedup") is None else f"{p['speedup']:.2f}x"


def _table_head(columns: list[str]) -> list[str]:
    return ["| τ | | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]


def _reference_label(decoding) -> str:
    """What the reference threshold decodes: greedy AR, except under typical acceptance (lossy verify)."""
    eps = float(decoding.get("typical_epsilon") or 0.0)
    return f"typical ε={eps:g}" if decoding.get("verify") and eps > 0 else "AR"


def _main_table(
    columns: list[str], thresholds: list[float], cell: dict, reference: float, label: str = "AR"
) -> list[str]:
    """Per threshold: accuracy (and its change), the intervals, tokens per forward and the wall-clock speed-up
    over the reference (and the mean acceptance length where drafts were verified) and agreement."""
    lines = ["", *_table_head(columns)]
    for thr in thresholds:
        name = f"**{fmt_threshold(thr)}** ({label})" if thr == reference else f"**{fmt_threshold(thr)}**"
        lengths = [_get(cell, (thr, c), "mean_acceptance_length") for c in columns]
        rows = [
            (name, "acc", [_fmt_acc(cell.get((thr, c))) for c in columns]),
            ("", "95% CI", [_fmt_ci(cell.get((thr, c))) for c in columns]),
            ("", "tok/fwd", [_interval_cell(cell.get((thr, c)), "tokens_per_forward", ".2f", 1.0) for c in columns]),
            ("", "speed-up", [_fmt_speedup(cell.get((thr, c))) for c in columns]),
            *([("", "accept. len", [_fmt(v, ".2f") for v in lengths])] if any(v is not None for v in lengths) else []),
            ("", "agree", [_interval_cell(cell.get((thr, c)), "agreement", ".0f", 100.0, "%") for c in columns]),
        ]
        for first, what, cells in rows:
            lines.append(f"| {first} | {what} | " + " | ".join(cells) + " |")
    return lines


def _throughput_section(columns: list[str], thresholds: list[float], cell: dict) -> list[str]:
    lines = [
        "",
        "## Throughput",
        "",
        "Generated tokens per second and decoder wall time (s) per task.",
        "",
        *_table_head(columns),
    ]
    for thr in thresholds:
        cells_tps = [_fmt(_get(cell, (thr, c), "tokens_per_second"), ".1f") for c in columns]
        cells_wall = [_fmt(_get(cell, (thr, c), "wall_seconds"), ".1f") for c in columns]
        lines.append(f"| **{fmt_threshold(thr)}** | tok/s | " + " | ".join(cells_tps) + " |")
        lines.append("|  | wall s | " + " | ".join(cells_wall) + " |")
    return lines


def _agreement_section(columns: list[str], thresholds: list[float], cell: dict, ref: str) -> list[str]:
    lines = [
        "",
        f"## Agreement with the τ = {ref} output",
        "",
        f"Per task and threshold, each output against the same run's τ = {ref} output of the same prompt, in %, "
        "with 95% intervals: *exact* = identical text; *chrF* = character n-gram F-score (sacrebleu's chrF); "
        "*token F1* = bag-of-words F1; *fidelity* = share of the tokens accepted from mask predictions that "
        "equal the model's own greedy AR choice given the output's own prefix (one extra forward; does not "
        "depend on where two outputs first diverge; – where no token came from a mask); *AR-equal* = the same "
        "over every generated token; *from masks* = share of generated tokens accepted from mask predictions.",
        "",
        "| τ | task | n | exact | chrF | token F1 | fidelity | AR-equal | from masks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for thr in thresholds:
        for c in columns:
            p = cell.get((thr, c))
            if p is None:
                continue
            n = p.get("n_samples")
            lines.append(
                f"| {fmt_threshold(thr)} | {c} | {n if n is not None else '–'} | "
                + " | ".join(
                    _interval_cell(p, k)
                    for k in ("agreement", "agreement_chrf", "agreement_token_f1", "fidelity", "ar_equal", "mask_share")
                )
                + " |"
            )
    return lines


def _compare_section(
    columns: list[str], thresholds: list[float], cell: dict, points: list[dict[str, Any]], ref: str
) -> list[str]:
    labels = list(dict.fromkeys(c["label"] for p in points for c in (p.get("compare") or [])))
    if not labels:
        return []
    lines = [
        "",
        "## Paired comparisons",
        "",
        "Accuracy of this run minus the compared run's, in points, on the same documents (paired bootstrap, 95%): "
        f"*same τ* = the compared run at the same threshold; *vs its AR* = the compared run at τ = {ref} "
        "(e.g. MARS at 0.9 against the AR-SFT model trained for as many steps). – where the compared run "
        "lacks the point.",
    ]
    for _j, label in enumerate(labels):
        lines += [
            "",
            f"### vs {label}",
            "",
            "| τ | | " + " | ".join(columns) + " |",
            "|---|---|" + "---:|" * len(columns),
        ]
        for thr in thresholds:
            same, ar = [], []
            for c in columns:
                comp = next((x for x in ((cell.get((thr, c)) or {}).get("compare") or []) if x["label"] == label), None)
                same.append(fmt_interval(comp["delta"], comp["delta_lo"], comp["delta_hi"], sign=True) if comp else "–")
                ar.append(
                    fmt_interval(comp["ar_delta"], comp["ar_delta_lo"], comp["ar_delta_hi"], sign=True) if comp else "–"
                )
            lines.append(f"| **{fmt_threshold(thr)}** | same τ | " + " | ".join(same) + " |")
            lines.append("|  | vs its AR | " + " | ".join(ar) + " |")
    return lines


def write_reports(plan: Plan, store: ResultsDir, points: list[dict[str, Any]]) -> str:
    table = render_table(plan, points)
    atomic_write_text(store.root / "table.md", table)
    return table
