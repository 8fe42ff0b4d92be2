"""CPU kernels compiled at first use: ``mars::small_linear``, an fp32 small-M GEMM for decode steps, and
``mars::fused_linear``, several of them over one input in one parallel pass (with a gated LoRA's low-rank
terms at given columns; ``mars::lowrank_linear`` is a LoRA up factor's product in the same order, and
``mars::pack_lowrank`` the factor's layout for the fused pass); ``mars::decode_attention``, a decode step's
attention (a few query columns against the KV cache, column-invariant; ``decode_attention.cpp``);
``mars::top_tokens``, a greedy step's argmax and top probability per column in one pass (``top_tokens.cpp``);
``mars::greedy_verify``, a lossless greedy verify step's draft check and next drafts (``greedy_verify.cpp``); and
``mars.DecoderStep``, a Llama-family decoder pass for one decode step written against ATen (``decoder_step.cpp``:
the lean forward's loop without the interpreter).

A decode step multiplies a handful of columns (batch x new tokens) by every weight matrix once, so on
a CPU it is bound by reading the weights from memory.  MKL's sgemm handles one column at that bound
but turns compute-bound from a few columns on; ``small_gemm.cpp`` streams each weight row once and computes
all columns from it (see the source for the blocking and why the result does not depend on how many columns
ride along).

The extension is built with ``torch.utils.cpp_extension`` (needs a C++ compiler and an x86-64 CPU
with AVX2 and FMA) in one flavour per machine: an ISA (AVX-512 where the CPU has AVX-512F, see
:func:`kernel_isa`) and the tuning of its CPU vendor (:func:`kernel_vendor`), whose compiler flags
:func:`flavour_cflags` makes from :data:`ISA_FLAGS` and the one tuning table :data:`TUNING`.  A build lives in
``<mars cache>/kernels/<name>-torch<version>-<hash>``: the hash covers the sources, the flags (the flavour
among them) and the Python/torch ABI, so a build for another torch, source or flavour is never loaded, a build
killed half-way is redone (see :func:`ensure_built`), and later processes load the cached library directly
(no compiler run).  The build's ``complete`` marker records the library's size and sha256, checked before every
load (as checkpoints' sha256 sidecars are): a library that fails the check or does not load is rebuilt, never
loaded (a truncated one would kill the process with SIGBUS inside the loader).  A cache that cannot be written
costs speed, never a crash: its finished builds are used as they are, and where none is, the eager path runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = tuple(
    HERE / name
    for name in ("small_gemm.cpp", "decode_attention.cpp", "decoder_step.cpp", "top_tokens.cpp", "greedy_verify.cpp")
)
HEADERS = (HERE / "small_gemm.h", HERE / "simd.h", HERE / "decode_attention.h")
# -ffp-contract=off: a product and a sum written apart stay apart (the LoRA epilogue must round as peft does)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG", "-ffp-contract=off")
REQUIRED_CPU_FLAGS = ("avx2", "fma")
ISAS = ("avx2", "avx512")
# The target of each ISA: AVX-512 gives 16-lane FMA chains and 32 vector registers for larger tiles.  The ISA is
# part of the flags, hence of the build key.
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f",)}
VENDORS = ("intel", "amd")
# The tuning of each flavour (ISA, CPU vendor): small_gemm.cpp's macros, passed as -D flags (the source has no
# defaults).  MARS_R x MARS_MB: rows x columns per tile from 4 columns on; MARS_R1, MARS_R2, MARS_R3: rows per tile
# at 1, 2 and 3 columns (MARS_R3 = 0: 3 columns take the MARS_R x MARS_MB tile); MARS_PF: prefetch distance in
# tiles; MARS_PF_SPREAD, MARS_LORA_PF, MARS_W_IN_REGISTER: options of the weight stream (see small_gemm.cpp).
# A tile's accumulators, columns and weight vector must fit the registers: 16 ymm with AVX2, 32 zmm with AVX-512.
# Each output element keeps its operation sequence under every value, so all flavours of one ISA give the same bits.
# fmt: off
TUNING = {
    # 32 zmm: 6 x 4 (29 registers), 8 x 2 and an 8 x 3 tile for a verify step's 3 columns (the last token and two
    # masks or drafts) stream more rows at once than 6 x 4's 6 x 3 remainder; Intel cores keep the stream fullest
    # prefetching one tile ahead with 4-row single-column tiles, and gain from the LoRA factor burst and the
    # weight vector pinned in a register.
    ("avx512", "intel"): {
        "MARS_R": 6, "MARS_MB": 4, "MARS_R1": 4, "MARS_R2": 8, "MARS_R3": 8,
        "MARS_PF": 1, "MARS_PF_SPREAD": 1, "MARS_LORA_PF": 1, "MARS_W_IN_REGISTER": 1,
    },
    # the AVX-512 tiles as for Intel; AMD cores keep the stream fullest prefetching two tiles ahead with 8-row
    # single-column tiles; the LoRA factor burst and the pinned weight vector are established on Intel cores only.
    ("avx512", "amd"): {
        "MARS_R": 6, "MARS_MB": 4, "MARS_R1": 8, "MARS_R2": 8, "MARS_R3": 8,
        "MARS_PF": 2, "MARS_PF_SPREAD": 1, "MARS_LORA_PF": 0, "MARS_W_IN_REGISTER": 0,
    },
    # 16 ymm: 3 x 4 (17 values, spill-free because gcc folds one weight load into an FMA) beats 4 x 2, 4 x 3 and
    # 2 x 4, 6 x 2 beats 4 x 2, and 3 columns take the 3 x 4 path (a 3 x 3 tile); the stream options as for Intel.
    ("avx2", "intel"): {
        "MARS_R": 3, "MARS_MB": 4, "MARS_R1": 4, "MARS_R2": 6, "MARS_R3": 0,
        "MARS_PF": 1, "MARS_PF_SPREAD": 1, "MARS_LORA_PF": 1, "MARS_W_IN_REGISTER": 1,
    },
    # the AVX2 tiles; the stream options as for AMD.
    ("avx2", "amd"): {
        "MARS_R": 3, "MARS_MB": 4, "MARS_R1": 8, "MARS_R2": 6, "MARS_R3": 0,
        "MARS_PF": 2, "MARS_PF_SPREAD": 1, "MARS_LORA_PF": 0, "MARS_W_IN_REGISTER": 0,
    },
}
# fmt: on


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return set()


def kernel_isa() -> str:
    """``avx512`` where the CPU has AVX-512F (unless ``MARS_KERNEL_ISA=avx2``), else ``avx2``."""
    wanted = os.environ.get("MARS_KERNEL_ISA", "").strip().lower()
    if wanted and wanted not in ISAS:
        raise KernelUnavailable(f"MARS_KERNEL_ISA={wanted!r}: choose one of {list(ISAS)}")
    has_avx512 = "avx512f" in cpu_flags()
    if wanted == "avx512" and not has_avx512:
        raise KernelUnavailable("MARS_KERNEL_ISA=avx512, but this CPU has no AVX-512F")
    return wanted or ("avx512" if has_avx512 else "avx2")


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``; empty where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text().split("vendor_id", 1)[1].split(":", 1)[1].split("\n", 1)[0].strip()
    except (OSError, IndexError):
        return ""


def kernel_vendor() -> str:
    """The vendor whose :data:`TUNING` this machine's build takes: ``MARS_KERNEL_VENDOR`` (``intel`` or ``amd``,
    to build and test another vendor's tuning here) where set, else ``intel`` on an Intel CPU and ``amd`` on any
    other (the tuning that needs no Intel-only option)."""
    wanted = os.environ.get("MARS_KERNEL_VENDOR", "").strip().lower()
    if wanted and wanted not in VENDORS:
        raise KernelUnavailable(f"MARS_KERNEL_VENDOR={wanted!r}: choose one of {list(VENDORS)}")
    return wanted or ("intel" if cpu_vendor() == "GenuineIntel" else "amd")


def flavour() -> tuple[str, str]:
    """This machine's build: ``(kernel_isa(), kernel_vendor())``, a key of :data:`TUNING`."""
    return kernel_isa(), kernel_vendor()


def flavour_cflags(isa: str, vendor: str) -> tuple[str, ...]:
    """The compiler flags of one flavour: the common ones, the ISA's, then its :data:`TUNING` as ``-D`` flags."""
    return (*CFLAGS, *ISA_FLAGS[isa], *(f"-D{name}={value}" for name, value in TUNING[isa, vendor].items()))


def cflags() -> tuple[str, ...]:
    """The compiler flags of this machine's build (:func:`flavour`)."""
    return flavour_cflags(*flavour())


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why (shown once, then the eager path is used)."""


def build_key() -> str:
    """``<torch version>-<hash of sources, flags, python and torch ABI>``."""
    import torch

    digest = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*sources, " ".join(cflags()).encode(), sys.version.encode(), torch.__version__.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return f"torch{version}-{digest.hexdigest()[:16]}"


def build_dir() -> Path:
    from mars.persistence import cache_root

    return cache_root() / "kernels" / f"small_gemm-{build_key()}"


def check_cpu() -> None:
    """Raise :class:`KernelUnavailable` unless this CPU runs AVX2+FMA code."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"the small-M GEMM kernel is x86-64 AVX2 code; this CPU is {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelUnavailable(f"the small-M GEMM kernel needs AVX2+FMA; torch reports CPU capability {capability}")
    flags = cpu_flags()
    if not flags:
        return
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        raise KernelUnavailable(f"the small-M GEMM kernel needs CPU flags {missing}, absent here")


NAME = "mars_small_gemm"
# The ops a loaded library must define: another library under this build's name is not this build
OPS = (
    "small_linear",
    "fused_linear",
    "lowrank_linear",
    "pack_lowrank",
    "decode_attention",
    "top_tokens",
    "greedy_verify",
)
MARKER = "complete"
NOT_BUILT = "holds no finished build"


@functools.cache
def small_linear_op():
    """``torch.ops.mars.small_linear`` (built or loaded on first call); raises :class:`KernelUnavailable`."""
    import torch

    failure = _loaded()
    if failure is not None:
        raise failure
    return torch.ops.mars.small_linear.default


@functools.cache
def _loaded() -> KernelUnavailable | None:
    """Build (where needed) and load this machine's library once per process; the failure, where there is one,
    is kept: a library that does not load stays loaded or half-loaded in the process, so retrying at every
    step would rebuild it at every step."""
    try:
        check_cpu()
        target = build_dir()
        library = ensure_built(target)
        try:
            _load(library)
        except KernelUnavailable as err:  # a library that passes its check yet does not load is a miss too
            ensure_built(target, rebuild=f"has a library that does not load ({err})")
            try:
                _load(library)
            except KernelUnavailable as again:
                raise KernelUnavailable(f"{again}; it is rebuilt, and later processes load the new build") from err
        _register_fake()
    except KernelUnavailable as err:
        return err
    return None


def _load(library: Path) -> None:
    """Load ``library`` into this process and check that it defines this build's ops."""
    import torch

    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        cause = f" ({err.__cause__})" if err.__cause__ else ""
        raise KernelUnavailable(f"the small-M GEMM kernel {library} does not load: {err}{cause}") from err
    missing = [op for op in OPS if not hasattr(torch.ops.mars, op)]
    if missing:  # refused here: calling a missing op would fail at the first decode step instead
        raise KernelUnavailable(f"the small-M GEMM kernel {library} loads but defines no mars::{missing[0]}")


@functools.cache
def fused_linear_op():
    """``torch.ops.mars.fused_linear``: several linears of one input (and gated LoRA terms at given columns) in
    one parallel pass; built with :func:`small_linear_op`, raises :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.fused_linear.default


@functools.cache
def lowrank_linear_op():
    """``torch.ops.mars.lowrank_linear``: ``x @ B^T`` for a LoRA up factor ``B`` [N, r] (or ``B`` packed by
    :func:`pack_lowrank_op` and ``rows=N``), each element one FMA chain over r, the order in which ``fused_linear``
    adds the term (so a model's own forward and the fused pass agree bit for bit); built with
    :func:`small_linear_op`, raises :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.lowrank_linear.default


@functools.cache
def pack_lowrank_op():
    """``torch.ops.mars.pack_lowrank``: a LoRA up factor in the layout ``fused_linear`` takes it (row panels of this
    build's width); built with :func:`small_linear_op`, raises :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.pack_lowrank.default


@functools.cache
def decode_attention_op():
    """``torch.ops.mars.decode_attention``: a decode step's fp32 attention (a few query columns against the cache;
    ``decode_attention.cpp``), SDPA for anything else; built with :func:`small_linear_op`, raises
    :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.decode_attention.default


@functools.cache
def top_tokens_op():
    """``torch.ops.mars.top_tokens``: a greedy step's choice at each prediction column in one pass over its logits
    (``top_tokens.cpp``); built with :func:`small_linear_op`, raises :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.top_tokens.default


@functools.cache
def greedy_verify_op():
    """``torch.ops.mars.greedy_verify``: a lossless greedy verify step's bookkeeping in one op
    (``greedy_verify.cpp``); built with :func:`small_linear_op`, raises :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.ops.mars.greedy_verify.default


@functools.cache
def op_or_none(accessor):
    """``accessor()`` (one of this module's op accessors: ``top_tokens_op``, ``greedy_verify_op``), or None where the
    kernels cannot be built or run here, for callers with an ATen fallback (the kernels' own check says why, once);
    asked once per accessor."""
    try:
        return accessor()
    except KernelUnavailable:
        return None


@functools.cache
def decoder_step_class():
    """``torch.classes.mars.DecoderStep`` (see ``decoder_step.cpp``); built with :func:`small_linear_op`, raises
    :class:`KernelUnavailable` likewise."""
    import torch

    small_linear_op()
    return torch.classes.mars.DecoderStep


def ensure_built(target: Path, *, rebuild: str | None = None) -> Path:
    """The kernel library in ``target``, built there first unless a finished build that passes its check is present
    (``rebuild``: why the present one is not used although it passes).

    A build is finished when its ``complete`` marker exists (written after the compiler succeeded, with the
    library's size and sha256); a folder without it (a build killed half-way, a crashed compiler), or whose library
    does not match it (truncated, overwritten), is wiped and built again, never loaded.  A finished build is checked
    without writing anything, so a read-only cache serves it; a build takes a lock file beside the folder, so two
    processes never build into it at once, and a cache that cannot be written raises :class:`KernelUnavailable`."""
    library = target / f"{NAME}.so"
    if rebuild is None and entry_problem(target) is None:
        return library
    try:
        with _build_lock(target):
            problem = rebuild or entry_problem(target)  # another process may have built it while this one waited
            if problem is not None:
                _rebuild(target, problem)
    except OSError as err:
        raise KernelUnavailable(
            f"the kernel cache {target.parent} cannot be written ({err}), so the small-M GEMM kernel cannot be built"
            " there (set MARS_CACHE to a writable folder)"
        ) from err
    return library


def entry_problem(target: Path) -> str | None:
    """Why the build in ``target`` cannot be loaded (:data:`NOT_BUILT` where it has no ``complete`` marker), or None
    where its library has the size and sha256 its marker records.  Reads only."""
    from mars.persistence import sha256_of

    library = target / f"{NAME}.so"
    try:
        record = json.loads((target / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return NOT_BUILT
    except (OSError, ValueError):
        record = None
    if not (isinstance(record, dict) and isinstance(record.get("size"), int) and record.get("sha256")):
        return "has a completion marker without the library's size and sha256"
    try:
        size = library.stat().st_size
        if size != record["size"]:
            return f"has a {size}-byte {library.name} where its build wrote {record['size']} bytes"
        if sha256_of(library) != record["sha256"]:
            return f"has a {library.name} whose sha256 is not the one its build recorded"
    except OSError as err:
        return f"has no readable {library.name} ({err.strerror or err})"
    return None


@contextlib.contextmanager
def _build_lock(target: Path):
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _rebuild(target: Path, problem: str) -> None:
    """Build into ``target`` from scratch (the caller holds the lock) and record the library in its marker."""
    import shutil

    from mars.persistence import sha256_of

    if problem != NOT_BUILT:
        log.warning("mars: the kernel cache %s %s: rebuilding it", target, problem)
    shutil.rmtree(target, ignore_errors=True)
    _build(target, NAME)
    library = target / f"{NAME}.so"
    if not library.is_file():
        raise KernelUnavailable(f"building the small-M GEMM kernel left no {library}")
    record = {"key": build_key(), "library": library.name, "size": library.stat().st_size, "sha256": sha256_of(library)}
    partial = target / f"{MARKER}.partial"
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, target / MARKER)  # a marker is whole or absent


def has_compiler() -> bool:
    """Whether the C++ compiler the build would use (``$CXX``, else ``c++``) is on the PATH."""
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) is not None


def can_run_here() -> bool:
    """Whether the kernels can run here: the CPU takes them, and a finished build is cached or a compiler can
    make one.  Builds and loads nothing."""
    try:
        check_cpu()
        return has_compiler() or entry_problem(build_dir()) is None
    except KernelUnavailable:
        return False


def _build(target: Path, name: str) -> None:
    from torch.utils import cpp_extension

    if not has_compiler():
        raise KernelUnavailable("no C++ compiler (c++ or $CXX) to build the small-M GEMM kernel")
    target.mkdir(parents=True, exist_ok=True)
    print(
        f"mars: compiling the CPU decode kernels once into {target} (minutes; `python -m mars.warmup` does it ahead) ...",
        file=sys.stderr,
    )
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=list(cflags()),
            build_directory=str(target),
            is_python_module=False,
            is_standalone=False,
            verbose=False,
        )
    except Exception as err:  # compiler errors, missing headers, ninja: all mean "not here"
        raise KernelUnavailable(f"building the small-M GEMM kernel failed: {str(err).strip()[:500]}") from err


def _register_fake() -> None:
    import torch

    @torch.library.register_fake("mars::small_linear")
    def _(x, weight, bias=None):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("mars::lowrank_linear")
    def _(x, weight, rows=None):
        return x.new_empty((*x.shape[:-1], weight.shape[0] if rows is None else rows))

    @torch.library.register_fake("mars::decode_attention")
    def _(query, key, value, mask, scale, width=None):
        return query.new_empty(query.shape)

    @torch.library.register_fake("mars::top_tokens")
    def _(logits, suppress, top_from):
        return logits.new_empty(logits.shape[:-1], dtype=torch.long), logits.new_empty(logits.shape[:-1])

    @torch.library.register_fake("mars::greedy_verify")
    def _(predicted, top, drafts, fed, draft_masks, verifying, draft_count, count, draft_threshold):
        rows = count.new_empty(count.shape)
        return rows, rows.clone(), drafts.new_empty(drafts.shape), rows.clone()

    @torch.library.register_fake("mars::fused_linear")
    def _(x, weights, biases, lora_a, lora_b, scalings, columns=None):
        return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
