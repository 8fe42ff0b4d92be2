"""Rows are read and checked before the model loads, and every error names the file, the line and what is
expected; a row marked ``finished: false`` (an answer cut at a token cap) gets no loss on its EOS."""

import json

import pytest

from mars.models import embedded_tokenizer
from mars.training.data import Rows, build_dataset, to_messages, tokenize_messages
from mars.training.run import run

GOOD = {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]}


@pytest.fixture
def no_model_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr("mars.training.run.load_model", fail)


@pytest.mark.parametrize(
    "lines,match",
    [
        (
            [json.dumps(GOOD), '{"messages": [{"role": "user", "content": "hi"}', json.dumps(GOOD)],
            r"rows.jsonl, line 2: not valid JSON \(.*\); expected one JSON object per line",
        ),
        ([], r"rows.jsonl holds no rows \(the file is empty\)"),
        (["", "   "], r"rows.jsonl holds no rows"),
        ([json.dumps(GOOD), json.dumps([1, 2])], r"rows.jsonl, line 2: expected a JSON object .* got list"),
        (
            [
                json.dumps(GOOD),
                json.dumps(GOOD),
                json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
            ],
            r"rows.jsonl, line 3: the conversation has no assistant turn to train on \(roles \['user'\]\)",
        ),
        ([json.dumps({**GOOD, "finished": "no"})], r"rows.jsonl, line 1: 'finished' must be true or false, got 'no'"),
        (
            [json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]})],
            r"rows.jsonl, line 1: message content must be a string",
        ),
    ],
)
def test_bad_rows_fail_before_the_model_loads_naming_file_and_line(
    compose_cfg, tiny_train_overrides, tmp_path, no_model_loading, lines, match
):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError, match=match):
        run(compose_cfg("train", tiny_train_overrides + [f"data.path={path}"]))


def test_a_cut_answer_gets_no_loss_on_its_eos():
    tok = embedded_tokenizer()
    messages = to_messages(GOOD)
    done = tokenize_messages(messages, tok, max_length=512)
    cut = tokenize_messages(messages, tok, max_length=512, finished=False)
    assert done["input_ids"] == cut["input_ids"]  # the template still closes the turn
    eos = done["input_ids"].index(tok.eos_token_id, done["loss_mask"].index(1))
    assert done["loss_mask"][eos] == 1 and cut["loss_mask"][eos] == 0
    assert [m for i, m in enumerate(done["loss_mask"]) if i != eos] == [
        m for i, m in enumerate(cut["loss_mask"]) if i != eos
    ]
    assert sum(cut["loss_mask"]) == sum(done["loss_mask"]) - 1 > 0


def test_only_the_last_answer_of_a_cut_conversation_loses_its_eos():
    tok = embedded_tokenizer()
    two_turns = GOOD["messages"] + [{"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Eleven"}]
    rows = Rows([{"messages": two_turns, "finished": False}, {"messages": two_turns}], "mem")
    cut, done = build_dataset(rows, tok, max_length=512).examples
    ids = done["input_ids"]
    eos_with_loss = [i for i, t in enumerate(ids) if t == tok.eos_token_id and done["loss_mask"][i]]
    assert len(eos_with_loss) == 2  # both answers close with an EOS that carries loss
    first, last = eos_with_loss
    assert cut["loss_mask"][first] == 1 and cut["loss_mask"][last] == 0


def test_a_finished_false_row_trains_through_train_py(compose_cfg, tiny_train_overrides, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**GOOD, "finished": i % 2 == 0}) + "\n" for i in range(4)))
    out = run(compose_cfg("train", tiny_train_overrides + [f"data.path={path}", "trainer.max_steps=1"]))
    assert (out / "mars_config.json").is_file()
