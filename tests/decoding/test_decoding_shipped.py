"""The shipped adapter (the embedded SmolLM2-135M with its MARS gated adapter, what ``python serve.py`` loads by
default) under the decoding settings the server derives on a CPU (``conf/serve.yaml``: ``max_step_columns`` auto,
8 columns): a verify request alone drafts, and more than one token per forward comes of it; and in a batch of
greedy, sampled and verified rows each row decodes what it decodes alone."""

import pytest
from conftest import CONF
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mars.decoding.api import encode_prompts
from mars.decoding.engine import DecodeEngine
from mars.decoding.forward import ModelRunner
from mars.decoding.stats import acceptance_figures
from mars.decoding.stopping import eos_token_ids
from mars.decoding.tree import columns_of

PROMPT = "Give three tips for staying healthy."


@pytest.fixture(scope="module")
def served():
    """The server's decoding settings on a CPU and its default checkpoint, loaded with the default config."""
    from mars.metadata import read_checkpoint
    from mars.models import load_model
    from mars.paths import bundled_path
    from mars.serving.config import serving_settings

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["device=cpu"])
    checkpoint = bundled_path(cfg.checkpoint)
    decoding = OmegaConf.to_container(cfg.decoding, resolve=True)
    settings = serving_settings(decoding, read_checkpoint(checkpoint), "cpu")
    return settings, load_model(checkpoint)


def _engine(served) -> DecodeEngine:
    settings, loaded = served
    model, tokenizer = loaded.model, loaded.tokenizer
    return DecodeEngine(ModelRunner(model), settings, loaded.mask.id, eos_token_ids(model, tokenizer), tokenizer)


def _finish(engine: DecodeEngine, requests: list) -> list:
    engine.admit(requests)
    done = {}
    while engine.live:
        for event in engine.step():
            if event.finished is not None:
                done[event.request.id] = event.finished
    return [done[r.id] for r in requests]


def test_a_verify_request_alone_drafts_under_the_servers_column_cap(served):
    settings, loaded = served
    assert settings.max_step_columns == 8 and settings.tree == "auto"  # what serve.py runs on a CPU
    engine = _engine(served)
    ids = encode_prompts(loaded.tokenizer, [PROMPT], chat_template=True)[0]
    (finished,) = _finish(engine, [engine.make_request(ids, verify=True, threshold=1.0, max_new_tokens=32)])
    assert engine.tree is not None and 1 + columns_of(engine.tree.shape, settings.tree_masks) <= 8
    figures = acceptance_figures(finished.draft_proposed, finished.draft_accepted, finished.draft_steps)
    tokens_per_forward = len(finished.token_ids) / finished.forwards
    assert figures["mean_acceptance_length"] is not None and figures["num_drafts"] > 0
    assert tokens_per_forward > 1.0, (tokens_per_forward, figures, engine.tree)


@pytest.mark.slow
def test_each_row_of_a_mixed_batch_on_the_shipped_adapter_decodes_what_it_decodes_alone(served):
    _, loaded = served
    # rows at threshold 1.0: under the server's column cap a row below it may decode differently under different
    # loads (documented), these may not
    prompts = encode_prompts(loaded.tokenizer, ["Name a colour.", "Say hi.", "Count to five.", "What is 2+2?"], True)
    rows = [dict(temperature=0.8, seed=1), dict(verify=True, temperature=0.8, seed=2), dict(verify=True), dict()]
    engine = _engine(served)
    together = _finish(engine, [engine.make_request(p, max_new_tokens=16, **r) for p, r in zip(prompts, rows)])
    assert sum(f.draft_steps for f in together) > 0
    for p, r, mixed in zip(prompts, rows, together):
        alone_engine = _engine(served)
        (alone,) = _finish(alone_engine, [alone_engine.make_request(p, max_new_tokens=16, **r)])
        assert mixed.token_ids == alone.token_ids, r
