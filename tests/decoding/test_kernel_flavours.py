"""The kernels' flavours (an ISA and a CPU vendor's tuning): one table gives every flavour's compiler flags, this
machine's build compiles with exactly its flavour's, and every flavour this CPU runs passes the kernel tests, with
the same bits for every vendor's tuning of one ISA."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decoding_fixtures import kernel_or_skip

from mars.decoding import kernels
from mars.decoding.kernels import KernelUnavailable

TESTS = Path(__file__).parent
# The kernel tests run for each extra flavour: the ops against torch or against each other (the tolerances and
# bit-for-bit checks of their own files), the lean forward and the C++ decoder step, greedy decoding, attention,
# and the token choice and verify kernels.
KERNEL_TESTS = ("test_fastpath.py", "test_lean_forward.py", "test_decode_attention.py")
KERNEL_TESTS += ("test_decoding_acceptance.py", "test_decoding_verify.py")
SELECTED = (
    "small_linear or row_does_not or lowrank or fused_linear or bf16 or lean or cpp_decoder or greedy_outputs"
    " or decode_attention or top_tokens or greedy_verify_kernel"
)
# Outputs of the GEMM ops at 1-9 columns (every tile shape: 1, 2, 3 columns and R x MB blocks with remainders),
# with a gated LoRA at some columns, for comparing builds across processes.
PROBE = """
import sys, torch
from mars.decoding import kernels
g = torch.Generator().manual_seed(0)
w, b, x = torch.randn(300, 257, generator=g), torch.randn(300, generator=g), torch.randn(9, 257, generator=g)
down, up = torch.randn(8, 257, generator=g), torch.randn(300, 8, generator=g)
packed = kernels.pack_lowrank_op()(up)
out = {}
for m in range(1, 10):
    out[f"small_linear {m}"] = kernels.small_linear_op()(x[:m], w, b)
    columns = torch.arange(min(m, 3))
    fused = kernels.fused_linear_op()(x[:m], [w, w[:37]], [b, None], [down, None], [packed, None], [0.5, 1.0], columns)
    out.update({f"fused_linear {m} {i}": y for i, y in enumerate(fused)})
    out[f"lowrank_linear {m}"] = kernels.lowrank_linear_op()(x[:m, :8], packed, 300)
torch.save(out, sys.argv[1])
"""


def source_macros() -> set[str]:
    """The ``MARS_*`` macros the kernel sources use (comments left out)."""
    code = "\n".join(p.read_text() for p in (*kernels.SOURCES, *kernels.HEADERS))
    return set(re.findall(r"\bMARS_[A-Z0-9_]+\b", re.sub(r"//[^\n]*", "", code)))


def defines(flags) -> dict[str, str]:
    return dict(f[2:].split("=", 1) for f in flags if f.startswith("-DMARS_"))


def test_every_flavour_defines_each_tuning_macro_of_the_source():
    assert set(kernels.TUNING) == {(isa, vendor) for isa in kernels.ISAS for vendor in kernels.VENDORS}
    for (isa, vendor), tuning in kernels.TUNING.items():
        flags = kernels.flavour_cflags(isa, vendor)
        assert flags[: len(kernels.CFLAGS)] == kernels.CFLAGS
        assert ("-mavx512f" in flags) == (isa == "avx512")
        assert set(defines(flags)) == set(tuning) == source_macros(), (isa, vendor)
    assert len({kernels.flavour_cflags(*key) for key in kernels.TUNING}) == len(kernels.TUNING)


def test_the_isa_decides_the_tiles_and_the_vendor_the_weight_stream():
    stream = {"MARS_PF", "MARS_R1", "MARS_LORA_PF", "MARS_W_IN_REGISTER"}
    for isa in kernels.ISAS:
        intel, amd = (defines(kernels.flavour_cflags(isa, vendor)) for vendor in ("intel", "amd"))
        assert {name for name in intel if intel[name] != amd[name]} == stream
        assert {name: intel[name] for name in stream} == {
            "MARS_PF": "1",
            "MARS_R1": "4",
            "MARS_LORA_PF": "1",
            "MARS_W_IN_REGISTER": "1",
        }
        assert {name: amd[name] for name in stream} == {
            "MARS_PF": "2",
            "MARS_R1": "8",
            "MARS_LORA_PF": "0",
            "MARS_W_IN_REGISTER": "0",
        }
    tiles = {"MARS_R", "MARS_MB", "MARS_R2", "MARS_R3"}
    wide, narrow = (defines(kernels.flavour_cflags(isa, "intel")) for isa in ("avx512", "avx2"))
    assert {name: wide[name] for name in tiles} == {"MARS_R": "6", "MARS_MB": "4", "MARS_R2": "8", "MARS_R3": "8"}
    assert {name: narrow[name] for name in tiles} == {"MARS_R": "3", "MARS_MB": "4", "MARS_R2": "6", "MARS_R3": "0"}


def test_the_vendor_follows_the_cpu_and_an_override_and_each_is_its_own_build(monkeypatch):
    monkeypatch.delenv("MARS_KERNEL_VENDOR", raising=False)
    for vendor_id, vendor in [("GenuineIntel", "intel"), ("AuthenticAMD", "amd"), ("HygonGenuine", "amd"), ("", "amd")]:
        monkeypatch.setattr(kernels, "cpu_vendor", lambda vendor_id=vendor_id: vendor_id)
        assert kernels.kernel_vendor() == vendor
        assert kernels.cflags() == kernels.flavour_cflags(kernels.kernel_isa(), vendor)
    amd = kernels.build_key()
    monkeypatch.setenv("MARS_KERNEL_VENDOR", "intel")
    assert kernels.flavour() == (kernels.kernel_isa(), "intel") and kernels.build_key() != amd
    monkeypatch.setenv("MARS_KERNEL_VENDOR", "arm")
    with pytest.raises(KernelUnavailable, match="choose one of"):
        kernels.build_key()


def test_a_build_compiles_with_exactly_its_flavours_flags(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(kernels, "has_compiler", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    kernels._build(tmp_path / "build", kernels.NAME)
    assert [tuple(call["extra_cflags"]) for call in calls] == [kernels.flavour_cflags(*kernels.flavour())]


def test_this_machines_cached_build_was_compiled_with_its_flavours_flags():
    kernel_or_skip()
    ninja = (kernels.build_dir() / "build.ninja").read_text()
    compile_flags = next(line for line in ninja.splitlines() if line.startswith("cflags = ")).split()
    flags = list(kernels.flavour_cflags(*kernels.flavour()))
    assert compile_flags[-len(flags) :] == flags


def runnable(isa: str) -> None:
    """Skip unless this CPU runs ``isa`` code and the kernels can be built here."""
    if not kernels.can_run_here():
        pytest.skip("the kernels cannot be built or run here")
    if isa == "avx512" and "avx512f" not in kernels.cpu_flags():
        pytest.skip("this CPU has no AVX-512F")


def flavour_env(isa: str, vendor: str) -> dict[str, str]:
    return {**os.environ, "MARS_KERNEL_ISA": isa, "MARS_KERNEL_VENDOR": vendor}


def flavour_build(isa: str, vendor: str, monkeypatch) -> Path:
    """The cache folder of the flavour's build (where a process with its environment builds and loads it)."""
    with monkeypatch.context() as patch:
        patch.setenv("MARS_KERNEL_ISA", isa)
        patch.setenv("MARS_KERNEL_VENDOR", vendor)
        return kernels.build_dir()


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("isa,vendor", list(kernels.TUNING))
def test_each_flavour_passes_the_kernel_tests(isa, vendor, monkeypatch):
    """The default suite tests this machine's flavour; the others this CPU runs are built and tested here."""
    runnable(isa)
    if (isa, vendor) == kernels.flavour():
        pytest.skip("this machine's own flavour: the default suite tests it")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *(str(TESTS / t) for t in KERNEL_TESTS)]
        + ["-k", SELECTED],
        env=flavour_env(isa, vendor),
        capture_output=True,
        text=True,
        timeout=2300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert (flavour_build(isa, vendor, monkeypatch) / "complete").is_file()  # built, not skipped


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("isa", kernels.ISAS)
def test_every_vendors_tuning_of_an_isa_gives_the_same_bits(isa, tmp_path):
    runnable(isa)
    outputs = {}
    for vendor in kernels.VENDORS:
        path = tmp_path / f"{vendor}.pt"
        run = subprocess.run(
            [sys.executable, "-c", PROBE, str(path)], env=flavour_env(isa, vendor), capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[vendor] = torch.load(path)
    intel, amd = outputs["intel"], outputs["amd"]
    assert intel.keys() == amd.keys() and len(intel) == 9 * 4
    for name in intel:
        assert torch.equal(intel[name], amd[name]), name
