"""The mask-token policy: never a new parameter where a spare row or an unused special token exists."""

import time

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


def test_the_parameter_count_of_a_gguf_file_is_read_from_its_header_alone(tmp_path):
    """A budget check needs the embedded model's size before its GGUF is converted (a fresh cache)."""
    import gguf
    import numpy as np

    from mars.models import embedded_gguf_path, gguf_parameter_count

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["a", "bb", "ccc"])  # an array of strings in the metadata is skipped over
    writer.add_array("mars.numbers", [1, 2, 3])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.zeros(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_parameter_count(path) == 3 * 4 + 5
    header = path.read_bytes()[:40]
    (tmp_path / "cut.gguf").write_bytes(header)
    with pytest.raises(ValueError, match="cut.gguf: the GGUF header is truncated"):
        gguf_parameter_count(tmp_path / "cut.gguf")
    assert gguf_parameter_count(embedded_gguf_path()) == 134_515_008  # SmolLM2-135M, tied embeddings


@pytest.fixture
def closed_hub(monkeypatch, tmp_path):
    """The hub at a closed local port (as HF_ENDPOINT=http://127.0.0.1:9 sets it) and an empty cache."""
    from huggingface_hub import constants

    import mars.models

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    mars.models._hub_unreachable.cache_clear()
    monkeypatch.setattr(mars.models, "_WARNED_OFFLINE", set())
    yield tmp_path / "hub"
    mars.models._hub_unreachable.cache_clear()


def cache_a_hub_model(cache, repo_id: str) -> None:
    """``repo_id`` in the Hugging Face cache layout, as a download leaves it."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    build_tiny_random(vocab_size=49152, num_layers=1).save_pretrained(snapshot)
    embedded_tokenizer().save_pretrained(snapshot)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_an_unreachable_hub_fails_fast_naming_the_model_and_the_offline_options(closed_hub, capfd, caplog):
    """Not a minute of retries and a transformers OSError: one error, in seconds, that says what to do."""
    from mars.models import HubUnreachableError, check_model_source, load_model

    start = time.monotonic()
    for attempt in (check_model_source, load_model):
        with pytest.raises(HubUnreachableError) as err:
            attempt("mars-nobody/no-such-model")
        message = str(err.value)
        assert "'mars-nobody/no-such-model'" in message and "http://127.0.0.1:9) is unreachable" in message
        assert "model.name_or_path=/path/to/model" in message and "HF_HUB_OFFLINE=1" in message
    assert time.monotonic() - start < 10
    assert "Retrying" not in "".join(capfd.readouterr()) and not caplog.records


def test_a_cached_hub_model_loads_without_asking_an_unreachable_hub_again(closed_hub, caplog):
    from mars.models import load_model

    cache_a_hub_model(closed_hub, "mars-test/tiny")
    start = time.monotonic()
    loaded = load_model("mars-test/tiny")
    assert time.monotonic() - start < 10 and loaded.model.config.num_hidden_layers == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "unreachable" in said[0] and "mars-test/tiny comes from the local cache" in said[0]


def test_offline_mode_loads_a_cached_hub_model_and_names_one_that_is_not_cached(closed_hub, monkeypatch):
    from huggingface_hub import constants

    from mars.models import HubUnreachableError, load_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachableError, match="'mars-test/tiny' is not in the local Hugging Face cache .*"):
        load_model("mars-test/tiny")
    cache_a_hub_model(closed_hub, "mars-test/tiny")
    assert load_model("mars-test/tiny").model.config.num_hidden_layers == 1
