"""The code sandbox that runs model-written programs (eval/offline/humaneval/sandbox.py, bubblewrap).

Each test is an escape that the Python-level guard alone lets through: the programs call
``posix``/``_socket`` directly, below the guard, so only the sandbox can stop them; or a way to fool the
harness (an early exit read as a pass, memory bounded per process only, nested user namespaces, a
self-inflicted SIGKILL read as a timeout). A test is skipped only where no sandbox can be made on this
machine, with the reason shown; everywhere else a failure is a failure.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from pathlib import Path

import pytest
from module_loading import load_module

REPO = Path(__file__).resolve().parents[2]


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
    # the CPU-time limit (SIGXCPU) is a timeout too, and says which
    mode, _ = sandbox._probe()
    cpu = sandbox._execute(mode, "while True:\n    pass\n", timeout=20.0, memory_bytes=1 << 30, cpu_seconds=1)
    assert cpu.status == "timed out (CPU time limit of 1 s, SIGXCPU)", cpu


@needs_sandbox
def test_a_program_passes_only_when_it_runs_to_its_end():
    """Exit status 0 is not a pass; the harness's own mark, written after the program's
    last statement returned, is. Nothing the program writes can stand in for it."""
    early = {
        "sys.exit": "import sys\nsys.exit(0)\n",
        "os._exit": "import os\nos._exit(0)\n",
        "atexit": "import atexit, os\natexit.register(os._exit, 0)\n",
        "thread": "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\ntime.sleep(5)\n",
        # a forger: every open descriptor gets what a marker could look like, then a clean exit
        "forger": "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'passed\\nOK\\n' * 8)\n"
        "    except OSError:\n        pass\nos._exit(0)\n",
    }
    for name, program in early.items():
        result = run(program + "assert False, 'unreachable'\n")
        assert not result.passed, (name, result)
    assert "before its checks finished" in run(early["os._exit"] + "assert False\n").status
    # a script block does not run (the program is not __main__), so a pending input() cannot fail it
    assert run("x = 1\nif __name__ == '__main__':\n    input()\nassert x == 1\n").passed


MEMORY_HOG = """
import posix, time
children, size = {children}, {mib} << 20
ready_r, ready_w = posix.pipe()
pids = []
for _ in range(children):
    pid = posix.fork()
    if pid == 0:
        block = bytearray(size)
        block[::4096] = b"x" * (size // 4096)  # touch every page: resident, not just reserved
        posix.write(ready_w, b"+")
        time.sleep(1.5)  # all children hold their memory at once
        posix._exit(0)
    pids.append(pid)
statuses = [posix.waitpid(pid, 0)[1] for pid in pids]
assert statuses == [0] * children, statuses
"""
SANDBOX_MIB = 160  # the test's own total: small enough for a shared machine


def _memory_bound_holds(run_with_limit):
    # three children of 80 MiB each fit their per-process limit (160 MiB) but not the sandbox's total
    hog = run_with_limit(MEMORY_HOG.format(children=3, mib=80))
    assert not hog.passed and "out of memory" in hog.status, hog
    # the same program well inside the total runs to its end
    fits = run_with_limit(MEMORY_HOG.format(children=3, mib=8))
    assert fits.passed, fits


@needs_sandbox
def test_memory_is_bounded_for_the_whole_sandbox_not_per_process():
    """RLIMIT_AS bounds one process; forked children together must stay within the
    sandbox's memory limit (a cgroup where one can be made here)."""
    _memory_bound_holds(lambda program: sandbox.run_python(program, memory_bytes=SANDBOX_MIB << 20))


@needs_sandbox
def test_memory_bound_without_a_cgroup_falls_back_to_a_watchdog(monkeypatch):
    """Where no cgroup can be made, a watchdog sums the sandbox's resident memory and kills all of it."""
    monkeypatch.setattr(sandbox, "_cgroup_parent", lambda: (None, "disabled for this test"))
    assert "watchdog" in sandbox.memory_bound()
    _memory_bound_holds(lambda program: sandbox.run_python(program, memory_bytes=SANDBOX_MIB << 20))


NESTED_USERNS = """
import ctypes, os, posix
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
libc = ctypes.CDLL(None, use_errno=True)
for flags in (CLONE_NEWUSER, CLONE_NEWUSER | CLONE_NEWNS):
    assert libc.unshare(flags) == -1, "unshare(%#x) succeeded" % flags
    assert ctypes.get_errno() in (1, 28), os.strerror(ctypes.get_errno())  # EPERM, or ENOSPC (userns max 0)
# the same through the unshare(1) tool and a fresh process
assert posix.system("unshare --user --mount true 2>/dev/null") != 0
"""


@needs_sandbox
def test_no_nested_user_namespace_in_any_mode():
    """A user namespace inside the sandbox would give the program the capabilities to
    mount its own (unbounded) tmpfs; it is refused in every mode that can run here."""
    ran = []
    for mode in sandbox._candidates():
        if not sandbox._execute(mode, "pass\n", 30.0, 1 << 30, 30).passed:
            continue  # this mode cannot run on this machine (e.g. the interpreter is not readable by 65534)
        result = sandbox._execute(mode, NESTED_USERNS, 30.0, 1 << 30, 30)
        assert result.passed, (mode.name, result)
        ran.append(mode.name)
    assert ran, "no sandbox mode ran"


@needs_sandbox
def test_a_program_killed_by_a_signal_is_reported_as_such_not_as_timed_out():
    """A self-inflicted SIGKILL is a kill, not a timeout; a real timeout still reads so."""
    start = time.monotonic()
    killed = run("import posix, signal\nposix.kill(posix.getpid(), signal.SIGKILL)\n", timeout=20.0)
    assert killed == sandbox.ExecutionResult(False, "killed by signal 9 (SIGKILL)"), killed
    assert time.monotonic() - start < 10  # reported at once, not after the 20 s timeout
    crashed = run("import ctypes\nctypes.string_at(0)\n")
    assert crashed.status == "killed by signal 11 (SIGSEGV)", crashed
    assert run("while True:\n    pass\n", timeout=1.0).status == "timed out"
    # the CPU-time limit (SIGXCPU) is a timeout too, and says which
    mode, _ = sandbox._probe()
    cpu = sandbox._execute(mode, "while True:\n    pass\n", timeout=20.0, memory_bytes=1 << 30, cpu_seconds=1)
    assert cpu.status == "timed out (CPU time limit of 1 s, SIGXCPU)", cpu


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
