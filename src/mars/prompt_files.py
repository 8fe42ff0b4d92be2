"""Prompt files: JSONL, one prompt per line, read the same way by every tool that takes one (the benchmarks,
the self-distillation builder).

A row is a JSON object holding the prompt as a string field (``prompt``; a tool may accept other names, such
as the evaluation files' ``question``) or as ``messages``, a chat whose first user turn is the prompt.
``id``, ``category`` and ``source`` are optional unless the tool needs them; every other field is ignored.
Blank lines are skipped.  Every line is checked: a line that is not UTF-8 or not JSON, a row that is no
object, has no prompt or an empty one, or a field of the wrong type is refused with a :class:`PromptFileError`
naming the file and the line, before any model loads.

No torch and nothing of mars: every layer may import it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_FIELDS = ("prompt",)  # the fields a row's prompt is read from, in order, unless a tool names others


class PromptFileError(ValueError):
    """A prompt file that cannot be used: ``path``, ``line`` (1-based; None: the whole file) and ``reason``."""

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{self.path}{'' if line is None else f', line {line}'}: {reason}")


class PromptFileNotFound(PromptFileError, FileNotFoundError):
    """A prompt file that does not exist (a ``FileNotFoundError`` too)."""


@dataclass(frozen=True)
class PromptRow:
    id: str  # the row's ``id`` as text, else ``<file stem>-<line>``
    prompt: str
    line: int  # its line in the file (1-based), for the refusals of the tools that read it
    category: str | None = None
    source: str | None = None


def prompt_of(row: Mapping[str, Any], fields: Sequence[str] = PROMPT_FIELDS) -> str | None:
    """The prompt of a row: its first string among ``fields``, else the content of the first user turn of its
    ``messages``; None where it has neither."""
    for name in fields:
        if isinstance(row.get(name), str):
            return row[name]
    messages = row.get("messages")
    if isinstance(messages, list):
        user = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
        if isinstance(user, str):
            return user
    return None


def read_prompt_file(
    path: str | os.PathLike,
    fields: Sequence[str] = PROMPT_FIELDS,
    require: Mapping[str, str] | None = None,
) -> list[PromptRow]:
    """Every prompt of the JSONL file ``path``, in file order.  ``fields``: where a row's prompt is read from
    (then ``messages``); ``require``: the optional fields (``id``, ``category``, ``source``) every row must have,
    each with why (named in the refusal)."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise PromptFileNotFound(path, None, "the file does not exist") from None
    except OSError as err:
        raise PromptFileError(path, None, f"cannot be read ({err.strerror or err})") from None
    rows = []
    for number, raw in enumerate(lines, 1):
        row = _json_row(path, number, raw)
        if row is not None:
            rows.append(_prompt_row(path, number, row, fields, require or {}))
    return rows


def _json_row(path: Path, number: int, raw: bytes) -> dict[str, Any] | None:
    """One line as a JSON object (None: a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PromptFileError(path, number, f"not UTF-8 (byte {err.start + 1}); save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(path, number, f"not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(row, dict):
        raise PromptFileError(path, number, f"expected a JSON object (one prompt per line), found {type(row).__name__}")
    return row


def _prompt_row(
    path: Path, number: int, row: dict[str, Any], fields: Sequence[str], require: Mapping[str, str]
) -> PromptRow:
    prompt = prompt_of(row, fields)
    if prompt is None:
        names = " or ".join(repr(f) for f in fields)
        raise PromptFileError(
            path,
            number,
            f"no prompt (expected a non-empty {names} string or a 'messages' list with a user turn), "
            f"found keys {sorted(row)}",
        )
    if not prompt.strip():
        raise PromptFileError(path, number, "the prompt is empty")
    for name, why in require.items():
        if name not in row:
            raise PromptFileError(path, number, f"no {name!r} field ({why})")
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        raise PromptFileError(path, number, f"'id' must be a string or an integer, found {row_id!r}")
    for name in ("category", "source"):
        if name in row and not isinstance(row[name], str):
            raise PromptFileError(path, number, f"{name!r} must be a string, found {row[name]!r}")
    return PromptRow(
        id=f"{path.stem}-{number}" if row_id is None else str(row_id),
        prompt=prompt,
        line=number,
        category=row.get("category"),
        source=row.get("source"),
    )
