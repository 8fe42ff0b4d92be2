"""The entry points' refusals before any work: a model that cannot be fetched is one line and exit status 2, with no
traceback and no stub run folder (the hub simulated unreachable: HF_HUB_OFFLINE=1 and a repo id not cached)."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from mars.cli import preflight

UNCACHED = "mars-test/not-cached"


@pytest.fixture
def hub_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets when the hub client loads


def test_the_sources_an_evaluation_or_a_server_loads(compose_cfg):
    served = compose_cfg("serve", [])  # the shipped gated adapter: its base is the embedded model
    assert preflight.model_sources(served) == ["embedded:smollm2-135m"]
    base = compose_cfg("evaluate", ["checkpoint=null", f"model.name_or_path={UNCACHED}"])
    assert preflight.model_sources(base) == [UNCACHED]
    drafted = compose_cfg("evaluate", ["decoding=mars_draft_model", "decoding.draft_model=org/draft"])
    assert preflight.model_sources(drafted) == ["embedded:smollm2-135m", "org/draft"]
    assert preflight.model_sources(compose_cfg("evaluate", ["decoding=mars_draft_model"])) == ["embedded:smollm2-135m"]


@pytest.mark.parametrize("entry", ["evaluate", "serve"])
def test_an_uncached_hub_model_offline_is_refused_naming_it(compose_cfg, hub_offline, entry):
    from mars.models import HubUnreachableError

    with pytest.raises(HubUnreachableError, match=f"model '{UNCACHED}' is not in the local Hugging Face cache"):
        preflight.check_sources(compose_cfg(entry, ["checkpoint=null", f"model.name_or_path={UNCACHED}"]))
    preflight.check_sources(compose_cfg(entry, []))  # the embedded model needs no hub


def test_a_checkpoint_with_a_bad_stored_record_is_refused_before_the_results_folder(compose_cfg, tmp_path):
    import json
    import shutil

    from mars.paths import bundled_path

    folder = tmp_path / "adapter"
    shutil.copytree(bundled_path("bundled:adapters/smollm2-135m-mars-rank8"), folder)
    preflight.check_sources(compose_cfg("evaluate", [f"checkpoint={folder}"]))  # as shipped: it passes
    meta = json.loads((folder / "mars_config.json").read_text())
    meta["draft_acceptance"]["conditional"][1] = [0.5, None, 0.6, 0.7]
    (folder / "mars_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"mars_config.json: draft_acceptance.conditional must be .* depth 2, top-2"):
        preflight.check_sources(compose_cfg("evaluate", [f"checkpoint={folder}"]))


@pytest.mark.parametrize("entry", ["evaluate", "serve"])
def test_a_model_named_beside_the_default_adapter_of_another_base_is_refused(compose_cfg, entry):
    """The default checkpoint is the embedded model's adapter, which brings its base: naming another model beside
    it would decode the embedded model under the other model's name."""
    with pytest.raises(
        ValueError, match="would decode embedded:smollm2-135m, not /data/other-model; set checkpoint=null"
    ):
        preflight.check_sources(compose_cfg(entry, ["model.name_or_path=/data/other-model"]))
    preflight.check_default_checkpoint(compose_cfg(entry, ["model.name_or_path=/data/other-model", "checkpoint=null"]))
    preflight.check_default_checkpoint(compose_cfg(entry, ["model=qwen2.5-0.5b"]))  # no default adapter: its own


def test_a_model_typed_beside_an_adapter_of_another_base_is_refused_on_the_command_line(tmp_path):
    from mars.paths import bundled_path

    adapter = bundled_path("bundled:adapters/smollm2-135m-mars-rank8")
    cmd = [sys.executable, str(REPO / "serve.py"), f"checkpoint={adapter}", "model.name_or_path=/data/other-model"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: model.name_or_path=/data/other-model beside the checkpoint "), lines[-3:]
    assert "leave model.name_or_path out to decode embedded:smollm2-135m" in lines[-1]
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def stub(folder):
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text("a: 1\n")
    (folder / "train.log").touch()
    return folder


def test_only_a_stub_run_folder_is_removed_with_the_empty_folders_above_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert preflight.remove_stub(stub(tmp_path / "outputs" / "train" / "run"))
    assert not (tmp_path / "outputs").exists()  # outputs/train/ held nothing else either
    (tmp_path / "outputs" / "keep.txt").parent.mkdir()
    (tmp_path / "outputs" / "keep.txt").write_text("x")
    assert preflight.remove_stub(stub(tmp_path / "outputs" / "serve" / "t0"))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["keep.txt"]
    logged = stub(tmp_path / "logged")
    (logged / "train.log").write_text("step 1\n")
    resumable = stub(tmp_path / "resumable")
    (resumable / "checkpoints").mkdir()
    (resumable / ".hydra" / "extra.yaml").write_text("")
    for kept in (logged, resumable, tmp_path):
        assert not preflight.remove_stub(kept) and kept.is_dir()


def test_a_refusal_is_one_line_on_stderr_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as done:
        preflight.refuse(ConnectionError("model 'x' cannot be fetched"))
    assert done.value.code == preflight.REFUSED_STATUS == 2
    assert capsys.readouterr().err == "error: model 'x' cannot be fetched\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, overrides",
    [
        ("train.py", [f"model.name_or_path={UNCACHED}", "logger=none"]),
        ("evaluate.py", ["checkpoint=null", f"model.name_or_path={UNCACHED}", "limit=1"]),
        ("serve.py", ["checkpoint=null", f"model.name_or_path={UNCACHED}"]),
    ],
)
def test_an_unreachable_hub_is_one_message_a_non_zero_exit_and_no_run_folder(tmp_path, script, overrides):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: model '{UNCACHED}' is not in the local Hugging Face cache"), lines[-5:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/<run>/ with .hydra/ and an empty log


@pytest.mark.parametrize("spelling", ["1_0", "+2"])
def test_a_tree_spelled_with_digit_separators_or_signs_on_the_command_line_is_refused(tmp_path, spelling):
    """Hydra reads 1_0 as the integer 10 and +2 as 2: the server checks the text as typed, before the model loads."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), "model=tiny-random", "checkpoint=null", f"decoding.tree={spelling}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"got '{spelling}'" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
