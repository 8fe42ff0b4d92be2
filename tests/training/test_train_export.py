"""``mars_config.json`` is read, validated and written in one place; an export is marked complete only
when its run reached its configured end; ``python -m mars.training.export`` writes the same metadata as training;
every training export carries ``custom_generate/`` and the ``config.json`` keys it reads, so vanilla transformers
decodes it with MARS verify."""

import json

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars.custom_generate_files import DECODER
from mars.metadata import MarsMetadata, MetadataError, read_metadata, write_metadata
from mars.models import read_mars_metadata
from mars.training.export import main as export_main
from mars.training.run import run


class StopEarly(Callback):
    """Asks Lightning to stop after ``steps`` steps (as an early-stopping rule would): fit returns normally."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def test_an_export_is_complete_only_when_the_run_reached_its_end(compose_cfg, tiny_train_overrides, tmp_path):
    overrides = tiny_train_overrides + ["trainer.max_steps=3", "checkpoint_every=1", "data.batch_size=2"]
    out = run(compose_cfg("train", overrides), callbacks=[StopEarly(1)])
    meta = read_metadata(out)
    assert meta.global_step == 1 and meta.complete is False  # usable weights, but not the finished run
    assert json.loads((tmp_path / "run" / "train_summary.json").read_text())["complete"] is False
    # so the same command is not skipped: it resumes and finishes
    run(compose_cfg("train", overrides))
    meta = read_metadata(out)
    assert meta.global_step == 3 and meta.complete is True


def test_metadata_round_trip_keeps_unknown_keys_and_names_bad_fields(tmp_path):
    meta = MarsMetadata(
        block_size=4,
        objective="mars",
        mask_token="<m>",
        mask_token_id=7,
        alpha=1.0,
        intra_block="causal",
        complete=True,
        extra={"note": "from a newer version"},
    )
    write_metadata(tmp_path, meta)
    again = read_metadata(tmp_path)
    assert again == meta and again.to_dict()["note"] == "from a newer version"
    assert read_mars_metadata(tmp_path)["complete"] is True
    assert read_metadata(tmp_path / "missing") is None
    (tmp_path / "mars_config.json").write_text(json.dumps({**meta.to_dict(), "block_size": 0}))
    with pytest.raises(MetadataError, match=r"mars_config.json: field 'block_size' must be an integer >= 1, got 0"):
        read_metadata(tmp_path)
    (tmp_path / "mars_config.json").write_text(json.dumps({"objective": "mars"}))
    with pytest.raises(MetadataError, match=r"missing field\(s\) \['block_size', 'mask_token', 'mask_token_id'\]"):
        read_metadata(tmp_path)
    (tmp_path / "mars_config.json").write_text("{not json")
    with pytest.raises(MetadataError, match="mars_config.json is not valid JSON"):
        read_metadata(tmp_path)
    with pytest.raises(MetadataError, match="intra_block"):
        MarsMetadata(block_size=4, objective="mars", mask_token="<m>", mask_token_id=7, intra_block="sideways")


def test_export_cli_writes_the_metadata_training_writes(compose_cfg, tiny_train_overrides, tmp_path):
    overrides = tiny_train_overrides + [
        "trainer.max_steps=2",
        "checkpoint_every=1",
        "objective=mars_no_sft",
        "block=3",
        "mask_schedule=linear_ramp",
    ]
    trained = run(compose_cfg("train", overrides))
    exported = tmp_path / "cli_export"
    export_main([str(tmp_path / "run" / "checkpoints" / "last.ckpt"), str(exported)])
    cli, train = read_mars_metadata(exported), read_mars_metadata(trained)
    for key in (
        "block_size",
        "objective",
        "alpha",
        "intra_block",
        "mask_schedule",
        "mask_token",
        "mask_token_id",
        "base_model",
        "base_num_parameters",
        "num_parameters",
        "global_step",
    ):
        assert cli[key] == train[key], key
    assert (cli["objective"], cli["alpha"], cli["block_size"], cli["global_step"]) == ("mars_no_sft", 0.0, 3, 2)
    assert train["complete"] is True and cli["complete"] is False  # --complete marks a final checkpoint by hand
    a, b = load_file(trained / "model.safetensors"), load_file(exported / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)


def test_the_export_folder_gets_the_permissions_of_any_saved_folder(tmp_path):
    """export_hf writes into a temporary folder and renames it; the folder follows the umask like
    save_pretrained's own folders (a mkdtemp folder alone would be 0700, unreadable to the group)."""
    import os

    from mars.models import load_model
    from mars.training.export import export_hf

    tiny = load_model("tiny-random", tiny=dict(vocab_size=64, hidden_size=16, num_layers=1, intermediate_size=32))
    meta = dict(block_size=4, objective="mars", mask_token=tiny.mask.token, mask_token_id=tiny.mask.id)
    umask = os.umask(0o022)
    try:
        out = export_hf(tiny.model, tiny.tokenizer, tmp_path / "hf", meta)
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "mars_config.json").stat().st_mode & 0o777 == 0o644


PROMPTS = ["What is 17 times 23?", "List three colours"]


# full fine-tune; a plain LoRA merged into the export (the same writer: slow, beside the default suite's full one)
@pytest.mark.parametrize("adapter", ["none", pytest.param("lora", marks=pytest.mark.slow)])
def test_a_training_export_decodes_through_custom_generate_as_plain_greedy(compose_cfg, tiny_train_overrides, adapter):
    out = run(compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "block=3", f"adapter={adapter}"]))
    meta = read_metadata(out)
    assert (out / "custom_generate" / "generate.py").read_bytes() == DECODER.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["mask_token_id"], config["mars_block_size"]) == (meta.mask_token_id, 3)
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers alone, no mars code
    tok = AutoTokenizer.from_pretrained(out)
    for prompt in PROMPTS:
        inputs = tok(prompt, return_tensors="pt")
        greedy = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        mars = model.generate(
            **inputs, max_new_tokens=16, custom_generate=str(out), trust_remote_code=True, return_dict_in_generate=True
        )
        assert mars.mode == "verify"  # the folder's decoder ran, not the built-in one
        assert mars.sequences.tolist() == greedy.tolist() and mars.generated_tokens == 16
        assert len(mars.accepted_per_position) == 2  # the export's block size 3: at most 2 drafts per forward


def test_a_gated_adapter_export_carries_custom_generate_for_the_model_load_model_builds(
    compose_cfg, tiny_train_overrides
):
    """The folder is the adapter (no config.json: vanilla from_pretrained has no model there);
    ``mars.models.load_model`` builds base + gated adapter, and its model decodes through the folder's decoder."""
    from mars.models import load_model

    gated = ["adapter=gated_lora", "objective=mars_gated", "adapter.rank=4"]
    out = run(compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", *gated]))
    assert (out / "custom_generate" / "generate.py").read_bytes() == DECODER.read_bytes()
    assert (out / "mars_adapter.json").is_file() and not (out / "config.json").exists()
    lm = load_model(str(out))
    inputs = lm.tokenizer(PROMPTS[0], return_tensors="pt")
    greedy = lm.model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=2)
    mars = lm.model.generate(
        **inputs,
        max_new_tokens=16,
        pad_token_id=2,
        custom_generate=str(out),
        trust_remote_code=True,
        return_dict_in_generate=True,
    )
    assert mars.mode == "verify" and mars.sequences.tolist() == greedy.tolist()
