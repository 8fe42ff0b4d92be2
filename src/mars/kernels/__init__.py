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
but turns compute-bound from about four columns on an AVX2 EPYC (a 4-column step cost 1.97x a 1-column
step); ``small_gemm.cpp`` streams each weight row once and computes all columns from it (see the
source for the blocking and why the result does not depend on how many columns ride along).

The extension is built with ``torch.utils.cpp_extension`` (needs a C++ compiler and an x86-64 CPU
with AVX2 and FMA; on a CPU with AVX-512F it is built for that, see :func:`kernel_isa`) into
``<mars cache>/kernels/<name>-torch<version>-<hash>``: the hash covers the sources, the flags (the ISA
among them) and the Python/torch ABI, so a build for another torch or another source is never
loaded, a build killed half-way is redone (see :func:`ensure_built`), and later processes load the cached
library directly (no compiler run).
"""

from __future__ import annotations

import functools
import hashlib
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
# On a CPU with AVX-512 the kernels are built for it: 16-lane FMA chains and larger tiles in 32 registers (2 and 4
# columns 15% and 11% faster on a Zen 4 EPYC: benchmarks/decode_step_cpu/avx512/).  MARS_KERNEL_ISA=avx2 forces
# the AVX2 build (for A/B runs); the ISA is part of the flags, hence of the build key.
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f",)}


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


# How the weight stream is fetched suits the memory system of each vendor's cores (measured, one step's 30 layers of
# projections, cold weights, 2 threads, benchmarks/decode_step_cpu/intel_stream/): on a 2-vCPU AMX Xeon, software
# prefetch one tile ahead (not two) and 4 weight rows per 1-column tile (not 8) took 25.7 -> 21.9 ms at 1 column and
# 26.1 -> 24.6 at 4 (MKL's gemv: 21.0 at 1), and a gated LoRA's factors fetched in one burst (MARS_LORA_PF, see
# small_gemm.cpp) cost 0.6 ms less per mask step, and each weight vector of a several-column tile loaded once
# (MARS_W_IN_REGISTER) 0.3-0.4 ms less per 3-column step; the AMD defaults were measured on Zen 3 and Zen 4 EPYCs.
# Each output element keeps its operation sequence, so the results are the same bits either way.
STREAM_FLAGS = {
    "GenuineIntel": ("-DMARS_PF=1", "-DMARS_R1=4", "-DMARS_LORA_PF=1", "-DMARS_W_IN_REGISTER=1"),
    "AuthenticAMD": (),
}


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``; empty where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text().split("vendor_id", 1)[1].split(":", 1)[1].split("\n", 1)[0].strip()
    except (OSError, IndexError):
        return ""


def cflags() -> tuple[str, ...]:
    """The compiler flags of this machine's build: the ISA's, then the weight-stream tuning of its vendor."""
    return (*CFLAGS, *ISA_FLAGS[kernel_isa()], *STREAM_FLAGS.get(cpu_vendor(), ()))


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
    from mars.models import cache_root

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


@functools.cache
def small_linear_op():
    """``torch.ops.mars.small_linear`` (built or loaded on first call); raises :class:`KernelUnavailable`."""
    import torch

    check_cpu()
    library = ensure_built(build_dir())
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        raise KernelUnavailable(f"could not load the small-M GEMM kernel {library}: {err}") from err
    _register_fake()
    return torch.ops.mars.small_linear.default


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


def ensure_built(target: Path) -> Path:
    """The kernel library in ``target``, built there first unless a finished build is present.

    A build is finished when its ``complete`` marker exists (written after the compiler succeeded); a folder
    without it (a build killed half-way, a crashed compiler) is wiped and built again, never loaded.  A lock
    file beside the folder keeps two processes from building into it at once."""
    import fcntl
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    library, marker = target / f"{NAME}.so", target / "complete"
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.is_file() and library.is_file()):
            shutil.rmtree(target, ignore_errors=True)
            _build(target, NAME)
            if not library.is_file():
                raise KernelUnavailable(f"building the small-M GEMM kernel left no {library}")
            marker.write_text(build_key() + "\n")
    return library


def has_compiler() -> bool:
    """Whether the C++ compiler the build would use (``$CXX``, else ``c++``) is on the PATH."""
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load_revision(rev: str, namespace: str = "ab_old") -> None:
    """Build and load the kernels' sources as they were at git revision ``rev`` of this checkout, under the operator
    namespace ``namespace`` (``torch.ops.<namespace>``, ``torch.classes.<namespace>``) beside this build's: for
    A/B benchmarks of a kernel change in one process.  Needs the git checkout and a compiler."""
    import subprocess
    import tempfile

    from torch.utils import cpp_extension

    root = HERE.parents[2]
    directory = Path(tempfile.gettempdir()) / f"mars_kernels_{namespace}_{rev.replace('/', '_').replace('~', '-')}"
    directory.mkdir(exist_ok=True)
    for path in (*SOURCES, *HEADERS):
        show = ["git", "show", f"{rev}:{path.relative_to(root)}"]
        (directory / path.name).write_bytes(subprocess.run(show, cwd=root, check=True, capture_output=True).stdout)
    cpp_extension.load(
        name=f"{namespace}_kernels",
        sources=[str(directory / p.name) for p in SOURCES],
        extra_cflags=[*cflags(), f"-DMARS_NAMESPACE={namespace}", "-Wno-builtin-macro-redefined"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def can_run_here() -> bool:
    """Whether the kernels can run here: the CPU takes them, and a finished build is cached or a compiler can
    make one.  Builds and loads nothing."""
    try:
        check_cpu()
        return (build_dir() / "complete").is_file() or has_compiler()
    except KernelUnavailable:
        return False


def _build(target: Path, name: str) -> None:
    from torch.utils import cpp_extension

    if not has_compiler():
        raise KernelUnavailable("no C++ compiler (c++ or $CXX) to build the small-M GEMM kernel")
    target.mkdir(parents=True, exist_ok=True)
    print(f"mars: compiling the CPU decode kernels once into {target} (about a minute) ...", file=sys.stderr)
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
