"""The kernel cache under faults: a cached library that is truncated, overwritten or foreign is a miss and is
rebuilt (never loaded: a truncated one kills the loading process with SIGBUS), and a cache that cannot be written
serves its finished builds or leaves decoding on the eager path, with one warning, instead of raising.

Building the kernels takes minutes, so these tests copy this machine's finished build into a temporary
``MARS_CACHE`` and stand a copy of it in for the compiler (one ``slow`` test runs the real compiler); whatever
loads a library runs in a subprocess, since a load is permanent and a bad one can kill the process."""

import _bisect
import builtins
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from decoding_fixtures import kernel_or_skip

from mars.decoding import kernels
from mars.persistence import sha256_of

TESTS = Path(__file__).resolve().parents[1]
# Run first in each subprocess: argv[1] is the known-good library, which a "compile" copies into the build folder.
FAKE_COMPILER = """
import shutil, sys
from mars.decoding import kernels

def copy_instead_of_compiling(target, name):
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(sys.argv[1], target / f"{name}.so")
    print("mars-test: compiled", file=sys.stderr)

kernels._build = copy_instead_of_compiling
"""
USE_KERNEL = """
import torch
x, w = torch.randn(3, 16), torch.randn(8, 16)
assert torch.allclose(kernels.small_linear_op()(x, w, None), x @ w.T, atol=1e-5)
print("mars-test: kernel ok")
"""
GENERATE = f"""
import sys, warnings
sys.path.insert(0, {str(TESTS)!r})
from decoding_fixtures import MASK_ID, build_model, hf_greedy
from mars.decoding import generate
from mars.models import embedded_tokenizer

tok = embedded_tokenizer()
if len(sys.argv) > 2:  # the cache under test from here on (the tokenizer comes from the usual one)
    import os
    os.environ["MARS_CACHE"] = sys.argv[2]
tok.padding_side, tok.pad_token, tok.mask_token = "left", tok.eos_token, "<empty_output>"
model, prompts = build_model(), [[1, 300, 301, 302, 303]]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        out = generate(model, tok, prompts, threshold=1.0, max_new_tokens=5, mask_token_id=MASK_ID)
assert out.token_ids == hf_greedy(model, tok, prompts, 5)
for w in caught:
    if "fast path off" in str(w.message):
        print("mars-test: warning:", w.message)
print("mars-test: generated")
"""
CORRUPTIONS = {
    "cut to 4 KB": lambda data: data[:4096],
    "cut to half": lambda data: data[: len(data) // 2],
    "random bytes": lambda data: os.urandom(len(data)),
    "empty": lambda data: b"",
}


@pytest.fixture(scope="module")
def good_library() -> Path:
    """This machine's finished build of the library (built once where it is not cached; skips where it cannot be)."""
    kernel_or_skip()
    library = kernels.build_dir() / f"{kernels.NAME}.so"
    assert kernels.entry_problem(library.parent) is None
    return library


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A temporary ``MARS_CACHE`` (this process and the subprocesses it starts)."""
    monkeypatch.setenv("MARS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cached_copy(good_library: Path, target: Path) -> Path:
    """A finished build in ``target``: the good library and its marker; returns the library."""
    target.mkdir(parents=True)
    shutil.copy(good_library.parent / kernels.MARKER, target / kernels.MARKER)
    return Path(shutil.copy(good_library, target / good_library.name))


def run_python(code: str, good_library: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, str(good_library), *args], capture_output=True, text=True, timeout=600
    )


def fake_compiler(monkeypatch, good_library: Path) -> list[Path]:
    """Stand a copy of the good library in for the compiler in this process; returns the builds it makes."""
    builds = []

    def copy_instead_of_compiling(target, name):
        builds.append(target)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(good_library, target / f"{name}.so")

    monkeypatch.setattr(kernels, "_build", copy_instead_of_compiling)
    return builds


@pytest.fixture
def read_only_filesystem(monkeypatch):
    """Call it to make every later write fail as on a read-only mount (root ignores chmod, so permissions
    cannot simulate one)."""

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    def guard(real):
        def opener(file, mode="r", *args, **kwargs):
            if any(flag in mode for flag in "wax+"):
                refuse()
            return real(file, mode, *args, **kwargs)

        return opener

    def make_read_only():
        monkeypatch.setattr(builtins, "open", guard(builtins.open))
        monkeypatch.setattr(io, "open", guard(io.open))
        for owner, name in ((os, "mkdir"), (os, "replace"), (os, "rename"), (Path, "mkdir"), (Path, "touch")):
            monkeypatch.setattr(owner, name, refuse)

    return make_read_only


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_cached_library_that_fails_its_check_is_a_miss_and_rebuilt_with_one_line(
    corruption, good_library, tmp_path, monkeypatch, caplog
):
    builds = fake_compiler(monkeypatch, good_library)
    target = tmp_path / "small_gemm-key"
    library = cached_copy(good_library, target)
    library.write_bytes(CORRUPTIONS[corruption](good_library.read_bytes()))
    assert kernels.entry_problem(target) not in (None, kernels.NOT_BUILT)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.ensure_built(target) == library
    assert builds == [target] and library.read_bytes() == good_library.read_bytes()
    rebuilds = [r.getMessage() for r in caplog.records if "rebuilding it" in r.getMessage()]
    assert len(rebuilds) == 1 and str(target) in rebuilds[0], rebuilds
    assert kernels.entry_problem(target) is None
    assert kernels.ensure_built(target) == library and len(builds) == 1  # repaired: reused, no compiler run


def test_a_marker_without_size_and_digest_is_a_miss(good_library, tmp_path, monkeypatch):
    """A marker that records nothing to check the library against (a build by an older version) is rebuilt."""
    builds = fake_compiler(monkeypatch, good_library)
    target = tmp_path / "small_gemm-key"
    cached_copy(good_library, target)
    (target / kernels.MARKER).write_text("torch2_13_0_cpu-0123456789abcdef\n")
    assert "without the library's size and sha256" in kernels.entry_problem(target)
    kernels.ensure_built(target)
    assert (
        builds == [target] and json.loads((target / kernels.MARKER).read_text())["size"] == good_library.stat().st_size
    )


def test_a_process_meeting_a_truncated_cached_library_rebuilds_it_and_runs_the_kernel(good_library, cache):
    """Loading a library cut short kills the process with SIGBUS inside the loader: it is rebuilt first."""
    library = cached_copy(good_library, kernels.build_dir())
    library.write_bytes(good_library.read_bytes()[:4096])
    out = run_python(FAKE_COMPILER + USE_KERNEL, good_library)
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert "mars-test: kernel ok" in out.stdout
    rebuilds = [line for line in out.stderr.splitlines() if "rebuilding it" in line]
    assert len(rebuilds) == 1 and "4096-byte" in rebuilds[0], out.stderr
    assert library.read_bytes() == good_library.read_bytes()


@pytest.mark.slow  # a decoding subprocess (about 15 s)
def test_a_library_that_passes_its_check_but_lacks_the_ops_is_rebuilt_and_decoding_falls_back(good_library, cache):
    """A library recorded as the build yet not defining its ops (a foreign ELF): this process decodes eagerly
    with one warning; the entry is rebuilt for the next one."""
    foreign = getattr(_bisect, "__file__", None)  # a small shared library that defines no mars ops
    if foreign is None:
        pytest.skip("_bisect is built into this Python: no foreign shared library at hand")
    target = kernels.build_dir()
    library = cached_copy(good_library, target)
    shutil.copy(foreign, library)
    (target / kernels.MARKER).write_text(json.dumps({"size": library.stat().st_size, "sha256": sha256_of(library)}))
    out = run_python(FAKE_COMPILER + GENERATE, good_library)
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    warnings_seen = [line for line in out.stdout.splitlines() if line.startswith("mars-test: warning:")]
    assert len(warnings_seen) == 1 and "defines no mars::small_linear" in warnings_seen[0], out.stdout
    assert "mars-test: generated" in out.stdout
    assert sum("rebuilding it" in line for line in out.stderr.splitlines()) == 1, out.stderr
    assert kernels.entry_problem(target) is None and library.read_bytes() == good_library.read_bytes()


def test_a_finished_build_in_a_read_only_cache_is_used_without_writing(good_library, tmp_path, read_only_filesystem):
    target = tmp_path / "small_gemm-key"
    shutil.copytree(good_library.parent, target, copy_function=shutil.copy)
    read_only_filesystem()
    assert kernels.ensure_built(target) == target / good_library.name


def test_a_read_only_cache_without_a_finished_build_is_kernel_unavailable(tmp_path, read_only_filesystem):
    read_only_filesystem()
    with pytest.raises(kernels.KernelUnavailable, match="cannot be written.*MARS_CACHE"):
        kernels.ensure_built(tmp_path / "small_gemm-key")


def test_a_cache_that_is_a_file_leaves_decoding_on_the_eager_path_with_one_warning(good_library, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    with monkeypatch.context() as patch:
        patch.setenv("MARS_CACHE", str(not_a_folder))
        with pytest.raises(kernels.KernelUnavailable, match="cannot be written"):
            kernels.ensure_built(kernels.build_dir())
    out = run_python(FAKE_COMPILER + GENERATE, good_library, str(not_a_folder))
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    warnings_seen = [line for line in out.stdout.splitlines() if line.startswith("mars-test: warning:")]
    assert len(warnings_seen) == 1 and "cannot be written" in warnings_seen[0], out.stdout
    assert "mars-test: compiled" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_truncated_cached_library_is_recompiled_end_to_end(good_library, cache):
    """The same as the default suite's truncation test, with the real compiler (minutes)."""
    library = cached_copy(good_library, kernels.build_dir())
    library.write_bytes(good_library.read_bytes()[: library.stat().st_size // 2])
    out = run_python("from mars.decoding import kernels\n" + USE_KERNEL, good_library)
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert "mars-test: kernel ok" in out.stdout and "rebuilding it" in out.stderr
    assert kernels.entry_problem(library.parent) is None
