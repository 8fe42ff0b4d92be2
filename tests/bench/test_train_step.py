"""``mars-bench train-step`` (as ``python -m mars.bench.train_step``) end to end on a tiny random model: every
(precision, objective) row, in its own process, with the optimizer training uses.  The default suite runs the fp32 rows (AR and MARS); the bf16
comparison (two more processes) is ``-m slow``."""

import json
import subprocess
import sys

import pytest

BATCH, LENGTH = 2, 32


def run_bench(tmp_path, paths: tuple[str, ...]):
    """(rows by (precision, objective), stdout) of one train-step run over ``paths`` x (AR, MARS)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "mars.bench.train_step", "--model", "tiny-random", "--batch", str(BATCH)]
    cmd += ["--length", str(LENGTH), "--steps", "2", "--warmup", "1", "--paths", ",".join(paths)]
    proc = subprocess.run(
        [*cmd, "--objectives", "ar,mars", "--json-out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    by = {(r["precision"], r["objective"]): r for r in rows}
    assert len(by) == len(rows) and set(by) == {(p, o) for p in paths for o in ("ar", "mars")}
    return by, proc.stdout


def check_rows_and_table(by: dict, stdout: str, paths: tuple[str, ...]) -> None:
    for r in by.values():
        # two timed steps, the warm-up step left out: their median is the mean of the fastest and slowest
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["median_s"] == pytest.approx((r["min_s"] + r["max_s"]) / 2, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(BATCH * LENGTH / r["median_s"], rel=1e-12)
        assert 10 < r["peak_mb"] < 64 * 1024  # the process's max RSS in MB (ru_maxrss is in KB)
    for precision in paths:
        # MARS adds the mask term to the AR loss of the same weights and batch
        assert by[precision, "mars"]["last_loss"] > by[precision, "ar"]["last_loss"]

    # the printed table's ratios are the rows' own: time against the first path and against AR
    header = next(line for line in stdout.splitlines() if line.startswith("| attn |"))
    assert f"time x {paths[0]}" in header and "time x AR" in header
    table = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[1] in paths:
            table[cells[1], cells[3]] = cells
    assert set(table) == set(by)
    for (precision, objective), cells in table.items():
        r, ar, first = by[precision, objective], by[precision, "ar"], by[paths[0], objective]
        assert cells[4] == f"{r['median_s']:.2f}" and cells[6] == f"{r['tokens_per_s']:.0f}"
        assert cells[8] == f"{r['median_s'] / first['median_s']:.2f}"
        assert (
            cells[9] == f"{r['median_s'] / ar['median_s']:.2f}" and cells[10] == f"{r['peak_mb'] / ar['peak_mb']:.2f}"
        )


def test_train_step_reports_the_fp32_ar_and_mars_rows(tmp_path):
    paths = ("32-true",)
    by, stdout = run_bench(tmp_path, paths)
    check_rows_and_table(by, stdout, paths)
    # fp32 weights need no fp32 master copy
    assert all("master" not in r["optimizer"].lower() for r in by.values())


@pytest.mark.slow
def test_train_step_reports_every_path_and_objective(tmp_path):
    paths = ("32-true", "bf16-true")
    by, stdout = run_bench(tmp_path, paths)
    check_rows_and_table(by, stdout, paths)
    # both paths train the same seeded model on the same batch: bf16 only rounds it
    assert by["bf16-true", "ar"]["last_loss"] == pytest.approx(by["32-true", "ar"]["last_loss"], rel=0.01)
    # bf16 weights train through fp32 master weights (no update lost to rounding); fp32 needs none
    optim = {r["precision"]: r["optimizer"] for r in by.values()}
    assert "master" in optim["bf16-true"].lower() and "master" not in optim["32-true"].lower()
