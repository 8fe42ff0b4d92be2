"""scripts/gpu_check.py (`make gpu-check`) on a CPU with --tiny: every check lands in results.json and results.md,
the fp32 decoders that must reproduce transformers' greedy output do, and a check that raises or hangs is recorded
while the run goes on.  A GPU runs the same code on the real shapes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from module_loading import load_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
EXACT = ("threshold-1.0", "verify-chain", "verify-tree-auto", "verify-tree-2,1")


@pytest.fixture(scope="module")
def gpu_check():
    return load_module(SCRIPT, "gpu_check")


def _checks(out: Path) -> dict[str, dict]:
    results = json.loads((out / "results.json").read_text())
    return {c["name"]: c for c in results["checks"]}


def _assert_exact(checks: dict[str, dict], prefix: str) -> None:
    for label in EXACT:
        check = checks[f"{prefix}.fp32.{label}"]
        assert check["status"] == "pass", check
        assert check["details"]["identical_rows"] == check["details"]["rows"] > 1
        assert check["details"]["first_difference"] is None


def test_fp32_decoders_match_transformers_greedy_and_every_check_is_recorded(gpu_check, tmp_path):
    argv = ["--device", "cpu", "--tiny", "--checks", "fp32", "--out", str(tmp_path)]
    assert gpu_check.main(argv, watchdog=False) == 0
    checks = _checks(tmp_path)
    names = ["environment", "qwen.build", "qwen.fp32.reference"] + [f"qwen.fp32.{d}" for d in gpu_check.DECODERS]
    for name in names:
        assert name in checks and checks[name]["seconds"] >= 0
    for group in ("bf16", "throughput", "train", "embedded"):  # not selected: named, with the reason
        assert checks[group]["status"] == "skipped" and "--checks" in checks[group]["summary"]
    _assert_exact(checks, "qwen")
    env = checks["environment"]["details"]
    assert env["device"] == "cpu" and env["torch"] and env["transformers"]
    markdown = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in markdown for name in names)


def test_a_check_that_raises_or_overruns_is_recorded_and_the_run_goes_on(gpu_check, tmp_path):
    run = gpu_check.Run(tmp_path, budget=30, header=dict(started="now", device="cpu", tiny=True), watchdog=False)

    def spin():
        while True:
            time.sleep(0.01)

    def broken():
        raise ValueError("tree=2,1 is refused")

    began = time.monotonic()
    run.check("hangs", "fp32", 0.3, spin)
    run.check("raises", "fp32", 5, broken)
    run.check("works", "fp32", 5, lambda: gpu_check.Outcome("pass", "fine"))
    assert time.monotonic() - began < 3
    assert run.finish() == 1
    checks = _checks(tmp_path)
    assert checks["hangs"]["status"] == "timeout"
    assert checks["raises"]["status"] == "error" and "tree=2,1 is refused" in checks["raises"]["summary"]
    assert checks["works"]["status"] == "pass"


def test_compare_names_each_rows_first_difference(gpu_check):
    found = gpu_check.compare([[5, 6, 7, 2], [8, 9], [4, 4]], [[5, 6, 1, 2], [8, 9], [4, 4, 3]])
    assert found["identical_rows"] == 1
    assert [(d["row"], d["position"]) for d in found["differences"]] == [(0, 2), (2, 2)]
    assert found["first_difference"]["expected"] == 7 and found["first_difference"]["got"] == 1
    assert found["agreeing_share"] == pytest.approx((2 + 2 + 2) / 8)


@pytest.mark.slow
def test_tiny_run_of_every_group(gpu_check, tmp_path):
    """The command as `make gpu-check` runs it (a subprocess, its watchdog armed), every group, on a CPU."""
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    checks = _checks(tmp_path)
    _assert_exact(checks, "qwen")
    if checks["embedded.build"]["status"] == "done":
        _assert_exact(checks, "embedded")
    assert checks["qwen.train.bf16-step"]["status"] == "pass"
    details = checks["qwen.train.bf16-step"]["details"]
    assert details["loss_finite"] and details["base_tensors_with_gradient"] == 0 and details["adapter_tensors"] > 0
    for batch in (1, 4, 16):
        rows = checks[f"qwen.bf16.throughput.batch{batch}"]["details"]["rows"]
        assert {"ar-hf", "ar-cursor"} <= {r["decoder"] for r in rows}
        assert all(r["tokens_per_s"] > 0 and r["batch"] == batch for r in rows)
        verify = [r for r in rows if r["decoder"] not in ("ar-hf", "ar-cursor")]
        assert verify and all(r["tree"] for r in verify)  # the shape tree=auto picked, reported
    assert all(f"qwen.bf16.{d}" in checks for d in gpu_check.DECODERS)
    markdown = (tmp_path / "results.md").read_text()
    assert "## Throughput (bf16)" in markdown and "## Training step" in markdown


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("mps", "--device 'mps' is not a device this check runs on: use cuda, cuda:N or cpu"),
        ("gpu0", "--device 'gpu0' is not a device this check runs on"),
        ("cuda:x", "--device 'cuda:x' is not a device this check runs on"),
    ],
)
def test_a_device_it_cannot_run_on_is_one_line_before_any_model(gpu_check, tmp_path, capsys, device, message):
    assert gpu_check.main(["--device", device, "--out", str(tmp_path / "out")], watchdog=False) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # no check ran, no model was built


def test_cuda_without_a_cuda_device_points_at_the_fix(gpu_check, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        assert gpu_check.device_problem("cuda") is None
        assert "CUDA device(s)" in gpu_check.device_problem(f"cuda:{torch.cuda.device_count()}")
        return
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path / "out")], watchdog=False) == 2
    err = capsys.readouterr().err
    fix = "install a CUDA build of torch" if torch.version.cuda is None else "sees no CUDA device"
    assert fix in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.fixture
def environment_kept():
    """Lightning's FSDP sets the process group's variables (MASTER_PORT, ...) in this process: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_paper_recipe_group_trains_resumes_from_a_sharded_checkpoint_and_projects_a_stage(
    gpu_check, tmp_path, environment_kept
):
    """train.py's run on experiment=paper_0.5b/mars_b4 (FSDP in one process, activation checkpointing, an
    accumulation derived from the global batch), killed after a sharded checkpoint and resumed from it."""
    argv = ["--device", "cpu", "--tiny", "--checks", "recipe", "--out", str(tmp_path)]
    assert gpu_check.main(argv, watchdog=False) == 0
    check = _checks(tmp_path)["qwen.recipe.paper-steps"]
    assert check["status"] == "pass", check
    d = check["details"]
    assert (d["global_batch"], d["rows_per_device"], d["accumulation"]) == (4, 2, 2)
    assert d["killed_after"] == 3 and d["resumed_steps"] == 2 and d["shard_digests_verified"]
    assert {"meta.pt", ".metadata", "sha256.rank0.json"} <= set(d["sharded_checkpoint_files"])
    assert d["step_seconds"] > 0 and d["paper_stage_steps"] == 26042
    assert d["paper_stage_gpu_hours_projected"] == pytest.approx(d["seconds_per_row"] * 384 * 26042 / 3600)
