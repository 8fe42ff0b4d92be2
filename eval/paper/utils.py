"""Helpers of the local copies of the paper's six lm-eval tasks (eval/paper/*.yaml).

The copies keep the built-in tasks' prompts, filters and metrics but read a few hand-written rows
from ``data/`` (``dataset_path: json`` semantics, paths relative to this folder so any working
directory works), so the lm-eval model and scoring path of every paper task runs without the hub.
The only metric replaced is HumanEval's: lm-eval's ``humaneval`` loads ``evaluate.load("code_eval")``
from the hub and runs the model's code in a fork of the process holding the model, uncontained; here
the same pass@1 (program = prediction + tests + ``check(entry_point)``) runs each program in the
bubblewrap sandbox of eval/offline/humaneval/sandbox.py.
"""

from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_local(data_files: dict[str, str] | None = None, **_metadata) -> datasets.DatasetDict:
    """``dataset_path: json`` with ``data_files`` relative to eval/paper/ (lm-eval calls this with the
    task's ``dataset_kwargs`` and metadata)."""
    if not data_files:
        raise ValueError("a local paper task needs dataset_kwargs.data_files")
    files = {split: str(HERE / path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)


# ---- IFEval: lm-eval's own checkers (need langdetect and immutabledict; punkt_tab only for the
# sentence-counting instructions, which the local rows avoid) -------------------------------------
def ifeval_process_results(doc, results):
    from lm_eval.tasks.ifeval.utils import process_results

    return process_results(doc, results)


def ifeval_agg_inst_level_acc(items):
    from lm_eval.tasks.ifeval.utils import agg_inst_level_acc

    return agg_inst_level_acc(items)


# ---- MMLU-Pro and GPQA: the built-in prompt builders / choice shuffling ------------------------------
def mmlu_pro_doc_to_text(doc):
    from lm_eval.tasks.mmlu_pro.utils import doc_to_text

    return doc_to_text(doc)


def gpqa_process_docs(dataset):
    from lm_eval.tasks.gpqa.cot_zeroshot.utils import process_docs

    return process_docs(dataset)


# ---- HumanEval: pass@1 without the hub ---------------------------------------------------------------
def humaneval_build_predictions(resps, docs):
    """lm-eval's ``build_predictions_instruct`` (restated: importing lm-eval's humaneval utils loads
    code_eval from the hub): the header plus the completion up to its closing code fence."""
    return [
        [doc["prompt"] + (r if r.find("```") == -1 else r[: r.find("```")]) for r in resp]
        for resp, doc in zip(resps, docs)
    ]


def _sandbox():
    """The code sandbox of the offline suite (eval/offline/humaneval/sandbox.py), loaded by path."""
    import importlib.util
    import sys

    name = "mars_eval_code_sandbox"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "offline" / "humaneval" / "sandbox.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def humaneval_pass_at_1(references: list[str], predictions: list[list[str]], **_kwargs) -> dict[str, float]:
    """Share of problems whose first prediction passes its tests (lm-eval's pass@1 with k=[1]); each
    program (prediction + tests + ``check(entry_point)``, as code_eval builds it) runs in the sandbox."""
    sandbox = _sandbox()
    passed = 0
    for reference, candidates in zip(references, predictions):
        passed += int(sandbox.run_python(candidates[0] + "\n" + reference + "\n", timeout=10.0).passed)
    return {"pass@1": passed / len(references) if references else 0.0}
