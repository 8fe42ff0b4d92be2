"""``python -m mars.integrations.export``: the layouts vLLM loads as a parallel drafter, the gated adapter's tensors,
and the refusals (no mask token, another vocabulary) before any model loads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mars.custom_generate_files import DECODER
from mars.integrations import export as ex
from mars.integrations.export import ExportError, export_for_vllm

# vLLM's get_parallel_drafting_token_id reads, in order: dflash_config.mask_token_id, mask_token_id,
# dspark_noise_token_id, pard_token, ptd_token_id; the export writes the plain one
VLLM_MASK_KEY = "mask_token_id"


def test_a_full_checkpoint_becomes_a_plain_folder_naming_its_mask_token(full_checkpoint, tmp_path):
    out = export_for_vllm(full_checkpoint, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    meta = json.loads((full_checkpoint / "mars_config.json").read_text())
    assert config[VLLM_MASK_KEY] == meta["mask_token_id"] and config["mars_block_size"] == 4
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "custom_generate" / "generate.py").read_text() == DECODER.read_text()
    assert (
        load_file(str(out / "model.safetensors")).keys() == load_file(str(full_checkpoint / "model.safetensors")).keys()
    )
    assert AutoConfig.from_pretrained(out).mask_token_id == meta["mask_token_id"]  # vanilla transformers keeps it


def test_the_command_line_writes_the_folder_and_refuses_a_folder_without_a_mask_token(
    full_checkpoint, tmp_path, capsys
):
    ex.main([str(full_checkpoint), str(tmp_path / "cli")])
    assert "exported:" in capsys.readouterr().out and (tmp_path / "cli" / "config.json").is_file()
    plain = tmp_path / "plain"
    shutil.copytree(full_checkpoint, plain)
    (plain / "mars_config.json").unlink()
    with pytest.raises(SystemExit) as stop:
        ex.main([str(plain), str(tmp_path / "never")])
    assert stop.value.code == 2
    assert "names no mask token" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_a_drafter_with_another_vocabulary_is_refused_naming_both(full_checkpoint, tmp_path):
    target = tmp_path / "target"
    tok = AutoTokenizer.from_pretrained(full_checkpoint)
    tok.add_tokens(["<not-in-the-drafter>"])
    tok.save_pretrained(target)
    with pytest.raises(ExportError) as err:
        export_for_vllm(full_checkpoint, tmp_path / "draft", target=str(target))
    assert str(full_checkpoint) in str(err.value) and str(target) in str(err.value)
    assert "<not-in-the-drafter>" in str(err.value) and not (tmp_path / "draft").exists()


def test_a_drafter_with_fewer_embedding_rows_than_its_target_is_padded_with_zero_rows(full_checkpoint, tmp_path):
    target = tmp_path / "target"
    AutoTokenizer.from_pretrained(full_checkpoint).save_pretrained(target)
    config = AutoConfig.from_pretrained(full_checkpoint)
    config.vocab_size += 64
    config.save_pretrained(target)
    out = export_for_vllm(full_checkpoint, tmp_path / "draft", target=str(target))
    padded = AutoModelForCausalLM.from_pretrained(out)
    source = AutoModelForCausalLM.from_pretrained(full_checkpoint)
    rows = padded.get_input_embeddings().weight
    assert rows.shape[0] == config.vocab_size and torch.all(rows[-64:] == 0)
    assert torch.equal(rows[:-64], source.get_input_embeddings().weight)
    written = json.loads((out / "config.json").read_text())
    assert written["vocab_size"] == config.vocab_size and written[VLLM_MASK_KEY] == config.mask_token_id


def test_a_gated_adapter_becomes_the_base_weights_plus_scaled_factors_for_the_vllm_class(gated_checkpoint, tmp_path):
    from mars.models import load_model

    out = export_for_vllm(gated_checkpoint, tmp_path / "gated")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MarsGatedLlamaForCausalLM"]
    record = config["mars_gated_lora"]
    assert record["rank"] == 4 and record["mask_embedding"] and record["layers"] == [0, 1]
    tensors = load_file(str(out / ex.GATED_WEIGHTS))
    gated = load_model(str(gated_checkpoint)).model
    base = load_model("tiny-random").model
    weights = load_file(str(out / "model.safetensors"))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], base.model.layers[0].self_attn.q_proj.weight)
    for layer in (0, 1):
        for module in ("q_proj", "down_proj"):
            parent = "self_attn" if module.endswith(("q_proj", "o_proj")) else "mlp"
            lora = getattr(getattr(gated.model.layers[layer], parent), module)
            want = lora.get_delta_weight("default")  # peft's B A * scaling
            have = (
                tensors[f"mars_gated_lora.layers.{layer}.{module}.B"]
                @ tensors[f"mars_gated_lora.layers.{layer}.{module}.A"]
            )
            assert torch.allclose(have, want, atol=1e-6)
    assert torch.equal(tensors["mars_gated_lora.mask_embedding_delta"], gated.mars_gate.delta.detach())


def test_a_merged_gated_adapter_equals_the_gated_model_where_every_column_is_a_mask(gated_checkpoint, tmp_path):
    """Merging removes the gate: the merged model computes the adapter everywhere, which the gated model does only
    where the input is the mask token, so on an input of masks alone the two agree (but for the mask token's own
    logit: with tied embeddings the merged delta also moves its head row)."""
    from mars.models import load_model

    out = export_for_vllm(gated_checkpoint, tmp_path / "merged", merge=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "mars_gated_lora" not in config
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    lm = load_model(str(gated_checkpoint))
    masks = torch.full((1, 6), lm.mask.id)
    with torch.no_grad():
        keep = torch.arange(merged.config.vocab_size) != lm.mask.id
        assert torch.allclose(merged(masks).logits[..., keep], lm.model(masks).logits[..., keep], atol=1e-4)
        real = torch.tensor([[5, 300, 41, 9000, 17, 2]])
        assert not torch.allclose(merged(real).logits, lm.model(real).logits, atol=1e-3)


def test_merge_is_refused_for_full_weights_and_the_checkpoint_cannot_be_its_own_output(full_checkpoint, tmp_path):
    with pytest.raises(ExportError, match="--merge is for gated adapters"):
        export_for_vllm(full_checkpoint, tmp_path / "x", merge=True)
    with pytest.raises(ExportError, match="is the checkpoint itself"):
        export_for_vllm(full_checkpoint, full_checkpoint)


def test_the_plugin_names_the_extra_where_vllm_is_not_installed():
    try:
        import vllm  # noqa: F401
    except ImportError:
        from mars.integrations.vllm_plugin import register

        with pytest.raises(ImportError, match=r"mars\[vllm\]"):
            register()
    else:
        pytest.skip("vLLM is installed here: the plugin registers instead (tests marked vllm)")


def test_without_a_vllm_interpreter_the_bench_names_the_make_target_and_the_extra(monkeypatch, tmp_path):
    from mars.integrations.vllm_env import VllmUnavailable, vllm_python

    monkeypatch.setenv("MARS_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(VllmUnavailable, match=r"make test-vllm.*|mars\[vllm\]") as err:
        vllm_python()
    assert "no-such-python" in str(err.value) and "mars[vllm]" in str(err.value)


def test_the_runner_refuses_a_drafter_with_another_tokenizer_before_an_engine_starts(full_checkpoint, tmp_path):
    from mars.integrations.vllm_runner import check_pair

    drafter = export_for_vllm(full_checkpoint, tmp_path / "draft")
    target = tmp_path / "target"
    tok = AutoTokenizer.from_pretrained(full_checkpoint)
    tok.add_tokens(["<only-in-the-target>"])
    tok.save_pretrained(target)
    check_pair(str(drafter), str(drafter))  # the same tokenizer passes
    with pytest.raises(ExportError, match="different vocabularies") as err:
        check_pair(str(target), str(drafter))
    assert str(target) in str(err.value) and str(drafter) in str(err.value)
