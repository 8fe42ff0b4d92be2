"""A bad prompt reads the same from the server as from ``generate`` (one check, :mod:`mars.decoding.prompt_check`):
the same message, the server's 400 naming the field, ``context_length_exceeded`` where the context is the cause."""

import httpx
import pytest
from serving_fixtures import assert_openai_error, loaded, one_thread, start_server  # noqa: F401  (fixtures)

from mars.decoding import generate

CONTEXT = 2048  # the tiny model's own: max_model_len=null below, so generate and the server see the same one


@pytest.fixture(scope="module")
def full_context(loaded):
    srv = start_server(loaded, "max_model_len=null")
    assert srv.state.context_length == CONTEXT == loaded.model.config.max_position_embeddings
    yield srv
    srv.stop()


def generate_refusal(loaded, srv, prompts, max_new_tokens):
    settings = srv.state.settings.replace(max_new_tokens=max_new_tokens)
    with pytest.raises(ValueError) as refused:
        generate(loaded.model, loaded.tokenizer, prompts, settings=settings)
    return str(refused.value)


@pytest.mark.parametrize(
    "prompt, code",
    [
        ([5, 60_000], None),  # an id outside the vocabulary
        ([[5, 6], [7, 60_000]], None),  # the second prompt's: named as generate names it
        ([[]], None),  # no token
        ("", None),  # text that tokenizes to nothing
        ([5] * CONTEXT, "context_length_exceeded"),  # no position left to generate in
    ],
    ids=["vocabulary", "second-prompt", "empty-ids", "empty-text", "context"],
)
def test_a_bad_prompt_gets_generates_words_from_the_server(loaded, full_context, prompt, code):
    reply = httpx.post(full_context.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
    err = assert_openai_error(reply, 400, "prompt", code)
    prompts = [prompt] if isinstance(prompt, str) or not isinstance(prompt[0], list) else prompt
    assert err["message"] == generate_refusal(loaded, full_context, prompts, 4)


def test_a_budget_past_the_context_reads_the_same_but_for_each_doors_own_key(loaded, full_context):
    prompt = [5] * (CONTEXT - 50)
    reply = httpx.post(full_context.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 60}, timeout=60)
    err = assert_openai_error(reply, 400, "max_tokens", "context_length_exceeded")
    offline = generate_refusal(loaded, full_context, [prompt], 60)
    assert "with max_new_tokens=60" in offline and "at most 50" in offline
    assert err["message"] == offline.replace("max_new_tokens", "max_tokens")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT}
    reply = httpx.post(full_context.url + "/v1/chat/completions", json=chat, timeout=60)
    err = assert_openai_error(reply, 400, "max_completion_tokens", "context_length_exceeded")
    assert err["message"].startswith("messages has ") and f"with max_completion_tokens={CONTEXT} " in err["message"]
