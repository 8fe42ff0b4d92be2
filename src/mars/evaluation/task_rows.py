"""Rows of a local lm-eval task file (eval/offline/*): read once, checked for the fields the task needs,
with the file and row named in the error.  Shared by the task helpers that lm-eval loads by path."""

from __future__ import annotations

import json
from pathlib import Path


def read_task_rows(path: Path, required: tuple[str, ...], missing_message: str) -> list[dict]:
    """The JSONL rows of ``path``; ``FileNotFoundError(missing_message)`` when it is absent, a
    ``ValueError`` naming the row when one lacks a field of ``required``."""
    if not path.is_file():
        raise FileNotFoundError(missing_message)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        missing = [f for f in required if f not in row]
        if missing:
            raise ValueError(f"{path}: row {row.get('id', '?')} lacks fields {missing} (needs {required})")
    return rows
