"""The mask-token policy: never a new parameter where a spare row or an unused special token exists."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mars.models import build_tiny_random, embedded_tokenizer, ensure_mask_token


def word_tokenizer(extra_special=()):
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "hello", "world", *extra_special])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<eos>",
        additional_special_tokens=list(extra_special) or None,
    )


def test_spare_embedding_row_is_used_without_resizing():
    tok = word_tokenizer()
    model = build_tiny_random(
        vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )
    n = sum(p.numel() for p in model.parameters())
    mask = ensure_mask_token(model, tok)
    assert mask.how == "spare_row" and mask.id == 4 < 8
    assert sum(p.numel() for p in model.parameters()) == n
    assert tok.mask_token_id == mask.id


def test_unused_special_token_is_reused_when_no_row_is_spare():
    tok = embedded_tokenizer()
    model = build_tiny_random(
        vocab_size=len(tok), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )
    mask = ensure_mask_token(model, tok)
    assert (mask.how, mask.token) == ("reused", "<empty_output>")
    assert model.get_input_embeddings().weight.shape[0] == len(tok)


def test_existing_mask_token_is_kept():
    tok = word_tokenizer(["[MASK]"])
    tok.mask_token = "[MASK]"
    model = build_tiny_random(
        vocab_size=5, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )
    mask = ensure_mask_token(model, tok)
    assert (mask.how, mask.id) == ("existing", 4)


def test_no_usable_policy_fails_clearly_and_adding_a_row_needs_consent():
    tok = word_tokenizer()
    model = build_tiny_random(
        vocab_size=4, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )
    with pytest.raises(ValueError, match="no usable mask token.*allow_new_embedding_row"):
        ensure_mask_token(model, tok)
    mask = ensure_mask_token(model, tok, allow_new_row=True)
    assert mask.how == "added_row" and model.get_input_embeddings().weight.shape[0] == 5


def test_tiny_random_models_are_real_and_differ_by_arch():
    llama, qwen = build_tiny_random("llama"), build_tiny_random("qwen2")
    assert llama.config.model_type == "llama" and qwen.config.model_type == "qwen2"
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert llama(ids).logits.shape == (1, 3, 49152)
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_random("gpt2")


def test_a_folder_that_is_not_a_model_is_named_before_any_loading(tmp_path):
    from mars.models import load_model

    empty = tmp_path / "checkpoints"
    empty.mkdir()
    (empty / "last.ckpt").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoints' is a folder without config.json.*\['last.ckpt'\]"):
        load_model(str(empty))  # (transformers' own error here is about sentencepiece)
    weights_only = tmp_path / "weights_only"
    build_tiny_random(
        vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    ).save_pretrained(weights_only)
    with pytest.raises(ValueError, match="has config.json but no tokenizer files"):
        load_model(str(weights_only))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model(str(tmp_path / "missing" / "model"))
