"""The code sandbox that runs model-written programs (eval/offline/humaneval/sandbox.py, bubblewrap).

Each test is an escape that the Python-level guard alone let through (issue 10, item 14): the programs
call ``posix``/``_socket`` directly, below the guard, so only the sandbox can stop them.  A test is
skipped only where no sandbox can be made on this machine, with the reason shown; everywhere else a
failure is a failure.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from pathlib import Path

import pytest
from module_loading import load_module

REPO = Path(__file__).resolve().parents[1]


def _load():
    name = "mars_eval_code_sandbox"
    if name not in sys.modules:
        load_module(REPO / "eval" / "offline" / "humaneval" / "sandbox.py", name)
    return sys.modules[name]


sandbox = _load()
AVAILABLE, HOW = sandbox.sandbox_status()
needs_sandbox = pytest.mark.skipif(not AVAILABLE, reason=f"no sandbox can be made on this machine: {HOW}")


def run(program: str, timeout: float = 10.0):
    return sandbox.run_python(program, timeout=timeout)


def processes_with(marker: str) -> list[int]:
    """Host processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(entry.name))
    return found


@pytest.fixture
def secret(tmp_path):
    """A host file outside the program's temp dir (in the test's tmp dir and in the repository)."""
    outside = tmp_path / "secret.txt"
    outside.write_text("host secret")
    return outside


@needs_sandbox
def test_a_plain_program_runs_and_reports_its_failure():
    assert run("import math\nassert math.gcd(12, 18) == 6\n").passed
    failed = run("assert 1 == 2, 'nope'\n")
    assert not failed.passed and failed.status == "failed: AssertionError: nope"
    # its working directory is a private, writable /tmp
    assert run("import os\nopen('scratch.txt', 'w').write('x')\nassert os.getcwd() == '/tmp'\n").passed


@needs_sandbox
def test_files_outside_the_temp_dir_can_be_neither_read_nor_written(secret):
    repo_file = REPO / "README.md"
    for path in (secret, repo_file, Path.home() / ".bashrc"):
        result = run(f"print(open({str(path)!r}).read())\n")
        assert not result.passed and ("FileNotFoundError" in result.status or "PermissionError" in result.status), (
            path,
            result,
        )
    assert not run(f"import pathlib\npathlib.Path({str(repo_file)!r}).read_text()\n").passed
    for target in (REPO / "pwned.txt", secret.parent / "pwned.txt", Path("/usr/pwned.txt")):
        result = run(
            f"import posix\nfd = posix.open({str(target)!r}, posix.O_WRONLY | posix.O_CREAT)\nposix.write(fd, b'x')\n"
        )
        assert not result.passed, (target, result)
        assert not target.exists(), target
    assert secret.read_text() == "host secret"


@needs_sandbox
def test_unlink_of_an_outside_file_fails(secret):
    result = run(f"import posix\nposix.unlink({str(secret)!r})\n")
    assert not result.passed and "Error" in result.status, result
    assert secret.exists()
    # the repository's files are out of reach too (read-only where they would be visible at all)
    assert not run(f"import posix\nposix.unlink({str(REPO / 'README.md')!r})\n").passed
    assert (REPO / "README.md").exists()


@needs_sandbox
def test_commands_cannot_reach_the_host(tmp_path, secret):
    marker = tmp_path / "ran.txt"
    # posix.system and os.posix_spawn below the guard: whatever they start stays inside the sandbox
    run(f"import posix\nposix.system('echo pwned > {marker}; cat {secret} > /tmp/copy; rm -f {secret}')\n")
    run(
        f"import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'echo pwned > {marker}; rm -f {secret}'], {{}})\n"
        "import time\ntime.sleep(0.5)\n"
    )
    assert not marker.exists()
    assert secret.read_text() == "host secret"
    # and the program runs as no one in particular: not root, no capabilities
    assert run(
        "import os\nassert os.getuid() != 0 and os.geteuid() != 0\n"
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "assert int(caps, 16) == 0, caps\n"
    ).passed


@needs_sandbox
def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        result = run(
            f"import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
            f"s.settimeout(3)\ns.connect(('127.0.0.1', {port}))\n"
        )
        assert not result.passed, result
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever reached the host
    finally:
        server.close()


@needs_sandbox
def test_a_setsid_child_does_not_survive_the_timeout():
    marker = f"{time.time_ns() % 10**9}.25"  # a `sleep` with a unique duration, to find it on the host
    program = (
        f"import posix\nif posix.fork() == 0:\n    posix.setsid()\n"
        f"    posix.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "while True:\n    pass\n"
    )
    start = time.monotonic()
    result = run(program, timeout=2.0)
    assert result.status == "timed out" and time.monotonic() - start < 8
    deadline = time.monotonic() + 3
    while processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(f"sleep {marker}") == []


@needs_sandbox
def test_a_fork_bomb_is_bounded_and_leaves_nothing_behind():
    # counts how many processes it can start; each child execs a recognisable sleep
    marker = f"{time.time_ns() % 10**9}.75"
    program = (
        f"import posix\nn = 0\ntry:\n    while n < 500:\n        if posix.fork() == 0:\n"
        f"            posix.execv('/bin/sleep', ['sleep', '{marker}'])\n        n += 1\n"
        f"except OSError:\n    pass\nassert n < {sandbox.NPROC}, n\n"
    )
    result = run(program, timeout=10.0)
    assert result.passed, result  # the limit stopped it below NPROC processes
    time.sleep(0.2)
    assert processes_with(f"sleep {marker}") == []  # the sandbox took its children with it
    # the classic form, forking forever, ends at the timeout
    start = time.monotonic()
    bomb = run(
        "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass\n", timeout=2.0
    )
    assert not bomb.passed and time.monotonic() - start < 10


@needs_sandbox
def test_memory_cpu_and_output_are_limited():
    assert run("x = bytearray(8 << 30)\n").status.startswith("failed: MemoryError")
    assert not run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout=5).passed
    assert run("while True:\n    pass\n", timeout=1.0).status == "timed out"


def test_without_a_sandbox_code_is_refused_unless_opted_in(monkeypatch):
    """Where no sandbox can be made, nothing runs unless MARS_ALLOW_UNSANDBOXED_CODE=1."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on the PATH: as on a machine without it
    sandbox._probe.cache_clear()
    try:
        monkeypatch.delenv(sandbox.OPT_IN_ENV, raising=False)
        ok, reason = sandbox.sandbox_status()
        assert not ok and "bubblewrap is not installed" in reason
        with pytest.raises(sandbox.SandboxUnavailable, match=r"MARS_ALLOW_UNSANDBOXED_CODE=1"):
            sandbox.run_python("print('hi')\n")
        monkeypatch.setenv(sandbox.OPT_IN_ENV, "1")
        assert "NOT sandboxed" in sandbox.require_sandbox()
        assert sandbox.run_python("assert 1 + 1 == 2\n").passed
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()
    assert sandbox.sandbox_status() == (AVAILABLE, HOW)


def test_evaluation_refuses_code_tasks_before_loading_a_model(compose_cfg, tmp_path, monkeypatch):
    """The offline suite runs model-written code: with no sandbox it is refused at planning time."""
    from mars.evaluation.config import prepare

    cfg = compose_cfg("evaluate", ["model=tiny-random", f"output_dir={tmp_path / 'out'}"])
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(sandbox.OPT_IN_ENV, raising=False)
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match=r"mars_humaneval.*bubblewrap is not installed"):
            prepare(cfg)
        assert not (tmp_path / "out").exists()
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()


def test_code_tasks_outside_the_sandbox_need_the_opt_in(monkeypatch):
    """lm-eval's built-in humaneval runs code through evaluate's code_eval, uncontained: refused."""
    import lm_eval

    from mars.evaluation.tasks import Suite, TaskSpec, check_code_execution, expand_suite, task_manager

    builtin = Path(lm_eval.__file__).parent / "tasks" / "humaneval"
    suite = Suite(
        name="builtin",
        tasks=[TaskSpec("humaneval", "HumanEval")],
        include_path=[str(builtin)],
        include_defaults=False,
        confirm_run_unsafe_code=True,
    )
    manager = task_manager(suite)
    expand_suite(suite, manager)
    monkeypatch.delenv(sandbox.OPT_IN_ENV, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"\['humaneval'\].*outside the mars sandbox"):
        check_code_execution(suite, manager)
    monkeypatch.setenv(sandbox.OPT_IN_ENV, "1")
    assert check_code_execution(suite, manager)
    suite.confirm_run_unsafe_code = False
    with pytest.raises(ValueError, match=r"confirm_run_unsafe_code"):
        check_code_execution(suite, manager)
