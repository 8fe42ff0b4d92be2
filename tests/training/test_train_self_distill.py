"""``data=self_distill``: a tiny model answers the prompts before the training model loads, training runs on
those rows, and a second run reuses the cached answers instead of generating again."""

import json
from pathlib import Path

from mars.training.run import run

PROMPTS = [
    "Describe the smell of rain on warm asphalt.",
    "Invent a name for a purple vegetable.",
    "Write one sentence about a lighthouse keeper's cat.",
    "Suggest a game for two bored robots.",
    "Explain why socks disappear, as a pirate would.",
]


def untied_tiny_model(folder):
    """A tiny random Llama with its own output matrix, saved as a local model folder.  (``tiny-random`` ties
    input and output embeddings, so its greedy answer repeats the prompt's last token, a newline, and
    every self-distilled answer would be empty.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mars.models import embedded_tokenizer

    tok = embedded_tokenizer()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def distill_overrides(tiny_train_overrides, tmp_path, out):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    model = tmp_path / "tiny-untied"
    if not model.is_dir():
        untied_tiny_model(model)
    keep = [o for o in tiny_train_overrides if not o.startswith(("data", "output_dir"))]
    return keep + [
        f"model.name_or_path={model}",
        "data=self_distill",
        "data.distill.prompts.source=jsonl",
        f"data.distill.prompts.path={prompts}",
        "data.distill.max_new_tokens=8",
        f"data.distill.root={tmp_path / 'distill'}",
        "data.batch_size=2",
        "trainer.max_steps=2",
        f"output_dir={out}",
    ]


def test_self_distilled_rows_train_and_the_cache_is_reused(compose_cfg, tiny_train_overrides, tmp_path, monkeypatch):
    import mars.decoding
    import mars.training.run
    import mars.training.self_distill

    calls, used = [], []
    real_rows, real_load = mars.training.self_distill.training_rows, mars.training.run.load_model

    def training_rows(*args, **kwargs):
        calls.append("distill")
        out = real_rows(*args, **kwargs)
        used.append(out["path"])
        return out

    monkeypatch.setattr(mars.training.self_distill, "training_rows", training_rows)
    monkeypatch.setattr(
        mars.training.run, "load_model", lambda *a, **k: calls.append("train model") or real_load(*a, **k)
    )

    first = run(compose_cfg("train", distill_overrides(tiny_train_overrides, tmp_path, tmp_path / "first")))
    assert calls == ["distill", "train model"]  # the answers exist before the training model loads
    rows = [json.loads(line) for line in Path(used[0]).read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(len(PROMPTS))]
    assert all(r["messages"][-1]["content"] and r["finished"] is False for r in rows)  # cut at 8 tokens
    assert json.loads((tmp_path / "first" / "train_summary.json").read_text())["global_step"] == 2
    assert (first / "mars_config.json").is_file()

    # a second run (another folder, same data settings) trains on the cached answers, generating nothing
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "distill").rglob("*.jsonl")}

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached answers were generated again")

    monkeypatch.setattr(mars.decoding, "generate", no_generation)
    run(compose_cfg("train", distill_overrides(tiny_train_overrides, tmp_path, tmp_path / "second")))
    assert used[1] == used[0]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "distill").rglob("*.jsonl")} == stamp  # answers untouched
    assert json.loads((tmp_path / "second" / "train_summary.json").read_text())["global_step"] == 2
