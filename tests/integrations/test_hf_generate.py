"""``model.generate(..., custom_generate=<exported folder>, trust_remote_code=True)`` with transformers alone: MARS
verify gives plain greedy ``generate``'s output, counts forwards as the project's engine does, and refuses what it
cannot decode."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars.integrations.export import export_for_vllm

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "List three colours"]
NEW = 24


@pytest.fixture(scope="module")
def exported(full_checkpoint, tmp_path_factory) -> Path:
    return export_for_vllm(full_checkpoint, tmp_path_factory.mktemp("export") / "hf")


@pytest.fixture(scope="module")
def vanilla(exported):
    """The export as a user loads it: transformers only, no mars code involved."""
    return AutoModelForCausalLM.from_pretrained(exported).eval(), AutoTokenizer.from_pretrained(exported)


def _mars(model, exported, **kwargs):
    return model.generate(**kwargs, custom_generate=str(exported), trust_remote_code=True)


def test_verify_equals_plain_greedy_generate_and_reports_tokens_per_forward(vanilla, exported):
    model, tok = vanilla
    for prompt in PROMPTS:
        inputs = tok(prompt, return_tensors="pt")
        greedy = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        out = _mars(model, exported, **inputs, max_new_tokens=NEW, return_dict_in_generate=True)
        assert out.sequences.tolist() == greedy.tolist()
        generated = greedy.shape[1] - inputs["input_ids"].shape[1]
        assert out.generated_tokens == generated and out.mode == "verify"
        assert out.tokens_per_forward == pytest.approx(generated / out.forwards)
        assert model.mars_generate_stats["forwards"] == out.forwards
        assert len(out.accepted_per_position) == 3  # block size 4: at most 3 drafts per forward


def test_tokens_and_forward_counts_are_the_project_engines_chain_verify(vanilla, exported, full_checkpoint):
    """The same chain as the engine's verify mode with masks after every step's drafts: same tokens, same forwards."""
    from mars.decoding import generate
    from mars.models import load_model

    model, tok = vanilla
    lm = load_model(str(full_checkpoint))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    engine = generate(
        lm.model,
        lm.tokenizer,
        ids,
        verify=True,
        chain_drafts="always",
        verify_masks="all",
        tree="chain",
        draft_threshold=0.0,
        max_new_tokens=NEW,
    )
    for row, expected in enumerate(engine.token_ids):
        out = _mars(model, exported, input_ids=torch.tensor([ids[row]]), max_new_tokens=NEW)
        assert out[0, len(ids[row]) :].tolist() == expected
        assert model.mars_generate_stats["forwards"] == engine.stats.per_row_forwards[row]


def test_the_thresholded_mode_decodes_as_the_engine_at_the_same_threshold(vanilla, exported, full_checkpoint):
    from mars.decoding import generate
    from mars.models import load_model

    model, tok = vanilla
    lm = load_model(str(full_checkpoint))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    engine = generate(lm.model, lm.tokenizer, ids, threshold=0.3, max_new_tokens=NEW)
    for row, expected in enumerate(engine.token_ids):
        out = _mars(model, exported, input_ids=torch.tensor([ids[row]]), max_new_tokens=NEW, threshold=0.3)
        assert out[0, len(ids[row]) :].tolist() == expected
        assert model.mars_generate_stats["forwards"] == engine.stats.per_row_forwards[row]
        assert model.mars_generate_stats["mode"] == "threshold=0.3"


def test_a_left_padded_batch_gives_each_row_its_own_output(vanilla, exported):
    model, tok = vanilla
    tok.padding_side = "left"
    batch = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    out = _mars(model, exported, **batch, max_new_tokens=NEW)
    for b, prompt in enumerate(PROMPTS[:2]):
        alone = tok(prompt, return_tensors="pt")
        single = _mars(model, exported, **alone, max_new_tokens=NEW)[0, alone["input_ids"].shape[1] :]
        row = out[b, batch["input_ids"].shape[1] :]
        assert row[: len(single)].tolist() == single.tolist()
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else model.generation_config.eos_token_id
        assert torch.all(row[len(single) :] == pad)


def test_a_gated_adapter_loaded_by_the_project_decodes_through_its_export(gated_checkpoint, tmp_path):
    """The gate acts at mask columns only, so verify still gives the gated model's (= its base's) greedy output."""
    from mars.models import load_model

    exported = export_for_vllm(gated_checkpoint, tmp_path / "gated")
    lm = load_model(str(gated_checkpoint))
    inputs = lm.tokenizer(PROMPTS[1], return_tensors="pt")
    greedy = lm.model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=2)
    out = _mars(lm.model, exported, **inputs, max_new_tokens=NEW, pad_token_id=2)
    assert out.tolist() == greedy.tolist()


def test_a_model_without_a_mask_token_is_refused(vanilla, exported):
    from mars.models import build_tiny_random

    _, tok = vanilla
    plain = build_tiny_random()  # a causal LM whose config names no mask token
    with pytest.raises(ValueError, match="has no mask token"):
        _mars(plain, exported, **tok("hi", return_tensors="pt"), max_new_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"do_sample": True}, "decodes greedily"),
        ({"num_beams": 2}, "num_beams=1"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"threshold": 1.5}, r"threshold must be in \(0, 1\]"),
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"output_scores": True, "return_dict_in_generate": True}, "returns no scores"),
    ],
)
def test_settings_it_cannot_honour_are_refused(vanilla, exported, kwargs, message):
    model, tok = vanilla
    with pytest.raises(ValueError, match=message):
        _mars(model, exported, **tok("hi", return_tensors="pt"), max_new_tokens=4, **kwargs)


def test_a_plain_peft_lora_without_the_gate_is_refused_naming_the_project_loader(vanilla, exported):
    from peft import LoraConfig, inject_adapter_in_model

    model, tok = vanilla
    adapted = AutoModelForCausalLM.from_pretrained(exported)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), adapted)
    with pytest.raises(ValueError, match="mars.models.load_model"):
        _mars(adapted, exported, **tok("hi", return_tensors="pt"), max_new_tokens=4)


def test_the_gated_vllm_folder_loaded_by_transformers_alone_is_refused(gated_checkpoint, tmp_path):
    exported = export_for_vllm(gated_checkpoint, tmp_path / "gated")
    model = AutoModelForCausalLM.from_pretrained(exported)  # base weights only: the adapter tensors are not its
    tok = AutoTokenizer.from_pretrained(exported)
    with pytest.raises(ValueError, match="mars.models.load_model"):
        _mars(model, exported, **tok("hi", return_tensors="pt"), max_new_tokens=4)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 16 x 64 tokens twice (greedy, then MARS) on a shared 2-core CPU
def test_the_shipped_adapter_through_custom_generate_is_greedy_at_more_than_one_token_per_forward(tmp_path):
    """The embedded 135M model with the shipped gated adapter, 16 held-out prompts x 64 tokens."""
    from mars.models import load_model
    from mars.paths import data_dir

    adapter = data_dir() / "adapters" / "smollm2-135m-mars-rank8"
    exported = export_for_vllm(adapter, tmp_path / "gated")
    lm = load_model(str(adapter))
    rows = [json.loads(line) for line in (data_dir() / "prompts" / "heldout.jsonl").read_text().splitlines()[:16]]
    tokens = forwards = 0
    for row in rows:
        text = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        inputs = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        greedy = lm.model.generate(**inputs, max_new_tokens=64, do_sample=False)
        out = _mars(lm.model, exported, **inputs, max_new_tokens=64)
        assert out.tolist() == greedy.tolist(), row["id"]
        tokens += lm.model.mars_generate_stats["generated_tokens"]
        forwards += lm.model.mars_generate_stats["forwards"]
    assert tokens / forwards > 1.2
