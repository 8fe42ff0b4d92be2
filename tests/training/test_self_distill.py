"""Self-distilled data: prompt sources and their checks, the per-prompt answer cache (reuse, resume,
subsets, another setting never reused), and answers equal to the model's own greedy output."""

import json

import pytest

from mars.decoding import generate
from mars.models import load_model
from mars.training import self_distill as sd

TINY = {
    "arch": "llama",
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
}
PROMPTS = ["Name a colour.", "What is two plus two?", "Say hello.", "Write a word.", "Count to three."]


def write_prompts(path, prompts=PROMPTS, field="prompt"):
    path.write_text("".join(json.dumps({"id": f"p{i}", field: p}) + "\n" for i, p in enumerate(prompts)))
    return path


@pytest.fixture
def settings(tmp_path):
    return sd.DistillSettings(max_new_tokens=6, batch_size=2, dtype="float32", root=str(tmp_path / "cache"))


@pytest.fixture
def answered(monkeypatch):
    """Records which prompts each build had to answer."""
    calls = []
    real = sd._answer

    def spy(model_name, todo, *args):
        calls.append([p["id"] for p in todo])
        return real(model_name, todo, *args)

    monkeypatch.setattr(sd, "_answer", spy)
    return calls


def test_build_answers_greedily_and_reuses(tmp_path, settings, answered):
    prompts = sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(write_prompts(tmp_path / "p.jsonl"))))
    result = sd.build("tiny-random", prompts, settings, tiny=TINY, progress=False)
    rows = [json.loads(line) for line in result.rows_path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(5)]
    assert result.stats["rows"] == 5 and answered == [[f"p{i}" for i in range(5)]]
    # the answers are the model's own greedy outputs
    lm = load_model("tiny-random", tiny=TINY)
    direct = generate(lm.model, lm.tokenizer, PROMPTS, chat_template=True, max_new_tokens=6)
    assert [r["messages"][1]["content"] for r in rows] == [t.strip() for t in direct.texts]
    assert [r["finished"] for r in rows] == [reason == "eos" for reason in direct.finish_reasons]
    # a rerun, and a subset of the prompts, answer nothing new
    sd.build("tiny-random", prompts, settings, tiny=TINY, progress=False)
    subset = sd.build("tiny-random", prompts[:3], settings, tiny=TINY, progress=False)
    assert answered == [[f"p{i}" for i in range(5)]]
    assert subset.stats["rows"] == 3 and subset.rows_path != result.rows_path


def test_a_killed_build_resumes_with_the_missing_prompts(tmp_path, settings, answered):
    prompts = sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(write_prompts(tmp_path / "p.jsonl"))))
    sd.build("tiny-random", prompts[:2], settings, tiny=TINY, progress=False)
    folder = sd.cache_folder(
        sd.fingerprint(sd.model_fingerprint("tiny-random", TINY), settings, "float32"), settings.root
    )
    with open(folder / "rows.jsonl", "a") as f:
        f.write('{"id": "p2", "messa')  # a write cut by a kill
    result = sd.build("tiny-random", prompts, settings, tiny=TINY, progress=False)
    assert answered == [["p0", "p1"], ["p2", "p3", "p4"]]
    assert result.stats["rows"] == 5
    assert json.loads(result.rows_path.with_suffix(".json").read_text())["complete"] is True


def test_another_setting_or_model_is_never_reused(tmp_path, settings, answered):
    prompts = sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(write_prompts(tmp_path / "p.jsonl"))))
    a = sd.build("tiny-random", prompts, settings, tiny=TINY, progress=False)
    b = sd.build(
        "tiny-random",
        prompts,
        sd.DistillSettings(max_new_tokens=7, batch_size=2, dtype="float32", root=settings.root),
        tiny=TINY,
        progress=False,
    )
    c = sd.build("tiny-random", prompts, settings, tiny={**TINY, "hidden_size": 32}, progress=False)
    assert len({a.folder, b.folder, c.folder}) == 3 and len(answered) == 3
    # a changed prompt text under the same id is a new prompt
    changed = [dict(p) for p in prompts]
    changed[0]["prompt"] = "Name a fruit."
    sd.build("tiny-random", changed, settings, tiny=TINY, progress=False)
    assert answered[-1] == ["p0"]


def test_prompt_sources_fail_clearly(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no prompts"):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(empty)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "broken"\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not valid JSON"):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(bad)))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"question": "what?"}\n')
    with pytest.raises(ValueError, match=r"line 1: no prompt \(expected a non-empty 'prompt' string"):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(nofield)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(tmp_path / "missing.jsonl")))
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match="repeats the id 'a'"):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(dup)))
    # messages form: the first user turn is the prompt
    chat = write_prompts(tmp_path / "chat.jsonl", [[{"role": "user", "content": "Hi there"}]], field="messages")
    assert sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(chat)))[0]["prompt"] == "Hi there"


def test_prompts_overlapping_the_evaluation_sets_are_refused(tmp_path):
    from mars.training.prompt_overlap import ROOT

    line = (ROOT / "eval" / "offline" / "math" / "data" / "asdiv_test.jsonl").read_text().splitlines()[0]
    eval_prompt = next(v for k, v in json.loads(line).items() if k in ("question", "prompt", "input"))
    path = write_prompts(tmp_path / "leak.jsonl", ["Say hello.", eval_prompt])
    with pytest.raises(ValueError, match=r"1 prompt\(s\) of .*leak.jsonl overlap the evaluation prompts \(p1: "):
        sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(path)))
    assert len(sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(path), allow_eval_overlap=True))) == 2


def test_the_committed_prompt_sets_load_and_pass_the_check():
    train = sd.load_prompts(sd.PromptSpec(limit=50))
    held = sd.load_prompts(sd.PromptSpec(split="heldout"))
    assert len(train) == 50 and len(held) == 400
    assert not {p["id"] for p in train} & {p["id"] for p in held}


def test_shipped_answers_are_reused_only_for_the_same_fingerprint(tmp_path, settings, answered, monkeypatch):
    prompts = sd.load_prompts(sd.PromptSpec(source="jsonl", path=str(write_prompts(tmp_path / "p.jsonl"))))
    built = sd.build("tiny-random", prompts, settings, tiny=TINY, progress=False)
    shipped = tmp_path / "shipped"
    (shipped / built.folder.name).mkdir(parents=True)
    for name in ("meta.json", "rows.jsonl"):
        (shipped / built.folder.name / name).write_bytes((built.folder / name).read_bytes())
    monkeypatch.setattr(sd, "SHIPPED", shipped)
    fresh = sd.DistillSettings(max_new_tokens=6, batch_size=2, dtype="float32", root=str(tmp_path / "fresh-cache"))
    reused = sd.build("tiny-random", prompts, fresh, tiny=TINY, progress=False)
    assert len(answered) == 1 and reused.stats["rows"] == 5  # nothing answered again
    assert reused.rows_path.read_text() == built.rows_path.read_text()
    # a shipped folder whose fingerprint does not match is ignored
    meta = shipped / built.folder.name / "meta.json"
    meta.write_text(meta.read_text().replace('"max_new_tokens": 6', '"max_new_tokens": 5'))
    sd.build(
        "tiny-random",
        prompts,
        sd.DistillSettings(max_new_tokens=6, batch_size=2, dtype="float32", root=str(tmp_path / "third")),
        tiny=TINY,
        progress=False,
    )
    assert len(answered) == 2


def test_the_model_fingerprint_digests_every_byte_of_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    weights = bytearray(3 << 20)  # larger than the first and last MiB together
    (folder / "model.safetensors").write_bytes(weights)
    before = sd.model_fingerprint(str(folder))
    weights[len(weights) // 2] = 1  # one edited byte in the middle of the file
    (folder / "model.safetensors").write_bytes(weights)
    assert sd.model_fingerprint(str(folder)) != before
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weight files"):
        sd.model_fingerprint(str(folder))


def test_the_shipped_answers_sit_under_the_key_the_embedded_model_computes():
    from mars.models import embedded_gguf_path
    from mars.persistence import sha256_of

    settings = sd.DistillSettings(max_new_tokens=192, batch_size=16, dtype="float32")
    fp = sd.fingerprint(sd.model_fingerprint("embedded:smollm2-135m"), settings, "float32")
    assert fp["model"] == f"embedded:smollm2-135m:{sha256_of(embedded_gguf_path())}"
    name = sd.cache_folder(fp, None).name
    assert json.loads((sd.SHIPPED / name / "meta.json").read_text())["fingerprint"] == fp
    assert len(sd._shipped_rows(name, fp)) == 2181
