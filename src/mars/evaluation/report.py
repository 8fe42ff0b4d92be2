"""The markdown table, laid out like the paper's Tables 4/8: one column per benchmark plus the average;
per threshold the accuracy with its change from threshold 1.0, the 95% intervals of both (the change as a
paired bootstrap over the same documents), the tokens per forward with its interval, beside it the wall-clock
speed-up over threshold 1.0 (measured, on the machine the preamble names), and the agreement with the threshold
1.0 output; after the threshold 1.0 row the lossless verify point's (its accuracy, whether its outputs are the
threshold 1.0 outputs, tokens per forward, speed-up, acceptance length).  Then an agreement section (exact, chrF,
token F1, per-token fidelity, each with its interval), the paired comparisons with the runs named in ``compare``,
and throughput."""

from __future__ import annotations

from typing import Any

from mars.evaluation.aggregate import AVERAGE, is_verify, row_of
from mars.evaluation.config import Plan, reference_threshold
from mars.evaluation.store import VERIFY, Point, ResultsDir
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
    cell = {(row_of(p), p["task"]): p for p in points}
    thresholds = sorted({p["threshold"] for p in points if not is_verify(p)}, reverse=(metric != "entropy"))
    rows = table_rows(thresholds, reference, any(is_verify(p) for p in points))
    lines = _preamble(plan, points, metric, ref)
    lines += _main_table(columns, rows, cell, reference, _reference_label(plan.decoding))
    lines += _agreement_section(columns, rows, cell, ref)
    lines += _compare_section(columns, thresholds, cell, points, ref)
    lines += _throughput_section(columns, rows, cell)
    lines += ["", "Samples per task: " + _sample_counts(points, columns, verify=False) + "."]
    if any(is_verify(p) for p in points):
        lines[-1] += " Verify point: " + _sample_counts(points, columns, verify=True) + "."
    return "\n".join(lines) + "\n"


def table_rows(thresholds: list[float], reference: float, verify: bool) -> list[Point]:
    """The table's rows: the thresholds in sweep order, the verify point right after the reference threshold."""
    rows: list[Point] = list(thresholds)
    if verify:
        rows.insert(rows.index(reference) + 1 if reference in rows else 0, VERIFY)
    return rows


def row_name(row: Point) -> str:
    """A row's name in the agreement and throughput sections: the threshold, or ``verify``."""
    return "verify" if row == VERIFY else fmt_threshold(row)


def _sample_counts(points: list[dict[str, Any]], columns: list[str], verify: bool) -> str:
    n = {p["task"]: p["n_samples"] for p in points if is_verify(p) == verify}
    return ", ".join(f"{c} {n.get(c, 0)}" for c in columns if c != AVERAGE)


def _preamble(plan: Plan, points: list[dict[str, Any]], metric: str, ref: str) -> list[str]:
    """The title, what was evaluated and how, what each row means, and which columns are scored against
    the reference output instead of a gold answer."""
    lines = [
        f"# MARS evaluation — {plan.curve_label}",
        "",
        _setup_line(plan, metric),
        "",
        _legend(plan, metric, ref),
        "",
        f"Timed on: {_machines(points)}.",
    ]
    lines += _typical_reference_note(plan.decoding, ref)
    lines += _similarity_note(points, ref)
    if plan.reference_added:
        lines += ["", f"(τ = {ref} was added to the requested sweep: deltas and agreement need it.)"]
    lines += _verify_note([p for p in points if is_verify(p)], ref)
    return lines


def _setup_line(plan: Plan, metric: str) -> str:
    """What was evaluated and how: the model or checkpoint, the decoding, the suite, dtype and limit."""
    res, dec = plan.resolved, plan.decoding
    source = f"checkpoint `{res['checkpoint']}`" if res.get("checkpoint") else f"model `{res['model']['name_or_path']}`"
    return (
        f"{source}; block size {plan.block_size}; acceptance metric `{metric}`; cache `{dec.get('cache')}`; "
        f"max {dec.get('max_new_tokens')} new tokens; greedy; suite `{plan.suite.name}` "
        f"({'chat template' if plan.suite.apply_chat_template else 'no chat template'})"
        + (f"; dtype `{res['dtype']}`" if res.get("dtype") else "")
        + (f"; limit {res['limit']} samples per task" if res.get("limit") else "")
        + "."
    )


def _legend(plan: Plan, metric: str, ref: str) -> str:
    """What the reference row and each figure of the table mean."""
    return (
        f"τ = {ref} is plain greedy AR decoding: the reference point. *acc* = accuracy in %, its change from "
        f"τ = {ref} in brackets; *95% CI* = interval of the accuracy (Wilson for right/wrong scores, else "
        f"bootstrap) and, as Δ, of its change from τ = {ref} (paired bootstrap over the same documents); "
        f"*tok/fwd* = generated tokens accepted per forward pass over all steps, with its bootstrap interval "
        f"over requests; *speed-up* = generated tokens per second over the τ = {ref} point's of the same task, "
        f"{_speedup_reference(plan, reference_threshold(metric), ref)}, the decoder's wall clock (a busy machine "
        "moves it; – where the two points ran on different machines); *accept. len* (verify only) = vLLM's mean "
        'acceptance length, 1 + drafts accepted per draft step (docs/decoding.md, "Acceptance figures"); *agree* = '
        f"share of outputs whose text is identical to the τ = {ref} output (a fidelity check the paper does not "
        "report)."
    )


def _typical_reference_note(decoding, ref: str) -> list[str]:
    """Where the reference point decodes under typical acceptance, that it is lossy, so not greedy AR."""
    if _reference_label(decoding) == "AR":
        return []
    return [
        "",
        f"Here τ = {ref} decodes with verified drafts under typical acceptance (`typical_epsilon` "
        f"{float(decoding['typical_epsilon']):g}): lossy, so it is not greedy AR; its change from the base model's "
        "greedy output is in the comparison section (`compare=`), and *AR-equal* below counts its tokens "
        "equal to the greedy AR choice.",
    ]


def _similarity_note(points: list[dict[str, Any]], ref: str) -> list[str]:
    """Which columns are scored against the reference output (no gold answer), and with which similarity."""
    similarity_cols = sorted({p["task"] for p in points if p.get("score") not in (None, "metric")})
    if not similarity_cols:
        return []
    return [
        "",
        "Columns scored against the τ = "
        + ref
        + " output (no gold answer; 100 at τ = "
        + ref
        + " by definition; left out of the Average's accuracy): "
        + ", ".join(f"{c} ({next(p['score'] for p in points if p['task'] == c)})" for c in similarity_cols)
        + ".",
    ]


def _verify_note(verify: list[dict[str, Any]], ref: str) -> list[str]:
    """What the verify row is, and why a few samples per task are enough for it."""
    if not verify:
        return []
    config = verify[0].get("verify_config") or "mars_verified"
    limit = verify[0].get("verify_limit")
    how_many = f"at most the first {limit} samples of each task" if limit else "the sweep's samples"
    text = (
        f"*verify* = τ = {ref} decoded with verified drafts (`{config}`; `verify.enabled=false` leaves it out): "
        f"lossless, its outputs are the τ = {ref} outputs by construction (*identical* = samples whose output equals "
        f"τ = {ref}'s token for token), so its accuracy is τ = {ref}'s and it decodes {how_many} (`verify.limit`), "
        f"enough to measure its speed; its *speed-up* is over the τ = {ref} point's decoder time on those same samples"
    )
    if any(p.get("speedup_samples") == "all_samples" for p in verify):
        text += f" (over all of τ = {ref}'s samples where they predate per-sample times)"
    lines = ["", text + "."]
    if any(p.get("outputs_identical") is False for p in verify):
        lines += [
            "",
            f"**Verify's outputs differ from τ = {ref}'s on some samples**, which lossless verify never does: its "
            "accuracy there is its own samples', with the change on the same documents.",
        ]
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


def _main_table(columns: list[str], points: list[Point], cell: dict, reference: float, label: str = "AR") -> list[str]:
    """Per threshold: accuracy (and its change), the intervals, tokens per forward and the wall-clock speed-up
    over the reference (and the mean acceptance length where drafts were verified) and agreement; the verify
    point's rows after the reference's."""
    lines = ["", *_table_head(columns)]
    for thr in points:
        if thr == VERIFY:
            lines += _verify_rows(columns, cell, reference)
            continue
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


def _verify_rows(columns: list[str], cell: dict, reference: float) -> list[str]:
    """The verify point: its accuracy (the reference's where its outputs are identical), how many of its outputs are
    identical to the reference's, tokens per forward, speed-up over the reference, mean acceptance length."""
    points = [cell.get((VERIFY, c)) for c in columns]
    lengths = [(p or {}).get("mean_acceptance_length") for p in points]
    rows = [
        (
            f"**verify** (τ={fmt_threshold(reference)}, lossless)",
            "acc",
            [_fmt_verify_acc(p, reference) for p in points],
        ),
        ("", "identical", [_fmt_identical(p) for p in points]),
        ("", "tok/fwd", [_interval_cell(p, "tokens_per_forward", ".2f", 1.0) for p in points]),
        ("", "speed-up", [_fmt_speedup(p) for p in points]),
        *([("", "accept. len", [_fmt(v, ".2f") for v in lengths])] if any(v is not None for v in lengths) else []),
    ]
    return [f"| {first} | {what} | " + " | ".join(cells) + " |" for first, what, cells in rows]


def _fmt_verify_acc(p: dict[str, Any] | None, reference: float) -> str:
    if p is None or p.get("accuracy") is None:
        return "–"
    if p.get("accuracy_from") == "reference":
        return f"{100 * p['accuracy']:.1f} (= τ {fmt_threshold(reference)})"
    delta = p.get("accuracy_delta")
    return f"{100 * p['accuracy']:.1f}" + ("" if delta is None else f" ({100 * delta:+.1f} on its samples)")


def _fmt_identical(p: dict[str, Any] | None) -> str:
    if p is None or p.get("n_identical") is None:
        return "–"
    return f"{p['n_identical']}/{p['n_samples']}"


def _throughput_section(columns: list[str], thresholds: list[Point], cell: dict) -> list[str]:
    """Tokens per second and decoder seconds per row (the verify point's over its own samples)."""
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
        lines.append(f"| **{row_name(thr)}** | tok/s | " + " | ".join(cells_tps) + " |")
        lines.append("|  | wall s | " + " | ".join(cells_wall) + " |")
    return lines


def _agreement_section(columns: list[str], thresholds: list[Point], cell: dict, ref: str) -> list[str]:
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
                f"| {row_name(thr)} | {c} | {n if n is not None else '–'} | "
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
