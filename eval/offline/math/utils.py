"""mars_math: ASDiv math word problems scored like GSM8K 0-shot chain of thought.

The answer is the number after the last "The answer is" in the response, else the last number in it;
it is right when it equals the gold number (commas, "$" and a trailing "." ignored; 1e-6 relative
tolerance, so "42.0" matches "42"). ``strict_match`` only accepts the "The answer is N" form.
"""

from __future__ import annotations

import re
from pathlib import Path

import datasets

from mars.evaluation.task_rows import read_task_rows

HERE = Path(__file__).resolve().parent
REQUIRED_FIELDS = ("id", "question", "answer")

_NUMBER = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\s?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)


def load_local(data_files: dict[str, str] | None = None, **_metadata) -> datasets.DatasetDict:
    """``dataset_path: json`` with ``data_files`` resolved relative to this folder, not the cwd."""
    if not data_files:
        raise ValueError("mars_math needs dataset_kwargs.data_files (e.g. {test: data/asdiv_test.jsonl})")
    splits = {}
    for split, rel in data_files.items():
        path = HERE / rel
        rows = read_task_rows(
            path,
            REQUIRED_FIELDS,
            f"mars_math data file {path} is missing; rebuild it with scripts/build_offline_benchmarks.py --only math",
        )
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def to_number(text: str | None) -> float | None:
    """'1,234', '$5', '3.50.' -> float; None when ``text`` holds no number."""
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_answer(response: str) -> tuple[str | None, str | None]:
    """(flexible, strict): the number after the last "The answer is", else the last number; strict
    is only the former."""
    stated = _ANSWER_IS_RE.findall(response)
    strict = stated[-1] if stated else None
    if strict is not None:
        return strict, strict
    numbers = _NUMBER_RE.findall(response)
    return (numbers[-1] if numbers else None), None


def same_number(predicted: str | None, gold: str) -> bool:
    p, g = to_number(predicted), to_number(gold)
    if p is None or g is None:
        return False
    return abs(p - g) <= 1e-6 * max(1.0, abs(g))


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    flexible, strict = extract_answer(results[0])
    return {
        "exact_match": float(same_number(flexible, doc["answer"])),
        "strict_match": float(same_number(strict, doc["answer"])),
    }
