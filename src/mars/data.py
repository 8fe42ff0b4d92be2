"""Instruction data -> token ids + loss masks, and the LightningDataModule that batches them.

Sources: the committed offline default (``data/offline_sft``: real prompts, self-distilled responses),
any local JSONL (``data.path``) and any hub dataset (``data.hub_id``), each row in chat-messages form
(``{"messages": [{"role", "content"}, ...]}``) or prompt/response form (``{"prompt", "response"}``).
The chat template is applied, loss falls on assistant tokens only (through their end-of-turn token),
rows are truncated to ``max_length`` and batched with rows of similar length.
"""

from __future__ import annotations

import logging
import functools
import math
import random
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
OFFLINE_DATA = REPO_ROOT / "data" / "offline_sft"


# ------------------------------------------------------------------------------------------
# Rows -> messages
# ------------------------------------------------------------------------------------------
def to_messages(row: dict[str, Any], index: int | None = None) -> list[dict[str, str]]:
    """Normalise one row to chat messages, or fail naming the row and the fields it has."""
    # JSON loaders unify columns across rows, so a missing field shows up as None
    row = {k: v for k, v in row.items() if v is not None}
    response = row.get("response", row.get("completion"))
    if row.get("messages"):
        messages = row["messages"]
    elif "prompt" in row and response is not None:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": response}]
    else:
        where = f"row {index}" if index is not None else "a row"
        raise ValueError(
            f"{where} has neither 'messages' nor 'prompt'/'response' fields (found keys {sorted(row)}); "
            "expected {'messages': [{'role': ..., 'content': ...}, ...]} or {'prompt': ..., 'response': ...}"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"row {index}: every message needs 'role' and 'content', got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def tokenize_messages(messages: list[dict[str, str]], tokenizer, max_length: int) -> dict[str, Any]:
    """Token ids of the chat-formatted conversation and a 0/1 loss mask over assistant tokens.

    Each assistant turn's span is the difference between the template rendered up to the turn
    (with the generation prompt) and up to its end; the span is cut after the first EOS so the
    template's trailing newline carries no loss.
    """
    ids: list[int] = []
    mask: list[int] = []
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        prefix, full = _as_ids(prefix), _as_ids(full)
        if full[: len(prefix)] != prefix:
            raise ValueError("chat template is not prefix-stable; cannot locate the assistant tokens")
        if full[: len(ids)] != ids:
            raise ValueError("chat template re-renders earlier turns differently; cannot build a loss mask")
        span_start = len(prefix)
        span = full[span_start:]
        cut = span.index(eos) + 1 if eos in span else len(span)
        mask.extend([0] * (span_start - len(mask)))
        mask.extend([1] * cut + [0] * (len(span) - cut))
        ids = full
    if not ids:
        raise ValueError("conversation has no assistant turn to train on")
    truncated = len(ids) > max_length
    return {
        "input_ids": ids[:max_length],
        "loss_mask": mask[:max_length],
        "truncated": truncated,
    }


def _as_ids(out) -> list[int]:
    # transformers 5 may return a BatchEncoding from apply_chat_template(tokenize=True)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------
def load_rows(source: str, path: str | None = None, hub_id: str | None = None, split: str = "train",
              limit: int | None = None) -> list[dict[str, Any]]:
    """Raw rows from ``offline`` (the committed default), ``jsonl`` (``path``) or ``hub`` (``hub_id``)."""
    import datasets

    if source == "offline":
        files = str(OFFLINE_DATA / f"{split}.jsonl")
        if not Path(files).is_file():
            raise FileNotFoundError(f"offline data {files} is missing (build it with scripts/build_offline_data.py)")
        ds = datasets.load_dataset("json", data_files=files, split="train")
    elif source == "jsonl":
        if not path or not Path(path).is_file():
            raise FileNotFoundError(f"data.path={path!r} is not a JSONL file")
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    elif source == "hub":
        if not hub_id:
            raise ValueError("data.source=hub needs data.hub_id")
        ds = datasets.load_dataset(hub_id, split=split)
    else:
        raise ValueError(f"data.source must be one of offline | jsonl | hub, got {source!r}")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds


class TokenizedDataset(Dataset):
    def __init__(self, examples: list[dict[str, Any]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.examples[i], "index": i}


def build_dataset(rows, tokenizer, max_length: int) -> TokenizedDataset:
    """Tokenize every row; drop rows with no response token left after truncation; log counts."""
    examples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        ex = tokenize_messages(to_messages(row, i), tokenizer, max_length)
        truncated += ex["truncated"]
        if sum(ex["loss_mask"][1:]) == 0:  # position 0 is never a target
            dropped += 1
            continue
        examples.append({"input_ids": ex["input_ids"], "loss_mask": ex["loss_mask"]})
    log.info("data: %d rows, %d truncated to max_length=%d, %d dropped (no response token left)",
             len(examples), truncated, max_length, dropped)
    if not examples:
        raise ValueError(f"the dataset is empty after filtering ({dropped} rows dropped, max_length={max_length})")
    return TokenizedDataset(examples)


# ------------------------------------------------------------------------------------------
# Batching
# ------------------------------------------------------------------------------------------
class LengthGroupedSampler(Sampler[int]):
    """Shuffled order in which neighbours have similar lengths (less padding), reproducible per epoch.

    Indices are shuffled, cut into mega-batches of ``batch_size * group``, sorted by length inside each
    and the resulting batches shuffled.  ``resume_at`` resumes mid-epoch after a restart.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, group: int = 32):
        self.lengths, self.batch_size, self.seed, self.group = lengths, batch_size, seed, group
        self.epoch = 0
        self.resume_at: tuple[int, int] | None = None  # (epoch, batches already trained) after a restart

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        rng = random.Random(self.seed * 100_003 + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        mega = self.batch_size * self.group
        batches = []
        for s in range(0, len(idx), mega):
            chunk = sorted(idx[s : s + mega], key=lambda i: self.lengths[i], reverse=True)
            batches += [chunk[b : b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
        rng.shuffle(batches)
        return [i for b in batches for i in b]

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        skip = 0
        if self.resume_at is not None and self.resume_at[0] == self.epoch:
            skip = self.resume_at[1] * self.batch_size
        self.resume_at = None
        # The trained batches go to the end instead of being dropped: the length stays what Lightning
        # (and its DDP sampler wrapper, which sizes itself once) expects, and the epoch loop stops after
        # the batches that were left, so the tail is never reached.
        return iter(order[skip:] + order[:skip])

    def __len__(self) -> int:
        return len(self.lengths)


def collate(batch: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row.  Right padding keeps every real token's attention unchanged in
    both streams (pads come after all real positions), so one mask serves the whole batch."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[r, :n] = torch.tensor(b["input_ids"])
        loss_mask[r, :n] = torch.tensor(b["loss_mask"])
    return {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "length": torch.tensor([len(b["input_ids"]) for b in batch]),
        "index": torch.tensor([b["index"] for b in batch]),
    }


class InstructionDataModule(L.LightningDataModule):
    """Tokenized instruction data, length-grouped batches, and mid-epoch resume state."""

    def __init__(self, tokenizer, *, source: str = "offline", path: str | None = None, hub_id: str | None = None,
                 split: str = "train", max_length: int = 512, batch_size: int = 8, limit: int | None = None,
                 seed: int = 0, num_workers: int = 0):
        super().__init__()
        if max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.tokenizer = tokenizer
        self.kw = dict(source=source, path=path, hub_id=hub_id, split=split, limit=limit)
        self.max_length, self.batch_size, self.seed, self.num_workers = max_length, batch_size, seed, num_workers
        self.dataset: TokenizedDataset | None = None
        self.sampler: LengthGroupedSampler | None = None
        self._resume: dict[str, int] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            self.dataset = build_dataset(load_rows(**self.kw), self.tokenizer, self.max_length)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        lengths = [len(e["input_ids"]) for e in self.dataset.examples]
        self.sampler = LengthGroupedSampler(lengths, self.batch_size, seed=self.seed)
        if self._resume is not None:
            self.sampler.set_epoch(self._resume["epoch"])
            # under DDP every rank took its own batches from the one order (Lightning's sampler wrapper
            # deals them out), so the order advanced world_size batches per step
            done = self._resume["batches_done"] * int(self._resume.get("world_size", 1))
            self.sampler.resume_at = (self._resume["epoch"], done)
            self._resume = None
        pad = self.tokenizer.pad_token_id
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                          collate_fn=functools.partial(collate, pad_id=pad), num_workers=self.num_workers)

    # Saved in every Lightning checkpoint: which epoch and how many of its batches were trained on,
    # so a killed run resumes on the next unseen batch instead of replaying the epoch.
    def state_dict(self) -> dict[str, int]:
        trainer = self.trainer
        if trainer is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": trainer.current_epoch, "batches_done": int(progress.processed),
                "world_size": int(trainer.world_size)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state:
            self._resume = dict(state)

    @property
    def num_batches(self) -> int:
        self.setup()
        return math.ceil(len(self.dataset) / self.batch_size)
