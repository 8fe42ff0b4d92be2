"""The results folder of one evaluation run, and its resume rules.

Layout (``outputs/eval/<run-name>/``)::

    config.yaml                      resolved config of the run (the first run that created the folder)
    samples/<threshold>/<task>.jsonl per-sample outputs, metrics and decoder stats of one point
    samples/<threshold>/<task>.json  the point's summary (lm-eval metrics, tokens/forward, timing);
                                     written last, so its presence marks the point complete
    points.json / points.csv         every point of the folder, aggregated
    table.md                         paper-style table (Tables 4/8)
    pareto_<task>.png                accuracy vs tokens per forward

Every file is written to a temporary sibling and renamed, so an interrupted run never leaves a
half-written file that looks complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import yaml

CONFIG_FILE = "config.yaml"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary sibling, then rename: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=_json_default, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _json_default(obj: Any) -> Any:
    # numpy scalars, tuples of metrics, sets: make them plain JSON
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def threshold_key(threshold: float) -> str:
    """Folder name of a threshold: ``1.0``, ``0.95``... (stable for floats parsed from the CLI)."""
    return repr(float(round(float(threshold), 6)))


class ResultsMismatchError(ValueError):
    """The results folder was written by a run whose result-relevant config differs."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for key, value in d.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: d}


def differing_keys(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two nested dicts (missing counts as different)."""
    a, b = _flatten(saved), _flatten(current)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<missing>") != b.get(k, "<missing>"))


class ResultsDir:
    """One evaluation run's folder: where each file goes, and whether a point is finished."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- paths -------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_FILE

    def samples_path(self, threshold: float, task: str) -> Path:
        return self.root / "samples" / threshold_key(threshold) / f"{task}.jsonl"

    def summary_path(self, threshold: float, task: str) -> Path:
        return self.root / "samples" / threshold_key(threshold) / f"{task}.json"

    # -- config fingerprint --------------------------------------------------------------------
    def check_compatible(self, fingerprint: dict) -> None:
        """Raise if the folder holds results of a run whose result-relevant config differs.

        ``fingerprint`` is the part of the config that changes results (model, checkpoint, decoding,
        tasks, limit, ...); thresholds are not part of it, so a sweep can add points later.
        """
        if not self.config_path.is_file():
            return
        saved = yaml.safe_load(self.config_path.read_text()) or {}
        saved_fp = saved.get("fingerprint")
        if saved_fp is None:
            return
        diff = differing_keys(saved_fp, fingerprint)
        if diff:
            details = "; ".join(
                f"{k}: saved {_flatten(saved_fp).get(k, '<missing>')!r} vs now {_flatten(fingerprint).get(k, '<missing>')!r}"
                for k in diff[:8]
            )
            raise ResultsMismatchError(
                f"The results folder {self.root} holds results of a different configuration ({details}). "
                "Mixing them would corrupt the table: pick another folder with run_name=... or output_dir=..., "
                "or delete the old folder."
            )

    def write_config(self, resolved: dict, fingerprint: dict) -> None:
        """Save the resolved config (with the fingerprint used for resume checks)."""
        # a JSON round trip turns shared sub-objects into plain copies (no YAML anchors)
        doc = json.loads(json.dumps({"fingerprint": fingerprint, "resolved": resolved}, default=_json_default))
        atomic_write_text(self.config_path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))

    # -- points --------------------------------------------------------------------------------
    def is_complete(self, threshold: float, task: str) -> bool:
        summary, samples = self.summary_path(threshold, task), self.samples_path(threshold, task)
        if not (summary.is_file() and samples.is_file()):
            return False
        try:
            expected = json.loads(summary.read_text()).get("n_samples")
            return expected is not None and len(read_jsonl(samples)) == expected
        except (json.JSONDecodeError, OSError):
            return False

    def write_point(self, threshold: float, task: str, samples: list[dict], summary: dict) -> None:
        # samples first, summary last: the summary is the completion mark
        write_jsonl(self.samples_path(threshold, task), samples)
        write_json(self.summary_path(threshold, task), {**summary, "n_samples": len(samples)})

    def read_summary(self, threshold: float, task: str) -> dict:
        return json.loads(self.summary_path(threshold, task).read_text())

    def read_samples(self, threshold: float, task: str) -> list[dict]:
        return read_jsonl(self.samples_path(threshold, task))

    def thresholds_on_disk(self) -> list[float]:
        base = self.root / "samples"
        if not base.is_dir():
            return []
        out = []
        for child in base.iterdir():
            try:
                out.append(float(child.name))
            except ValueError:
                continue
        return sorted(out, reverse=True)
