"""``mars-bench spec`` end to end on the tiny model: per-category rows and an overall row, verify's outputs
identical to AR's, vLLM's acceptance figures consistent with one another; a prompt file without a category, a line
that is not UTF-8, an empty or over-long prompt and a category named like the overall row refused naming the line
before any model loads; the model's shipped MARS checkpoint as the default, and a warning for untrained masks."""

import csv
import json

import pytest

from mars.bench.spec import build_parser, main

ARGS = ["--model", "tiny-random", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "5", "--threads", "1"]


def write_prompts(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("tree", ["chain", "1"])  # a shape applies to the verify rows, never to the AR baseline
def test_spec_reports_each_category_and_overall_with_identical_outputs(tmp_path, tree):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"category": "chat", "prompt": "Say hi."},
            {"category": "math", "prompt": "What is 2 + 3?"},
            {"category": "chat", "prompt": "Name a dog."},  # past --limit-per-category 1
        ],
    )
    out = tmp_path / "out"
    # tree chain: auto would time the step costs per width first (seconds of a test for no other check)
    args = [*ARGS, "--limit-per-category", "1", "--prompts-file", prompts, "--tree", tree, "--out", str(out)]
    assert main(args) == 0
    rows = {r["category"]: r for r in csv.DictReader((out / "spec.csv").open())}
    assert list(rows) == ["chat", "math", "overall"]
    assert [rows[c]["prompts"] for c in rows] == ["1", "1", "2"]
    # lossless: every prompt's verify output is AR's, token for token
    assert [rows[c]["identical_outputs"] for c in rows] == ["1", "1", "2"]
    assert {r["tree"] for r in rows.values()} == {tree}  # the layout verify ran with, as asked
    for r in rows.values():
        assert float(r["speedup_min"]) <= float(r["speedup"]) <= float(r["speedup_max"])
        assert float(r["ar_tokens_per_s"]) > 0 and float(r["verify_tokens_per_s"]) > 0
        if r["mean_acceptance_length"]:  # 1 + the per-position acceptance, summed over the draft depths
            by_position = [float(a) for a in r["acceptance_by_position"].split(";")]
            assert float(r["mean_acceptance_length"]) == pytest.approx(1 + sum(by_position), abs=1e-3)
    table = (out / "spec.md").read_text()
    assert "| chat | 1 |" in table and "| math | 1 |" in table and "| overall | 2 |" in table
    assert [line.rsplit(" | ", 1)[1] for line in table.splitlines()[-3:]] == ["1/1 |", "1/1 |", "2/2 |"]
    config = json.loads((out / "config.json").read_text())
    assert config["settings"]["verify"]["verify"] is True and config["settings"]["ar-cursor"]["verify"] is False
    assert config["settings"]["verify"]["tree"] == tree and config["max_new_tokens"] == 5
    assert config["categories"] == {"chat": 1, "math": 1} and "cpu_native_bf16" in config["hardware"]


def test_a_prompt_file_without_categories_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import mars.models

    loads = []
    monkeypatch.setattr(mars.models, "load_model", lambda *a, **k: loads.append(a))
    prompts = write_prompts(tmp_path / "p.jsonl", [{"category": "chat", "prompt": "Hi."}, {"prompt": "Say hi."}])
    with pytest.raises(SystemExit, match="line 2: no 'category' field"):
        main([*ARGS, "--prompts-file", prompts, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="decoding flags: tree must be one of"):
        main([*ARGS, "--tree", "0,1", "--out", str(tmp_path / "out")])
    assert loads == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"category": "chat", "prompt": "Hi."}\n{"category": "chat", "prompt": "caf\xe9"}\n', "line 2: not UTF-8"),
        (
            b'{"category": "chat", "prompt": "Hi."}\n\n{"category": "chat", "prompt": "  "}\n',
            "line 3: the prompt is empty",
        ),
        (b'{"category": "Overall", "prompt": "Hi."}\n', "line 1: category 'Overall' is the name of the row over"),
        (
            b'{"category": "chat", "prompt": "Hi."}\n{"category": "long", "prompt": "' + b"word " * 2100 + b'"}\n',
            r"line 2: the prompt has \d+ tokens with the chat template; with --max-new-tokens 5 it would pass the "
            "model's context of 2048 tokens",
        ),
    ],
)
def test_a_bad_prompt_is_refused_naming_its_line_before_the_model_loads(tmp_path, monkeypatch, content, message):
    import mars.models

    loads = []
    monkeypatch.setattr(mars.models, "load_model", lambda *a, **k: loads.append(a))
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    with pytest.raises(SystemExit, match=message):
        main([*ARGS, "--prompts-file", str(prompts), "--out", str(tmp_path / "out")])
    assert loads == [] and not (tmp_path / "out").exists()


def test_the_default_checkpoint_is_the_models_shipped_adapter_and_untrained_masks_are_warned_of(capsys):
    from mars.bench.spec import REFERENCE, reference_checkpoint, resolve_checkpoint, warn_if_untrained
    from mars.paths import data_dir

    shipped = str(data_dir() / "adapters" / "smollm2-135m-mars-rank8")
    assert build_parser().parse_args([]).checkpoint == REFERENCE
    assert resolve_checkpoint("embedded:smollm2-135m", REFERENCE) == shipped == reference_checkpoint("smollm2-135m")
    assert resolve_checkpoint("tiny-random", REFERENCE) is None  # a model that ships no MARS checkpoint
    assert resolve_checkpoint("embedded:smollm2-135m", "none") is None
    assert warn_if_untrained("embedded:smollm2-135m", shipped) is True
    assert capsys.readouterr().err == ""
    assert warn_if_untrained("embedded:smollm2-135m", None) is False
    assert "the base model embedded:smollm2-135m has had no MARS training" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--checkpoint=/nonexistent: no such folder"):
        resolve_checkpoint("tiny-random", "/nonexistent")
