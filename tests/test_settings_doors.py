"""One decoding-settings type from every door: ``generate`` takes either ``settings=`` or
its fields as keywords, never both; the benchmark CLIs' decoding flags and the server's per-request options
are derived from DecodingSettings' fields, so a field declared there (the prompt-lookup n-gram size; a new
one added in a subclass here) is a flag and a request option with no further code."""

import argparse
import dataclasses
from dataclasses import dataclass, field

import httpx
import pytest
from pydantic import ValidationError
from serving_fixtures import loaded, one_thread, server  # noqa: F401  (fixtures)

from mars.bench import cli_options, probe, throughput
from mars.decoding import DecodingSettings, generate
from mars.decoding.settings import _help
from mars.serving.schemas import CompletionRequest, RequestOptions, request_options_model


@dataclass(frozen=True)
class WithTopK(DecodingSettings):
    """DecodingSettings plus one field, declared the way every field is (help, per_request)."""

    top_k: int = field(default=0, metadata=_help("sample among the k most probable tokens (0: all)", per_request=True))


def test_generate_refuses_settings_beside_a_decoding_keyword():
    # refused before the model is touched (None would fail at once if it were)
    with pytest.raises(ValueError, match=r"settings= and the decoding keyword\(s\) \['block_size'\]"):
        generate(None, None, ["hi"], settings=DecodingSettings(), block_size=2)
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['treshold'\]"):
        generate(None, None, ["hi"], treshold=0.9)
    with pytest.raises(ValueError, match="lookup_ngram must be an integer >= 1"):
        generate(None, None, ["hi"], lookup_ngram=0)  # keywords build one validated DecodingSettings


def test_every_field_reaches_generate_and_the_throughput_flags():
    """Each DecodingSettings field is a generate keyword; each field the throughput command does not vary
    itself is one of its flags, with the dataclass's default and help."""
    names = set(DecodingSettings.field_names())
    flags = set(throughput.build_parser().parse_args([]).decoding_fields)
    assert flags == names - {"threshold", *throughput.VARIANT_FIELDS}
    helps = {a.dest: a.help for a in throughput.build_parser()._actions}
    assert helps["lookup_ngram"] == DecodingSettings.help()["lookup_ngram"]
    args, _, _ = throughput.parse_args(["--lookup-ngram", "2", "--max-accept", "3", "--threads", "1"])
    base = throughput.base_settings(args, block_size=4)
    assert (base.lookup_ngram, base.max_accept, base.max_new_tokens) == (2, 3, 64)  # 64: this command's default
    assert base.seed is None and base.draft_threshold == DecodingSettings().draft_threshold
    with pytest.raises(SystemExit, match="lookup_ngram must be an integer >= 1, got 0"):
        throughput.parse_args(["--lookup-ngram", "0", "--threads", "1"])
    with pytest.raises(SystemExit):  # argparse names the flag: int only
        throughput.parse_args(["--lookup-ngram", "two"])
    args, _ = probe.parse_args(["--checkpoint", "x", "--window", "2", "--max-accept", "none"])
    assert (args.window, args.max_accept, args.max_new_tokens) == (2, None, 96)


def test_a_new_field_is_a_cli_flag_and_a_request_option_without_further_code(monkeypatch):
    monkeypatch.setattr(cli_options, "DecodingSettings", WithTopK)
    args, _, _ = throughput.parse_args(["--top-k", "5", "--threads", "1"])
    settings = throughput.base_settings(args, block_size=4)
    assert isinstance(settings, WithTopK) and settings.top_k == 5
    p = argparse.ArgumentParser()
    cli_options.add_decoding(p, include=["top_k"])
    assert p.parse_args([]).top_k == 0  # the dataclass's default

    options = request_options_model(WithTopK)
    assert set(options.model_fields) == set(RequestOptions.model_fields) | {"top_k"}
    assert options.model_validate({"top_k": 5}).top_k == 5
    with pytest.raises(ValidationError):
        options.model_validate({"top_k": "5"})  # strict: a JSON integer
    assert options.model_fields["top_k"].description == "sample among the k most probable tokens (0: all)"


def test_the_request_options_are_the_per_request_fields():
    per_request = {f.name for f in dataclasses.fields(DecodingSettings) if f.metadata.get("per_request")}
    # the OpenAI API already names the budget, the temperature and the seed
    assert set(RequestOptions.model_fields) == per_request - {"max_new_tokens", "temperature", "seed"}
    assert {"threshold", "verify", "lookup_ngram"} <= set(CompletionRequest.model_fields)


def test_a_request_sets_lookup_ngram_on_its_own_row(server, monkeypatch):  # noqa: F811
    engine = server.state.loop.engine
    made = []
    real = engine.make_request

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine, "make_request", spy)
    body = {"model": "tiny-random", "prompt": "1, 2, 3,", "max_tokens": 4, "verify": True, "lookup_ngram": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert made[-1].settings.lookup_ngram == 2 and made[-1].verify
    r = httpx.post(server.url + "/v1/completions", json={**body, "lookup_ngram": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lookup_ngram"
    assert "lookup_ngram must be an integer >= 1, got 0" in r.json()["error"]["message"]


def test_lookup_ngram_from_the_yaml_and_the_lm_eval_model_args(compose_cfg):
    """The same field through the decoding YAML (a Hydra override) and lm-eval's string model_args."""
    from omegaconf import OmegaConf

    cfg = compose_cfg("evaluate", ["decoding=mars_lookup", "decoding.lookup_ngram=2"])
    settings = DecodingSettings.from_mapping(OmegaConf.to_container(cfg.decoding, resolve=True))
    assert settings.draft_source == "lookup" and settings.lookup_ngram == 2
    assert DecodingSettings.from_mapping({"lookup_ngram": "5"}).lookup_ngram == 5  # model_args arrive as text
    with pytest.raises(ValueError, match="lookup_ngram must be an integer >= 1"):
        DecodingSettings.from_mapping({"lookup_ngram": "0"})


def test_a_checkpoint_is_named_after_its_run_everywhere(tmp_path):
    """Results folders and the server's ``model`` field share one label: the run for train.py's exports,
    the pipeline's name for a pipeline's train stage, the folder itself otherwise."""
    from mars.metadata import checkpoint_label, model_label

    assert checkpoint_label(tmp_path / "outputs" / "train" / "my-run" / "hf") == "my-run"
    assert (
        checkpoint_label(tmp_path / "outputs" / "reproduce" / "smollm2-135m" / "train" / "hf") == "smollm2-135m-train"
    )
    assert (
        checkpoint_label(tmp_path / "outputs" / "reproduce" / "smollm2-135m" / "train" / "snapshots" / "10min")
        == "10min"
    )
    assert model_label({"checkpoint": str(tmp_path / "x" / "train" / "hf")}) == "x-train"
    assert model_label({"model": {"name_or_path": "embedded:smollm2-135m"}}) == "embedded-smollm2-135m"
