"""The one reader of prompt files: a row's prompt from its string field or its chat, the optional fields, and
every bad line refused naming the file and the line."""

import json

import pytest

from mars.prompt_files import PromptFileError, PromptFileNotFound, prompt_of, read_prompt_file


def write(path, *lines: str | bytes):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def test_rows_read_in_file_order_with_their_optional_fields(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    path = write(
        tmp_path / "set.jsonl",
        json.dumps({"id": "a-1", "prompt": "Say hi.", "category": "chat", "source": "a", "answer": "ignored"}),
        "",
        json.dumps({"messages": chat, "id": 7}),
        json.dumps({"question": "What is 2 + 3?", "prompt": "Add two and three."}),
    )
    rows = read_prompt_file(path)
    assert [(r.id, r.prompt, r.line, r.category, r.source) for r in rows] == [
        ("a-1", "Say hi.", 1, "chat", "a"),
        ("7", "Hi there", 3, None, None),  # the first user turn; an integer id as text
        ("set-4", "Add two and three.", 4, None, None),  # no id: the file's stem and the line
    ]
    # the fields a tool names are tried in order before the chat
    assert [r.prompt for r in read_prompt_file(path, fields=("question", "prompt"))][2] == "What is 2 + 3?"


def test_prompt_of_reads_a_field_then_the_first_user_turn():
    assert prompt_of({"text": "x", "prompt": "p"}, ("text", "prompt")) == "x"
    assert prompt_of({"messages": [{"role": "assistant", "content": "no"}, {"role": "user", "content": "u"}]}) == "u"
    assert prompt_of({"messages": [{"role": "assistant", "content": "no"}]}) is None
    assert prompt_of({"prompt": 3}) is None


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"prompt": "caf\xe9"}', r"line 2: not UTF-8 \(byte 16\); save the file as UTF-8"),
        (b'{"prompt": "broken"', r"line 2: not valid JSON \(Expecting ',' delimiter, column 20\)"),
        (b'["Say hi."]', "line 2: expected a JSON object .*, found list"),
        (b'{"text": "Say hi."}', r"line 2: no prompt \(expected a non-empty 'prompt' string .*found keys \['text'\]"),
        (b'{"prompt": "  "}', "line 2: the prompt is empty"),
        (b'{"prompt": "Hi.", "category": "chat", "id": 1.5}', "line 2: 'id' must be a string or an integer, found 1.5"),
        (b'{"prompt": "Hi.", "category": null}', "line 2: 'category' must be a string, found None"),
        (b'{"prompt": "Hi."}', r"line 2: no 'category' field \(the figures are per category\)"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_and_the_line(tmp_path, line, reason):
    path = write(tmp_path / "bad.jsonl", '{"prompt": "Fine.", "category": "chat"}', line)
    with pytest.raises(PromptFileError, match=f"bad.jsonl, {reason}") as err:
        read_prompt_file(path, require={"category": "the figures are per category"})
    assert (err.value.path, err.value.line) == (str(path), 2)


def test_a_missing_file_is_a_file_not_found_error_naming_it(tmp_path):
    with pytest.raises(PromptFileNotFound, match="nowhere.jsonl: the file does not exist") as err:
        read_prompt_file(tmp_path / "nowhere.jsonl")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)
    with pytest.raises(PromptFileError, match="cannot be read"):
        read_prompt_file(tmp_path)  # a folder
    assert read_prompt_file(write(tmp_path / "blank.jsonl", "", "  ")) == []
