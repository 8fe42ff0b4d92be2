"""``mars-bench`` (run as ``python -m mars.bench``): the help lists every tool, each tool answers
``--help``, and an unknown tool is refused naming the allowed ones."""

import subprocess
import sys

import pytest

from mars.bench import TOOLS


def mars_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mars.bench", *args], capture_output=True, text=True, timeout=120)


def test_the_help_lists_every_tool():
    proc = mars_bench("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: mars-bench <tool>")
    listed = [line.split()[0] for line in proc.stdout.split("tools:\n", 1)[1].splitlines() if line.strip()]
    assert listed == list(TOOLS)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tool_answers_help(tool, capsys):
    """In this process (each tool imports torch: a subprocess per tool costs seconds for nothing more)."""
    from mars.bench.__main__ import main

    with pytest.raises(SystemExit) as done:
        main([tool, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mars-bench {tool}") and "--help" in out


def test_an_unknown_tool_is_refused_naming_the_allowed_ones():
    proc = mars_bench("nonesuch")
    assert proc.returncode == 2
    assert "unknown tool 'nonesuch'" in proc.stderr and ", ".join(TOOLS) in proc.stderr
