"""Declared configs: train, evaluate and serve are each checked by one schema whose refusals name the key,
what it allows and what it got; every key of their YAML files is declared; loggers and callbacks are
built from ``_target_`` entries, so another one is configuration, not code; one reader gives the metadata
and the block size of a checkpoint to decode with."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import TINY_SFT
from lightning.pytorch.callbacks import Callback

from mars.config_schema import ConfigError
from mars.decoding.settings import DecodingSettings, decoding_block_size
from mars.evaluation.config import EvaluateConfig, check_config
from mars.metadata import CheckpointError, MetadataError, read_checkpoint
from mars.pipeline import complete_checkpoint
from mars.serving.config import ServeConfig
from mars.training.config import TrainConfig
from mars.training.run import run

TINY_TRAIN = ["model=tiny-random", "data=jsonl", f"data.path={TINY_SFT}", "logger=none"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lr=-1"], "optim.lr must be a number > 0, got -1"),
        (["optim.warmup_ratio=1"], "optim.warmup_ratio must be in [0, 1) (the share of steps spent warming up), got 1"),
        (["block=4.0"], "block must be an integer >= 1 (the training block size B), got 4.0"),
        (["overwrite=1"], "overwrite must be true or false, got 1"),
        (["resume=sometimes"], "resume must be one of ['auto', 'never'], got 'sometimes'"),
        (["optim.master_weights=maybe"], "optim.master_weights must be true or false or one of ['auto'], got 'maybe'"),
        (["+optim.lrr=0.1"], "optim.lrr is not a known setting; known: ['betas', 'lr', 'master_weights',"),
        (["trainer.max_steps=-2"], "trainer.max_steps must be an integer >= -1 (-1: no limit, max_epochs decides)"),
        (["data.limit=0"], "data.limit must be an integer >= 1 or null, got 0"),
        (["+objective.alhpa=0"], "unknown objective setting(s) ['alhpa']"),
        (["data=self_distill", "data.distill.batch_size=0"], "data.distill.batch_size must be an integer >= 1, got 0"),
        (["+callbacks.stop._target_=lightning.pytorch.callbacks.EarlyStop"], "callbacks.stop._target_="),
        (["logger=csv", "+logger.csv.versoin=1"], "logger.csv: lightning.pytorch.loggers.CSVLogger cannot take"),
    ],
)
def test_a_bad_training_key_is_named_with_what_it_allows(compose_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.of(compose_cfg("train", TINY_TRAIN + overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["budget.minutes=nan"], "budget.minutes must be a finite number > 0 or null, got nan"),
        (["budget.minutes=inf"], "budget.minutes must be a finite number > 0 or null, got inf"),
        (["budget.minutes=-1"], "budget.minutes must be a finite number > 0 or null, got -1"),
        (["budget.minutes=0"], "budget.minutes must be a finite number > 0 or null, got 0"),
        (["budget.minutes=10", "budget.snapshots=[nan]"], "budget.snapshots must be finite minutes > 0"),
        (["optim.lr=nan"], "optim.lr must be a finite number > 0, got nan"),
        (["optim.warmup_ratio=-inf"], "optim.warmup_ratio must be a finite number in [0, 1), got -inf"),
        (["stop_grace_seconds=inf"], "stop_grace_seconds must be a finite number > 0, got inf"),
    ],
)
def test_nan_and_infinity_are_refused_like_any_out_of_range_number(compose_cfg, overrides, message):
    """A NaN or infinite budget never ends the run (and a NaN one sets the lr to 0): refused, naming the key."""
    with pytest.raises(ConfigError) as err:
        TrainConfig.of(compose_cfg("train", TINY_TRAIN + overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["threads=0"], "threads must be an integer >= 1 or null, got 0"),
        (["dtype=float8"], "dtype: unknown dtype 'float8'"),
        (["fidelity=1"], "fidelity must be true or false, got 1"),
        (["decoding.batch_size=0"], "decoding.batch_size must be an integer >= 1, got 0"),
        (
            ["decoding.block_size=0"],
            "decoding.block_size must be an integer >= 1 or null (null: the checkpoint's training block size), got 0",
        ),
        (["compare=[1]"], "compare[0]"),
    ],
)
def test_a_bad_evaluation_key_is_named_with_what_it_allows(compose_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(_resolved(compose_cfg("evaluate", ["model=tiny-random", *overrides])))
    assert message in str(err.value)


def test_a_bad_api_key_is_refused_without_echoing_it(compose_cfg):
    with pytest.raises(ConfigError, match="api_key must be a string or null, got a value of type int") as err:
        ServeConfig.from_cfg(compose_cfg("serve", ["model=tiny-random", "api_key=918273645"]))
    assert "918273645" not in str(err.value)


@pytest.mark.parametrize(
    "name, schema, overrides",
    [
        ("train", TrainConfig, TINY_TRAIN),
        ("train", TrainConfig, TINY_TRAIN + ["data=self_distill", "adapter=lora", "logger=wandb"]),
        ("evaluate", EvaluateConfig, ["model=tiny-random"]),
        ("serve", ServeConfig, ["model=tiny-random"]),
    ],
)
def test_every_key_of_the_yaml_files_is_declared(compose_cfg, name, schema, overrides):
    """The YAML gives the values, the schema the types: a key added to one must be added to the other."""
    resolved = _resolved(compose_cfg(name, overrides))
    assert schema.model_validate(resolved).model_extra == {}
    assert set(resolved) == set(schema.model_fields) - {"checkpoint_meta"}  # (serve's is derived)


@pytest.mark.parametrize("logger", ["csv", "wandb", "tensorboard", "mlflow", "none", "[csv,tensorboard]"])
def test_every_logger_config_names_a_target_that_takes_its_keys(compose_cfg, logger):
    """tensorboard and mlflow are not installed here: their YAML must still name an importable class whose
    constructor takes every key given (a typo would fail this), so installing the package is all they need."""
    settings = TrainConfig.of(compose_cfg("train", [*TINY_TRAIN, f"logger={logger}"]))
    expected = [] if logger == "none" else logger.strip("[]").split(",")
    assert list(settings.logger) == expected
    assert all(entry["save_dir"].startswith(str(settings.output_dir)) for entry in settings.logger.values())


class WritesAFile(Callback):
    """A callback no mars module knows about, added to a run by configuration alone."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module):
        self.path.write_text(f"{trainer.global_step}\n")


def test_loggers_and_callbacks_come_from_configuration_alone(compose_cfg, tmp_path):
    marker = tmp_path / "callback_ran.txt"
    overrides = [
        *TINY_TRAIN,
        "logger=csv",
        "+logger.second._target_=lightning.pytorch.loggers.CSVLogger",
        f"+logger.second.save_dir={tmp_path / 'second'}",
        "+logger.second.name=metrics",
        f"+callbacks.marker._target_={__name__}.WritesAFile",
        f"+callbacks.marker.path={marker}",
        "data.batch_size=4",
        "trainer.max_steps=2",
        "trainer.precision=32-true",
        f"output_dir={tmp_path / 'run'}",
    ]
    run(compose_cfg("train", overrides))
    assert marker.read_text() == "2\n"
    for folder in (tmp_path / "run" / "csv", tmp_path / "second" / "metrics" / "version_0"):
        header = (folder / "metrics.csv").read_text().splitlines()[0].split(",")
        assert any(c.startswith("lr-AdamW") for c in header), header  # the default LearningRateMonitor
        hparams = yaml.safe_load((folder / "hparams.yaml").read_text())
        assert hparams["block"] == 4 and hparams["optim"]["lr"] == 5e-6  # the run's whole config


def test_a_run_without_a_logger_leaves_out_the_callbacks_that_need_one(compose_cfg, tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar

    from mars.training.loggers import build_callbacks

    section = compose_cfg("train", TINY_TRAIN).callbacks
    assert {type(c) for c in build_callbacks(section, with_logger=True)} == {TQDMProgressBar, LearningRateMonitor}
    assert {type(c) for c in build_callbacks(section, with_logger=False)} == {TQDMProgressBar}


# ------------------------------------------------------------------------------------------
# One reader of a checkpoint's metadata
# ------------------------------------------------------------------------------------------
def _checkpoint(folder: Path, **meta) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if meta:
        (folder / "mars_config.json").write_text(json.dumps(meta))
    return folder


def test_a_checkpoint_is_read_through_the_validating_reader(tmp_path):
    good = _checkpoint(tmp_path / "good", block_size=8, objective="mars", mask_token="<m>", mask_token_id=3)
    assert read_checkpoint(good)["block_size"] == 8 and read_checkpoint(good)["mask_token"] == "<m>"
    bad = _checkpoint(tmp_path / "bad", block_size="8", objective="mars", mask_token="<m>", mask_token_id=3)
    with pytest.raises(CheckpointError, match=r"field 'block_size' must be an integer >= 1, got '8'"):
        read_checkpoint(bad)  # read raw before, a string block size reached the decoder
    plain = _checkpoint(tmp_path / "plain")
    (plain / "tokenizer_config.json").write_text(json.dumps({"mask_token": {"content": "<mask>"}}))
    assert read_checkpoint(plain) == {"mask_token": "<mask>"}  # a base model whose tokenizer has one
    unfinished = _checkpoint(tmp_path / "half", **json.loads((good / "mars_config.json").read_text()), complete=False)
    assert not complete_checkpoint(unfinished)
    with pytest.raises(MetadataError):
        complete_checkpoint(bad)


def test_one_block_size_rule_for_every_decoding_door(tmp_path, compose_cfg):
    default = DecodingSettings().block_size
    assert decoding_block_size(None, None) == default
    assert decoding_block_size(None, {"block_size": 8}) == 8
    assert decoding_block_size(2, {"block_size": 8}) == 2
    ckpt = _checkpoint(tmp_path / "b8", block_size=8, objective="mars", mask_token="<m>", mask_token_id=3)
    served = ServeConfig.from_cfg(compose_cfg("serve", ["model=tiny-random", f"checkpoint={ckpt}"]))
    evaluated = check_config(_resolved(compose_cfg("evaluate", ["model=tiny-random", f"checkpoint={ckpt}"])))
    assert served.settings.block_size == evaluated.block_size == 8


def _resolved(cfg) -> dict:
    from omegaconf import OmegaConf

    from mars.evaluation.config import register_resolvers

    register_resolvers()
    return OmegaConf.to_container(cfg, resolve=True)
