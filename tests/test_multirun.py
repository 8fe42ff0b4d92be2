"""Real Hydra multiruns of both entry points, as subprocesses on the tiny model (the way
lightning-hydra-template's tests/test_sweeps.py launches ``-m`` runs).

A multirun calls the Hydra task function once per job in one process, so anything that only breaks on
a second call (a package attribute shadowed by a submodule of the same name once the submodule is first
imported, so the second job calls a module) shows up only here.  The evaluation
multirun is the README's ``python evaluate.py -m +sweep=eval_grid`` with the tiny model and the
checkpoints that the training multirun wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lm_eval_fixtures import write_generation_task

REPO = Path(__file__).resolve().parents[1]
TINY_SFT = REPO / "tests" / "data" / "tiny_sft.jsonl"
QUESTIONS = ["What is the capital of France?", "Say hello.", "Name a colour of the sky."]


def launch(script: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO / script), "-m", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory holding a fixture benchmark suite (one tiny generate_until task)."""
    root = tmp_path_factory.mktemp("multirun")
    tasks = root / "tasks"
    write_generation_task(tasks, "fx_mr", [{"question": q, "answer": "Paris"} for q in QUESTIONS], max_gen_toks=6)
    (root / "conf" / "benchmarks").mkdir(parents=True)
    (root / "conf" / "benchmarks" / "fixture.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "fixture",
                "include_path": [str(tasks)],
                "include_defaults": False,
                "apply_chat_template": True,
                "fewshot_as_multiturn": True,
                "system_instruction": None,
                "confirm_run_unsafe_code": False,
                "tasks": [{"name": "fx_mr", "label": "FX", "metric": "exact_match", "filter": "none"}],
            }
        )
    )
    return root


def eval_overrides(workdir: Path) -> list[str]:
    return [
        f"hydra.searchpath=[file://{workdir / 'conf'}]",
        "benchmarks=fixture",
        "dtype=float32",
        "decoding.max_new_tokens=6",
        "plots=false",
    ]


@pytest.fixture(scope="module")
def trained(workdir) -> Path:
    """``python train.py -m block=2,4`` on the tiny model: two jobs, two steps each (console output kept
    in train_console.txt)."""
    proc = launch(
        "train.py",
        "block=2,4",
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=2",
        "data.limit=4",
        "trainer=cpu",
        "trainer.max_steps=2",
        "trainer.precision=32-true",
        "logger=none",
        "run_name=paper-tiny-random-mars-b${block}-e5",  # eval_grid's pattern: the paper experiments' run names
        cwd=workdir,
    )
    (workdir / "train_console.txt").write_text(proc.stdout + proc.stderr)
    return workdir


def test_train_console_shows_each_lightning_line_once_and_no_advert(trained):
    """Each Lightning line appears once (Lightning's own console handler and Hydra's root handler would
    both print it), and no fit advertises LitLogger."""
    console = (trained / "train_console.txt").read_text()
    assert console.count("Seed set to 0") == 2  # one per job
    assert console.count("`Trainer.fit` stopped: `max_steps=2` reached.") == 2
    assert "litlogger" not in console.lower()


def test_train_multirun_runs_every_job(trained):
    for block in (2, 4):
        export = trained / "outputs" / "train" / f"paper-tiny-random-mars-b{block}-e5" / "hf"
        meta = json.loads((export / "mars_config.json").read_text())
        assert meta["block_size"] == block, meta
        assert (export / "config.json").is_file()
    sweep = yaml.safe_load((trained / "outputs" / "multirun" / "train" / "multirun.yaml").read_text())
    assert sweep["hydra"]["mode"] == "MULTIRUN"


def test_evaluate_multirun_of_the_eval_grid_sweep(trained):
    """The README's ``python evaluate.py -m +sweep=eval_grid``: its checkpoint pattern finds what the
    training multirun wrote; two jobs (block 2 and 4), each a two-threshold sweep in its own folder."""
    launch(
        "evaluate.py",
        "+sweep=eval_grid",
        "model=tiny-random",
        "sweep_objective=mars",
        "sweep_block=2,4",
        "thresholds=[1.0,0.9]",
        *eval_overrides(trained),
        cwd=trained,
    )
    for block in (2, 4):
        out = trained / "outputs" / "eval" / f"paper-tiny-random-mars-b{block}-e5-b{block}-fixture-maxnew6"
        points = json.loads((out / "points.json").read_text())
        assert {p["threshold"] for p in points} == {1.0, 0.9}, out
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["fingerprint"]["decoding"]["block_size"] == block
        assert saved["fingerprint"]["checkpoint"].endswith(f"paper-tiny-random-mars-b{block}-e5/hf")
