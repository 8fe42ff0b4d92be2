"""From the per-(threshold, task) files of a results folder to one row per table cell ("point").

A suite entry that is a group (BBH, MMLU-Pro) scores the size-weighted mean of its leaves, and its
decoder statistics are summed over the leaves; its documents are pooled (keyed by leaf and doc id) for
the intervals.  Every point carries, besides the paper's accuracy and tokens per forward (and under verify
vLLM's ``mean_acceptance_length``):

- the wall-clock ``speedup``: generated tokens per second over the threshold 1.0 point's of the same task, both
  measured on the ``machine`` the point names (None where they ran on different machines);
- 95% intervals (:mod:`mars.evaluation.agreement`): accuracy (Wilson for 0/1 scores, else bootstrap),
  its change from threshold 1.0 as a *paired* bootstrap over the same documents (``accuracy_delta_lo/hi``),
  tokens per forward over requests;
- agreement with the same run's threshold 1.0 output of the same prompt: ``agreement`` (identical text),
  ``agreement_chrf``, ``agreement_token_f1``, and from the decoder's per-sample ``fidelity`` record the
  share of mask-accepted tokens equal to the model's own greedy AR choice (``fidelity``), the same over
  all tokens (``ar_equal``) and the share of tokens taken from masks (``mask_share``), each with ``_lo/_hi``;
- for each folder in ``compare``, the paired difference against that run on the same documents, at the
  same threshold (``compare_delta``) and against its threshold 1.0 point (``compare_ar_delta``): e.g. MARS at
  0.9 against the AR-SFT model trained for as many steps.  points.json lists every compared run under
  ``compare``; points.csv has the first one's columns.

The lossless verify point (``mode: verify``; the threshold points are ``mode: threshold``) gets rows of its own,
after every threshold's, at threshold 1.0 but apart from the reference point (``is_reference`` false): tokens per
forward and mean acceptance length over the samples it decoded (the first ``verify.limit`` of each task);
``outputs_identical``, whether every output equals the threshold 1.0 output of the same document token for token;
the accuracy of the threshold 1.0 point (``accuracy_from: reference``) where they are identical (verify is lossless
by construction, so its few samples measure only its speed), else its own samples' with the paired change
(``accuracy_from: samples``); and ``speedup``, its tokens per second over those of the threshold 1.0 point on the
same samples (each sample's share of its batch's decoder time; ``speedup_samples: all_samples`` where that
point's samples predate those times and its whole throughput stands in), ``reference_tokens_per_second`` the
latter.

A suite entry may say ``score: chrf`` (or ``token_f1``, ``exact``): its accuracy is then that similarity
to the threshold 1.0 output rather than lm-eval's metric (the held-out prompts have no gold answer), and it is
left out of the Average's accuracy.  The ``Average`` row is the unweighted mean over the suite's entries
(accuracy over the metric-scored ones), as in the paper's Avg column; its intervals come from a stratified
bootstrap for the paired changes and the entries' own intervals combined for the rest.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars.evaluation import agreement as stats
from mars.evaluation.config import Plan, is_lossless_verify, reference_threshold
from mars.evaluation.store import VERIFY, Point, ResultsDir, write_json
from mars.evaluation.tasks import score_kinds
from mars.persistence import atomic_write_text

AVERAGE = "Average"
INTERVAL_KEYS = (
    "accuracy",
    "accuracy_delta",
    "tokens_per_forward",
    "agreement",
    "agreement_chrf",
    "agreement_token_f1",
    "fidelity",
    "ar_equal",
    "mask_share",
    "compare_delta",
    "compare_ar_delta",
)
FIELDS = (
    "label",
    "model",
    "block_size",
    "threshold",
    "mode",
    "task",
    "lm_eval_task",
    "metric",
    "score",
    "accuracy",
    "accuracy_lo",
    "accuracy_hi",
    "accuracy_interval",
    "accuracy_delta",
    "accuracy_delta_lo",
    "accuracy_delta_hi",
    "n_paired",
    "tokens_per_forward",
    "tokens_per_forward_lo",
    "tokens_per_forward_hi",
    "batch_tokens_per_forward",
    "mean_acceptance_length",
    "tokens_per_second",
    "speedup",
    "machine",
    "wall_seconds",
    "generated_tokens",
    "n_samples",
    "agreement",
    "agreement_lo",
    "agreement_hi",
    "agreement_chrf",
    "agreement_chrf_lo",
    "agreement_chrf_hi",
    "agreement_token_f1",
    "agreement_token_f1_lo",
    "agreement_token_f1_hi",
    "fidelity",
    "fidelity_lo",
    "fidelity_hi",
    "fidelity_tokens",
    "ar_equal",
    "ar_equal_lo",
    "ar_equal_hi",
    "mask_share",
    "mask_share_lo",
    "mask_share_hi",
    "compare_label",
    "compare_threshold",
    "compare_delta",
    "compare_delta_lo",
    "compare_delta_hi",
    "compare_n",
    "compare_ar_delta",
    "compare_ar_delta_lo",
    "compare_ar_delta_hi",
    "is_reference",
    "verify_lossless",
    "outputs_identical",
    "n_identical",
    "accuracy_from",
    "speedup_samples",
    "reference_tokens_per_second",
    "verify_config",
    "verify_limit",
)
THRESHOLD, VERIFY_MODE = "threshold", "verify"  # a point's ``mode``


def is_verify(p: dict[str, Any]) -> bool:
    """Whether a point is the verify point (points.json files written before ``mode`` hold threshold points only)."""
    return p.get("mode") == VERIFY_MODE


def row_of(p: dict[str, Any]) -> Point:
    """The table row of a point: its threshold, or VERIFY."""
    return VERIFY if is_verify(p) else p["threshold"]


def _nanmean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _num(value: Any) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


class _Samples:
    """Sample rows of one results folder, read once per (threshold, leaf) and keyed by (leaf, doc id)."""

    def __init__(self, store: ResultsDir):
        self.store = store
        self._cache: dict[tuple[float, str], dict] = {}

    def complete(self, threshold: Point, leaves: list[str]) -> bool:
        return bool(leaves) and all(self.store.is_complete(threshold, leaf) for leaf in leaves)

    def rows(self, threshold: Point, leaves: list[str]) -> dict[tuple[str, Any], dict] | None:
        if not self.complete(threshold, leaves):
            return None
        out = {}
        for leaf in leaves:
            if (threshold, leaf) not in self._cache:
                self._cache[(threshold, leaf)] = {r["doc_id"]: r for r in self.store.read_samples(threshold, leaf)}
            out.update({(leaf, doc): row for doc, row in self._cache[(threshold, leaf)].items()})
        return out

    def scores(self, threshold: Point, leaves: list[str], kind: str, reference: float) -> dict | None:
        """Per-document score: lm-eval's (``metric``) or the similarity to the reference output."""
        rows = self.rows(threshold, leaves)
        if rows is None:
            return None
        if kind == "metric":
            return {k: _num(r.get("score")) for k, r in rows.items()}
        ref = self.rows(reference, leaves)
        if ref is None:
            return None
        return {k: stats.similarity(kind, r.get("output"), ref[k].get("output")) for k, r in rows.items() if k in ref}


def agreement(store: ResultsDir, threshold: float, reference: float, leaves: list[str]) -> float | None:
    """Share of samples (over ``leaves``) whose output text equals the reference point's output."""
    samples = _Samples(store)
    rows, ref = samples.rows(threshold, leaves), samples.rows(reference, leaves)
    if rows is None or ref is None:
        return None
    pairs = [(r.get("output"), ref[k].get("output")) for k, r in rows.items() if k in ref]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _paired(a: dict | None, b: dict | None) -> stats.Estimate:
    if not a or not b:
        return stats.NONE
    keys = [k for k in a if k in b]
    return stats.paired_difference([a[k] for k in keys], [b[k] for k in keys])


def _compare_label(path: Path) -> str:
    try:
        points = json.loads((path / "points.json").read_text())
        if points and points[0].get("label"):
            return str(points[0]["label"])
    except (OSError, ValueError):
        pass
    return path.name


def _entry_point(
    plan: Plan,
    samples: _Samples,
    others: list[tuple[str, Path, _Samples]],
    threshold: float,
    spec,
    reference: float,
    kind: str,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """One suite entry at one threshold: its point and what the Average needs from it (the documents'
    scores, the reference's, the compared runs'); None until every leaf's results are on disk."""
    store = samples.store
    if not samples.complete(threshold, spec.leaves):
        return None
    summaries = [store.read_summary(threshold, leaf) for leaf in spec.leaves]
    totals = _decoder_totals(summaries)
    rows = samples.rows(threshold, spec.leaves) or {}
    pairs = _pairs(rows, samples.rows(reference, spec.leaves))
    scores = samples.scores(threshold, spec.leaves, kind, reference)
    ref_scores = samples.scores(reference, spec.leaves, kind, reference)
    acc = _accuracy(kind, threshold, reference, scores, summaries, totals["n"])
    delta = _paired(scores, ref_scores) if threshold != reference else stats.Estimate(0.0, 0.0, 0.0, len(rows))
    counted, tpf = _counted_rows(rows)
    point: dict[str, Any] = {
        **_entry_identity(plan, spec, plan.curve_label, threshold, THRESHOLD, kind, reference, summaries),
        **acc.fields("accuracy"),
        "accuracy_interval": acc.method,  # Wilson | bootstrap | none (the reference against itself)
        "accuracy_delta": None,
        "accuracy_delta_lo": delta.lo,
        "accuracy_delta_hi": delta.hi,
        "n_paired": delta.n,
        **_speed_fields(totals, tpf),
        "machine": machine_label(summaries),
        "is_reference": threshold == reference,
        "verify_lossless": plan.verify_lossless(threshold),
    }
    point.update(_agreement_fields(pairs, threshold == reference))
    point["fidelity_tokens"] = _fidelity_tokens(rows)

    compares, compared_scores = _compare_entry(others, threshold, spec.leaves, kind, reference, scores)
    point["compare"] = compares
    _flatten_compare(point)
    extras = {"scores": scores, "ref_scores": ref_scores, "counted": counted, "pairs": pairs}
    return point, {**extras, "compare": compared_scores}


def _verify_entry(
    plan: Plan, samples: _Samples, spec, reference: float, kind: str, ref_point: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """One suite entry's verify point (see the module's docstring) and what its Average needs; None until every
    leaf's verify point is on disk.  ``ref_point``: the entry's threshold 1.0 point, if complete."""
    store = samples.store
    if not samples.complete(VERIFY, spec.leaves):
        return None
    summaries = [store.read_summary(VERIFY, leaf) for leaf in spec.leaves]
    recorded = summaries[0].get("verify") or {}
    totals = _decoder_totals(summaries)
    rows = samples.rows(VERIFY, spec.leaves) or {}
    ref_rows = samples.rows(reference, spec.leaves) if ref_point is not None else None
    pairs = _pairs(rows, ref_rows)
    same = sum(_same_output(a, b) for a, b in pairs)
    identical = (len(pairs) == len(rows) and same == len(rows)) if ref_rows else None
    scores = samples.scores(VERIFY, spec.leaves, kind, reference)
    ref_all = samples.scores(reference, spec.leaves, kind, reference) if ref_rows else None
    ref_scores = {k: ref_all[k] for k in scores or {} if k in ref_all} if ref_all is not None else None
    if identical:
        acc_fields, delta = _reference_accuracy(ref_point), stats.Estimate(0.0, 0.0, 0.0, len(rows))
    else:
        acc = _accuracy(kind, VERIFY, reference, scores, summaries, totals["n"])
        acc_fields = {**acc.fields("accuracy"), "accuracy_interval": acc.method}
        delta = _paired(scores, ref_scores)
    counted, tpf = _counted_rows(rows)
    ar_tokens, ar_seconds, basis = _reference_time(pairs, ref_point)
    label = plan.verify_label(str(recorded.get("config") or "mars_verified"))
    point: dict[str, Any] = {
        **_entry_identity(plan, spec, label, reference, VERIFY_MODE, kind, reference, summaries),
        **acc_fields,
        "accuracy_from": "reference" if identical else "samples",
        "accuracy_delta": delta.value,
        "accuracy_delta_lo": delta.lo,
        "accuracy_delta_hi": delta.hi,
        "n_paired": delta.n,
        **_speed_fields(totals, tpf),
        "machine": machine_label(summaries),
        "is_reference": False,
        **_verify_fields(recorded, reference, identical, same if ref_rows else None),
    }
    _add_verify_speedup(point, ar_tokens, ar_seconds, basis, ref_point)
    point.update(_agreement_fields(pairs, False))
    point["fidelity_tokens"] = _fidelity_tokens(rows)
    point["compare"] = []
    _flatten_compare(point)
    extras = {"scores": scores, "ref_scores": ref_scores, "counted": counted, "pairs": pairs, "compare": []}
    return point, {**extras, "ar_tokens": ar_tokens, "ar_seconds": ar_seconds, "basis": basis}


# The fields and row selections the threshold and the verify points share, each built in one place so the two
# kinds of point keep the same keys and meanings.


def _entry_identity(
    plan: Plan, spec, label: str, threshold: float, mode: str, kind: str, reference: float, summaries
) -> dict[str, Any]:
    """The fields naming a point: its curve, model, threshold, mode, task and how the task is scored."""
    return {
        "label": label,
        "model": plan.model_label,
        "block_size": plan.block_size,
        "threshold": threshold,
        "mode": mode,
        "task": spec.label,
        "lm_eval_task": spec.name,
        "metric": summaries[0]["metric"] if kind == "metric" else f"{kind} vs τ={reference:g} output",
        "score": kind,
    }


def _pairs(rows: dict, ref_rows: dict | None) -> list[tuple[dict, dict]]:
    """Each document's row with the reference point's row of the same document (none without the reference)."""
    return [] if ref_rows is None else [(r, ref_rows[k]) for k, r in rows.items() if k in ref_rows]


def _counted_rows(rows: dict) -> tuple[list[dict], stats.Estimate]:
    """The rows that record their tokens and forwards, and tokens per forward over them with its interval."""
    counted = [r for r in rows.values() if r.get("tokens") is not None and r.get("forwards") is not None]
    return counted, stats.ratio_interval([r["tokens"] for r in counted], [r["forwards"] for r in counted])


def _fidelity_tokens(rows: dict) -> int | None:
    """The mask-accepted tokens the rows' fidelity records cover (None where no row has one)."""
    fid = [r.get("fidelity") for r in rows.values() if isinstance(r.get("fidelity"), Mapping)]
    return sum(int(f.get("mask_tokens", 0)) for f in fid) if fid else None


def _reference_accuracy(ref_point: dict[str, Any]) -> dict[str, Any]:
    """A lossless verify point's accuracy: every document's output, hence its score, is the reference's."""
    return {k: ref_point.get(k) for k in ("accuracy", "accuracy_lo", "accuracy_hi", "accuracy_interval")}


def _verify_fields(recorded: dict, reference: float, identical: bool | None, n_identical: int | None) -> dict:
    """What only a verify point records: its settings' losslessness, the outputs' identity to the reference's,
    and the config and limit it was decoded with."""
    return {
        "verify_lossless": is_lossless_verify(dict(recorded.get("settings") or {}), reference),
        "outputs_identical": identical,
        "n_identical": n_identical,
        "verify_config": recorded.get("config"),
        "verify_limit": recorded.get("limit"),
    }


def _same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two samples' outputs are the same: token for token where both record their ids, else as text."""
    if a.get("output_ids") is not None and b.get("output_ids") is not None:
        return a["output_ids"] == b["output_ids"]
    return a.get("output") == b.get("output")


def _reference_time(pairs: list, ref_point: dict[str, Any] | None) -> tuple[float, float, str | None]:
    """The threshold 1.0 point's generated tokens and decoder seconds on the verify point's samples (each sample's
    share of its batch), or over all its samples where its rows predate per-sample times."""
    if pairs and all(ref.get("seconds") is not None and ref.get("tokens") is not None for _, ref in pairs):
        return (
            float(sum(ref["tokens"] for _, ref in pairs)),
            float(sum(ref["seconds"] for _, ref in pairs)),
            "same_samples",
        )
    if ref_point is not None and ref_point.get("wall_seconds"):
        return float(ref_point["generated_tokens"]), float(ref_point["wall_seconds"]), "all_samples"
    return 0.0, 0.0, None


def _add_verify_speedup(point: dict[str, Any], ar_tokens: float, ar_seconds: float, basis, ref_point) -> None:
    """The verify point's wall-clock speed-up over the threshold 1.0 point (None across machines)."""
    ar_speed = ar_tokens / ar_seconds if ar_seconds > 0 else None
    same_machine = ref_point is not None and ref_point.get("machine") == point.get("machine") != "several machines"
    fast = point.get("tokens_per_second")
    point["reference_tokens_per_second"] = ar_speed
    point["speedup"] = fast / ar_speed if same_machine and fast and ar_speed else None
    point["speedup_samples"] = basis if point["speedup"] is not None else None


def _decoder_totals(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The leaves' sample counts and decoder statistics, summed (a group's leaves count as one entry)."""
    dec = [s.get("decoder") or {} for s in summaries]
    return {
        "n": sum(s["n_samples"] for s in summaries),
        "tokens": sum(d.get("generated_tokens", 0) for d in dec),
        "row_forwards": sum(d.get("row_forwards", 0) for d in dec),
        "batch_forwards": sum(d.get("batch_forwards", 0) for d in dec),
        "seconds": sum(d.get("seconds", 0.0) for d in dec),
        "num_drafts": sum(d.get("num_drafts", 0) for d in dec),
        "num_accepted_tokens": sum(d.get("num_accepted_tokens", 0) for d in dec),
    }


def machine_label(summaries: list[dict[str, Any]]) -> str | None:
    """The machine that decoded a point, from its leaves' summaries (``machine``: :func:`mars.hardware.describe`
    and the device, recorded as each point finishes): the GPU's name on a GPU, else the CPU's model, its vector
    ISA and the torch threads; None where no summary records one, ``"several machines"`` where they differ."""
    labels = set()
    for summary in summaries:
        info = summary.get("machine")
        if not isinstance(info, Mapping):
            return None
        if str(info.get("device", "cpu")).startswith("cuda") and info.get("cuda"):
            labels.add(str(info["cuda"]))
        else:
            labels.add(f"{info.get('cpu')} ({info.get('cpu_capability')}, {info.get('threads')} threads)")
    return labels.pop() if len(labels) == 1 else ("several machines" if labels else None)


def add_speedups(points: list[dict[str, Any]], reference: float) -> None:
    """Each threshold point's ``speedup``: its generated tokens per second over the reference point's of the same
    task, the wall-clock gain or loss of its threshold; None where either has no throughput or the two ran on
    different machines (a recorded machine against another, or mixed within a point).  The verify point carries
    its own (over the reference point on its samples)."""
    base = {p["task"]: p for p in points if p["threshold"] == reference and not is_verify(p)}
    for p in points:
        if is_verify(p):
            continue
        ref = base.get(p["task"])
        same_machine = ref is not None and ref.get("machine") == p.get("machine") != "several machines"
        fast, slow = p.get("tokens_per_second"), (ref or {}).get("tokens_per_second")
        p["speedup"] = fast / slow if same_machine and fast and slow else None


def _accuracy(kind: str, threshold: Point, reference: float, scores: dict | None, summaries, n: int) -> stats.Estimate:
    """The entry's accuracy with its interval: lm-eval's aggregate for a metric-scored entry, else the mean
    similarity to the reference output (exactly the value itself at the reference)."""
    acc = stats.mean_interval((scores or {}).values(), binary=None if kind in ("metric", "exact") else False)
    if kind != "metric" and threshold == reference:  # the reference against itself: 1.0 by definition
        acc = stats.Estimate(acc.value, acc.value, acc.value, acc.n, "none")
    if kind == "metric":  # lm-eval's own aggregate (equal to the sample mean for mean-aggregated metrics)
        value = sum(s["accuracy"] * s["n_samples"] for s in summaries) / n if n else float("nan")
        acc = stats.Estimate(value, acc.lo, acc.hi, acc.n, acc.method)
    return acc


def _speed_fields(totals: dict[str, Any], tpf: stats.Estimate) -> dict[str, Any]:
    """Tokens per forward (per row, with its interval over requests, and per batch), vLLM's mean acceptance
    length under verify (None without a draft step), throughput, counts."""
    tokens, row_fw, batch_fw, seconds = (totals[k] for k in ("tokens", "row_forwards", "batch_forwards", "seconds"))
    drafts = totals["num_drafts"]
    return {
        "tokens_per_forward": tokens / row_fw if row_fw else None,
        "tokens_per_forward_lo": tpf.lo,
        "tokens_per_forward_hi": tpf.hi,
        "batch_tokens_per_forward": tokens / batch_fw if batch_fw else None,
        "mean_acceptance_length": 1 + totals["num_accepted_tokens"] / drafts if drafts else None,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "wall_seconds": seconds,
        "generated_tokens": tokens,
        "n_samples": totals["n"],
    }


def _agreement_fields(pairs: list, is_reference: bool) -> dict[str, Any]:
    """Agreement with the reference output (exact, chrF, token F1) and the fidelity figures, each with its
    interval; at the reference itself the similarities are an identity, not a sample (no interval)."""
    figures = stats.agreement_figures(pairs) if pairs else {}
    if is_reference:
        figures.update(
            {k: stats.Estimate(e.value, e.value, e.value, e.n) for k, e in figures.items() if k in stats.SIMILARITY}
        )
    fields: dict[str, Any] = {}
    for name, key in (
        ("exact", "agreement"),
        ("chrf", "agreement_chrf"),
        ("token_f1", "agreement_token_f1"),
        ("fidelity", "fidelity"),
        ("ar_equal", "ar_equal"),
        ("mask_share", "mask_share"),
    ):
        fields.update(figures.get(name, stats.NONE).fields(key))
    return fields


def _compare_entry(others, threshold: float, leaves: list[str], kind: str, reference: float, scores):
    """Each compared run against this entry: the paired differences at the same threshold and at its AR
    point, and the compared run's scores (kept for the Average)."""
    compares, compared_scores = [], []
    for label, path, other in others:
        same = other.scores(threshold, leaves, kind, reference)
        ar = other.scores(reference, leaves, kind, reference)
        d_same, d_ar = _paired(scores, same), _paired(scores, ar)
        compares.append(_compare_row(label, path, threshold if same is not None else None, d_same, d_ar))
        compared_scores.append((same, ar))
    return compares, compared_scores


def _compare_row(label: str, path, threshold, d_same, d_ar) -> dict:
    """One compared run at a point: paired differences against it at the same threshold and at its AR point."""
    return {
        "label": label,
        "path": str(path),
        "threshold": threshold,
        "delta": d_same.value,
        "delta_lo": d_same.lo,
        "delta_hi": d_same.hi,
        "n": d_same.n,
        "ar_delta": d_ar.value,
        "ar_delta_lo": d_ar.lo,
        "ar_delta_hi": d_ar.hi,
        "ar_n": d_ar.n,
    }


def _flatten_compare(point: dict[str, Any]) -> None:
    first = (point.get("compare") or [None])[0] or {}
    point.update(
        {
            "compare_label": first.get("label"),
            "compare_threshold": first.get("threshold"),
            "compare_delta": first.get("delta"),
            "compare_delta_lo": first.get("delta_lo"),
            "compare_delta_hi": first.get("delta_hi"),
            "compare_n": first.get("n"),
            "compare_ar_delta": first.get("ar_delta"),
            "compare_ar_delta_lo": first.get("ar_delta_lo"),
            "compare_ar_delta_hi": first.get("ar_delta_hi"),
        }
    )


def _estimate(p: dict[str, Any], key: str) -> stats.Estimate:
    return stats.Estimate(p.get(key), p.get(f"{key}_lo"), p.get(f"{key}_hi"), int(p.get("n_samples") or 0))


def _average(row: list[dict[str, Any]], extras: list[dict[str, Any]], others: list) -> dict[str, Any]:
    """The Average column of one threshold: unweighted means over the entries (accuracy over the
    metric-scored ones); each figure's interval combines the entries' own intervals
    (:func:`~mars.evaluation.agreement.combine_intervals`), the paired changes come from a stratified
    paired bootstrap (identical outputs everywhere: a zero-width interval)."""
    metric = [i for i, p in enumerate(row) if p["score"] == "metric"]
    point = {
        **{k: row[0].get(k) for k in ("label", "model", "block_size", "threshold", "mode", "is_reference")},
        "verify_lossless": all(p.get("verify_lossless") for p in row),
        "task": AVERAGE,
        "lm_eval_task": None,
        "metric": "mean over tasks",
        "score": "metric",
        **_average_accuracy(row, extras, metric),
        "batch_tokens_per_forward": _nanmean([p["batch_tokens_per_forward"] for p in row]),
        "mean_acceptance_length": _nanmean([p.get("mean_acceptance_length") for p in row]),
        "tokens_per_second": (
            sum(p["generated_tokens"] for p in row) / s if (s := sum(p["wall_seconds"] for p in row)) > 0 else None
        ),
        "wall_seconds": sum(p["wall_seconds"] for p in row),
        "generated_tokens": sum(p["generated_tokens"] for p in row),
        "n_samples": sum(p["n_samples"] for p in row),
        "machine": row[0]["machine"] if len({p["machine"] for p in row}) == 1 else "several machines",
    }
    point.update(_average_figures(row))
    point["fidelity_tokens"] = (
        sum(p["fidelity_tokens"] or 0 for p in row) if any(p["fidelity_tokens"] is not None for p in row) else None
    )
    point["compare"] = _average_compares(row, extras, others, metric)
    _flatten_compare(point)
    return point


def _same_documents(a: dict, b: dict) -> tuple[list, list]:
    """Two runs' scores on the documents both have, in the same order (one stratum of a paired bootstrap)."""
    keys = [k for k in a if k in b]
    return [a[k] for k in keys], [b[k] for k in keys]


def _average_accuracy(row: list[dict[str, Any]], extras: list[dict[str, Any]], metric: list[int]) -> dict[str, Any]:
    """The Average's accuracy (metric-scored entries only) and its paired change from the reference."""
    paired = [_same_documents(extras[i]["scores"] or {}, extras[i]["ref_scores"] or {}) for i in metric]
    delta = stats.mean_of_paired_differences(paired) if not row[0]["is_reference"] else stats.Estimate(0.0, 0.0, 0.0)
    acc = stats.combine_intervals([_estimate(row[i], "accuracy") for i in metric])
    return {
        "accuracy": _nanmean([row[i]["accuracy"] for i in metric]),
        "accuracy_lo": acc.lo,
        "accuracy_hi": acc.hi,
        "accuracy_interval": acc.method,  # combined: the tasks' own intervals added in quadrature
        "accuracy_delta": None,
        "accuracy_delta_lo": delta.lo,
        "accuracy_delta_hi": delta.hi,
        "n_paired": delta.n,
    }


def _average_figures(row: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens per forward, agreement and fidelity: means over all entries with combined intervals."""
    fields: dict[str, Any] = {}
    for key in (
        "tokens_per_forward",
        "agreement",
        "agreement_chrf",
        "agreement_token_f1",
        "fidelity",
        "ar_equal",
        "mask_share",
    ):
        est = stats.combine_intervals(
            [_estimate(p, key) for p in row], bounds=None if key == "tokens_per_forward" else (0.0, 1.0)
        )
        fields.update({key: _nanmean([p[key] for p in row]), f"{key}_lo": est.lo, f"{key}_hi": est.hi})
    return fields


def _average_compares(row: list[dict[str, Any]], extras: list[dict[str, Any]], others: list, metric: list[int]):
    """Each compared run against the Average: stratified paired differences over the metric-scored
    entries, at the same threshold and at its AR point (none unless every entry has the compared scores)."""
    compares = []
    for j, (label, path, _) in enumerate(others):
        same_groups, ar_groups = [], []
        for i in metric:
            a = extras[i]["scores"] or {}
            same, ar = extras[i]["compare"][j]
            for target, groups in ((same, same_groups), (ar, ar_groups)):
                if target is not None:
                    groups.append(_same_documents(a, target))
        complete = len(same_groups) == len(metric) and metric
        d_same = stats.mean_of_paired_differences(same_groups) if complete else stats.NONE
        d_ar = stats.mean_of_paired_differences(ar_groups) if len(ar_groups) == len(metric) and metric else stats.NONE
        compares.append(_compare_row(label, path, row[0]["threshold"] if complete else None, d_same, d_ar))
    return compares


def collect_points(plan: Plan, store: ResultsDir) -> list[dict[str, Any]]:
    """Every complete point in the folder (this run's thresholds and earlier ones), plus averages;
    writes points.json and points.csv."""
    metric = str(plan.decoding.get("metric", "probability"))
    reference = reference_threshold(metric)
    kinds = score_kinds(plan.resolved.get("benchmarks"))
    samples = _Samples(store)
    others = [(_compare_label(Path(p)), Path(p), _Samples(ResultsDir(p))) for p in (plan.compare or [])]
    thresholds = sorted(set(store.thresholds_on_disk()) | set(plan.thresholds), reverse=(metric != "entropy"))
    points: list[dict[str, Any]] = []
    for thr in thresholds:
        built = [
            b
            for spec in plan.suite.tasks
            if (b := _entry_point(plan, samples, others, thr, spec, reference, kinds.get(spec.name, "metric")))
        ]
        if not built:
            continue
        row, extras = [b[0] for b in built], [b[1] for b in built]
        points.extend(row)
        if len(row) == len(plan.suite.tasks) and len(row) > 1:
            points.append(_average(row, extras, others))
    ref_acc = {p["task"]: p["accuracy"] for p in points if p["threshold"] == reference}
    for p in points:
        if p["task"] in ref_acc and p["accuracy"] is not None and ref_acc[p["task"]] is not None:
            p["accuracy_delta"] = p["accuracy"] - ref_acc[p["task"]]
    add_speedups(points, reference)
    points.extend(_verify_points(plan, samples, reference, kinds, points))
    write_json(store.root / "points.json", points)
    atomic_write_text(store.root / "points.csv", points_csv(points))
    return points


def _verify_points(
    plan: Plan, samples: _Samples, reference: float, kinds: dict[str, str], points: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The verify point's rows (after every threshold's, so that a reader taking the first row at threshold 1.0
    gets the reference point), with their Average."""
    ref = {p["task"]: p for p in points if p["threshold"] == reference}
    built = [
        b
        for spec in plan.suite.tasks
        if (b := _verify_entry(plan, samples, spec, reference, kinds.get(spec.name, "metric"), ref.get(spec.label)))
    ]
    row, extras = [b[0] for b in built], [b[1] for b in built]
    if len(row) == len(plan.suite.tasks) and len(row) > 1:
        average = _average(row, extras, [])
        identical = [p["outputs_identical"] for p in row]
        metric = [p for p in row if p["score"] == "metric"]
        average.update(
            outputs_identical=None if None in identical else all(identical),
            accuracy_from="reference" if all(identical) else "samples",
            accuracy_delta=_nanmean([p["accuracy_delta"] for p in metric]),
            n_identical=None if None in identical else sum(p["n_identical"] for p in row),
            verify_config=row[0]["verify_config"],
            verify_limit=row[0]["verify_limit"],
        )
        bases = {e["basis"] for e in extras}
        basis = bases.pop() if len(bases) == 1 else (None if None in bases else "all_samples")
        ar = (sum(e["ar_tokens"] for e in extras), sum(e["ar_seconds"] for e in extras))
        _add_verify_speedup(average, *ar, basis, ref.get(AVERAGE))
        row.append(average)
    return row


def points_csv(points: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(FIELDS), extrasaction="ignore")
    writer.writeheader()
    for p in points:
        writer.writerow({k: ("" if p.get(k) is None else p.get(k)) for k in FIELDS})
    return buf.getvalue()
