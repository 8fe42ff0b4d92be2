"""The step-cost command on a tiny model: one row per (threads, path, batch, columns), ratios to the
1-column step, the machine's bounds beside them, and bad input refused before any model loads."""

import csv
import json

import pytest

from mars.bench.step_cost import main


def test_python_loop_path_turns_only_the_cpp_layer_loop_off():
    import torch
    from decoding_fixtures import kernel_or_skip

    from mars.bench.step_cost import StepBench
    from mars.models import load_model

    kernel_or_skip()
    model = load_model("tiny-random", dtype=torch.float32).model.eval()
    with torch.inference_mode():
        benches = {native: StepBench(model, 1, 2, 5, fast=True, native=native) for native in (True, False)}
        outputs = {native: bench() for native, bench in benches.items()}
    assert isinstance(benches[True].runner._lean._native, torch.ScriptObject)  # the C++ loop ran
    assert benches[False].runner._lean._native is False
    assert torch.equal(outputs[True], outputs[False])


def test_step_cost_table_end_to_end(tmp_path):
    out = tmp_path / "out"
    args = ["--model", "tiny-random", "--columns", "1,4", "--batch-sizes", "1,2", "--repeats", "2", "--warmup", "0"]
    paths = ("fast", "python-loop", "eager")
    assert main([*args, "--threads", "1", "--context", "5", "--paths", ",".join(paths), "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "step_cost.csv").open()))
    keys = {(r["threads"], r["path"], r["batch"], r["columns"]) for r in rows}
    assert keys == {("1", p, b, c) for p in paths for b in ("1", "2") for c in ("1", "4")}
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["bandwidth_gb_s"]) > 0 and float(r["peak_gflop_s"]) > 0
        if r["columns"] == "1":
            assert float(r["ratio"]) == 1.0
    table = (out / "step_cost.md").read_text()
    assert "read bandwidth" in table and "| threads | path | batch | columns |" in table
    assert json.loads((out / "config.json").read_text())["threads"] == [1]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--columns", "0,2"], "--columns takes comma-separated positive integers"),
        (["--batch-sizes", "x"], "--batch-sizes takes comma-separated positive integers"),
        (["--paths", "fast,turbo"], "--paths: unknown"),
        (["--threads", "two"], "--threads: threads='two'"),
    ],
)
def test_step_cost_refuses_bad_input(flags, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*flags, "--model", "does-not-exist", "--out", str(tmp_path)])
