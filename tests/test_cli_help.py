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


# ------------------------------------------------------------------------------------------
# The Hydra entry points: each --help names its own groups and describes every top-level key
# ------------------------------------------------------------------------------------------
def _hydra_help(script: str) -> str:
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [sys.executable, str(REPO / script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _section(text: str, title: str) -> list[str]:
    body = text.split(f"== {title}", 1)[1].split("\n== ", 1)[0]
    return [line for line in body.splitlines()[1:] if line.strip()]


@pytest.mark.parametrize(
    "script, config, groups",
    [
        ("evaluate.py", "evaluate", {"benchmarks", "decoding", "logger", "model"}),
        ("serve.py", "serve", {"decoding", "model"}),
    ],
)
def test_an_entry_points_help_lists_its_own_groups_and_describes_every_key(script, config, groups, compose_cfg):
    text = _hydra_help(script)
    listed = {line.split(":", 1)[0] for line in _section(text, "Config groups") if not line.startswith(" ")}
    assert listed == groups  # not trainer, objective, mask_schedule...: train.py's groups
    keys = _section(text, "Keys")
    for key in compose_cfg(config, []):
        if key in groups:
            continue
        at = next((i for i, line in enumerate(keys) if line.startswith(f"{key} = ")), None)
        assert at is not None, f"{key} is not listed"
        assert keys[at + 1].startswith("    ") and len(keys[at + 1].strip()) > 10, f"{key} has no description"
    for group in groups:  # each group named with its options and what it is for
        line = next(i for i, x in enumerate(_section(text, "Config groups")) if x.startswith(f"{group}:"))
        assert _section(text, "Config groups")[line + 1].startswith("    ")


def test_train_py_help_lists_the_training_groups_only_and_every_key(compose_cfg):
    text = _hydra_help("train.py")
    listed = {line.split(":", 1)[0] for line in _section(text, "Config groups") if not line.startswith(" ")}
    training = {
        "adapter",
        "callbacks",
        "data",
        "experiment",
        "logger",
        "mask_schedule",
        "model",
        "objective",
        "trainer",
    }
    assert listed == training  # not benchmarks or decoding: evaluation's
    assert "mars_gated_soft" in next(x for x in _section(text, "Config groups") if x.startswith("objective:"))
    keys = [line.split(" = ", 1)[0] for line in _section(text, "Keys") if " = " in line and not line.startswith(" ")]
    assert keys == [k for k in compose_cfg("train", []) if k not in listed]
    assert "optim.lr=1e-5" in text and "decoding." not in text


def test_the_training_config_check_loads_no_lightning():
    """train.py's --help and its config check read the schema alone: Lightning (seconds to load) waits for a run."""
    import subprocess
    import sys

    code = "import sys, mars.training.config, mars.cli.help; assert 'lightning' not in sys.modules, 'lightning'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docs_configs_lists_every_option_of_every_group():
    import re

    from conftest import REPO

    text = (REPO / "docs" / "configs.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)/` \| (.*?) \|", text, re.M))
    assert "mars_gated_soft" in rows["objective"]
    for group, choices in rows.items():
        if group == "experiment":  # its rows name folders of recipes (paper_0.5b/*), beside their shared base
            continue
        named = set(re.findall(r"`([\w.-]+)`", choices))
        options = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        assert options <= named, f"docs/configs.md does not list {sorted(options - named)} of {group}/"
