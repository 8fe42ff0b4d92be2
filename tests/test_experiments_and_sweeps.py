"""Every experiment file and every sweep point composes and trains one step on the tiny model, and every
evaluation sweep point composes into a checked plan for a checkpoint that a training sweep writes, so a
broken config cannot land."""

import itertools
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import CONF, REPO
from omegaconf import DictConfig, OmegaConf

from mars.evaluation.config import prepare
from mars.training.config import validate
from mars.training.run import run

EXPERIMENTS = sorted(
    str(p.relative_to(CONF / "experiment").with_suffix(""))
    for p in (CONF / "experiment").rglob("*.yaml")
    if p.stem != "paper_common"
)
HYDRA_SWEEPS = sorted(p.stem for p in (REPO / "sweeps" / "hydra").glob("*.yaml") if not p.stem.startswith("eval_"))
HYDRA_EVAL_SWEEPS = sorted(p.stem for p in (REPO / "sweeps" / "hydra").glob("eval_*.yaml"))
WANDB_SWEEPS = sorted((REPO / "sweeps").glob("wandb_*.yaml"))
# Applied after each point: the tiny model, local data, one CPU step.
TINY = [
    "model.name_or_path=tiny-random",
    "data.source=jsonl",
    "data.batch_size=2",
    "data.limit=4",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_nodes=1",
    "trainer.strategy=auto",
    "trainer.precision=32-true",
    "trainer.max_steps=1",
    "trainer.accumulate_grad_batches=1",
    "global_batch=null",
    "gradient_checkpointing=false",
    "logger=none",
    "plots=false",  # the loss curve is drawn by tests/evaluation/test_plots.py, not once per point
]


def grid(params: dict) -> list[list[str]]:
    keys = list(params)
    values = [str(v).split(",") for v in params.values()]
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]


def wandb_points(path: Path) -> list[list[str]]:
    spec = yaml.safe_load(path.read_text())
    params = {k: v["values"] if "values" in v else [v["value"]] for k, v in spec["parameters"].items()}
    params.pop("logger", None)  # tests log nowhere
    keys = list(params)
    assert spec["program"] in ("train.py", "evaluate.py") and "${args_no_hyphens}" in spec["command"]
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*params.values())]


def sweep_points(hydra_sweeps: list[str], program: str):
    """(label, overrides) of every point of the given Hydra sweeps and of the W&B sweeps of ``program``."""
    for sweep in hydra_sweeps:
        spec = yaml.safe_load((REPO / "sweeps" / "hydra" / f"{sweep}.yaml").read_text())
        for point in grid(spec["hydra"]["sweeper"]["params"]):
            yield f"+sweep={sweep} " + " ".join(point), [f"+sweep={sweep}", *point]
    for path in WANDB_SWEEPS:
        if yaml.safe_load(path.read_text())["program"] == program:
            for point in wandb_points(path):
                yield f"{path.name} " + " ".join(point), point


def all_points():
    for exp in EXPERIMENTS:
        yield f"experiment={exp}", [f"experiment={exp}"]
    yield from sweep_points(HYDRA_SWEEPS, "train.py")


def test_the_paper_grid_is_complete():
    for size in ("0.5b", "7b"):
        names = {e.split("/")[1] for e in EXPERIMENTS if e.startswith(f"paper_{size}/")}
        assert {"ar_sft", "ar_sft_10ep", "block_diffusion_b4"} <= names
        assert {f"{o}_b{b}" for o in ("mars", "mars_no_sft") for b in (4, 8, 16)} <= names


# Settings whose value the one tiny CPU step never reaches: the epoch count, log and checkpoint cadence (one
# step ends first), the lr and warmup (a number in the same optimizer), the hub id (data.source=jsonl), FSDP's
# options (strategy=auto), the loader's worker count (trained both ways below), the recipe's name (a label the
# config check reads) and the block size (a number in the same two-stream layout, which test_masking.py and
# test_two_stream.py build at many blocks). Points that differ only there take the same code path: the default
# suite trains one of them; -m slow trains every distinct point.
SAME_PATH = {
    "optim": ("lr", "warmup_ratio"),
    "trainer": ("max_epochs", "log_every_n_steps", "fsdp"),
    "data": ("hub_id", "num_workers"),
    "": ("checkpoint_every", "checkpoint_minutes", "recipe", "block"),
}


def settings_key(cfg, same_path: dict[str, tuple[str, ...]]) -> str:
    """The point's settings less names, paths and model ids (one job on the tiny model), less ``same_path``."""
    settings = {
        k: v
        for k, v in OmegaConf.to_container(cfg).items()
        if k not in ("run_name", "output_dir", "export_dir", "model")
    }
    for group, keys in same_path.items():
        for key in keys:
            (settings[group] if group else settings).pop(key, None)
    return OmegaConf.to_yaml(settings)


def train_distinct_points(compose_cfg, tmp_path, same_path) -> dict[str, DictConfig]:
    """Composes and validates every point, and trains one step of each distinct ``settings_key``."""
    points = list(all_points())
    assert len(points) > 30
    seen = {}
    for label, overrides in points:
        cfg = compose_cfg("train", overrides + TINY + [f"data.path={REPO / 'tests/data/tiny_sft.jsonl'}"])
        assert cfg.run_name and cfg.block >= 1, label
        validate(cfg)  # what run() checks first: every point, trained or not, holds valid settings
        key = settings_key(cfg, same_path)
        if key in seen:
            continue
        cfg.output_dir = str(tmp_path / f"p{len(seen)}")
        cfg.export_dir = str(tmp_path / f"p{len(seen)}" / "hf")
        out = run(cfg)
        assert (out / "mars_config.json").is_file(), label
        seen[key] = cfg
    return seen


def test_every_experiment_and_sweep_point_is_valid_and_each_code_path_trains_one_step(compose_cfg, tmp_path):
    trained = train_distinct_points(compose_cfg, tmp_path, SAME_PATH)
    assert len(trained) >= 7  # demo, AR SFT, block diffusion, MARS, MARS without SFT, two budgets
    # the loader's worker count is left out of the key: both ways of loading still train
    workers = {cfg.data.num_workers for cfg in trained.values()}
    assert 0 in workers and any(w > 0 for w in workers), workers


@pytest.mark.slow
def test_every_experiment_and_sweep_point_trains_one_step(compose_cfg, tmp_path):
    assert len(train_distinct_points(compose_cfg, tmp_path, {})) >= 8


def train_export_dirs(compose_cfg) -> dict[str, tuple[int, str]]:
    """export_dir -> (block, objective) of every point of the training sweeps, at the default schedule."""
    dirs = {}
    for _, overrides in all_points():
        if overrides[0].startswith("experiment="):
            continue
        cfg = compose_cfg("train", overrides)
        dirs[cfg.export_dir] = (cfg.block, cfg.objective.name)
    return dirs


def test_every_evaluation_sweep_point_plans_a_checkpoint_a_training_sweep_writes(compose_cfg, tmp_path, monkeypatch):
    exports = train_export_dirs(compose_cfg)
    points = list(sweep_points(HYDRA_EVAL_SWEEPS, "evaluate.py"))
    assert len(points) >= 12
    monkeypatch.chdir(tmp_path)  # checkpoint paths are relative to the working directory, as on the CLI
    folders, checkpoints = set(), set()
    for label, overrides in points:
        cfg = compose_cfg("evaluate", overrides)
        if "+sweep=eval_grid" in overrides:
            assert cfg.benchmarks.name == "paper", label  # the paper's six tasks ...
            # ... whose lm-eval task index takes about 20 s a point to build: the plan is checked on the offline suite
            cfg = compose_cfg("evaluate", [*overrides, "benchmarks=offline"])
        assert cfg.checkpoint in exports, f"{label}: {cfg.checkpoint} is not written by any training sweep"
        block, objective = exports[cfg.checkpoint]
        ckpt = tmp_path / cfg.checkpoint
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "config.json").write_text("{}")
        (ckpt / "mars_config.json").write_text(
            json.dumps({"block_size": block, "objective": objective, "mask_token": "<mask>", "mask_token_id": 0})
        )
        # resolved now that the checkpoint is there (the folder's name reads its block), before prepare()
        folders.add(str(cfg.output_dir))
        checkpoints.add(cfg.checkpoint)
        plan = prepare(cfg, check_results_dir=False)
        assert plan.block_size == block, label
        assert 1.0 in plan.thresholds and len(plan.thresholds) >= 2, label  # the AR reference is always there
        assert str(plan.output_dir).startswith("outputs/eval/"), label
    # each point gets its own results folder
    assert len(folders) == len(checkpoints)


# ------------------------------------------------------------------------------------------------
# The paper's sweeps: launched as dry runs (composition and checks, nothing trained), every point the paper's setup
# ------------------------------------------------------------------------------------------------
def check_paper_point(cfg, experiment: str, stage1_exports: dict[str, str]) -> None:
    size, name = experiment.removeprefix("paper_").split("/")
    assert cfg.model.id == f"qwen2.5-{size}", experiment
    assert cfg.block == int(name.rsplit("_b", 1)[1]), experiment
    assert (cfg.data.source, cfg.data.hub_id, cfg.data.max_length) == ("hub", "allenai/Dolci-Instruct-SFT", 512)
    assert cfg.global_batch == 384 and cfg.recipe == "paper" and cfg.optim.lr == 5.0e-6, experiment
    assert cfg.model.name_or_path == stage1_exports[size], experiment  # the start checkpoint: stage 1's export
    assert cfg.export_dir == f"outputs/train/paper-qwen2.5-{size}-{cfg.objective.name}-b{cfg.block}-e5/hf"


def test_the_paper_sweeps_launch_as_dry_runs_of_the_papers_experiments(
    compose_cfg, tmp_path, monkeypatch, capfd, closed_hub
):
    from mars.cli.train import main

    stage1 = {s: compose_cfg("train", [f"experiment=paper_{s}/ar_sft"]).export_dir for s in ("0.5b", "7b")}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "+sweep=paper_grid", "dry_run=true"])
    main()  # Hydra's multirun: every job composes, is checked and prints its plan; nothing loads
    grid = yaml.safe_load((REPO / "sweeps" / "hydra" / "paper_grid.yaml").read_text())
    experiments = grid["hydra"]["sweeper"]["params"]["experiment"].split(",")
    assert len(experiments) == 14
    for experiment in experiments:
        size, name = experiment.removeprefix("paper_").split("/")
        objective, block = name.rsplit("_b", 1)
        job = tmp_path / "outputs" / "multirun" / "train" / f"paper-qwen2.5-{size}-{objective}-b{block}-e5"
        check_paper_point(OmegaConf.load(job / ".hydra" / "config.yaml"), experiment, stage1)
    wandb = [p for p in WANDB_SWEEPS if p.name == "wandb_paper_grid.yaml"]
    points = [point for path in wandb for point in wandb_points(path)]
    assert [p[0].removeprefix("experiment=") for p in points] == experiments  # the same grid as W&B runs it
    for point in points:  # each as a W&B agent runs it: python train.py <point>
        monkeypatch.setattr(sys, "argv", ["train.py", *point, "dry_run=true", "hydra.run.dir=agent"])
        main()
        check_paper_point(OmegaConf.load(tmp_path / "agent" / ".hydra" / "config.yaml"), point[0][11:], stage1)
    out = capfd.readouterr().out
    assert (
        out.count("plan: global batch 384 = ") == 28 and out.count("would be refused here: model.name_or_path=") == 28
    )
    assert not (tmp_path / "outputs" / "train").exists()  # a dry run writes no run folder
