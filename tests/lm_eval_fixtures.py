"""Local lm-eval tasks for tests: a generate_until task over a few rows, scored by exact match, written as the
JSONL rows and the YAML that lm-eval's ``include_path`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def write_generation_task(
    folder: Path,
    name: str,
    rows: list[dict],
    *,
    max_gen_toks: int,
    until: list[str] | None = None,
    fields: tuple[str, str] = ("question", "answer"),
    data_file: str | None = None,
) -> Path:
    """``<folder>/<name>.yaml`` over ``rows`` (written to ``data_file``, default ``<name>.jsonl``); ``fields``
    names each row's prompt and target.  Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / (data_file or f"{name}.jsonl")
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    text, target = fields
    cfg = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "{{" + text + "}}",
        "doc_to_target": target,
        "generation_kwargs": {"until": list(until or []), "max_gen_toks": max_gen_toks, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def suite(folder: Path, *names: str) -> dict:
    """A benchmark suite of the generation tasks ``names`` written under ``folder`` (exact match, no defaults)."""
    return {
        "name": "fixture",
        "include_path": [str(folder)],
        "include_defaults": False,
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": None,
        "confirm_run_unsafe_code": False,
        "tasks": [{"name": n, "label": n.upper(), "metric": "exact_match", "filter": "none"} for n in names],
    }
