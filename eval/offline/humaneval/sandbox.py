"""Run model-written Python programs in a bubblewrap sandbox (stdlib only; shared by every task that
executes code: eval/offline/humaneval and eval/paper's HumanEval copy).

What a program gets (``run_python``):

- its own namespaces (bubblewrap, ``bwrap``): PID (it sees only itself; when the sandbox's init dies the
  kernel kills every process in it, so a child that called ``setsid`` or double-forked cannot outlive
  the timeout), network (only a loopback device that is down: no connection to the host or anywhere),
  IPC, UTS, and a user namespace when bwrap runs unprivileged;
- an empty root file system holding only read-only binds of the system (``/usr``, ``/lib*``, ``/bin``)
  and of the Python interpreter's prefix, a fresh ``/proc`` and ``/dev``, a private ``/tmp`` (tmpfs,
  64 MiB, the working directory) and the program itself (read-only, under ``/sandbox``): the host's
  files (home, repository, results, the caller's temp dir) do not exist inside, and nothing outside
  ``/tmp`` is writable;
- an unprivileged user (as root the program drops to uid/gid 65534 before it runs, and bwrap gives it
  no capabilities), ``PR_SET_NO_NEW_PRIVS``, a new terminal session;
- resource limits: address space, CPU seconds, file size, no core dumps, and a process count
  (``RLIMIT_NPROC``, which bounds fork bombs; root would ignore it, hence the uid drop);
- a wall-clock timeout after which the whole sandbox is killed (its process group, and with it the
  PID namespace).

The Python-level guard (destructive ``os``/``shutil``/``subprocess`` calls replaced by a
``PermissionError``) still runs first: it keeps verdicts the same with and without a sandbox, but it is
not what contains a program (``posix.system`` or ``_socket`` walk around it).

Where no sandbox can be made (bwrap missing, or the kernel refuses its namespaces), code is not run:
:class:`SandboxUnavailable` says why and how to fix it, and ``MARS_ALLOW_UNSANDBOXED_CODE=1`` is the
explicit opt-in to run with the Python-level guard and rlimits only (plus ``unshare --net`` where that
works). ``sandbox_status()`` reports which mode is in use.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

OPT_IN_ENV = "MARS_ALLOW_UNSANDBOXED_CODE"
NOBODY = 65534
TMPFS_BYTES = 64 << 20
FILE_BYTES = 16 << 20
NPROC = 16  # processes (threads count too) of the sandbox's user; a HumanEval program needs one
ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "LANG": "C.UTF-8",
}

# Runs first in the child interpreter: drop root, set limits, then run the guarded program.
# argv: program file, memory bytes, cpu seconds, file bytes, process count.
GUARD = r"""
import builtins, os, resource, shutil, socket, subprocess, sys
path, memory, cpu, fsize, nproc = sys.argv[1], *map(int, sys.argv[2:6])
if os.geteuid() == 0:  # bwrap ran as root: never run the program as root (root ignores RLIMIT_NPROC)
    os.setgroups([])
    os.setgid(%(nobody)d)
    os.setuid(%(nobody)d)
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
    if nproc <= 0 and limit == resource.RLIMIT_NPROC:
        continue
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
del path, memory, cpu, fsize, nproc
exec(code, {"__name__": "__main__", "__builtins__": builtins})
""" % {"nobody": NOBODY}  # noqa: UP031  (the program's own braces rule out str.format)


class ExecutionResult(NamedTuple):  # (a NamedTuple: lm-eval loads task files without registering them)
    passed: bool
    status: str  # "passed", "timed out" or "failed: <last line of the error>"


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made here, and running model-written code without one was not allowed."""


class Mode(NamedTuple):
    name: str  # "bwrap" (root: no user namespace, uid drop) | "bwrap-userns" | "unsandboxed"
    description: str
    run_as: int | None = None  # Popen user/group for bwrap itself


# ------------------------------------------------------------------------------------------------
# the sandbox command
# ------------------------------------------------------------------------------------------------
def interpreter() -> str:
    """The base interpreter (a venv's python is a link to it; the venv's packages are not needed)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_dirs() -> list[str]:
    """Folders the interpreter needs, beyond the system folders bound anyway."""
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(interpreter()))
    system = ("/usr", "/lib", "/lib64", "/bin")
    keep = sorted(d for d in dirs if not any(d == s or d.startswith(s + "/") for s in system))
    return [d for d in keep if not any(d != o and d.startswith(o + "/") for o in keep)]


def bwrap_argv(mode: Mode, guard_fd: int, program_fd: int) -> list[str]:
    """bwrap's arguments up to the command (the program and guard come in as file descriptors)."""
    bwrap = shutil.which("bwrap")
    argv = [bwrap]
    if mode.name == "bwrap":  # running as root: privileged bwrap, no user namespace, uid drop in the guard
        argv += [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
        ]
    else:
        argv += ["--unshare-all", "--unshare-user"] + (["--disable-userns"] if _supports("--disable-userns") else [])
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for system in ("/usr", "/lib", "/lib64", "/bin"):
        if os.path.exists(system):
            argv += ["--ro-bind", system, system]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made = set()
    for folder in _python_dirs():
        parents = list(Path(folder).parents)[::-1][1:]  # without "/"
        for parent in parents:  # world-traversable parents (bwrap would create them 0700)
            if str(parent) not in made:
                argv += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        argv += ["--ro-bind", folder, folder]
    size = ["--size", str(TMPFS_BYTES)] if _supports("--size") else []
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        *size,
        "--tmpfs",
        "/tmp",
        "--perms",
        "0755",
        "--dir",
        "/sandbox",
        "--perms",
        "0444",
        "--ro-bind-data",
        str(guard_fd),
        "/sandbox/guard.py",
        "--perms",
        "0444",
        "--ro-bind-data",
        str(program_fd),
        "/sandbox/solution.py",
        "--chdir",
        "/tmp",
        "--",
    ]
    return argv


@functools.cache
def _supports(flag: str) -> bool:
    """Whether this bwrap knows ``flag`` (--disable-userns and --size came with 0.8)."""
    try:
        text = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in text.stdout + text.stderr


def _popen_user(mode: Mode) -> dict:
    if mode.run_as is None:
        return {}
    return {"user": mode.run_as, "group": mode.run_as, "extra_groups": []}


def _candidates() -> list[Mode]:
    if os.geteuid() == 0:
        return [
            Mode("bwrap", "bubblewrap as root: PID/net/IPC/UTS namespaces, program as uid 65534"),
            Mode("bwrap-userns", "bubblewrap as uid 65534 in a user namespace", run_as=NOBODY),
        ]
    return [Mode("bwrap-userns", "bubblewrap, unprivileged, in a user namespace")]


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[Mode | None, str]:
    """The first sandbox mode that runs a program here, or why none does."""
    if shutil.which("bwrap") is None:
        return None, (
            "bubblewrap is not installed (`apt-get install bubblewrap` on Debian/Ubuntu; "
            "`make setup` installs it where it can)"
        )
    reasons = []
    for mode in _candidates():
        result = _execute(
            mode, "import os\nassert os.getuid() != 0\n", timeout=30.0, memory_bytes=1 << 30, cpu_seconds=30
        )
        if result.passed:
            return mode, mode.description
        reasons.append(f"{mode.description}: {result.status}")
    return None, "bubblewrap cannot create its namespaces here (" + "; ".join(reasons) + ")"


def sandbox_status() -> tuple[bool, str]:
    """(whether programs run sandboxed here, the mode or the reason why not)."""
    mode, text = _probe()
    return mode is not None, text


def unsandboxed_allowed() -> bool:
    return os.environ.get(OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes")


def require_sandbox(what: str = "model-written code") -> str:
    """Raise :class:`SandboxUnavailable` unless programs can run sandboxed (or the opt-in is set);
    returns a line saying how they will run."""
    ok, text = sandbox_status()
    if ok:
        return f"sandboxed ({text})"
    if unsandboxed_allowed():
        return f"NOT sandboxed ({OPT_IN_ENV}=1; {text})"
    raise SandboxUnavailable(
        f"refusing to run {what}: no sandbox can be made here: {text}. Install bubblewrap where user "
        f"namespaces work, or set {OPT_IN_ENV}=1 to run it with Python-level guards and rlimits only "
        "(inside a throwaway container or VM)."
    )


# ------------------------------------------------------------------------------------------------
# running a program
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _net_isolation() -> tuple[str, ...]:
    """Unsandboxed opt-in only: a command prefix that removes the network where ``unshare`` allows it."""
    for prefix in (("unshare", "--net"), ("unshare", "--map-root-user", "--net")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


def _execute(
    mode: Mode | None, program: str, timeout: float, memory_bytes: int, cpu_seconds: int, nproc: int = NPROC
) -> ExecutionResult:
    limits = [str(memory_bytes), str(cpu_seconds), str(FILE_BYTES), str(nproc)]
    with tempfile.TemporaryDirectory(prefix="mars_code_") as tmp:
        work = Path(tmp)
        (work / "guard.py").write_text(GUARD, encoding="utf-8")
        (work / "solution.py").write_text(program, encoding="utf-8")
        kwargs = {}
        with (
            open(work / "guard.py", "rb") as guard,
            open(work / "solution.py", "rb") as source,
            open(work / "stdout", "wb") as out,
            open(work / "stderr", "wb") as err,
        ):
            if mode is None:  # explicit opt-in: a fresh interpreter in a scratch folder, no namespaces
                scratch = work / "scratch"
                scratch.mkdir()
                # readable and writable by the uid the guard drops to when this runs as root
                os.chmod(work, 0o755)
                os.chmod(scratch, 0o777)
                for name in ("guard.py", "solution.py"):
                    os.chmod(work / name, 0o644)
                cmd = [
                    *_net_isolation(),
                    sys.executable,
                    "-I",
                    "-B",
                    str(work / "guard.py"),
                    str(work / "solution.py"),
                    *limits[:3],
                    "0",
                ]
                env = {**ENV, "HOME": str(scratch), "TMPDIR": str(scratch)}
                cwd, fds = str(scratch), ()
            else:
                cmd = [
                    *bwrap_argv(mode, guard.fileno(), source.fileno()),
                    interpreter(),
                    "-I",
                    "-B",
                    "/sandbox/guard.py",
                    "/sandbox/solution.py",
                    *limits,
                ]
                env, cwd, fds = dict(ENV), tmp, (guard.fileno(), source.fileno())
                kwargs = _popen_user(mode)
            # output to files, so that the file-size limit bounds what a runaway print can produce
            try:
                proc = subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=fds,
                    start_new_session=True,
                    **kwargs,
                )
            except OSError as error:
                return ExecutionResult(False, f"failed: cannot start the sandbox: {error}")
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # the whole session; in a sandbox, bwrap's death takes its PID namespace with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return ExecutionResult(False, "timed out")
        if code == 0:
            return ExecutionResult(True, "passed")
        if code in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            return ExecutionResult(False, "timed out")
        lines = (work / "stderr").read_bytes()[-4000:].decode("utf-8", "replace").strip().splitlines()
        return ExecutionResult(False, f"failed: {lines[-1] if lines else f'exit status {code}'}")


def run_python(program: str, timeout: float = 10.0, memory_bytes: int = 2 << 30, nproc: int = NPROC) -> ExecutionResult:
    """Run ``program`` (Python source) sandboxed; passed = exit status 0 within ``timeout`` seconds.

    Raises :class:`SandboxUnavailable` where no sandbox can be made and ``MARS_ALLOW_UNSANDBOXED_CODE``
    is not set.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    mode, reason = _probe()
    if mode is None:
        require_sandbox()  # raises unless opted in
        _warn_unsandboxed(reason)
    return _execute(mode, program, timeout, memory_bytes, int(timeout) + 1, nproc)


@functools.lru_cache(maxsize=1)
def _warn_unsandboxed(reason: str) -> None:
    log.warning("running model-written code WITHOUT a sandbox (%s=1): %s", OPT_IN_ENV, reason)
