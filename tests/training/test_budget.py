"""Compute budgets (mars.training.budget): they end a run, drive its lr schedule, survive a kill, refuse nonsense."""

import json
import math

import pytest
import torch
from test_train_resume import StopAfter

from mars.models import build_tiny_random, embedded_tokenizer, load_model
from mars.training.budget import BudgetSettings
from mars.training.budget_callback import ComputeBudget
from mars.training.module import budget_lr_factor
from mars.training.run import run


def test_a_budget_ends_training_and_the_export_counts_as_complete(compose_cfg, tiny_train_overrides, tmp_path):
    # the CPU clock: another process loading the machine slows the run but does not shorten it
    cfg = compose_cfg("train", tiny_train_overrides + ["budget.minutes=0.05", "budget.clock=cpu"])
    run(cfg)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["complete"] and summary["global_step"] > 1
    assert summary["budget"]["used_minutes"] >= 0.05 and summary["budget"]["clock"] == "cpu"
    assert summary["tokens_seen"] > summary["response_tokens_seen"] > 0


def test_a_gated_adapter_run_under_a_budget_exports_an_adapter_that_decodes_like_the_base(
    compose_cfg, tiny_train_overrides, tmp_path
):
    from mars.decoding import generate

    cfg = compose_cfg(
        "train",
        tiny_train_overrides
        + ["adapter=gated_lora", "objective=mars_gated", "adapter.rank=4", "budget.minutes=0.03", "budget.clock=wall"],
    )
    out = run(cfg)
    files = {p.name for p in out.iterdir()}
    assert "mars_adapter.json" in files and "model.safetensors" not in files
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert all("lora_" in k or "mask_embedding" in k for k in ckpt["state_dict"])  # trainable tensors only
    adapted, base = load_model(str(out)), load_model("tiny-random")
    prompts = ["hello there", "what is two and two"]
    tau1 = generate(adapted.model, adapted.tokenizer, prompts, threshold=1.0, block_size=4, max_new_tokens=12)
    verify = generate(adapted.model, adapted.tokenizer, prompts, verify=True, block_size=4, max_new_tokens=12)
    ar = generate(base.model, base.tokenizer, prompts, decoder="ar", max_new_tokens=12)
    assert tau1.token_ids == ar.token_ids == verify.token_ids


def test_a_killed_budget_run_resumes_with_the_budget_it_had_left(compose_cfg, tiny_train_overrides, tmp_path):
    over = tiny_train_overrides + ["budget.minutes=0.5", "budget.clock=wall", "checkpoint_every=1"]
    with pytest.raises(StopAfter.Killed):
        run(compose_cfg("train", over), callbacks=[StopAfter(2)])
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    used = ckpt["callbacks"]["ComputeBudget"]["used"]
    assert 0 < used < 30
    budget = ComputeBudget(BudgetSettings(minutes=0.5, clock="wall"))
    budget.load_state_dict(ckpt["callbacks"]["ComputeBudget"])
    assert budget.progress() == pytest.approx(used / 30)


def test_budget_lr_schedule_warms_up_then_decays_to_zero_at_the_budgets_end():
    state = {"p": 0.0}
    factor = budget_lr_factor(lambda: state["p"], warmup_ratio=0.1)
    values = {}
    for p in (0.05, 0.1, 0.55, 1.0):
        state["p"] = p
        values[p] = factor(0)
    assert values[0.05] == pytest.approx(0.5)
    assert values[0.1] == pytest.approx(1.0)
    assert values[0.55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[1.0] == pytest.approx(0.0, abs=1e-9)


def test_a_budget_too_small_for_one_step_is_refused_before_the_model_loads(compose_cfg, tmp_path):
    folder = tmp_path / "model"
    build_tiny_random().save_pretrained(folder)
    embedded_tokenizer().save_pretrained(folder)
    over = [
        f"model.name_or_path={folder}",
        "data=jsonl",
        "data.path=tests/data/tiny_sft.jsonl",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
        "budget.minutes=0.0001",
    ]
    with pytest.raises(ValueError, match="budget.minutes .* too small for one training step"):
        run(compose_cfg("train", over))
    over[-1] = "+trainer.max_time=00:00:00:00.01"
    with pytest.raises(ValueError, match="trainer.max_time .* too small for one training step"):
        run(compose_cfg("train", over))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "bad,match", [({"minutes": 0}, "budget.minutes"), ({"minutes": 5, "clock": "gpu"}, "budget.clock")]
)
def test_bad_budgets_fail_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        BudgetSettings(**bad)


def test_snapshots_are_exported_at_their_share_of_the_budget_for_a_learning_curve(
    compose_cfg, tiny_train_overrides, tmp_path
):
    over = tiny_train_overrides + [
        "adapter=gated_lora",
        "objective=mars_gated",
        "adapter.rank=2",
        "budget.minutes=0.04",
        "budget.clock=wall",
        "budget.snapshots=[0.01,0.02]",
    ]
    run(compose_cfg("train", over))
    snaps = sorted((tmp_path / "run" / "snapshots").iterdir())
    assert [p.name for p in snaps] == ["0.01min", "0.02min"]
    metas = [json.loads((p / "mars_config.json").read_text()) for p in snaps]
    assert [m["snapshot_minutes"] for m in metas] == [0.01, 0.02]
    assert not any(m["complete"] for m in metas)
    assert 0 < metas[0]["global_step"] <= metas[1]["global_step"]
    assert load_model(str(snaps[0])).metadata["snapshot_minutes"] == 0.01


def test_snapshots_outside_the_budget_are_refused():
    with pytest.raises(ValueError, match="within budget.minutes"):
        BudgetSettings(minutes=1, snapshots=(0.5, 2))


def test_a_budget_too_small_for_one_step_of_the_embedded_model_is_refused_on_a_fresh_cache(
    compose_cfg, tmp_path, monkeypatch
):
    """The first run has no converted model to read the size from; it is refused all the same, before the
    GGUF is converted, as every later run is."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MARS_CACHE", str(cache))
    over = [
        "trainer=cpu",
        "data=jsonl",
        "data.path=tests/data/tiny_sft.jsonl",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
        "budget.minutes=1e-9",
    ]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"budget.minutes .* too small for one training step.* 135M-parameter"):
            run(compose_cfg("train", over))
    assert not (cache / "smollm2-135m-instruct").exists()
    assert not (tmp_path / "run").exists()
