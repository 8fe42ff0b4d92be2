"""The results folder of one evaluation run, and its resume rules.

Layout (``outputs/eval/<run-name>/``)::

    config.yaml                      resolved config of the run (the first run that created the folder)
    samples/<threshold>/<task>.jsonl per-sample outputs, metrics and decoder stats of one point
    samples/<threshold>/<task>.json  the point's summary (lm-eval metrics, tokens/forward, timing);
                                     written last, so its presence marks the point complete
    samples/verify/<task>.jsonl|json the lossless verify point (threshold 1.0 with verified drafts, on the
                                     first samples of each task; its summary records its settings)
    partial/<point>/<task>.jsonl     append-only cache of the point's finished generations (one line
                                     per request, keyed by a hash of prompt + settings + config
                                     fingerprint), written after every decoded batch: a killed run
                                     resumes at (threshold, task, sample) and decodes only what is
                                     missing; removed once the point is complete
    points.json / points.csv         every point of the folder, aggregated
    table.md                         paper-style table (Tables 4/8)
    pareto_<task>.<png|pdf|svg>      accuracy vs tokens per forward (plots.format)

Every file but the partial cache is written to a temporary sibling and renamed, so an interrupted run
never leaves a half-written file that looks complete; the partial cache's lines are read up to the
last whole one (both through :mod:`mars.persistence`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from mars.persistence import (
    append_jsonl,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    fingerprint_differences,
    json_default,
    read_appended_jsonl,
    read_jsonl,
    remove_tree,
)

CONFIG_FILE = "config.yaml"


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """A results file: atomic, numpy scalars and sets made plain JSON."""
    atomic_write_json(path, obj, default=json_default)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    atomic_write_jsonl(path, rows, default=json_default)


def threshold_key(threshold: float) -> str:
    """Folder name of a threshold: ``1.0``, ``0.95``... (stable for floats parsed from the CLI)."""
    return repr(float(round(float(threshold), 6)))


# The lossless verify point: a point of its own beside the thresholds (at threshold 1.0, so no threshold can
# name it), and the name of its folders
VERIFY = "verify"
Point = float | str  # a threshold, or VERIFY


def point_key(point: Point) -> str:
    """Folder name of a point: its threshold's (:func:`threshold_key`), or ``verify``."""
    return VERIFY if point == VERIFY else threshold_key(point)


def _point_of(name: str) -> Point | None:
    """The point a folder name stands for (None: no point's folder)."""
    if name == VERIFY:
        return VERIFY
    try:
        return float(name)
    except ValueError:
        return None


def canonical_fingerprint(fingerprint: dict) -> dict:
    """``fingerprint`` with every decoding setting it does not list at its default: a setting that the decoding
    config starts to list at its default (or stops listing) changes no output, so it does not change a folder's
    identity either."""
    from dataclasses import MISSING, fields

    from mars.decoding.settings import DecodingSettings

    defaults = {f.name: f.default for f in fields(DecodingSettings) if f.default is not MISSING}
    decoding = fingerprint.get("decoding")
    if not isinstance(decoding, dict):
        return fingerprint
    return {**fingerprint, "decoding": {**defaults, **decoding}}


def fingerprint_hash(fingerprint: dict) -> str:
    """A short stable hash of a config fingerprint (salts the partial cache's request keys)."""
    text = json.dumps(canonical_fingerprint(fingerprint), sort_keys=True, default=json_default)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class RequestCache:
    """Append-only cache of finished generations of one (threshold, task): a JSON line per request.

    ``append`` writes a whole batch with one ``write`` call and flushes it, so a killed process loses at
    most the batch in flight; ``load`` keeps every whole line (a torn last line is skipped, and the next
    append starts on a fresh line).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[str, dict]:
        return {row["key"]: row for row in read_appended_jsonl(self.path) if "key" in row}

    def append(self, rows: list[dict]) -> None:
        append_jsonl(self.path, rows, default=json_default)


class ResultsMismatchError(ValueError):
    """The results folder was written by a run whose result-relevant config differs."""


class ResultsDir:
    """One evaluation run's folder: where each file goes, and whether a point is finished."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- paths -------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_FILE

    # A point is a threshold or VERIFY (the lossless verify point) throughout.
    def samples_path(self, threshold: Point, task: str) -> Path:
        return self.root / "samples" / point_key(threshold) / f"{task}.jsonl"

    def summary_path(self, threshold: Point, task: str) -> Path:
        return self.root / "samples" / point_key(threshold) / f"{task}.json"

    def partial_path(self, threshold: Point, task: str, rank: int = 0) -> Path:
        suffix = f".rank{rank}" if rank else ""
        return self.root / "partial" / point_key(threshold) / f"{task}{suffix}.jsonl"

    # -- partial generations -------------------------------------------------------------------
    def request_cache(self, threshold: Point, task: str, rank: int = 0) -> RequestCache:
        """Where this process appends the finished generations of a point in progress."""
        return RequestCache(self.partial_path(threshold, task, rank))

    def load_partial(self, threshold: Point, task: str) -> dict[str, dict]:
        """Every finished generation of the point on disk (all ranks' files)."""
        folder = self.partial_path(threshold, task).parent
        rows: dict[str, dict] = {}
        if folder.is_dir():
            for path in sorted(folder.glob(f"{task}.jsonl")) + sorted(folder.glob(f"{task}.rank*.jsonl")):
                rows.update(RequestCache(path).load())
        return rows

    def partial_points(self) -> list[tuple[Point, str]]:
        """(point, task) of every point with partial generations on disk."""
        base = self.root / "partial"
        points = set()
        if base.is_dir():
            for folder in base.iterdir():
                point = _point_of(folder.name)
                if point is None:
                    continue
                for path in folder.glob("*.jsonl"):
                    points.add((point, path.name.removesuffix(".jsonl").split(".rank")[0]))
        return sorted(points, key=lambda p: (point_key(p[0]), p[1]))

    def discard_partial(self, threshold: Point | None = None, task: str | None = None) -> None:
        """Drop the partial cache of one point (after it completed), or all of it."""
        if threshold is None:
            shutil.rmtree(self.root / "partial", ignore_errors=True)
            return
        folder = self.partial_path(threshold, task or "").parent
        for path in list(folder.glob(f"{task}.jsonl")) + list(folder.glob(f"{task}.rank*.jsonl")):
            path.unlink(missing_ok=True)
        try:
            folder.rmdir()
            folder.parent.rmdir()
        except OSError:
            pass  # other points still in progress

    # -- config fingerprint --------------------------------------------------------------------
    def saved_fingerprint(self) -> dict | None:
        if not self.config_path.is_file():
            return None
        try:
            saved = yaml.safe_load(self.config_path.read_text()) or {}
        except yaml.YAMLError:
            return None  # a torn config.yaml cannot vouch for anything
        return saved.get("fingerprint") if isinstance(saved, dict) else None

    def complete_points(self) -> list[tuple[Point, str]]:
        """(point, task) of every complete point in the folder: the thresholds', then the verify point's."""
        points = []
        for point in [*self.thresholds_on_disk(), VERIFY]:
            folder = self.root / "samples" / point_key(point)
            for summary in sorted(folder.glob("*.json")):
                if self.is_complete(point, summary.stem):
                    points.append((point, summary.stem))
        return points

    def check_compatible(self, fingerprint: dict) -> None:
        """Raise if the folder holds results of a run whose result-relevant config differs.

        ``fingerprint`` is the part of the config that changes results (model, checkpoint, decoding,
        tasks, limit, ...); thresholds are not part of it, so a sweep can add points later.  A folder
        that holds no complete point (a run that failed or was killed before finishing one) is not
        refused: nothing in it can be mixed up, and its partial generations are keyed by the
        fingerprint, so another config never reuses them.
        """
        saved_fp = self.saved_fingerprint()
        if saved_fp is None:
            return
        diff = fingerprint_differences(canonical_fingerprint(saved_fp), canonical_fingerprint(fingerprint))
        if diff and self.complete_points():
            details = "; ".join(f"{k}: saved {saved!r} vs now {now!r}" for k, saved, now in diff[:8])
            raise ResultsMismatchError(
                f"The results folder {self.root} holds results of a different configuration ({details}). "
                "Mixing them would corrupt the table: pick another folder with run_name=... or output_dir=..., "
                "or evaluate this one from scratch with overwrite=true (deletes its results)."
            )

    def clear(self) -> None:
        """Remove the folder's results (``overwrite=true``), as train.py's overwrite does: the complete points
        first, ``config.yaml`` (the fingerprint) last, each folder renamed away before it is deleted, so a kill
        at any moment leaves results that the saved fingerprint still describes, or none.  evaluate.log stays
        (a log, as train.py leaves its logger's folders)."""
        for name in ("samples", "partial"):
            remove_tree(self.root / name)
        written = [self.root / n for n in ("points.json", "points.csv", "table.md")] + sorted(
            self.root.glob("pareto_*")
        )
        for path in written:
            path.unlink(missing_ok=True)
        self.config_path.unlink(missing_ok=True)

    def write_config(self, resolved: dict, fingerprint: dict) -> None:
        """Save the resolved config (with the fingerprint used for resume checks)."""
        # a JSON round trip turns shared sub-objects into plain copies (no YAML anchors)
        doc = json.loads(json.dumps({"fingerprint": fingerprint, "resolved": resolved}, default=json_default))
        atomic_write_text(self.config_path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))

    # -- points --------------------------------------------------------------------------------
    def is_complete(self, threshold: Point, task: str) -> bool:
        summary, samples = self.summary_path(threshold, task), self.samples_path(threshold, task)
        if not (summary.is_file() and samples.is_file()):
            return False
        try:
            expected = json.loads(summary.read_text()).get("n_samples")
            return expected is not None and len(read_jsonl(samples)) == expected
        except (ValueError, OSError):  # a damaged file (JSONDecodeError is a ValueError) is not complete
            return False

    def write_point(self, threshold: Point, task: str, samples: list[dict], summary: dict) -> None:
        # samples first, summary last: the summary is the completion mark
        write_jsonl(self.samples_path(threshold, task), samples)
        write_json(self.summary_path(threshold, task), {**summary, "n_samples": len(samples)})

    def read_summary(self, threshold: Point, task: str) -> dict:
        return json.loads(self.summary_path(threshold, task).read_text())

    def read_samples(self, threshold: Point, task: str) -> list[dict]:
        return read_jsonl(self.samples_path(threshold, task))

    def thresholds_on_disk(self) -> list[float]:
        """The thresholds with a samples folder (the verify point's is not one)."""
        base = self.root / "samples"
        if not base.is_dir():
            return []
        points = [_point_of(child.name) for child in base.iterdir()]
        return sorted((p for p in points if isinstance(p, float)), reverse=True)
