"""End-to-end training through train.py's code path on a tiny model: export round trip, resume,
objectives, bad input."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import REPO, TINY_SFT
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars.models import read_mars_metadata
from mars.training.data import LengthGroupedSampler
from mars.training.run import run


def test_train_exports_a_vanilla_hf_checkpoint_with_same_parameter_count(compose_cfg, tiny_train_overrides, tmp_path):
    cfg = compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "block=3"])
    out = run(cfg)
    meta = read_mars_metadata(out)
    assert meta["block_size"] == 3 and meta["objective"] == "mars" and meta["complete"]
    assert meta["alpha"] == 1.0 and meta["intra_block"] == "causal" and meta["global_step"] == 2
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
    state = {k[len("model.") :]: v for k, v in ckpt["state_dict"].items()}
    ids = torch.tensor([[5, 17, 200, 3000, 42, 7]])
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    fresh = AutoModelForCausalLM.from_pretrained(out).eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, fresh(ids).logits)


def test_a_finished_run_is_skipped_and_a_killed_run_resumes_without_losing_steps(
    compose_cfg, tiny_train_overrides, tmp_path
):
    from test_train_resume import StopAfter

    base = tiny_train_overrides + ["checkpoint_every=1", "data.batch_size=2", "trainer.max_steps=4"]
    with pytest.raises(StopAfter.Killed):
        run(compose_cfg("train", base), callbacks=[StopAfter(2)])
    assert not (tmp_path / "run" / "hf").exists()  # killed: nothing exported
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    # the data loader's position is its StatefulDataLoader state: epoch 0, 2 batches of 2 rows trained
    state = ckpt["InstructionDataModule"]["loader"]["_sampler_iter_state"]["sampler_state"]
    assert state == {"epoch": 0, "yielded": 4}
    # the same command resumes from last.ckpt
    run(compose_cfg("train", base))
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["steps_this_run"] == 2 and summary["complete"]
    # now finished: a rerun is skipped, not retrained
    before = (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns
    run(compose_cfg("train", base))
    assert (tmp_path / "run" / "hf" / "model.safetensors").stat().st_mtime_ns == before


def test_length_grouped_sampler_resumes_on_the_next_unseen_batch():
    lengths = [5, 9, 3, 12, 7, 7, 1, 30, 2, 11, 6]  # 11 rows in batches of 2: the partial batch goes last
    s = LengthGroupedSampler(lengths, batch_size=2, seed=1, group=2)
    s.set_epoch(3)
    full = list(s)
    assert sorted(full) == list(range(len(lengths))) and len(full) == len(s)
    assert s.state_dict() == {"epoch": 3, "yielded": 11}
    resumed = LengthGroupedSampler(lengths, batch_size=2, seed=1, group=2)
    resumed.load_state_dict({"epoch": 3, "yielded": 4})  # two batches trained
    resumed.set_epoch(3)  # Lightning sets the epoch before the first index is drawn
    assert list(resumed) == full[4:]  # the rest of the epoch, partial batch included, nothing twice
    assert list(resumed) == full  # the skip applies to the interrupted epoch's first pass only
    # a state saved on an epoch's last batch: Lightning goes on with the next epoch, which is whole
    after_end = LengthGroupedSampler(lengths, batch_size=2, seed=1, group=2)
    after_end.load_state_dict({"epoch": 3, "yielded": 11})
    assert after_end.epoch == 4
    s.set_epoch(4)
    assert list(after_end) == list(s) != full  # a new order every epoch


def test_data_parallel_ranks_get_whole_batches_and_resume_where_they_stopped():
    """Under DDP every rank takes whole length-grouped batches of one shared order (padded so every rank
    runs the same number of steps); after a restart at step k each rank continues exactly where it stopped."""
    lengths = [5, 9, 3, 12, 7, 7, 1, 30, 2, 11, 6]  # 6 batches of 2, the last one partial

    def batches(sampler):
        order = list(sampler)
        return [order[i : i + 2] for i in range(0, len(order), 2)]  # as the data loader cuts them

    ref = batches(LengthGroupedSampler(lengths, batch_size=2, seed=0))
    ranks = [LengthGroupedSampler(lengths, batch_size=2, seed=0, num_replicas=3, rank=r) for r in range(3)]
    per_rank = [batches(r) for r in ranks]
    assert [len(b) for b in per_rank] == [2, 2, 2] and [len(r) for r in ranks] == [4, 4, 3]
    assert [b for step in zip(*per_rank) for b in step] == ref  # dealt out in order, whole batches
    for rank in range(3):
        resumed = LengthGroupedSampler(lengths, batch_size=2, seed=0, num_replicas=3, rank=rank)
        resumed.load_state_dict({"epoch": 0, "yielded": 2})  # rank 0's state after one step
        assert batches(resumed) == per_rank[rank][1:]
    four = [LengthGroupedSampler(lengths, batch_size=2, seed=0, num_replicas=4, rank=r) for r in range(4)]
    assert [len(batches(r)) for r in four] == [2, 2, 2, 2]  # 6 batches padded to 8
    assert all(len(list(r)) == len(r) for r in four)


def test_length_grouped_batches_have_similar_lengths():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(400)]
    order = list(LengthGroupedSampler(lengths, batch_size=8, seed=0, group=16))

    def spread(idx):
        batches = [idx[i : i + 8] for i in range(0, len(idx), 8)]
        return sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches) / len(batches)

    shuffled = list(range(400))
    rng.shuffle(shuffled)
    assert spread(order) < 0.25 * spread(shuffled)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ("block=0", "block must be"),
        ("objective.alpha=-0.5", "alpha must be >= 0"),
        ("objective.name=ntp", "unknown objective"),
        ("mask_schedule.name=cosine", "mask_schedule must be one of"),
        ("mask_schedule=random_ratio mask_schedule.min_ratio=0.9 mask_schedule.max_ratio=0.5", "random_ratio needs"),
        ("mask_schedule=linear_ramp mask_schedule.ramp_fraction=0", "linear_ramp needs"),
        ("optim.warmup_ratio=1.5", r"optim.warmup_ratio must be in \[0, 1\)"),
        ("optim.lr=0", "optim.lr must be"),
        ("trainer.max_steps=0", "trains nothing"),
        ("trainer.max_epochs=0", "trains nothing"),
        ("data.max_length=1", "data.max_length must be an integer >= 2"),
        ("data.batch_size=0", "data.batch_size must be"),
        ("checkpoint_every=0", "checkpoint_every must be"),
        ("data.path=/nonexistent/rows.jsonl", "data.path='/nonexistent/rows.jsonl' is not a file"),
        ("data.source=csv", "data.source must be one of"),
    ],
)
def test_bad_config_fails_before_loading_anything(compose_cfg, tiny_train_overrides, overrides, match, tmp_path):
    not_a_model = tmp_path / "not_a_model"  # would fail only when loading: validation must come first
    not_a_model.mkdir()
    cfg = compose_cfg("train", tiny_train_overrides + overrides.split() + [f"model.name_or_path={not_a_model}"])
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run(cfg)
    assert not (tmp_path / "run").exists()  # nothing written for a refused request


def test_a_folder_that_is_not_a_model_is_named_before_anything_loads(compose_cfg, tiny_train_overrides, tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    cfg = compose_cfg("train", tiny_train_overrides + [f"model.name_or_path={folder}"])
    with pytest.raises(ValueError, match=r"weights.* is a folder without config.json.*not a Hugging Face model"):
        run(cfg)


def test_row_without_messages_or_prompt_fails_clearly(compose_cfg, tiny_train_overrides, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    cfg = compose_cfg("train", tiny_train_overrides + [f"data.path={bad}"])
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2 has neither 'messages' nor 'prompt'/'response'.*question"):
        run(cfg)


def test_empty_dataset_after_filtering_fails_clearly(compose_cfg, tiny_train_overrides):
    # 24 tokens hold only the system prompt: no response token survives truncation
    cfg = compose_cfg("train", tiny_train_overrides + ["data.max_length=24"])
    with pytest.raises(ValueError, match="empty after filtering"):
        run(cfg)


@pytest.mark.slow
def test_ddp_with_two_cpu_processes(tmp_path):
    """Lightning's DDP through train.py on 2 processes; the default suite's 2-process train.py run is FSDP's
    (tests/training/test_train_fsdp.py), the strategy this project adds code to."""
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "train.py",
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=2",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.max_steps=2",
        "logger=none",
        f"output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 2
    assert read_mars_metadata(out / "hf")["complete"]
    console = proc.stdout + proc.stderr  # Lightning's lines go through Hydra's console handler (stdout)
    assert "world_size=2" in console or "distributed_backend=gloo" in console or "Initializing distributed" in console


def test_wandb_logger_runs_offline_without_credentials_or_library_notices(
    compose_cfg, tiny_train_overrides, tmp_path, monkeypatch, caplog, capfd
):
    """No prompt for a key, the ``wandb sync`` command of the offline run, and none of the notices the
    libraries print on every run about their own calls (torchdata's set_vital, Lightning's LeafSpec,
    transformers' past_key_values, W&B's anonymous setting)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from mars.models import cache_root

    monkeypatch.setenv("MARS_CACHE", str(cache_root()))  # keep the converted model cache when HOME moves
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: must not prompt
    overrides = [o for o in tiny_train_overrides if not o.startswith("logger=")]
    cfg = compose_cfg("train", overrides + ["logger=wandb", "trainer.max_steps=2"])
    with caplog.at_level("INFO", logger="mars.training.loggers"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert f"wandb sync {runs[0]}" in caplog.text  # how to upload the offline run
    said = [str(w.message) for w in caught] + ["".join(capfd.readouterr())]
    for notice in ("'set_vital' is deprecated", "LeafSpec)` is deprecated", "`past_key_values` is deprecated"):
        assert not any(notice in text for text in said), notice
    assert not any("anonymous setting has no effect" in text for text in said)
