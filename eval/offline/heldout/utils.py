"""mars_heldout: the held-out prompts of data/prompts/heldout.jsonl, answered freely, for agreement.

The prompts are read in place (never copied under eval/**/data/: mars.training.prompt_overlap scans those files, and
training prompts that share a template with a held-out one would then be refused).  lm-eval's metric
here is only ``nonempty`` (share of non-empty outputs, a sanity figure); the real measures compare each
output with the same checkpoint's threshold-1.0 output of the same prompt and are computed by
mars.evaluation.aggregate (exact agreement, chrF, token F1, per-token fidelity; see
mars.evaluation.agreement).

``size`` (dataset_kwargs) takes a subset stratified by category: each category gets its share of
``size`` by largest remainder (ties to the category seen first), and within a category the rows come
in file order, so a smaller subset is a prefix of a larger one within each category.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import datasets

from mars.evaluation.task_rows import read_task_rows

HERE = Path(__file__).resolve().parent
REQUIRED_FIELDS = ("id", "category", "prompt")


def stratified(rows: list[dict], size: int | None) -> list[dict]:
    """``size`` rows with each category's share of the file (largest remainder), in file order."""
    if size is None or size >= len(rows):
        return list(rows)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    counts = Counter(r["category"] for r in rows)
    order = list(dict.fromkeys(r["category"] for r in rows))
    exact = {c: counts[c] * size / len(rows) for c in order}
    quota = {c: int(exact[c]) for c in order}
    spare = size - sum(quota.values())
    for c in sorted(order, key=lambda c: (-(exact[c] - quota[c]), order.index(c)))[:spare]:
        quota[c] += 1
    taken: Counter = Counter()
    out = []
    for row in rows:
        if taken[row["category"]] < quota[row["category"]]:
            taken[row["category"]] += 1
            out.append(row)
    return out


def load_heldout(
    data_files: dict[str, str] | None = None, size: int | None = None, **_metadata
) -> datasets.DatasetDict:
    """``data_files`` relative to this folder (the repo's data/prompts/heldout.jsonl); ``size`` a
    stratified subset."""
    if not data_files:
        raise ValueError(
            "mars_heldout needs dataset_kwargs.data_files (e.g. {test: ../../../data/prompts/heldout.jsonl})"
        )
    splits = {}
    for split, rel in data_files.items():
        path = (HERE / rel).resolve()
        rows = read_task_rows(
            path,
            REQUIRED_FIELDS,
            f"mars_heldout: {path} is missing (the held-out prompts of data/prompts; "
            "scripts/build_prompt_set.py writes them)",
        )
        rows = stratified(rows, None if size is None else int(size))
        splits[split] = datasets.Dataset.from_list(
            [{k: r[k] for k in ("id", "source", "category", "prompt") if k in r} for r in rows]
        )
    return datasets.DatasetDict(splits)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"nonempty": float(bool(results[0].strip()))}
