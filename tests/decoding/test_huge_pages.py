"""The decoding weights moved into one huge-page buffer: same values, same parameters, own storages, once."""

import pytest
import torch
from decoding_fixtures import MASK_ID, RAGGED, build_model, tokenizer  # noqa: F401
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from mars.decoding import generate, huge_pages


@pytest.fixture
def thp(monkeypatch):
    """Placement asked for whatever this machine's THP setting (the buffer works without huge pages too)."""
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.delenv(huge_pages.ENV, raising=False)


def tied_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_placed_weights_keep_their_values_parameters_and_logits(thp):
    model = build_model(seed=3)
    ids = torch.randint(0, 1024, (2, 9))
    before = model(ids).logits
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    placed = huge_pages.place_weights(model)
    assert placed >= sum(p.numel() * p.element_size() for p in params.values())
    for name, p in model.named_parameters():
        assert p is params[name]  # the same Parameter objects: optimisers and hooks still hold them
        assert torch.equal(p, values[name])
        # a storage of its own, starting at the tensor, on a 4 KB boundary
        assert p.untyped_storage().data_ptr() == p.data_ptr() and p.data_ptr() % huge_pages.ALIGN == 0
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    assert torch.equal(model(ids).logits, before)


def test_placement_happens_once_per_model(thp):
    model = build_model(seed=4)
    placed = huge_pages.place_weights(model)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.place_weights(model) == placed
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_a_tied_weight_stays_tied_and_saves_and_loads(thp, tmp_path):
    model = tied_model()
    huge_pages.place_weights(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)  # safetensors refuses tensors sharing memory: each has its own storage
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name


def test_training_steps_update_placed_weights(thp):
    model = tied_model().train()
    huge_pages.place_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.lm_head.weight.detach().clone()
    ids = torch.randint(0, 256, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(model.lm_head.weight, before)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_off_switch_and_a_machine_without_huge_pages_leave_weights_where_they_are(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = build_model(seed=5)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.place_weights(model) == 0
    assert huge_pages.describe() == f"off ({huge_pages.ENV}=0)"
    monkeypatch.delenv(huge_pages.ENV)
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "never")
    other = build_model(seed=5)
    assert huge_pages.place_weights(other) == 0
    assert huge_pages.describe() == "unavailable (THP never)"
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_the_thp_mode_is_read_from_the_bracketed_word(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_pages.transparent_huge_pages() == "madvise"
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "absent")
    assert huge_pages.transparent_huge_pages() is None


def test_decoding_places_the_weights_and_gives_the_same_tokens(thp, tokenizer):  # noqa: F811
    placed, plain = build_model(seed=6), build_model(seed=6)
    plain_pointers = [p.data_ptr() for p in plain.parameters()]
    prompts = RAGGED[:2]
    kwargs = dict(max_new_tokens=12, mask_token_id=MASK_ID, cache="cursor", threshold=1.0)
    ar = generate(plain, tokenizer, prompts, decoder="ar", max_new_tokens=12, mask_token_id=MASK_ID)
    huge_pages.place_weights(plain)  # (the AR baseline placed them already: this returns at once)
    assert [p.data_ptr() for p in plain.parameters()] != plain_pointers
    out = generate(placed, tokenizer, prompts, **kwargs)
    verify = generate(placed, tokenizer, prompts, verify=True, **kwargs)
    assert out.token_ids == ar.token_ids == verify.token_ids
    assert huge_pages.place_weights(placed) > 0


def test_views_and_distributed_models_are_left_where_they_are(thp, monkeypatch):
    model = tied_model()
    flat = torch.zeros(64 * 32 + 64)
    with torch.no_grad():
        shared = torch.nn.Parameter(flat[64:].view(32, 64))  # a view into a larger storage, as a flat shard's
    model.model.layers[0].mlp.down_proj.weight = shared
    huge_pages.place_weights(model)
    assert model.model.layers[0].mlp.down_proj.weight.data_ptr() == flat.data_ptr() + 64 * 4
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() % huge_pages.ALIGN == 0  # the others moved
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    other = tied_model()
    pointers = [p.data_ptr() for p in other.parameters()]
    assert huge_pages.place_weights(other) == 0
    assert [p.data_ptr() for p in other.parameters()] == pointers
