"""The mask-token policy: never a new parameter where a spare row or an unused special token exists."""

import time

import pytest
import torch
from conftest import REPO
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


# ------------------------------------------------------------------------------------------------
# The paper's checkpoint format: model_type a2d-qwen2, architecture A2DQwen2LMHeadModel, <|mask|>
# ------------------------------------------------------------------------------------------------
PAPER_PROMPTS = [[17, 230, 4051, 99], [8, 9, 10, 11, 12, 13, 14], [300, 301]]


def write_paper_folder(folder, *, block_size=None, model_type="a2d-qwen2", architecture="A2DQwen2LMHeadModel"):
    """A tiny Qwen2 saved as the paper's code saves its models: config.json with its own model type and
    architecture name, the weights under the plain Qwen2 names, a tokenizer with <|mask|> as its mask token in
    a spare embedding row."""
    import json

    tokenizer = embedded_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    model = build_tiny_random(arch="qwen2", vocab_size=len(tokenizer) + 7, num_layers=2, seed=3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=[architecture])
    if block_size is not None:
        config["block_size"] = block_size
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return model


def test_a_checkpoint_in_the_paper_format_loads_as_plain_qwen2_with_its_weights_and_mask(tmp_path):
    from transformers import AutoConfig, Qwen2ForCausalLM

    from mars.models import load_model

    saved = write_paper_folder(tmp_path / "paper")
    with pytest.raises(ValueError, match="a2d-qwen2"):
        AutoConfig.from_pretrained(tmp_path / "paper")  # what vanilla transformers does with the paper's format
    lm = load_model(str(tmp_path / "paper"))
    assert type(lm.model) is Qwen2ForCausalLM and lm.model.config.model_type == "qwen2"
    assert (lm.mask.token, lm.mask.how) == ("<|mask|>", "existing") and lm.mask.id == len(lm.tokenizer) - 1
    expected = saved.state_dict()
    got = lm.model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_threshold_one_on_a_paper_checkpoint_is_transformers_greedy_token_for_token(tmp_path):
    from decoding_fixtures import hf_greedy

    from mars.decoding import generate
    from mars.models import load_model

    write_paper_folder(tmp_path / "paper")
    lm = load_model(str(tmp_path / "paper"))
    lm.model.generation_config.eos_token_id = 2
    out = generate(lm.model, lm.tokenizer, PAPER_PROMPTS, threshold=1.0, max_new_tokens=16)
    reference = hf_greedy(lm.model, lm.tokenizer, PAPER_PROMPTS, 16)
    assert out.token_ids == reference and all(len(r) > 4 for r in reference)
    assert out.stats.mean_row_tokens_per_forward == 1.0


def test_paper_weights_that_do_not_fit_the_plain_architecture_are_refused_before_loading(tmp_path):
    import json

    from mars.models import load_model
    from mars.paper_checkpoints import PaperFormatError

    write_paper_folder(tmp_path / "paper")
    config = json.loads((tmp_path / "paper" / "config.json").read_text())
    config["intermediate_size"] = 96  # the saved MLPs are 128 wide
    (tmp_path / "paper" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PaperFormatError, match=r"mlp\.down_proj\.weight: checkpoint \[64, 128\], architecture \[64, 96\]"
    ):
        load_model(str(tmp_path / "paper"))
    config.update(intermediate_size=128, num_hidden_layers=3, layer_types=["full_attention"] * 3)  # a layer too many
    (tmp_path / "paper" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PaperFormatError, match=r"missing \(model\.layers\.2\."):
        load_model(str(tmp_path / "paper"))
    config.update(num_hidden_layers=2, layer_types=["full_attention"] * 2, model_type="a2d-llama")
    (tmp_path / "paper" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PaperFormatError, match="only \\['a2d-qwen2', 'a2d-qwen3', 'a2d-qwen3-it'\\] are known"):
        load_model(str(tmp_path / "paper"))


def test_the_block_size_of_a_paper_checkpoint_comes_from_it_or_must_be_named(tmp_path):
    from mars.decoding.settings import decoding_block_size
    from mars.metadata import mars_trained, read_checkpoint

    write_paper_folder(tmp_path / "says", block_size=8)
    meta = read_checkpoint(tmp_path / "says")
    assert meta["mask_token"] == "<|mask|>" and mars_trained(meta) and decoding_block_size(None, meta) == 8
    write_paper_folder(tmp_path / "silent")
    meta = read_checkpoint(tmp_path / "silent")
    assert decoding_block_size(4, meta) == 4
    with pytest.raises(ValueError, match=r"does not record the block size .* decoding\.block_size=<B>"):
        decoding_block_size(None, meta)


def test_evaluate_runs_on_a_paper_checkpoint_and_refuses_it_without_a_block_size(compose_cfg, tmp_path):
    from lm_eval_fixtures import suite, write_generation_task
    from omegaconf import OmegaConf, open_dict

    from mars.evaluation import run as run_eval
    from mars.evaluation.config import prepare

    write_paper_folder(tmp_path / "paper")
    tasks = write_generation_task(
        tmp_path / "tasks", "fx_paper", [{"question": "Say hello.", "answer": "x"}] * 2, max_gen_toks=6
    )

    def cfg(*overrides):
        composed = compose_cfg(
            "evaluate",
            [f"checkpoint={tmp_path / 'paper'}", "dtype=float32", "plots=false", "thresholds=[1.0,0.9]", *overrides],
        )
        with open_dict(composed):
            composed.benchmarks = OmegaConf.create(suite(tasks, "fx_paper"))
            composed.output_dir = str(tmp_path / "results")
        return composed

    with pytest.raises(ValueError, match=r"decoding\.block_size=<B>"):
        prepare(cfg())  # before any model loads
    outcome = run_eval(cfg("decoding.block_size=4", "decoding.max_new_tokens=6"))
    assert outcome.plan.block_size == 4 and outcome.plan.checkpoint_meta["paper_format"] == "a2d-qwen2"
    assert {p["threshold"] for p in outcome.points} == {1.0, 0.9}
    assert all(p["tokens_per_forward"] >= 1.0 for p in outcome.points)


def test_serve_answers_from_a_paper_checkpoint(tmp_path):
    import httpx
    from hydra import compose, initialize_config_dir

    from mars.serving.config import ServeConfig
    from mars.serving.server import BackgroundServer, build_state

    write_paper_folder(tmp_path / "paper", block_size=4)
    overrides = [f"checkpoint={tmp_path / 'paper'}", "max_tokens=8", "warmup=false", "device=cpu", "dtype=float32"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        sc = ServeConfig.from_cfg(compose(config_name="serve", overrides=overrides))
    server = BackgroundServer(build_state(sc)).start()
    try:
        reply = httpx.post(
            server.url + "/v1/completions", json={"prompt": "Say hello.", "max_tokens": 8, "threshold": 1.0}, timeout=60
        )
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1
