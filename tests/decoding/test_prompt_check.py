"""The prompt checks ``generate`` and the server share: which prompt is refused, in which words, and which refusals
are about the context (the server's ``context_length_exceeded``)."""

import pytest

from mars.decoding.prompt_check import PromptTooLong, check_budget, check_prompt, check_prompts


def test_a_prompt_is_refused_for_its_length_first_then_for_being_empty_then_for_an_id():
    with pytest.raises(PromptTooLong, match=r"^prompt 2 has 8 tokens, longer than the model's context of 8 tokens"):
        check_prompt([99] * 8, vocab=10, context=8, label="prompt 2")  # the length, before any id is read
    with pytest.raises(ValueError, match=r"^messages is empty after tokenization$") as empty:
        check_prompt([], vocab=10, context=8, label="messages")
    with pytest.raises(
        ValueError, match=r"^prompt 0 has token id 10, outside the model's vocabulary of 10 ids$"
    ) as bad:
        check_prompt([3, 10, -1], vocab=10, context=None, label="prompt 0")
    assert not isinstance(empty.value, PromptTooLong) and not isinstance(bad.value, PromptTooLong)
    with pytest.raises(ValueError, match="token id -1"):
        check_prompt([3, -1], vocab=10, context=8, label="prompt 0")
    check_prompt([0, 9] * 100, vocab=10, context=None, label="prompt 0")  # no context: any length


def test_a_budget_past_the_context_names_its_own_key_and_the_room_left():
    check_budget(5, 3, 8, label="prompt 0")  # reaches position 8: fits
    check_budget(5, 10**6, None, label="prompt 0")
    with pytest.raises(PromptTooLong) as refused:
        check_budget(5, 4, 8, label="prompt 1", budget="max_tokens")
    assert str(refused.value) == (
        "prompt 1 has 5 tokens: with max_tokens=4 generation would reach position 9, past the model's context of "
        "8 tokens; shorten the prompt or lower max_tokens to at most 3"
    )


def test_a_batch_names_its_first_bad_prompt_and_checks_the_budget_after_the_longest():
    with pytest.raises(ValueError, match=r"^prompt 1 is empty"):
        check_prompts([[1], [], [10]], vocab=10, context=8, max_new_tokens=1)
    with pytest.raises(PromptTooLong, match=r"^prompt 2 has 6 tokens: with max_new_tokens=3 .* at most 2$"):
        check_prompts([[1], [1, 2], [1] * 6], vocab=10, context=8, max_new_tokens=3)
    check_prompts([[1], [1] * 6], vocab=10, context=8, max_new_tokens=2)
