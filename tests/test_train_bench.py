"""python -m mars.train_bench end to end on a tiny random model: every (precision, objective) row, in its own
process, with the optimizer training uses."""

import json
import subprocess
import sys


def test_train_bench_reports_every_path_and_objective(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "mars.train_bench", "--model", "tiny-random", "--batch", "2", "--length", "32"]
    cmd += ["--steps", "2", "--warmup", "0", "--paths", "32-true,bf16-true", "--objectives", "ar,mars"]
    proc = subprocess.run([*cmd, "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["precision"], r["objective"]) for r in rows} == {
        (p, o) for p in ("32-true", "bf16-true") for o in ("ar", "mars")
    }
    for r in rows:
        assert r["median_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_mb"] > 0
    # bf16 weights train through fp32 master weights (no update lost to rounding); fp32 needs none
    optim = {r["precision"]: r["optimizer"] for r in rows}
    assert "master" in optim["bf16-true"].lower() and "master" not in optim["32-true"].lower()
    assert "| bf16-true |" in proc.stdout and "time x AR" in proc.stdout
