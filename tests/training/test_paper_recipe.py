"""The paper's recipe at GPU scale, checked on a CPU: a model of the paper without its recipe is refused naming
the experiment to use, the paper's experiments compose the paper's keys, the global batch derives its
accumulation from the processes present, stage 2 without stage 1 is refused naming the command that makes it,
hub data that cannot be reached is refused at once naming the fetch command (no traceback from train.py), a
dataset folder trains offline, and every run states its plan first and its cost after its first steps."""

import json
import sys
import time

import pytest
from conftest import TINY_SFT

from mars.training.config import TrainConfig, check_recipe, derive_accumulation, validate
from mars.training.refusals import BatchMismatch, DataUnreachable, RecipeMissing, StageMissing
from mars.training.run import run

PAPER_KEYS = {
    "data.source": "hub",
    "data.hub_id": "allenai/Dolci-Instruct-SFT",
    "data.max_length": 512,
    "global_batch": 384,
    "optim.lr": 5.0e-6,
    "optim.schedule": "cosine",
    "optim.warmup_ratio": 0.03,
    "trainer.precision": "bf16-mixed",
    "recipe": "paper",
}
STAGE2 = [f"{o}_b{b}" for o in ("mars", "mars_no_sft") for b in (4, 8, 16)] + ["block_diffusion_b4"]


def value(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the refusals below come before."""
    import mars.models
    import mars.training.run

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(mars.models, "load_model", refuse)
    monkeypatch.setattr(mars.training.run, "load_model", refuse)


@pytest.mark.parametrize("size", ["7b", "0.5b"])
def test_the_headline_command_on_a_paper_model_is_refused_in_one_line_naming_the_papers_experiments(
    compose_cfg, size, no_model_loads, tmp_path
):
    cfg = compose_cfg("train", [f"model=qwen2.5-{size}", "block=4", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(RecipeMissing) as refused:
        run(cfg)
    message = str(refused.value)
    assert "\n" not in message
    for named in (
        f"model=qwen2.5-{size}",
        "data offline",
        "a global batch of 8",
        "gradient checkpointing off",
        f"python train.py experiment=paper_{size}/mars_b4",
        f"experiment=paper_{size}/ar_sft",
        f"python scripts/paper_pipeline.py --model {size}",
        "recipe=custom",
    ):
        assert named in message, named
    assert not (tmp_path / "run").exists()
    # stage 1 by its objective, and a block of the paper's grid by its block
    stage1 = compose_cfg("train", [f"model=qwen2.5-{size}", "objective=ar"])
    with pytest.raises(RecipeMissing, match=f"experiment=paper_{size}/ar_sft \\(stage 1\\)"):
        validate(stage1)
    b16 = compose_cfg("train", [f"model=qwen2.5-{size}", "objective=mars_no_sft", "block=16"])
    with pytest.raises(RecipeMissing, match=f"experiment=paper_{size}/mars_no_sft_b16 "):
        validate(b16)
    custom = compose_cfg("train", [f"model=qwen2.5-{size}", "recipe=custom"])
    check_recipe(TrainConfig.of(custom), processes=1)  # knowingly these settings: no refusal


@pytest.mark.parametrize("size", ["7b", "0.5b"])
def test_the_paper_experiments_compose_the_papers_recipe_from_the_stage_one_export(compose_cfg, size):
    stage1 = compose_cfg("train", [f"experiment=paper_{size}/ar_sft"])
    assert stage1.objective.name == "ar" and stage1.model.name_or_path == f"Qwen/Qwen2.5-{size.upper()}-Instruct"
    for name in ["ar_sft", "ar_sft_10ep", *STAGE2]:
        cfg = compose_cfg("train", [f"experiment=paper_{size}/{name}"])
        for key, expected in PAPER_KEYS.items():
            assert value(cfg, key) == expected, (name, key)
        assert cfg.trainer.max_epochs == (10 if name == "ar_sft_10ep" else 5), name
        assert cfg.checkpoint_minutes == 30 and cfg.trainer.devices == -1, name
        if size == "7b":
            assert cfg.trainer.strategy == "fsdp" and cfg.gradient_checkpointing, name
            assert cfg.trainer.fsdp.state_dict_type == "sharded" and cfg.data.batch_size == 4, name
        else:
            assert cfg.trainer.strategy == "ddp" and cfg.data.batch_size == 8, name
        if name in STAGE2:  # stage 2 starts from the export stage 1 writes, and names the command that writes it
            assert cfg.model.name_or_path == stage1.export_dir, name
            assert f"python train.py experiment=paper_{size}/ar_sft" in cfg.model.made_by, name
            assert cfg.block == int(name.rsplit("_b", 1)[1]), name


def test_the_global_batch_derives_the_accumulation_from_the_processes_present(compose_cfg):
    for size, rows, processes, accumulation in (("7b", 4, 8, 12), ("0.5b", 8, 8, 6), ("0.5b", 8, 16, 3)):
        cfg = compose_cfg("train", [f"experiment=paper_{size}/mars_b4"])
        derive_accumulation(cfg, TrainConfig.of(cfg), processes)
        assert cfg.trainer.accumulate_grad_batches == accumulation
        assert rows * processes * cfg.trainer.accumulate_grad_batches == 384
    cfg = compose_cfg("train", ["experiment=paper_7b/mars_b4"])
    with pytest.raises(BatchMismatch, match=r"data.batch_size=4 x 64 process\(es\) .* = 256: use data.batch_size=3"):
        derive_accumulation(cfg, TrainConfig.of(cfg), 64)  # 384 = 3 x 64 x 2
    with pytest.raises(BatchMismatch, match=r"x 5 process\(es\) .* = 20: .*a multiple of 5 \(e.g. 380\)"):
        derive_accumulation(cfg, TrainConfig.of(cfg), 5)
    cfg = compose_cfg("train", ["experiment=paper_7b/mars_b4", "trainer.accumulate_grad_batches=4"])
    with pytest.raises(BatchMismatch, match="needs trainer.accumulate_grad_batches=12 on 8 process"):
        derive_accumulation(cfg, TrainConfig.of(cfg), 8)


def test_stage_two_without_stage_one_is_refused_naming_the_stage_one_command_before_any_model_loads(
    compose_cfg, tmp_path, monkeypatch, no_model_loads
):
    monkeypatch.chdir(tmp_path)  # no outputs/train/paper-... here
    cfg = compose_cfg("train", ["experiment=paper_0.5b/mars_b4", "trainer.accelerator=cpu", "trainer.devices=1"])
    began = time.monotonic()
    with pytest.raises(StageMissing) as refused:
        run(cfg)
    assert time.monotonic() - began < 15
    assert "model.name_or_path=outputs/train/paper-qwen2.5-0.5b-ar-b4-e5/hf" in str(refused.value)
    assert "make it first with python train.py experiment=paper_0.5b/ar_sft" in str(refused.value)
    # a stage 1 that has not finished: rerun it (it resumes)
    stage1 = tmp_path / "outputs" / "train" / "paper-qwen2.5-0.5b-ar-b4-e5" / "hf"
    stage1.mkdir(parents=True)
    (stage1 / "mars_config.json").write_text(
        json.dumps({"block_size": 4, "objective": "ar", "mask_token": "<m>", "mask_token_id": 1, "complete": False})
    )
    with pytest.raises(StageMissing, match="has not finished: rerun python train.py experiment=paper_0.5b/ar_sft"):
        run(cfg)


def test_train_py_prints_a_refusal_as_one_line_without_a_traceback(tmp_path, monkeypatch, capfd):
    from mars.cli.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "experiment=paper_7b/mars_b16", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: model.name_or_path=outputs/train/paper-qwen2.5-7b-ar-b4-e5/hf")
    assert "experiment=paper_7b/ar_sft" in lines[-1] and "Traceback" not in err


def test_unreachable_hub_data_is_refused_at_once_naming_the_fetch_command(compose_cfg, closed_hub, tmp_path):
    cfg = compose_cfg(
        "train", ["model=tiny-random", "data=dolci", "trainer.precision=32-true", f"output_dir={tmp_path / 'run'}"]
    )
    began = time.monotonic()
    with pytest.raises(DataUnreachable) as refused:
        validate(cfg)
    assert time.monotonic() - began < 15
    message = str(refused.value)
    assert "allenai/Dolci-Instruct-SFT" in message and "http://127.0.0.1:9" in message and "\n" not in message
    assert "python -m mars.training.fetch --out <folder> --dataset allenai/Dolci-Instruct-SFT" in message
    assert "data=dolci_local data.path=<folder>/datasets/allenai/Dolci-Instruct-SFT" in message


def test_a_fetched_dataset_folder_trains_without_the_hub(compose_cfg, tmp_path, closed_hub):
    import datasets

    from mars.metadata import is_complete
    from mars.training.data import read_jsonl
    from mars.training.fetch import dataset_folder, save_dataset, train_overrides

    hub = tmp_path / "hub"
    rows = [  # one form in every row, as a hub dataset has it
        r
        if "messages" in r
        else {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]}
        for r in read_jsonl(TINY_SFT)
    ]
    folder = save_dataset(datasets.Dataset.from_list(rows), dataset_folder(hub, "org/sft"))
    assert train_overrides(hub, "org/sft", []) == [f"data=dolci_local data.path={folder}"]
    overrides = [
        "model=tiny-random",
        "data=dolci_local",
        f"data.path={folder}",
        "data.batch_size=4",
        "data.num_workers=0",
        "trainer.precision=32-true",
        "trainer.max_steps=2",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
    ]
    out = run(compose_cfg("train", overrides))
    assert is_complete(out)
    fingerprint = json.loads((tmp_path / "run" / "fingerprint.json").read_text())
    assert fingerprint["data"]["source"] == "disk" and len(fingerprint["data"]["content"]) == 64
    missing = compose_cfg("train", overrides[:2] + [f"data.path={tmp_path / 'nothing'}"] + overrides[3:])
    with pytest.raises(FileNotFoundError, match="python -m mars.training.fetch"):
        validate(missing)


def test_a_dry_run_prints_the_plan_and_what_is_missing_and_writes_nothing(compose_cfg, tmp_path, capsys, closed_hub):
    cfg = compose_cfg("train", ["experiment=paper_7b/mars_b8", f"output_dir={tmp_path / 'run'}", "dry_run=true"])
    assert run(cfg) == tmp_path / "run" / "hf"
    out = capsys.readouterr().out
    assert (
        "plan: paper-qwen2.5-7b-mars-b8-e5 (recipe paper): mars B=8 from outputs/train/paper-qwen2.5-7b-ar-b4-e5/hf"
        in out
    )
    assert "global batch 384 = 4 rows x 1 process(es) x 96 accumulation" in out
    assert "strategy fsdp (FULL_SHARD, sharded checkpoints); gradient checkpointing on" in out
    assert "checkpoints every 30 minutes and at the end" in out
    assert "would be refused here: model.name_or_path=outputs/train/paper-qwen2.5-7b-ar-b4-e5/hf" in out
    assert "would be refused here: data.hub_id=allenai/Dolci-Instruct-SFT" in out
    assert not (tmp_path / "run").exists()


def test_a_run_states_its_plan_first_and_its_cost_after_the_first_steps(
    compose_cfg, tiny_train_overrides, tmp_path, caplog
):
    from mars.training.export import read_lightning_checkpoint

    overrides = tiny_train_overrides + ["global_batch=8", "trainer.max_steps=7", "checkpoint_every=100"]
    with caplog.at_level("INFO"):
        run(compose_cfg("train", overrides))
    said = [r.getMessage() for r in caplog.records]
    plan = [line for line in said if line.startswith("plan: ")]
    assert plan and said.index(plan[0]) < next(i for i, s in enumerate(said) if s.startswith("cost: "))
    assert any("data jsonl" in line and "10 rows" in line for line in plan)
    assert any("global batch 8 = 4 rows x 1 process(es) x 2 accumulation; 7 optimizer steps" in line for line in plan)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    estimate = summary["cost_estimate"]
    assert estimate["seconds_per_step"] > 0 and estimate["steps_left"] == 1 and estimate["processes"] == 1
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "accumulate_grad_batches: 2" in config  # derived, and recorded with the run
    # no periodic checkpoint in 7 steps at checkpoint_every=100: the last step is saved at the end
    assert read_lightning_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")[1]["global_step"] == 7


def test_a_minute_cadence_is_lightnings_time_interval(tmp_path):
    from mars.training.checkpointing import checkpoint_callback

    by_time = checkpoint_callback(tmp_path, 25, 30)
    assert by_time._train_time_interval.total_seconds() == 1800 and by_time._every_n_train_steps == 0
    assert checkpoint_callback(tmp_path, 25, None)._every_n_train_steps == 25


def test_the_offline_data_config_reads_the_folder_the_fetch_command_writes(compose_cfg):
    from mars.training.fetch import DATASET, dataset_folder

    cfg = compose_cfg("train", ["experiment=paper_7b/mars_b4", "data=dolci_local"])
    assert cfg.data.source == "disk" and cfg.data.path == str(dataset_folder("hub", DATASET))
    assert cfg.data.max_length == 512 and cfg.data.batch_size == 4  # the experiment's values still apply
