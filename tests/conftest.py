"""Shared fixtures: compose the Hydra configs exactly as the entry points do."""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
TINY_SFT = REPO / "tests" / "data" / "tiny_sft.jsonl"


def pytest_terminal_summary(terminalreporter):
    """The machine the suite ran on, beside its time (the suite's time budget is per CPU kind)."""
    from mars.hardware import describe

    d = describe()
    terminalreporter.write_line(
        f"machine: {d['cpu']} ({d['cpu_capability']}), {os.cpu_count()} CPUs, torch {d['torch']}"
    )


@pytest.fixture
def compose_cfg():
    """compose_cfg("train", [overrides]) -> DictConfig, with Hydra's global state cleaned up."""

    def _compose(name: str, overrides: list[str] | None = None):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name=name, overrides=list(overrides or []))

    return _compose


@pytest.fixture
def tiny_train_overrides(tmp_path):
    return [
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
    ]


@pytest.fixture(scope="session")
def full_checkpoint(tmp_path_factory) -> Path:
    """A tiny full fine-tuned MARS checkpoint (tests/mars_checkpoints.py), once per session."""
    from mars_checkpoints import make_full_checkpoint

    return make_full_checkpoint(tmp_path_factory.mktemp("full") / "hf")


@pytest.fixture(scope="session")
def gated_checkpoint(tmp_path_factory) -> Path:
    """A tiny gated-adapter MARS checkpoint (tests/mars_checkpoints.py), once per session."""
    from mars_checkpoints import make_gated_checkpoint

    return make_gated_checkpoint(tmp_path_factory.mktemp("gated") / "adapter")


@pytest.fixture(scope="module")
def tiny():
    """The tiny random model with the embedded tokenizer, loaded once per test module."""
    from mars.models import load_model

    return load_model("tiny-random")


@pytest.fixture
def loads(monkeypatch, tiny):
    """An evaluation's model loads routed to the module's tiny model, counted."""
    import mars.evaluation.runner as run_mod

    calls = []

    def fake_load(plan):
        calls.append(plan)
        return tiny

    monkeypatch.setattr(run_mod, "load_for_plan", fake_load)
    return calls


@pytest.fixture
def closed_hub(monkeypatch):
    """The hub at a closed local port, as HF_ENDPOINT=http://127.0.0.1:9 sets it."""
    from huggingface_hub import constants

    import mars.models

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    mars.models._hub_unreachable.cache_clear()
    yield
    mars.models._hub_unreachable.cache_clear()
