"""The ground floor of everything this project writes and re-reads: atomic files and folders, complete
content digests (cached), checksum sidecars, fingerprint differences and a lock per run folder.

No torch, no Lightning, nothing of mars: every layer may import it.

- **Atomic writes** (:func:`atomic_write`, :func:`atomic_dir`): the data goes to a temporary sibling in
  the same folder (a rename is atomic only within one filesystem: a temporary file in ``/tmp`` is *copied*
  onto a run folder on another disk, and a disk that fills mid-copy truncates a good checkpoint), is
  flushed and fsynced, then renamed over the target.  A reader sees the old file or the whole new one; a
  failure leaves the old one untouched and no temporary behind.  Files and folders get the permissions
  the umask gives any new file (``mkstemp`` / ``mkdtemp`` would leave 0600 / 0700).
- **JSON lines** (:func:`atomic_write_jsonl`, :func:`read_jsonl`; :func:`append_jsonl`,
  :func:`read_appended_jsonl`): a whole file is written atomically and read strictly (a bad line is an
  error naming the file and line); an append-only file (a cache a killed process resumes from) gets each
  batch in one flushed ``write`` and is read up to its last whole line: a line torn by a kill is skipped,
  the next append starts on a fresh line, and ``repair`` rewrites the file without it.
- **Digests** (:func:`file_sha256`): sha256 of every byte, never a sample (a digest of size + first and
  last MiB misses an edit in the middle, such as changed embedding rows).  Large files are read once: the
  digest is cached under the file's path, size, mtime, ctime and inode, and only for files not modified in
  the last seconds (a same-size edit within one timestamp tick would otherwise reuse a stale digest).
- **Checksum sidecars** (:func:`write_checksum`, :func:`verify_checksum`): ``<file>.sha256`` in
  ``sha256sum`` format beside a file that is replaced in place (a checkpoint), so a bit flip is found
  before the file is trusted.
- **Run-folder lock** (:func:`folder_lock`): one process per folder; a second is refused naming the
  holder's PID; a lock left by a dead process is taken over (an ``fcntl`` lock dies with its process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

CHUNK = 8 << 20
# a file modified less than this long ago is hashed but its digest not cached (timestamp granularity)
RACY_SECONDS = 2.0


# ------------------------------------------------------------------------------------------
# Atomic files and folders
# ------------------------------------------------------------------------------------------
def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened / fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, fsync: bool = True) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: written to a temporary file in ``path``'s folder,
    renamed onto ``path`` when the block ends without an error (else removed; ``path`` unchanged)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes whole files: mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps: Any) -> None:
    atomic_write_text(path, json.dumps(obj, **{"indent": 2, **dumps}) + "\n")


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a folder so that it never exists half-deleted: renamed to a hidden sibling first."""
    path = Path(path)
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.deleting.", dir=path.parent))
    os.replace(path, trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp: <write files into tmp>``: the folder appears as ``out`` only when
    the block ends without an error, replacing an existing ``out`` (with ``replace=False`` an ``out`` that
    exists by then -- another process built the same cache first -- is kept and this copy dropped); its
    mode follows the umask."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700: nobody else can read the export
        yield tmp
        if target.exists() and not replace:
            return
        if target.exists():
            remove_tree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if replace or not target.exists():
                raise  # (a folder renamed onto a non-empty one fails: the other process's copy is kept)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(target.parent)


def remove_stale_temporaries(folder: str | os.PathLike, name: str) -> list[Path]:
    """Delete the temporaries :func:`atomic_write` left for ``folder/name`` when a process was killed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.glob(f".{name}.*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


# ------------------------------------------------------------------------------------------
# JSON lines
# ------------------------------------------------------------------------------------------
def json_default(obj: Any) -> Any:
    """``json.dumps(default=...)`` for results: numpy scalars as numbers, sets sorted, anything else as text."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


def jsonl_text(rows: Iterable[Any], **dumps: Any) -> str:
    """One JSON document per line (``ensure_ascii=False`` unless given), each ending in a newline."""
    dumps = {"ensure_ascii": False, **dumps}
    return "".join(json.dumps(row, **dumps) + "\n" for row in rows)


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Any], **dumps: Any) -> None:
    atomic_write_text(path, jsonl_text(rows, **dumps))


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """Every non-blank line of a whole JSONL file; a line that is not JSON raises ``ValueError`` naming
    the file and the line (a whole file written atomically has none)."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg}, column {err.colno})") from None
    return rows


def append_jsonl(path: str | os.PathLike, rows: Iterable[Any], **dumps: Any) -> None:
    """Append ``rows`` to an append-only JSONL file in one flushed ``write`` (a killed process loses at
    most this batch, torn); after a torn last line the batch starts on a fresh line."""
    text = jsonl_text(rows, **dumps)
    if not text:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as handle:
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                text = "\n" + text  # end the torn line first, so it cannot swallow the next row
        handle.write(text.encode("utf-8"))
        handle.flush()


def read_appended_jsonl(path: str | os.PathLike, *, repair: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of an append-only JSONL file (see :func:`append_jsonl`), one per whole line.

    A line torn by a kill is skipped: the last line when it lacks its newline (every append ends in
    one), and any line that is not a JSON object.  With ``repair`` (single writer only) the file is then
    rewritten without them, atomically and keeping the whole lines byte for byte, so a file that is also
    read as plain JSONL (a training split) holds rows only.  A missing file has no rows."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    *lines, tail = data.split(b"\n")
    rows, kept = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            continue
        if isinstance(row, dict):
            rows.append(row)
            kept.append(line)
    if repair and (tail or len(kept) != sum(1 for line in lines if line.strip())):
        atomic_write_bytes(path, b"".join(line + b"\n" for line in kept))
    return rows


# ------------------------------------------------------------------------------------------
# Complete digests
# ------------------------------------------------------------------------------------------
class HashingWriter:
    """A write-only file wrapper that hashes what passes through it (one read of the data, not two)."""

    def __init__(self, handle: IO[bytes]):
        self.handle, self.hash, self.size = handle, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += len(view)
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def sha256_of(path: str | os.PathLike) -> str:
    """sha256 of every byte of ``path`` (no cache)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """Where converted models, digests and other derived assets live (``MARS_CACHE`` overrides)."""
    return Path(os.environ.get("MARS_CACHE", Path.home() / ".cache" / "mars"))


def digest_cache_path() -> Path:
    return cache_root() / "digests.json"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_sha256(path: str | os.PathLike, *, cache: bool = True) -> str:
    """sha256 of every byte of ``path``, cached by (path, size, mtime, ctime, inode) in
    ``<MARS_CACHE>/digests.json`` so that a multi-GB weight file is read once, not at every run."""
    path = Path(path).expanduser().resolve()
    before = path.stat()
    cache_file = digest_cache_path()
    key = str(path)
    if cache:
        hit = _read_cache(cache_file).get(key)
        if isinstance(hit, dict) and hit.get("stat") == _stat_key(before):
            return str(hit["sha256"])
    digest = sha256_of(path)
    after = path.stat()
    settled = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_SECONDS * 1e9
    if cache and settled and _stat_key(after) == _stat_key(before):
        entries = {k: v for k, v in _read_cache(cache_file).items() if Path(k).exists()}
        entries[key] = {"stat": _stat_key(after), "sha256": digest}
        with contextlib.suppress(OSError):  # a read-only cache folder costs speed, never correctness
            atomic_write_json(cache_file, entries, sort_keys=True)
    return digest


# ------------------------------------------------------------------------------------------
# Whole weight files
# ------------------------------------------------------------------------------------------
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``path`` unless it is a whole safetensors file: its header parses and
    its tensors end exactly at the end of the file (a truncated copy fails here, in microseconds, instead
    of as a ``SafetensorError`` once the model loads)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"{path} is truncated or not a safetensors file ({size} bytes, no readable header)")
        try:
            header = json.loads(handle.read(length))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{path} has a damaged safetensors header ({err})") from None
    if 8 + length + end != size:
        raise ValueError(
            f"{path} is truncated or damaged: its header describes {8 + length + end} bytes, the file has {size}"
        )


def check_weight_files(folder: str | os.PathLike, *, required: bool = True) -> None:
    """A model folder's weights are there (unless not ``required``) and whole: every shard its index names,
    safetensors by their header.  Checked before a results or run folder is written."""
    folder = Path(folder)
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a valid weight index ({err})") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ValueError(f"{folder} lacks the weight shard(s) {missing[:5]} named by {index.name}")
    weights = [p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights and required:
        raise ValueError(f"{folder} holds no weight files (any of {WEIGHT_SUFFIXES})")
    for path in weights:
        if path.suffix == ".safetensors":
            check_safetensors(path)


# ------------------------------------------------------------------------------------------
# Checksum sidecars
# ------------------------------------------------------------------------------------------
class ChecksumError(ValueError):
    """A file does not match the checksum recorded when it was written."""


def checksum_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def write_checksum(path: str | os.PathLike, *digests: str) -> None:
    """Record the accepted digest(s) of ``path`` in ``<path>.sha256`` (``sha256sum -c`` format).  Two
    digests while ``path`` is being replaced: a kill between the two renames leaves either file valid."""
    name = Path(path).name
    atomic_write_text(checksum_path(path), "".join(f"{d}  {name}\n" for d in dict.fromkeys(digests) if d))


def recorded_checksums(path: str | os.PathLike) -> list[str] | None:
    """The digests recorded for ``path``, or None when it has no sidecar."""
    side = checksum_path(path)
    if not side.is_file():
        return None
    return [line.split()[0] for line in side.read_text(encoding="utf-8").splitlines() if line.strip()]


def verify_checksum(path: str | os.PathLike) -> bool:
    """True when ``path`` matches its sidecar, False when it has none; raises :class:`ChecksumError`
    naming the file when it does not match (a bit flip, a truncation, a foreign file put in its place)."""
    recorded = recorded_checksums(path)
    if recorded is None:
        return False
    actual = sha256_of(path)
    if actual not in recorded:
        raise ChecksumError(
            f"{path} is corrupt: its sha256 is {actual}, but {recorded[0]} was recorded when it was written "
            f"({checksum_path(path).name}). It cannot be trusted; delete it (and its .sha256) to resume from "
            "an earlier checkpoint, or retrain."
        )
    return True


# ------------------------------------------------------------------------------------------
# Fingerprint differences
# ------------------------------------------------------------------------------------------
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for key, value in d.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: d}


def fingerprint_differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved, current)`` for every key whose value differs (a missing key counts).  Both are
    compared as JSON stores them (a tuple equals the list it is saved as, a numpy scalar its number)."""
    a, b = (flatten(json.loads(json.dumps(d, default=json_default))) for d in (saved, current))
    missing = "<missing>"
    return [
        (k, a.get(k, missing), b.get(k, missing))
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    ]


# ------------------------------------------------------------------------------------------
# One process per run folder
# ------------------------------------------------------------------------------------------
LOCK_FILE = ".lock"


class FolderLockedError(RuntimeError):
    """Another live process holds the folder's lock."""


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text(encoding="utf-8"))
        return f"PID {info['pid']} on {info.get('host', '?')} (since {info.get('since', '?')})"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "run") -> Iterator[Path]:
    """Hold ``folder/.lock`` for the block: a second process is refused with the holder's PID.  The lock
    is an ``fcntl`` lock, released by the kernel when its process dies, so a stale lock file of a killed
    run is simply taken over."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            raise FolderLockedError(
                f"{folder} is in use by another {what}: {_holder(lock_path)} holds {lock_path}. Two {what}s "
                "writing one folder would interleave their files; wait for it to end (or stop it), or give "
                "this one its own folder."
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield lock_path
    finally:
        os.close(fd)  # releases the lock; the file stays (deleting it would race with a newcomer)


__all__ = [
    "ChecksumError",
    "FolderLockedError",
    "HashingWriter",
    "WEIGHT_SUFFIXES",
    "atomic_dir",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_jsonl",
    "atomic_write_text",
    "append_jsonl",
    "cache_root",
    "check_safetensors",
    "check_weight_files",
    "checksum_path",
    "current_umask",
    "file_sha256",
    "fingerprint_differences",
    "flatten",
    "folder_lock",
    "json_default",
    "jsonl_text",
    "read_appended_jsonl",
    "read_jsonl",
    "recorded_checksums",
    "remove_stale_temporaries",
    "remove_tree",
    "sha256_of",
    "verify_checksum",
    "write_checksum",
]
