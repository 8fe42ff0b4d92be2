"""Short-answer tasks of the quality suite: loading and scoring (see README.md beside this file).

Every task is ``generate_until`` with the chat template, cut at the first newline: the answer is read from
the first line of the response, so a wordy answer ("The capital city of France is Paris.") counts as
much as a bare one ("Paris"), and a response that names several candidates is judged by the first.

- capitals / continents: the earliest candidate (every capital and alias of the task's table / the six
  continents) named in the first line, after the question's own country name is blanked out, must be
  the gold answer or one of its aliases (accents, case and punctuation ignored).
- first_letter: the letter stated (a bare letter, the letter after "is", a quoted letter, or a
  stand-alone capital letter other than "I" and "A"), case ignored.
- next_number: the number after the last "is"/"=" in the first line, else its first integer other than
  the number asked about.
- copy: the first line, surrounding quotes and whitespace removed, equals the sentence exactly
  (``exact_match``); ``chrf`` grades near misses.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from pathlib import Path

import datasets

from mars.evaluation.task_rows import read_task_rows

HERE = Path(__file__).resolve().parent
REQUIRED_FIELDS = ("id", "question", "answer")
CONTINENTS = ("Africa", "Asia", "Europe", "North America", "South America", "Oceania", "Antarctica")
CONTINENT_ALIASES = {"Australia": "Oceania"}


def load_local(data_files: dict[str, str] | None = None, **_metadata) -> datasets.DatasetDict:
    """``dataset_path: json`` with ``data_files`` resolved relative to this folder, not the cwd."""
    if not data_files:
        raise ValueError("quality tasks need dataset_kwargs.data_files (e.g. {test: data/capitals.jsonl})")
    splits = {}
    for split, rel in data_files.items():
        path = HERE / rel
        rows = read_task_rows(
            path, REQUIRED_FIELDS, f"{path} is missing; rebuild it with scripts/build_quality_tasks.py"
        )
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


# ------------------------------------------------------------------------------------------------
# text helpers
# ------------------------------------------------------------------------------------------------
def fold(text: str) -> str:
    """Lowercase, accents removed, runs of non-alphanumerics as one space."""
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).lower()
    return " ".join("".join(c if c.isalnum() else " " for c in text).split())


def first_line(response: str | None) -> str:
    for line in (response or "").strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def earliest(text: str, candidates: dict[str, str], blank: tuple[str, ...] = ()) -> str | None:
    """The value of the candidate (folded name -> value) named first in ``text`` (folded, whole words;
    at one position the longest name wins), after the names in ``blank`` are removed."""
    hay = f" {fold(text)} "
    for name in blank:
        if name and fold(name):
            hay = hay.replace(f" {fold(name)} ", " # ")
    best: tuple[int, int, str] | None = None
    for key, value in candidates.items():
        pos = hay.find(f" {key} ")
        if pos >= 0 and (best is None or (pos, -len(key)) < best[:2]):
            best = (pos, -len(key), value)
    return best[2] if best else None


# ------------------------------------------------------------------------------------------------
# scorers
# ------------------------------------------------------------------------------------------------
@functools.cache
def capital_candidates() -> dict[str, str]:
    """Every capital and alias of data/capitals.jsonl (folded) -> the folded gold capital it stands for."""
    out = {}
    for line in (HERE / "data" / "capitals.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            for name in [row["answer"], *row.get("aliases", [])]:
                out.setdefault(fold(name), fold(row["answer"]))
    return out


def capital_answer(response: str, country: str) -> str | None:
    return earliest(first_line(response), capital_candidates(), blank=(country,))


def continent_answer(response: str, country: str) -> str | None:
    names = {fold(c): c for c in CONTINENTS} | {fold(a): c for a, c in CONTINENT_ALIASES.items()}
    return earliest(first_line(response), names, blank=(country,))


# after "is": a quoted letter of either case, or a bare capital (a bare "a" is the article)
_LETTER_AFTER_IS = re.compile(r"\bis\s*:?\s*(?:[\"'“‘(]([A-Za-z])[\"'”’)]|([A-Z])(?![A-Za-z'’]))")
_QUOTED_LETTER = re.compile(r"[\"'“‘(]([A-Za-z])[\"'”’)]")
_CAPITAL_LETTER = re.compile(r"(?<![A-Za-z'’])([B-HJ-Z])(?![A-Za-z'’])")


def letter_answer(response: str) -> str | None:
    line = first_line(response)
    bare = line.strip(" \t\"'“”‘’.()*:")
    if len(bare) == 1 and bare.isalpha():
        return bare.upper()
    for pattern in (_LETTER_AFTER_IS, _QUOTED_LETTER, _CAPITAL_LETTER):
        found = ["".join(f) if isinstance(f, tuple) else f for f in pattern.findall(line)]
        if found:
            return (found[-1] if pattern is _LETTER_AFTER_IS else found[0]).upper()
    return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _integers(text: str) -> list[int]:
    """Whole numbers in ``text`` (a decimal such as 4.5 is skipped, not read as 4 and 5)."""
    return [int(float(t)) for t in _NUMBER.findall(text) if float(t).is_integer()]


def number_answer(response: str, asked: int) -> int | None:
    line = first_line(response).replace(",", "")
    parts = re.split(r"\bis\b|=", line)
    if len(parts) > 1:
        found = _integers(parts[-1])
        if found:
            return found[0]
    return next((n for n in _integers(line) if n != asked), None)


def copied_text(response: str) -> str:
    return " ".join(first_line(response).strip("\"'“”‘’").split())


def _chrf(hypothesis: str, reference: str) -> float:
    try:
        from mars.evaluation.agreement import chrf
    except ImportError:  # lm-eval without the mars package on the path: no graded score
        return float(hypothesis == reference)
    return chrf(hypothesis, reference)


def process_capitals(doc: dict, results: list[str]) -> dict[str, float]:
    # a candidate stands for its row's gold capital, so an alias of the right country counts as right
    return {"exact_match": float(capital_answer(results[0], doc["country"]) == fold(doc["answer"]))}


def process_continents(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(continent_answer(results[0], doc["country"]) == doc["answer"])}


def process_first_letter(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(letter_answer(results[0]) == doc["answer"].upper())}


def process_next_number(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(number_answer(results[0], int(doc["number"])) == int(doc["answer"]))}


def process_copy(doc: dict, results: list[str]) -> dict[str, float]:
    text = copied_text(results[0])
    return {"exact_match": float(text == doc["answer"]), "chrf": _chrf(text, doc["answer"])}
