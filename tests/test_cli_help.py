"""Every `python -m mars...` command answers --help: argparse %-formats help texts, so one literal '%' in a
field's help (the decoding settings' texts are shared by several commands) would make --help crash."""

import importlib

import pytest

COMMANDS = [
    "mars.bench.throughput",
    "mars.bench.step_cost",
    "mars.bench.reliability",
    "mars.bench.probe",
    "mars.training.adapter_rank",
    "mars.training.export",
    "mars.training.self_distill",
    "mars.bench.train_step",
    "mars.bench.loadtest",
    "mars.bench.step_breakdown",
]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_and_exits_cleanly(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
