"""Statistics for judging a threshold's quality cost: intervals, paired differences and agreement.

Why paired: at a threshold below 1.0 most outputs of a MARS checkpoint are identical to its threshold 1.0
(greedy AR) outputs, so per-document differences are mostly zero and a paired bootstrap over the same
documents resolves a change of a point or two where two independent intervals would overlap widely.

Everything here is a pure function of plain lists (no files, no model):

- intervals: :func:`mean_interval` (Wilson for 0/1 scores, else a percentile bootstrap),
  :func:`wilson_interval`, :func:`ratio_interval` (a ratio of sums, e.g. tokens per forward over
  requests), :func:`paired_difference` (mean of ``a - b`` over paired documents); for an average over
  tasks :func:`combine_intervals` (each task's own interval, half-widths added in quadrature) and
  :func:`mean_of_paired_differences` (a stratified paired bootstrap: each task resampled on its own);
- similarity of an output to the reference output of the same prompt: :func:`chrf` (sacrebleu's
  sentence chrF, character 1-6-grams, whitespace removed, beta 2, scaled to 0-1) and :func:`token_f1`
  (bag-of-words F1 as in SQuAD, over :func:`words`), so that one changed word is not a total miss;
- :func:`agreement_figures`: for documents paired with their reference output, exact agreement,
  chrF, token F1 and the per-token fidelity recorded by the decoder (the share of mask-accepted tokens
  that equal the model's own greedy AR choice given the output's own prefix; see
  :mod:`mars.evaluation.fidelity`), each with its interval.

Every bootstrap is seeded (same data, same interval) and uses ``ITERATIONS`` resamples; percentile
intervals at ``CONFIDENCE``.  An interval of identical paired values has zero width.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sacrebleu.metrics import CHRF

CONFIDENCE = 0.95
ITERATIONS = 2000
_CHUNK = 4_000_000  # resampled values held in memory at once


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its interval, over ``n`` units (documents, requests, pairs)."""

    value: float | None
    lo: float | None = None
    hi: float | None = None
    n: int = 0
    # how the interval was made (Wilson | bootstrap | combined), for figures' captions; not part of equality
    method: str | None = field(default=None, compare=False)

    def fields(self, name: str) -> dict[str, Any]:
        """``{name: value, name_lo: lo, name_hi: hi}`` for a points row."""
        return {name: self.value, f"{name}_lo": self.lo, f"{name}_hi": self.hi}


NONE = Estimate(None, None, None, 0)


# ------------------------------------------------------------------------------------------------
# Text similarity
# ------------------------------------------------------------------------------------------------
_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str | None) -> list[str]:
    """Word tokens for :func:`token_f1`: runs of letters/digits, and each punctuation mark on its own
    (case kept: "Paris" and "paris" differ, as they do in the output)."""
    return _WORD.findall(text or "")


@functools.cache
def _chrf_metric(order: int, beta: float) -> CHRF:
    return CHRF(char_order=order, word_order=0, beta=beta)


def chrf(hypothesis: str | None, reference: str | None, order: int = 6, beta: float = 2.0) -> float:
    """Sentence-level chrF in [0, 1]: sacrebleu's ``sentence_chrf`` (character n-grams of orders
    1..``order``, whitespace removed, recall weighted ``beta`` times) divided by 100.

    One convention of ours on top: two outputs that are both empty (or whitespace only) agree and score
    1.0, where sacrebleu scores 0; an empty string against a non-empty one scores 0 in both.
    """
    hyp, ref = hypothesis or "", reference or ""
    if not hyp.split() and not ref.split():
        return 1.0
    return _chrf_metric(order, beta).sentence_score(hyp, [ref]).score / 100


def token_f1(hypothesis: str | None, reference: str | None) -> float:
    """Bag-of-words F1 in [0, 1] between two texts (:func:`words`); two empty texts score 1.0."""
    h, r = Counter(words(hypothesis)), Counter(words(reference))
    if not h and not r:
        return 1.0
    common = sum((h & r).values())
    if common == 0:
        return 0.0
    precision, recall = common / sum(h.values()), common / sum(r.values())
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------------------------------------------
# Intervals
# ------------------------------------------------------------------------------------------------
def _clean(values: Iterable[Any]) -> np.ndarray:
    out = []
    for v in values:
        if v is None:
            continue
        f = float(v)
        if not math.isnan(f):
            out.append(f)
    return np.asarray(out, dtype=float)


def _is_binary(values: np.ndarray) -> bool:
    return bool(values.size) and bool(np.all((values == 0.0) | (values == 1.0)))


def _alpha(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return 1.0 - confidence


def wilson_interval(successes: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n`` (well behaved at 0 and 1 and for small n)."""
    if n <= 0:
        raise ValueError("wilson_interval needs n >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n={n}], got {successes}")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - _alpha(confidence) / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends (no rounding residue)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def _replicates(n: int, iterations: int, seed: int, stat) -> np.ndarray:
    """``stat(index_matrix)`` over ``iterations`` bootstrap resamples of ``n`` units, in chunks."""
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK // max(n, 1))
    out = []
    done = 0
    while done < iterations:
        k = min(rows, iterations - done)
        out.append(stat(rng.integers(0, n, size=(k, n))))
        done += k
    return np.concatenate(out)


def _percentiles(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    a = _alpha(confidence)
    lo, hi = np.quantile(replicates, [a / 2, 1 - a / 2])
    return float(lo), float(hi)


def _mean_replicates(values: np.ndarray, iterations: int, seed: int) -> np.ndarray:
    return _replicates(values.size, iterations, seed, lambda idx: values[idx].mean(axis=1))


def _ratio_replicates(num: np.ndarray, den: np.ndarray, iterations: int, seed: int) -> np.ndarray:
    def stat(idx):
        d = den[idx].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(d > 0, num[idx].sum(axis=1) / np.where(d > 0, d, 1), np.nan)

    return _replicates(num.size, iterations, seed, stat)


def mean_interval(
    values: Iterable[Any],
    confidence: float = CONFIDENCE,
    iterations: int = ITERATIONS,
    seed: int = 0,
    binary: bool | None = None,
) -> Estimate:
    """Mean of per-document scores with its interval: Wilson for right/wrong scores, else a percentile
    bootstrap.  ``binary=None`` decides by the data (every score 0 or 1); a graded score (chrF) that
    happens to be all 1.0 should pass ``binary=False`` (no variation: a zero-width interval).
    ``None``/NaN scores are left out."""
    v = _clean(values)
    if v.size == 0:
        return NONE
    mean = float(v.mean())
    if _is_binary(v) if binary is None else binary:
        lo, hi = wilson_interval(float(v.sum()), int(v.size), confidence)
        method = "Wilson"
    else:
        lo, hi = _percentiles(_mean_replicates(v, iterations, seed), confidence)
        method = "bootstrap"
    return Estimate(mean, min(lo, mean), max(hi, mean), int(v.size), method)


def ratio_interval(
    numerators: Sequence[float],
    denominators: Sequence[float],
    confidence: float = CONFIDENCE,
    iterations: int = ITERATIONS,
    seed: int = 0,
) -> Estimate:
    """``sum(numerators) / sum(denominators)`` with a bootstrap interval over the units (requests):
    tokens per forward over requests, fidelity over outputs.  None when the denominators sum to 0."""
    if len(numerators) != len(denominators):
        raise ValueError(f"ratio_interval: {len(numerators)} numerators vs {len(denominators)} denominators")
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.size == 0 or den.sum() <= 0:
        return Estimate(None, None, None, int(num.size))
    value = float(num.sum() / den.sum())
    reps = _ratio_replicates(num, den, iterations, seed)
    reps = reps[~np.isnan(reps)]
    lo, hi = _percentiles(reps, confidence) if reps.size else (value, value)
    return Estimate(value, min(lo, value), max(hi, value), int(num.size))


def paired_difference(
    a: Sequence[Any], b: Sequence[Any], confidence: float = CONFIDENCE, iterations: int = ITERATIONS, seed: int = 0
) -> Estimate:
    """Mean of ``a[i] - b[i]`` over paired documents with a percentile bootstrap over the pairs
    (pairs where either side is missing are left out).  Identical pairs give a zero-width interval."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs paired lists, got {len(a)} and {len(b)} values")
    diffs = _clean(None if x is None or y is None else float(x) - float(y) for x, y in zip(a, b))
    if diffs.size == 0:
        return NONE
    mean = float(diffs.mean())
    if np.all(diffs == diffs[0]):
        return Estimate(mean, mean, mean, int(diffs.size))
    lo, hi = _percentiles(_mean_replicates(diffs, iterations, seed), confidence)
    return Estimate(mean, min(lo, mean), max(hi, mean), int(diffs.size))


def combine_intervals(estimates: Sequence[Estimate], bounds: tuple[float, float] | None = (0.0, 1.0)) -> Estimate:
    """Unweighted mean of independent estimates (the table's Average over tasks) with an interval that
    adds each estimate's own half-widths in quadrature, side by side: ``mean -/+ sqrt(sum(w_i^2)) / k``.
    Each task keeps its own interval method (Wilson for right/wrong scores, where a bootstrap over a
    task that is all right or all wrong would claim no uncertainty at all).  Estimates without a value
    are left out; ``bounds`` clips the result (None for unbounded figures such as tokens per forward)."""
    given = [e for e in estimates if e.value is not None]
    if not given:
        return NONE
    k = len(given)
    value = sum(e.value for e in given) / k
    if any(e.lo is None or e.hi is None for e in given):
        return Estimate(value, None, None, sum(e.n for e in given))
    lo = value - math.sqrt(sum((e.value - e.lo) ** 2 for e in given)) / k
    hi = value + math.sqrt(sum((e.hi - e.value) ** 2 for e in given)) / k
    if bounds is not None:
        lo, hi = max(bounds[0], lo), min(bounds[1], hi)
    return Estimate(value, min(lo, value), max(hi, value), sum(e.n for e in given), "combined")


def mean_of_paired_differences(
    groups: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    confidence: float = CONFIDENCE,
    iterations: int = ITERATIONS,
    seed: int = 0,
) -> Estimate:
    """Unweighted mean over groups of each group's paired mean difference, stratified bootstrap."""
    diffs = []
    for a, b in groups:
        if len(a) != len(b):
            raise ValueError("mean_of_paired_differences needs paired lists in every group")
        d = _clean(None if x is None or y is None else float(x) - float(y) for x, y in zip(a, b))
        if d.size:
            diffs.append(d)
    if not diffs:
        return NONE
    value = float(np.mean([d.mean() for d in diffs]))
    if all(np.all(d == d[0]) for d in diffs):
        return Estimate(value, value, value, int(sum(d.size for d in diffs)))
    reps = np.mean([_mean_replicates(d, iterations, seed + i) for i, d in enumerate(diffs)], axis=0)
    lo, hi = _percentiles(reps, confidence)
    return Estimate(value, min(lo, value), max(hi, value), int(sum(d.size for d in diffs)))


# ------------------------------------------------------------------------------------------------
# Agreement with the reference output
# ------------------------------------------------------------------------------------------------
SIMILARITY = {
    "exact": lambda out, ref: float((out or "") == (ref or "")),
    "chrf": chrf,
    "token_f1": token_f1,
}


def similarity(kind: str, output: str | None, reference: str | None) -> float:
    """One document's agreement with its reference output: ``exact`` (0/1), ``chrf`` or ``token_f1``."""
    try:
        return SIMILARITY[kind](output, reference)
    except KeyError:
        raise ValueError(f"unknown similarity {kind!r}; one of {sorted(SIMILARITY)}") from None


def pair_rows(
    rows: Iterable[Mapping[str, Any]], reference: Iterable[Mapping[str, Any]], key: str = "doc_id"
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(row, reference row) for every ``key`` present in both, in the order of ``rows``."""
    ref = {r[key]: r for r in reference}
    return [(r, ref[r[key]]) for r in rows if r[key] in ref]


def fidelity_counts(row: Mapping[str, Any]) -> dict[str, int] | None:
    fid = row.get("fidelity")
    if isinstance(fid, Mapping) and all(k in fid for k in ("tokens", "ar_equal", "mask_tokens", "mask_ar_equal")):
        return {k: int(fid[k]) for k in ("tokens", "ar_equal", "mask_tokens", "mask_ar_equal")}
    return None


def mask_counts(row: Mapping[str, Any]) -> tuple[int, int] | None:
    """(tokens accepted from masks, generated tokens) of one output, from ``fidelity`` or ``from_mask``."""
    fid = fidelity_counts(row)
    if fid is not None:
        return fid["mask_tokens"], fid["tokens"]
    flags = row.get("from_mask")
    if isinstance(flags, Sequence) and not isinstance(flags, str):
        return sum(bool(f) for f in flags), len(flags)
    return None


def agreement_figures(
    pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
    confidence: float = CONFIDENCE,
    iterations: int = ITERATIONS,
    seed: int = 0,
) -> dict[str, Estimate]:
    """Agreement of outputs with their reference outputs (same prompts), with intervals.

    ``pairs``: (sample row, reference sample row) as written in ``samples/<threshold>/<task>.jsonl``
    (``output``; optionally ``fidelity`` = {tokens, ar_equal, mask_tokens, mask_ar_equal} and
    ``from_mask``).  Returns ``exact`` (share of identical outputs), ``chrf`` and ``token_f1`` (means),
    ``fidelity`` (mask-accepted tokens equal to the AR choice / mask-accepted tokens, over outputs),
    ``ar_equal`` (the same over every generated token) and ``mask_share`` (tokens accepted from masks /
    generated tokens).  A figure with nothing to measure (no fidelity recorded, no mask token accepted
    at threshold 1.0) is ``value=None``.
    """
    kw = {"confidence": confidence, "iterations": iterations, "seed": seed}
    out: dict[str, Estimate] = {
        kind: mean_interval(
            [similarity(kind, r.get("output"), ref.get("output")) for r, ref in pairs],
            binary=None if kind == "exact" else False,
            **kw,
        )
        for kind in SIMILARITY
    }
    fids = [f for r, _ in pairs if (f := fidelity_counts(r)) is not None]
    out["fidelity"] = ratio_interval([f["mask_ar_equal"] for f in fids], [f["mask_tokens"] for f in fids], **kw)
    out["ar_equal"] = ratio_interval([f["ar_equal"] for f in fids], [f["tokens"] for f in fids], **kw)
    masks = [m for r, _ in pairs if (m := mask_counts(r)) is not None]
    out["mask_share"] = ratio_interval([m[0] for m in masks], [m[1] for m in masks], **kw)
    return out


__all__ = [
    "CONFIDENCE",
    "Estimate",
    "ITERATIONS",
    "SIMILARITY",
    "agreement_figures",
    "chrf",
    "combine_intervals",
    "fidelity_counts",
    "mask_counts",
    "mean_interval",
    "mean_of_paired_differences",
    "pair_rows",
    "paired_difference",
    "ratio_interval",
    "similarity",
    "token_f1",
    "wilson_interval",
    "words",
]
