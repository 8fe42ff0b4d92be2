"""scripts/paper_pipeline.py: stage 1 -> stage 2 from stage 1's export -> the evaluation of both, each stage a
train.py or evaluate.py command, skipped when its result is complete (so a rerun resumes the sequence)."""

import json

import pytest
from conftest import REPO, TINY_SFT
from module_loading import load_module

pipeline = load_module(REPO / "scripts" / "paper_pipeline.py", "paper_pipeline")


def commands(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("python ")]


def test_the_dry_run_is_the_papers_sequence_stage_two_from_stage_ones_export(tmp_path, capsys):
    argv = ["--model", "7b", "--stage2", "mars_b4,mars_b16", "--root", str(tmp_path), "--dry-run"]
    assert pipeline.main(argv) == 0
    lines = commands(capsys.readouterr().out)
    stage1 = "outputs/train/paper-qwen2.5-7b-ar-b4-e5/hf"
    assert lines[0].endswith("train.py experiment=paper_7b/ar_sft")
    assert lines[1].endswith(f"train.py experiment=paper_7b/mars_b4 model.name_or_path={stage1}")
    assert lines[2].endswith(f"train.py experiment=paper_7b/mars_b16 model.name_or_path={stage1}")
    assert f"evaluate.py checkpoint={stage1} benchmarks=paper thresholds=[1.0]" in lines[3]
    for line, run in zip(lines[4:], ("paper-qwen2.5-7b-mars-b4-e5", "paper-qwen2.5-7b-mars-b16-e5")):
        assert f"checkpoint=outputs/train/{run}/hf benchmarks=paper thresholds=[1.0,0.95]" in line
    assert len(lines) == 6 and not (tmp_path / "outputs").exists()


def test_finished_stages_are_skipped_and_offline_folders_feed_both_stages(tmp_path, capsys):
    stage1 = tmp_path / "outputs" / "train" / "paper-qwen2.5-0.5b-ar-b4-e5" / "hf"
    stage1.mkdir(parents=True)
    (stage1 / "mars_config.json").write_text(
        json.dumps({"block_size": 4, "objective": "ar", "mask_token": "<m>", "mask_token_id": 1, "complete": True})
    )
    argv = ["--model", "0.5b", "--root", str(tmp_path), "--hub-dir", "/shared/hub", "--skip-eval", "--dry-run"]
    assert pipeline.main(argv) == 0
    out = capsys.readouterr().out
    assert "=== stage1: done already, skipped" in out
    data = "data=dolci_local data.path=/shared/hub/datasets/allenai/Dolci-Instruct-SFT"
    assert (
        f"experiment=paper_0.5b/ar_sft {data} model.name_or_path=/shared/hub/models/Qwen/Qwen2.5-0.5B-Instruct" in out
    )
    assert f"=== stage2-mars_b4: python {REPO / 'train.py'} experiment=paper_0.5b/mars_b4 {data}" in out


def test_a_bad_override_stops_the_pipeline_before_any_stage(tmp_path, capsys):
    with pytest.raises(Exception, match="block"):
        pipeline.main(["--model", "0.5b", "--root", str(tmp_path), "--dry-run", "block=0"])
    assert "===" not in capsys.readouterr().out


TINY = [
    "model.name_or_path=tiny-random",
    "data=jsonl",
    f"data.path={TINY_SFT}",
    "data.batch_size=2",
    "data.num_workers=0",
    "global_batch=null",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.strategy=auto",
    "trainer.precision=32-true",
    "trainer.max_steps=2",
    "gradient_checkpointing=false",
    "logger=none",
]


@pytest.mark.slow
def test_the_pipeline_runs_stage_one_stage_two_and_the_evaluation_and_a_rerun_skips_them(tmp_path, capsys):
    """Four subprocesses on the tiny model (about two minutes on 2 vCPUs)."""
    argv = ["--model", "0.5b", "--root", str(tmp_path), "--benchmarks", "quality", "--thresholds", "1.0,0.9"]
    argv += ["--eval-override", "limit=1", "--eval-override", "decoding.max_new_tokens=4", *TINY]
    assert pipeline.main(argv) == 0
    train = tmp_path / "outputs" / "train"
    stage2 = json.loads((train / "paper-qwen2.5-0.5b-mars-b4-e5" / "hf" / "mars_config.json").read_text())
    assert stage2["complete"] and stage2["base_model"].endswith("paper-qwen2.5-0.5b-ar-b4-e5/hf")
    points = json.loads(
        (tmp_path / "outputs" / "eval" / "paper-qwen2.5-0.5b-mars-b4-e5-quality" / "points.json").read_text()
    )
    assert {p["threshold"] for p in points} == {1.0, 0.9}
    capsys.readouterr()
    assert pipeline.main(argv) == 0
    assert capsys.readouterr().out.count("done already, skipped") == 4
