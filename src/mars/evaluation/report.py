"""The markdown table, laid out like the paper's Tables 4/8: one column per benchmark plus the average;
per threshold the accuracy with its change from tau = 1.0, the tokens per forward beneath it, and the
agreement with the tau = 1.0 output; a second table gives throughput and wall time."""

from __future__ import annotations

from typing import Any

from mars.evaluation.aggregate import AVERAGE
from mars.evaluation.config import Plan, reference_threshold
from mars.evaluation.store import ResultsDir, atomic_write_text


def _fmt_acc(p: dict[str, Any] | None) -> str:
    if p is None or p.get("accuracy") is None:
        return "–"
    text = f"{100 * p['accuracy']:.1f}"
    if p.get("accuracy_delta") is not None and not p.get("is_reference"):
        text += f" ({100 * p['accuracy_delta']:+.1f})"
    return text


def fmt_threshold(thr: float) -> str:
    """1.0, 0.95, 0.5 (never "1")."""
    text = f"{thr:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def render_table(plan: Plan, points: list[dict[str, Any]]) -> str:
    metric = str(plan.decoding.get("metric", "probability"))
    reference = reference_threshold(metric)
    columns = [spec.label for spec in plan.suite.tasks] + ([AVERAGE] if len(plan.suite.tasks) > 1 else [])
    cell = {(p["threshold"], p["task"]): p for p in points}
    thresholds = sorted({p["threshold"] for p in points}, reverse=(metric != "entropy"))
    res = plan.resolved
    dec = plan.decoding
    source = f"checkpoint `{res['checkpoint']}`" if res.get("checkpoint") else f"model `{res['model']['name_or_path']}`"
    lines = [
        f"# MARS evaluation — {plan.curve_label}",
        "",
        f"{source}; block size {plan.block_size}; acceptance metric `{metric}`; cache `{dec.get('cache')}`; "
        f"max {dec.get('max_new_tokens')} new tokens; greedy; suite `{plan.suite.name}` "
        f"({'chat template' if plan.suite.apply_chat_template else 'no chat template'})"
        + (f"; limit {res['limit']} samples per task" if res.get("limit") else "") + ".",
        "",
        f"τ = {fmt_threshold(reference)} is plain greedy AR decoding: the reference point. Accuracy in %, its change "
        f"from τ = {fmt_threshold(reference)} in brackets; *tok/fwd* = generated tokens accepted per forward pass, "
        f"over all steps; *agree* = share of samples whose output text is identical to the τ = {fmt_threshold(reference)} output "
        "(a fidelity check the paper does not report).",
    ]
    if plan.reference_added:
        lines += ["", f"(τ = {fmt_threshold(reference)} was added to the requested sweep: deltas and agreement need it.)"]
    header = "| τ | | " + " | ".join(columns) + " |"
    rule = "|---|---|" + "---:|" * len(columns)
    lines += ["", header, rule]
    for thr in thresholds:
        name = f"**{fmt_threshold(thr)}** (AR)" if thr == reference else f"**{fmt_threshold(thr)}**"
        rows = [
            (name, "acc", [_fmt_acc(cell.get((thr, c))) for c in columns]),
            ("", "tok/fwd", [_fmt((cell.get((thr, c)) or {}).get("tokens_per_forward"), ".2f") for c in columns]),
            ("", "agree", [_fmt(None if (a := (cell.get((thr, c)) or {}).get("agreement")) is None else 100 * a,
                                ".0f", "%") for c in columns]),
        ]
        for first, what, cells in rows:
            lines.append(f"| {first} | {what} | " + " | ".join(cells) + " |")
    lines += ["", "## Throughput", "", "Generated tokens per second and decoder wall time (s) per task.", "",
              header, rule]
    for thr in thresholds:
        cells_tps = [_fmt((cell.get((thr, c)) or {}).get("tokens_per_second"), ".1f") for c in columns]
        cells_wall = [_fmt((cell.get((thr, c)) or {}).get("wall_seconds"), ".1f") for c in columns]
        lines.append(f"| **{fmt_threshold(thr)}** | tok/s | " + " | ".join(cells_tps) + " |")
        lines.append("|  | wall s | " + " | ".join(cells_wall) + " |")
    n = {p["task"]: p["n_samples"] for p in points}
    lines += ["", "Samples per task: " + ", ".join(f"{c} {n.get(c, 0)}" for c in columns if c != AVERAGE) + "."]
    return "\n".join(lines) + "\n"


def write_reports(plan: Plan, store: ResultsDir, points: list[dict[str, Any]]) -> str:
    table = render_table(plan, points)
    atomic_write_text(store.root / "table.md", table)
    return table
