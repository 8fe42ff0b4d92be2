"""The package outside this checkout: what the wheel carries, where the project's files are found, and a
wheel installed into a fresh environment in another folder that trains, evaluates and serves (slow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLED = ("conf", "eval", "data")  # top-level folders that ship in the wheel under mars/bundle/


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_pyproject_lists_every_subpackage_and_maps_the_project_folders():
    """setuptools' package list is explicit (the bundled folders need package-dir entries): a new folder of
    modules under src/mars that is not listed would be missing from the wheel."""
    tool = _pyproject()["tool"]["setuptools"]
    on_disk = {
        ".".join(p.relative_to(REPO / "src").parts)
        for p in (REPO / "src" / "mars").rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))
    } | {"mars"}
    listed = set(tool["packages"])
    assert on_disk - listed == set(), f"add {sorted(on_disk - listed)} to [tool.setuptools] packages"
    for folder in BUNDLED:
        assert tool["package-dir"][f"mars.bundle.{folder}"] == folder
        assert f"mars.bundle.{folder}" in listed


def test_project_files_are_the_checkouts_own_folders():
    from mars import paths

    assert paths.in_checkout()
    assert paths.project_root() == REPO
    assert (paths.conf_dir() / "train.yaml").is_file() and (paths.eval_dir() / "offline").is_dir()
    assert (paths.data_dir() / "offline_sft" / "train.jsonl").is_file()


def _shipped(path: Path, globs: list[str]) -> bool:
    """Whether a setuptools package-data pattern matches ``path`` (its "**/" also matches no folder at all)."""
    return any(path.match(g.removeprefix(prefix)) for g in globs for prefix in ("", "**/"))


def test_every_file_of_the_bundled_folders_is_package_data():
    """The wheel carries only the files its package-data patterns match: a file type added to conf/, eval/ or
    data/ (the reference adapter's safetensors and chat template) that no pattern matches would be missing from
    an installed package, and the default checkpoint of evaluate.py and serve.py with it.  A link (conf/sweep)
    is copied file by file."""
    patterns = _pyproject()["tool"]["setuptools"]["package-data"]
    for folder in BUNDLED:
        tracked = subprocess.run(
            ["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
        globs = patterns[f"mars.bundle.{folder}"]
        missed = [
            f for f in tracked if not (REPO / f).is_symlink() and not _shipped(Path(f).relative_to(folder), globs)
        ]
        assert missed == [], f"{folder}/ files no package-data pattern ships: {missed[:5]}"


def test_the_default_checkpoint_of_the_embedded_model_is_shipped():
    """evaluate.py and serve.py default to the model's ``reference_checkpoint``: for the embedded model a
    ``bundled:`` adapter folder under data/, which must exist and be a MARS-trained checkpoint."""
    import yaml

    from mars.metadata import mars_trained, read_checkpoint
    from mars.paths import bundled_path

    ref = yaml.safe_load((REPO / "conf" / "model" / "smollm2-135m.yaml").read_text())["reference_checkpoint"]
    assert ref.startswith("bundled:")
    assert mars_trained(read_checkpoint(bundled_path(ref)))


def test_python_m_mars_paths_prints_a_folder(capsys):
    """``--include_path "$(python -m mars.paths eval)/offline"``: the shipped tasks for lm-eval's own CLI."""
    from mars import paths

    paths.main(["eval"])
    assert capsys.readouterr().out.strip() == str(REPO / "eval")
    with pytest.raises(SystemExit, match=r"usage: python -m mars.paths \[root\|conf\|eval\|data\], got 'evals'"):
        paths.main(["evals"])


def _suite_over(folder: Path, task: str):
    from mars.evaluation.tasks import Suite, TaskSpec, expand_suite, task_manager

    suite = Suite(
        name="copy",
        tasks=[TaskSpec(name=task, label=task)],
        include_path=[str(folder)],
        include_defaults=False,
        confirm_run_unsafe_code=True,
    )
    manager = task_manager(suite)
    return expand_suite(suite, manager), manager


def test_a_copy_of_eval_runs_its_code_in_the_mars_sandbox(tmp_path):
    """A second clone using the first clone's environment: its eval/ tasks load their own copy of the
    sandbox, so they count as sandboxed; a task outside any mars eval/ folder that runs code does not."""
    from mars.evaluation.tasks import code_tasks

    clone_eval = tmp_path / "clone" / "eval"
    shutil.copytree(REPO / "eval" / "offline" / "humaneval", clone_eval / "offline" / "humaneval")
    suite, manager = _suite_over(clone_eval / "offline", "mars_humaneval")
    assert code_tasks(suite, manager) == (["mars_humaneval"], [])

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    text = (clone_eval / "offline" / "humaneval" / "mars_humaneval.yaml").read_text()
    assert "task: mars_humaneval\n" in text and "unsafe_code: true" in text
    (foreign / "foreign_code.yaml").write_text(text.replace("task: mars_humaneval\n", "task: foreign_code\n"))
    shutil.copy(clone_eval / "offline" / "humaneval" / "utils.py", foreign / "utils.py")
    suite, manager = _suite_over(foreign, "foreign_code")
    assert code_tasks(suite, manager) == ([], ["foreign_code"])


# ------------------------------------------------------------------------------------------------
# slow: build the wheel, install it into a fresh venv elsewhere, run the console scripts there
# ------------------------------------------------------------------------------------------------
def _files_under(root: Path, folders: tuple[str, ...]) -> set[str]:
    out = set()
    for folder in folders:
        for where, dirs, files in os.walk(root / folder, followlinks=True):  # conf/sweep is a link
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out |= {str((Path(where) / f).relative_to(root)) for f in files if not f.endswith(".pyc")}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _fresh_venv(where: Path, wheel: Path) -> tuple[Path, Path]:
    """A venv without this environment's site-packages processing: the wheel installed with --no-deps,
    the heavy dependencies (torch, lightning, lm-eval, ...) borrowed from this environment by a path entry.
    That entry does not process the .pth files there, so this checkout's editable install stays out."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "borrowed_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    return where / "bin", Path(purelib)


def _build_wheel(tmp_path: Path) -> Path:
    """The sources as a user gets them (no outputs, caches or build folders), built with pip."""
    src = tmp_path / "src"
    skip_top = {".venv", ".git", "outputs", "multirun", "build", "results", "tests"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = skip_top if Path(folder) == REPO else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}

    shutil.copytree(REPO, src, symlinks=True, ignore=ignore)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("mars-*.whl")
    return wheel


def _train_elsewhere(bin_dir: Path, work: Path, env: dict) -> Path:
    """mars-train on the shipped offline data (data/offline_sft) and configs; the exported folder."""
    _run(
        [
            str(bin_dir / "mars-train"),
            "model=tiny-random",
            "data.limit=16",
            "data.batch_size=4",
            "trainer.max_steps=2",
            "trainer.precision=32-true",
            "logger=none",
        ],
        work,
        env,
    )
    hf = work / "outputs" / "train" / "tiny-random-mars-b4-full-limit16-steps2" / "hf"
    assert (hf / "mars_config.json").is_file()
    return hf


def _evaluate_elsewhere(bin_dir: Path, hf: Path, work: Path, env: dict) -> None:
    """mars-eval on the shipped quality suite (its held-out task reads ../../../data/prompts beside eval/)."""
    _run(
        [
            str(bin_dir / "mars-eval"),
            f"checkpoint={hf}",
            "benchmarks=quality",
            "limit=1",
            "decoding.max_new_tokens=4",
            "threshold=1.0",
            "output_dir=eval",
        ],
        work,
        env,
    )
    points = json.loads((work / "eval" / "points.json").read_text())
    assert {p["task"] for p in points} >= {"Held-out (chrF vs AR)", "Capitals"}


def _wait_healthy(server: subprocess.Popen, url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "mars-serve did not come up"
        time.sleep(0.5)


def _serve_one_completion(bin_dir: Path, hf: Path, work: Path, env: dict) -> None:
    """mars-serve: health, then one completion."""
    port = _free_port()
    server = subprocess.Popen(
        [str(bin_dir / "mars-serve"), f"checkpoint={hf}", f"port={port}", "warmup=false"],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(server, url, 180)
        body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            reply = json.load(r)
        assert reply["usage"]["completion_tokens"] >= 1 and reply["model"] == "tiny-random-mars-b4-full-limit16-steps2"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_wheel_installed_elsewhere_trains_evaluates_and_serves(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    bundled = {n.removeprefix("mars/bundle/") for n in names if n.startswith("mars/bundle/")}
    assert bundled == _files_under(REPO, BUNDLED)

    bin_dir, site_packages = _fresh_venv(tmp_path / "venv", wheel)
    for script in ("mars-train", "mars-eval", "mars-serve", "mars-lm-eval"):
        assert (bin_dir / script).is_file(), script
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    where = _run([str(bin_dir / "python"), "-c", "import mars.paths as p; print(p.project_root())"], work, env)
    assert where.stdout.strip() == str(site_packages / "mars" / "bundle")  # package data, not this checkout

    hf = _train_elsewhere(bin_dir, work, env)
    _evaluate_elsewhere(bin_dir, hf, work, env)
    _serve_one_completion(bin_dir, hf, work, env)
