"""End-to-end training through train.py's code path on a tiny model: export round trip, resume,
objectives, bad input."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars.data import LengthGroupedSampler
from mars.models import read_mars_metadata
from mars.train import run

from conftest import REPO, TINY_SFT


def test_train_exports_a_vanilla_hf_checkpoint_with_same_parameter_count(compose_cfg, tiny_train_overrides, tmp_path):
    cfg = compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "block=3"])
    out = run(cfg)
    meta = read_mars_metadata(out)
    assert meta["block_size"] == 3 and meta["objective"] == "mars" and meta["complete"]
    assert meta["mask_token"] == "<empty_output>" and meta["mask_token_policy"] == "reused"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.mask_token == "<empty_output>" and tok.mask_token_id == meta["mask_token_id"]
    assert sum(p.numel() for p in model.parameters()) == meta["base_num_parameters"] == meta["num_parameters"]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 2
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "loss_curve.png").is_file()
    # identical logits after the round trip through the saved directory
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()}
    ids = torch.tensor([[5, 17, 200, 3000, 42, 7]])
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    fresh = AutoModelForCausalLM.from_pretrained(out).eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, fresh(ids).logits)


def test_a_finished_run_is_skipped_and_a_killed_run_resumes_without_losing_steps(compose_cfg, tiny_train_overrides, tmp_path):
    base = tiny_train_overrides + ["checkpoint_every=1", "data.batch_size=2"]
    run(compose_cfg("train", base + ["trainer.max_steps=2"]))
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    assert ckpt["InstructionDataModule"] == {"epoch": 0, "batches_done": 2, "world_size": 1}
    # "kill" = the export never happened; the same command with more steps resumes from last.ckpt
    import shutil

    shutil.rmtree(tmp_path / "run" / "hf")
    run(compose_cfg("train", base + ["trainer.max_steps=4"]))
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["steps_this_run"] == 2
    # now finished: a rerun is skipped, not retrained
    before = (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns
    run(compose_cfg("train", base + ["trainer.max_steps=4"]))
    assert (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns == before


def test_length_grouped_sampler_resumes_on_the_next_unseen_batch():
    lengths = [5, 9, 3, 12, 7, 7, 1, 30, 2, 11, 6]
    s = LengthGroupedSampler(lengths, batch_size=2, seed=1, group=2)
    s.set_epoch(3)
    full = list(s)
    assert sorted(full) == list(range(len(lengths)))
    resumed = LengthGroupedSampler(lengths, batch_size=2, seed=1, group=2)
    resumed.set_epoch(3)
    resumed.resume_at = (3, 2)
    first = list(resumed)
    assert first[: len(full) - 4] == full[4:] and len(first) == len(full)  # the trained batches come last
    assert list(resumed) == full  # the skip applies to the interrupted epoch's first pass only
    s.set_epoch(4)
    assert list(s) != full  # a new order every epoch

def test_ddp_resume_skips_every_rank_past_the_batches_all_ranks_trained():
    """Lightning deals one sampler order out to the ranks (DistributedSamplerWrapper); after a restart at
    step k each rank must continue exactly where it stopped, not replay its neighbours' batches."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from mars.data import InstructionDataModule
    from mars.models import embedded_tokenizer

    def rank_indices(state, rank):
        dm = InstructionDataModule(embedded_tokenizer(), source="jsonl", path=str(TINY_SFT), batch_size=2)
        if state:
            dm.load_state_dict(state)
        sampler = dm.train_dataloader().sampler
        return list(DistributedSamplerWrapper(sampler, num_replicas=2, rank=rank, shuffle=False))

    for rank in (0, 1):
        uninterrupted = rank_indices(None, rank)
        resumed = rank_indices({"epoch": 0, "batches_done": 1, "world_size": 2}, rank)
        assert len(resumed) == len(uninterrupted)
        assert resumed[: len(uninterrupted) - 2] == uninterrupted[2:]  # one step of batch 2 was trained here


def test_length_grouped_batches_have_similar_lengths():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(400)]
    order = list(LengthGroupedSampler(lengths, batch_size=8, seed=0, group=16))

    def spread(idx):
        batches = [idx[i:i + 8] for i in range(0, len(idx), 8)]
        return sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches) / len(batches)

    shuffled = list(range(400))
    rng.shuffle(shuffled)
    assert spread(order) < 0.25 * spread(shuffled)


@pytest.mark.parametrize("override,match", [
    ("block=0", "block must be"),
    ("objective.alpha=-0.5", "alpha must be >= 0"),
    ("objective.name=ntp", "unknown objective"),
    ("mask_schedule.name=cosine", "mask_schedule must be one of"),
])
def test_bad_config_fails_before_loading_anything(compose_cfg, tiny_train_overrides, override, match):
    cfg = compose_cfg("train", tiny_train_overrides + [override, "model.name_or_path=/nonexistent"])
    with pytest.raises(ValueError, match=match):
        run(cfg)


def test_row_without_messages_or_prompt_fails_clearly(compose_cfg, tiny_train_overrides, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    cfg = compose_cfg("train", tiny_train_overrides + [f"data.path={bad}"])
    with pytest.raises(ValueError, match=r"row 1 has neither 'messages' nor 'prompt'/'response'.*question"):
        run(cfg)


def test_empty_dataset_after_filtering_fails_clearly(compose_cfg, tiny_train_overrides):
    # 24 tokens hold only the system prompt: no response token survives truncation
    cfg = compose_cfg("train", tiny_train_overrides + ["data.max_length=24"])
    with pytest.raises(ValueError, match="empty after filtering"):
        run(cfg)


def test_ddp_with_two_cpu_processes(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "train.py", "model=tiny-random", "data=jsonl", f"data.path={TINY_SFT}",
           "data.batch_size=2", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=2", "logger=none", f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 2
    assert read_mars_metadata(out / "hf")["complete"]
    assert "world_size=2" in proc.stderr or "distributed_backend=gloo" in proc.stderr or "Initializing distributed" in proc.stderr


def test_wandb_logger_runs_offline_without_credentials(compose_cfg, tiny_train_overrides, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from mars.models import cache_root

    monkeypatch.setenv("MARS_CACHE", str(cache_root()))  # keep the converted model cache when HOME moves
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: must not prompt
    overrides = [o for o in tiny_train_overrides if not o.startswith("logger=")]
    cfg = compose_cfg("train", overrides + ["logger=wandb", "trainer.max_steps=2"])
    run(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
