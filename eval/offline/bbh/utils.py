"""mars_bbh: answer extraction and exact match for the BBH-style subtasks.

Each row says how its answer is read (``kind``): ``choice`` (an option letter such as "(B)"; the
option's text also counts), ``label`` (one of a fixed set, e.g. Yes/No, valid/invalid), ``number``,
``dyck`` (a sequence of closing brackets) or ``words`` (a sorted word list). The part of the response
read is what follows the last "the answer is", else the whole response; choices and labels take the
first match in it (answer-only prompting puts the answer first), numbers the last, and ``dyck``/
``words`` read the first non-empty line. lm-eval's own bbh filters work the same way in spirit
(regex / multiple-choice / word-sort filters); these are our own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent
REQUIRED_FIELDS = ("id", "input", "target", "kind", "labels", "options")
KINDS = ("choice", "label", "number", "dyck", "words")

_ANSWER_IS = re.compile(r"answer is\s*:?", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+")
_BRACKETS = set("()[]{}<>")
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()


def load_local(data_files: dict[str, str] | None = None, **_metadata) -> datasets.DatasetDict:
    """``dataset_path: json`` with ``data_files`` resolved relative to this folder, not the cwd."""
    if not data_files:
        raise ValueError("a mars_bbh subtask needs dataset_kwargs.data_files (e.g. {test: data/snarks.jsonl})")
    splits = {}
    for split, rel in data_files.items():
        path = HERE / rel
        if not path.is_file():
            raise FileNotFoundError(
                f"mars_bbh data file {path} is missing; rebuild it with scripts/build_offline_benchmarks.py --only bbh"
            )
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for row in rows:
            missing = [f for f in REQUIRED_FIELDS if f not in row]
            if missing:
                raise ValueError(f"{path}: row {row.get('id', '?')} lacks fields {missing} (needs {REQUIRED_FIELDS})")
            if row["kind"] not in KINDS:
                raise ValueError(f"{path}: row {row['id']} has kind {row['kind']!r}; allowed: {KINDS}")
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def _answer_part(response: str) -> str:
    found = list(_ANSWER_IS.finditer(response))
    return response[found[-1].end() :] if found else response


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _choice(text: str, labels: list[str], options: list[str]) -> str | None:
    letters = [label.strip("()") for label in labels]
    hits = []
    m = re.search(r"\(([A-Z])\)", text)
    if m and m.group(1) in letters:
        hits.append((m.start(), f"({m.group(1)})"))
    m = re.match(r"\s*\**\s*([A-Z])\**(?:[).:]|\s*$)", text)  # "B", "B)", "B." at the start (not the article "A ...")
    if m and m.group(1) in letters:
        hits.append((m.start(1), f"({m.group(1)})"))
    lowered = text.lower()
    for label, option in zip(labels, options):  # the option's text: only if no other option's text contains it
        o = option.lower().strip()
        if not o or any(o != p.lower().strip() and o in p.lower() for p in options):
            continue
        m = re.search(rf"(?<!\w){re.escape(o)}(?!\w)", lowered)
        if m:
            hits.append((m.start(), label))
    return min(hits)[1] if hits else None


def _label(text: str, labels: list[str]) -> str | None:
    best = None
    for label in labels:
        m = re.search(rf"(?<![\w-]){re.escape(label)}(?![\w-])", text, re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), label)
    return best[1] if best else None


def _number(text: str) -> str | None:
    numbers = _NUMBER.findall(text.replace(",", ""))
    if numbers:
        return str(int(numbers[-1]))
    words = re.findall(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", text.lower())
    return str(_NUMBER_WORDS.index(words[-1])) if words else None


def _dyck(text: str) -> str | None:
    line = _first_line(text)
    closing = [c for c in line if c in _BRACKETS]
    return " ".join(closing) if closing else None


def _words(text: str, doc_input: str) -> str | None:
    """The list's words in the order the response first names them (like lm-eval's WordSortFilter)."""
    listed = doc_input.split("List:", 1)[-1].split()
    line = _first_line(text)
    order = []
    for token in re.findall(r"[\w'&.-]+", line.lower()):
        token = token.strip(".")
        if token in listed and token not in order:
            order.append(token)
    return " ".join(order) if order else None


def extract_answer(doc: dict, response: str) -> str | None:
    """The answer a response gives, in the form of ``doc["target"]`` (None when none is found)."""
    text = _answer_part(response)
    kind = doc["kind"]
    if kind == "choice":
        return _choice(text, list(doc["labels"]), list(doc["options"]))
    if kind == "label":
        return _label(text, list(doc["labels"]))
    if kind == "number":
        return _number(text)
    if kind == "dyck":
        return _dyck(text)
    if kind == "words":
        return _words(text, doc["input"])
    raise ValueError(f"row {doc.get('id')}: unknown kind {kind!r}; allowed: {KINDS}")


def is_correct(doc: dict, response: str) -> bool:
    answer = extract_answer(doc, response)
    if answer is None:
        return False
    if doc["kind"] == "label":
        return answer.lower() == doc["target"].lower()
    if doc["kind"] == "dyck":
        return answer.split() == doc["target"].split()
    return answer == doc["target"]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(is_correct(doc, results[0]))}
