"""Multi-stage jobs made of commands one could type (``make reproduce``, the recipe search): each stage is
run once, logged, timed, and skipped when its result exists, so a killed job resumes by running it again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mars.metadata import is_complete
from mars.persistence import atomic_write_text


class Stages:
    """Runs each stage's command once (from ``cwd``); remembers wall times in ``<out>/stages.json``.  A decoding
    stage picks its own OpenMP wait when it starts (:func:`mars.hardware.apply_process_defaults`, from the tasks
    running then: the job's finished stages do not count)."""

    def __init__(self, out: Path, dry_run: bool, cwd: Path):
        self.out, self.dry_run, self.cwd = out, dry_run, cwd
        self.record_path = out / "stages.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.is_file() else {}
        self.commands: list[str] = []

    def run(self, name: str, cmd: list[str], done: bool, env: dict | None = None) -> None:
        text = "python " + " ".join(cmd)
        self.commands.append(f"# {name}\n{text}")
        if done:
            print(f"=== {name}: done already, skipped", flush=True)
            return
        print(f"\n=== {name}: {text}", flush=True)
        if self.dry_run:
            return
        start = time.perf_counter()
        subprocess.run([sys.executable, *cmd], cwd=self.cwd, check=True, env={**os.environ, **(env or {})})
        minutes = (time.perf_counter() - start) / 60
        self.record[name] = {
            **self.record.get(name, {}),
            "minutes_last_run": round(minutes, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        atomic_write_text(self.record_path, json.dumps(self.record, indent=2) + "\n")
        print(f"=== {name} took {minutes:.1f} min", flush=True)

    def write_commands(self, path: Path, title: str) -> None:
        atomic_write_text(path, f"# {title}\n\n```\n" + "\n\n".join(self.commands) + "\n```\n")


def complete_checkpoint(path: Path) -> bool:
    """A training export that reached its configured end (``mars_config.json`` says ``complete``)."""
    return is_complete(path)


def has_points(folder: Path, thresholds: list[float]) -> bool:
    """An evaluation folder whose ``points.json`` holds every one of ``thresholds``."""
    points = folder / "points.json"
    if not points.is_file():
        return False
    have = {round(float(p["threshold"]), 6) for p in json.loads(points.read_text())}
    return all(round(t, 6) in have for t in thresholds)


def reuse_base_reference(base_eval: Path, out: Path) -> None:
    """A gated adapter's tau = 1.0 output is the base model's, token for token (its real columns run the
    frozen base weights, and a tau = 1.0 row accepts only the real column's prediction: tests/training/test_adapters.py,
    tests/training/test_budget.py), so the base's tau = 1.0 samples serve as the adapter's reference point instead of
    decoding the same outputs again.  Used for the recipe search's variants and the learning curve's points;
    the reference run's final evaluation decodes its tau = 1.0 point for real."""
    from mars.evaluation.store import threshold_key

    source = base_eval / "samples" / threshold_key(1.0)
    target = out / "samples" / threshold_key(1.0)
    if source.is_dir() and not target.exists():
        shutil.copytree(source, target)
