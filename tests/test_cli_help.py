"""Every `python -m mars...` command answers --help: argparse %-formats help texts, so one literal '%' in a
field's help (the decoding settings' texts are shared by several commands) made --help crash."""

import importlib

import pytest

COMMANDS = [
    "mars.evaluation.throughput",
    "mars.evaluation.step_cost",
    "mars.evaluation.reliability",
    "mars.evaluation.probe",
    "mars.adapter_rank",
    "mars.export",
    "mars.self_distill",
    "mars.train_bench",
    "mars.serving.loadtest",
]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_and_exits_cleanly(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
