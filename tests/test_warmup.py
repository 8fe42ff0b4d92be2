"""``python -m mars.warmup`` (``make setup``): a first start's one-time work done ahead, each step reporting its
progress, and skipped once its result is cached."""

import os
import subprocess
import sys
import time

import pytest

from mars import warmup


def test_check_reports_the_work_of_a_fresh_cache_and_builds_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MARS_CACHE", str(tmp_path / "cache"))
    assert warmup.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"[1/2] embedded model: to do (no converted copy in {tmp_path / 'cache'}" in out
    kernels = next(line for line in out.splitlines() if line.startswith("[2/2] CPU decode kernels"))
    assert "to do" in kernels or "skipped" in kernels  # skipped where the CPU or the compiler cannot build them
    assert not (tmp_path / "cache").exists()


def test_a_running_step_reports_its_seconds(capsys):
    with warmup.ticking("compiling", every=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and all(line.startswith("  compiling: ") and line.endswith(" s ...") for line in lines)


@pytest.mark.slow
def test_a_second_warm_up_skips_the_conversion_and_the_kernel_build(tmp_path):
    """The whole warm-up in a fresh cache (a minute or more: the conversion and the compiler run), then again."""
    env = {**os.environ, "MARS_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "mars.warmup"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "[1/2] embedded model: done in" in first.stdout
    built = "[2/2] CPU decode kernels: done in" in first.stdout
    assert built or "[2/2] CPU decode kernels: skipped" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0 and "[1/2] embedded model: cached, nothing to do" in second.stdout
    if built:
        assert "[2/2] CPU decode kernels: cached, nothing to do" in second.stdout
    assert "compiling" not in second.stderr and "Converting" not in second.stderr
    assert subprocess.run([*cmd, "--check"], capture_output=True, env=env, timeout=300).returncode == 0
