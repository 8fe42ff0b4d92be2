"""Instruction data -> token ids + loss masks, batched by length (the LightningDataModule: :mod:`mars.training.datamodule`).

Sources: the committed offline default (``data/offline_sft``: real prompts, self-distilled responses),
any local JSONL (``data.path``), any hub dataset (``data.hub_id``) and a hub dataset saved to a folder
(``source: disk``, written once by ``python -m mars.training.fetch`` where the hub is reachable, for nodes
without it), each row in chat-messages form
(``{"messages": [{"role", "content"}, ...]}``) or prompt/response form (``{"prompt", "response"}``).
The chat template is applied, loss falls on assistant tokens only (through their end-of-turn token),
rows are truncated to ``max_length`` and batched with rows of similar length.

A row may carry ``"finished": false`` (a self-distilled answer cut at the token cap): its last assistant
turn then gets no loss on the end-of-turn token, so the model does not learn to stop mid-sentence.

Rows are read and checked (JSON, fields, an assistant turn) by :func:`load_rows` / :func:`check_rows`
before any model loads, and every error names the file, the line and what was expected.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from pydantic import AfterValidator, Field
from torch.utils.data import Dataset, Sampler

from mars.config_schema import OpenSection, validated
from mars.paths import data_dir
from mars.training.refusals import DataUnreachable

log = logging.getLogger(__name__)

OFFLINE_DATA = data_dir() / "offline_sft"  # the checkout's data/, or the installed package's copy
SOURCES = ("offline", "jsonl", "hub", "disk")
# what datasets' save_to_disk writes: one split (a Dataset) or several (a DatasetDict)
DISK_MARKERS = ("state.json", "dataset_dict.json")


def fetch_command(hub_id: str | None) -> str:
    """The one-time command that saves ``hub_id`` (and the paper's models) into a folder for offline training."""
    dataset = f" --dataset {hub_id}" if hub_id else ""
    return f"python -m mars.training.fetch --out <folder>{dataset}"


ROW_FORMS = "{'messages': [{'role': ..., 'content': ...}, ...]} or {'prompt': ..., 'response': ...}"


# ------------------------------------------------------------------------------------------
# Rows -> messages
# ------------------------------------------------------------------------------------------
def to_messages(row: dict[str, Any], index: int | str | None = None) -> list[dict[str, str]]:
    """Normalise one row to chat messages, or fail naming the row and the fields it has.

    ``index`` names the row in messages: a number (``row 3``) or a label (``file.jsonl, line 4``)."""
    where = "a row" if index is None else (f"row {index}" if isinstance(index, int) else str(index))
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a JSON object but {type(row).__name__}; expected {ROW_FORMS}")
    # JSON loaders unify columns across rows, so a missing field shows up as None
    row = {k: v for k, v in row.items() if v is not None}
    response = row.get("response", row.get("completion"))
    if row.get("messages"):
        messages = row["messages"]
        if not isinstance(messages, list):
            raise ValueError(
                f"{where}: 'messages' must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}"
            )
    elif "prompt" in row and response is not None:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": response}]
    else:
        raise ValueError(
            f"{where} has neither 'messages' nor 'prompt'/'response' fields (found keys {sorted(row)}); "
            f"expected {ROW_FORMS}"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: every message needs 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise ValueError(
                f"{where}: message content must be a string, got {type(m['content']).__name__} in {str(m)[:120]}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}: the conversation has no assistant turn to train on (roles "
            f"{[m['role'] for m in messages]}); expected at least one 'assistant' message"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def row_finished(row: dict[str, Any], index: int | str | None = None) -> bool:
    """``False`` only for a row marked ``"finished": false`` (its answer was cut); the field is optional."""
    value = row.get("finished") if isinstance(row, dict) else None
    if value is None:
        return True
    if not isinstance(value, bool):
        where = "a row" if index is None else (f"row {index}" if isinstance(index, int) else str(index))
        raise ValueError(f"{where}: 'finished' must be true or false, got {value!r}")
    return value


def tokenize_messages(
    messages: list[dict[str, str]], tokenizer, max_length: int, finished: bool = True
) -> dict[str, Any]:
    """Token ids of the chat-formatted conversation and a 0/1 loss mask over assistant tokens.

    Each assistant turn's span is the difference between the template rendered up to the turn
    (with the generation prompt) and up to its end; the span is cut after the first EOS so the
    template's trailing newline carries no loss.  With ``finished=False`` (the last answer was cut at a
    token cap) the last assistant turn's span ends *before* its EOS: the template closes the turn, but
    the model must not learn to close it there.
    """
    ids: list[int] = []
    mask: list[int] = []
    eos = tokenizer.eos_token_id
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
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
        if not finished and i == last_assistant and eos in span:
            cut -= 1  # no loss on the EOS that closes a cut answer
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
@dataclass
class Rows:
    """Raw rows and where each came from (``file, line N`` for JSONL, ``hub_id, row N`` for the hub)."""

    rows: Sequence[dict[str, Any]]
    where: str
    lines: list[int] | None = None  # the file line of each row (JSONL sources)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def label(self, i: int) -> str:
        return f"{self.where}, line {self.lines[i]}" if self.lines is not None else f"{self.where}, row {i}"


def read_jsonl(path: str | Path) -> Rows:
    """Every row of a JSONL file, failing on the first bad line with the file, the line and what is wrong."""
    path = Path(path)
    rows, lines = [], []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"{path}, line {number}: not valid JSON ({err.msg}, column {err.colno}); "
                        f"expected one JSON object per line: {ROW_FORMS}"
                    ) from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{path}, line {number}: expected a JSON object ({ROW_FORMS}), got {type(row).__name__}"
                    )
                rows.append(row)
                lines.append(number)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err}); expected a JSONL file") from None
    if not rows:
        raise ValueError(f"{path} holds no rows (the file is empty); expected one JSON object per line: {ROW_FORMS}")
    return Rows(rows, str(path), lines)


def data_file(source: str, path: str | None = None, split: str = "train") -> Path | None:
    """The local file a file-backed source reads (None for the hub), checked to exist."""
    if source == "offline":
        file = OFFLINE_DATA / f"{split}.jsonl"
        if not file.is_file():
            raise FileNotFoundError(
                f"offline data {file} is missing (data.split={split!r}; the committed splits are "
                "train and heldout; build them with scripts/build_offline_data.py)"
            )
        return file
    if source == "jsonl":
        if not path:
            raise ValueError("data.source=jsonl needs data.path=<file.jsonl>")
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(
                f"data.path={path!r} is not a file (expected a JSONL file, one row per line: {ROW_FORMS})"
            )
        return file
    if source == "hub":
        return None
    if source == "disk":
        if not path:
            raise ValueError("data.source=disk needs data.path=<folder written by python -m mars.training.fetch>")
        folder = Path(path).expanduser()
        if not any((folder / m).is_file() for m in DISK_MARKERS):
            raise FileNotFoundError(
                f"data.path={path!r} is not a dataset folder (no {' or '.join(DISK_MARKERS)}): write it once where "
                f"the hub is reachable with {fetch_command(None)} and point data.path at its datasets/<id> folder"
            )
        return folder
    raise ValueError(f"data.source must be one of {' | '.join(SOURCES)} (or self_distill in train.py), got {source!r}")


def check_hub_dataset(hub_id: str | None, split: str = "train") -> None:
    """A hub dataset can be read here: the hub answers (one request, seconds), or offline mode is on (the
    Hugging Face cache answers; :func:`load_rows` names a dataset missing from it).  Otherwise one error at once,
    naming the fetch command and the folder config that trains without the hub, instead of a minute of retries
    and a ConnectionError."""
    from huggingface_hub import constants

    from mars.models import _hub_unreachable

    if not hub_id:
        raise ValueError("data.source=hub needs data.hub_id")
    if constants.HF_HUB_OFFLINE:
        return
    reason = _hub_unreachable(constants.ENDPOINT)
    if reason is not None:
        raise DataUnreachable(
            unreachable_message(hub_id, split, f"the hub ({constants.ENDPOINT}) does not answer: {reason}")
        )


def unreachable_message(hub_id: str, split: str, why: str) -> str:
    from huggingface_hub import constants

    cache = (
        f"HF_HUB_OFFLINE=1 is set, and the Hugging Face cache ({constants.HF_HUB_CACHE}) does not hold it"
        if constants.HF_HUB_OFFLINE
        else "or set HF_HUB_OFFLINE=1 where it is in the Hugging Face cache"
    )
    return (
        f"data.hub_id={hub_id} (split {split}) cannot be read here: {why}. Fetch it once where the hub is reachable "
        f"with {fetch_command(hub_id)}, then train from that folder without the hub: data=dolci_local "
        f"data.path=<folder>/datasets/{hub_id} ({cache})"
    )


def load_rows(
    source: str, path: str | None = None, hub_id: str | None = None, split: str = "train", limit: int | None = None
) -> Rows:
    """Raw rows from ``offline`` (the committed default), ``jsonl`` (``path``) or ``hub`` (``hub_id``)."""
    file = data_file(source, path, split)
    if source == "disk":
        rows = Rows(read_disk_dataset(file, split), f"{file} ({split})")
    elif file is not None:
        rows = read_jsonl(file)
    else:
        if not hub_id:
            raise ValueError("data.source=hub needs data.hub_id")
        rows = Rows(read_hub_dataset(hub_id, split), f"{hub_id} ({split})")
    if len(rows) == 0:
        raise ValueError(f"the dataset {rows.where} holds no rows")
    if limit is not None:
        if isinstance(rows.rows, list):
            rows = Rows(rows.rows[:limit], rows.where, rows.lines[:limit] if rows.lines else None)
        else:
            rows = Rows(rows.rows.select(range(min(limit, len(rows)))), rows.where)
    return rows


def read_hub_dataset(hub_id: str, split: str):
    """``datasets.load_dataset(hub_id, split=split)``; where neither the hub nor the cache can give it, the
    error names the fetch command (:func:`unreachable_message`)."""
    import datasets
    from huggingface_hub import constants

    try:
        return datasets.load_dataset(hub_id, split=split)
    except (ConnectionError, FileNotFoundError) as err:
        if isinstance(err, FileNotFoundError) and not constants.HF_HUB_OFFLINE:
            raise  # the hub answered: there is no such dataset
        raise DataUnreachable(unreachable_message(hub_id, split, f"{type(err).__name__}: {err}")) from None


def read_disk_dataset(folder: Path, split: str):
    """A folder that ``datasets``' ``save_to_disk`` wrote (memory-mapped, nothing is copied): one split, or the
    ``split`` of a DatasetDict."""
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{folder} holds the splits {sorted(loaded)}, not data.split={split!r}")
        return loaded[split]
    return loaded


def check_rows(rows: Rows) -> None:
    """Every row has messages (or prompt/response) with an assistant turn and a valid ``finished`` flag:
    checked without a tokenizer, so a bad row fails before the model loads."""
    for i, row in enumerate(rows):
        to_messages(row, rows.label(i))
        row_finished(row, rows.label(i))


class TokenizedDataset(Dataset):
    def __init__(self, examples: list[dict[str, Any]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.examples[i], "index": i}


def build_dataset(rows, tokenizer, max_length: int) -> TokenizedDataset:
    """Tokenize every row; drop rows with no response token left after truncation; log counts."""
    if not isinstance(rows, Rows):
        rows = Rows(list(rows), "data")
    examples, truncated, dropped, cut = [], 0, 0, 0
    for i, row in enumerate(rows):
        label = rows.label(i)
        finished = row_finished(row, label)
        try:
            ex = tokenize_messages(to_messages(row, label), tokenizer, max_length, finished=finished)
        except ValueError as err:
            if str(err).startswith(label):
                raise
            raise ValueError(f"{label}: {err}") from None
        truncated += ex["truncated"]
        cut += not finished
        if sum(ex["loss_mask"][1:]) == 0:  # position 0 is never a target
            dropped += 1
            continue
        examples.append({"input_ids": ex["input_ids"], "loss_mask": ex["loss_mask"]})
    log.info(
        "data: %d rows (%d cut at a token cap: no loss on their EOS), %d truncated to max_length=%d, "
        "%d dropped (no response token left)",
        len(examples),
        cut,
        truncated,
        max_length,
        dropped,
    )
    if not examples:
        raise ValueError(
            f"the dataset {rows.where} is empty after filtering ({dropped} rows dropped: no response "
            f"token left within max_length={max_length})"
        )
    return TokenizedDataset(examples)


# ------------------------------------------------------------------------------------------
# Batching
# ------------------------------------------------------------------------------------------
class LengthGroupedSampler(Sampler[int]):
    """Shuffled order in which neighbours have similar lengths (less padding), reproducible per epoch,
    resumable, and sharded over data-parallel ranks by whole batches.

    Indices are shuffled, cut into mega-batches of ``batch_size * group``, sorted by length inside each,
    cut into batches, and the batches shuffled; the one partial batch (when the dataset size is not a
    multiple of ``batch_size``) goes last, so the data loader's ``batch_size`` cuts exactly these batches.
    Under data parallelism rank ``r`` takes batches ``r, r + R, ...`` of that list, padded with its first
    batches to a multiple of ``R`` so every rank runs the same number of steps (the partial batch stays
    last on its rank).

    Stateful (``state_dict``/``load_state_dict``, carried by ``StatefulDataLoader``): the epoch and the
    indices this rank has handed out.  A restored sampler skips exactly those in that epoch, on every rank
    (all ranks step together, so rank 0's count is theirs), and a state saved on an epoch's last batch
    starts the next epoch whole.  The order is computed when the first index is drawn, after Lightning has
    called ``set_epoch``.
    """

    def __init__(
        self, lengths: list[int], batch_size: int, seed: int = 0, group: int = 32, num_replicas: int = 1, rank: int = 0
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.lengths, self.batch_size, self.seed, self.group = lengths, batch_size, seed, group
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.yielded = 0  # indices handed out in the current pass
        self._restored: tuple[int, int] | None = None  # (epoch, indices yielded) from a checkpoint

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches, before they are dealt to the ranks (the partial one last)."""
        rng = random.Random(self.seed * 100_003 + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        mega = self.batch_size * self.group
        batches = []
        for s in range(0, len(idx), mega):
            chunk = sorted(idx[s : s + mega], key=lambda i: self.lengths[i], reverse=True)
            batches += [chunk[b : b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
        rng.shuffle(batches)
        return [b for b in batches if len(b) == self.batch_size] + [b for b in batches if len(b) < self.batch_size]

    def rank_batches(self) -> list[list[int]]:
        batches = self.all_batches()
        batches = batches + batches[: -len(batches) % self.num_replicas]
        return batches[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return self._generate()

    def _generate(self) -> Iterator[int]:
        order = [i for b in self.rank_batches() for i in b]
        skip = 0
        if self._restored is not None:
            epoch, done = self._restored
            self._restored = None
            if epoch == self.epoch:
                skip = done
        self.yielded = skip
        for i in order[skip:]:
            self.yielded += 1
            yield i

    def __len__(self) -> int:
        n, b = len(self.lengths), self.batch_size
        sizes = [b] * (n // b) + ([n % b] if n % b else [])  # all_batches' sizes: the partial one last
        sizes = sizes + sizes[: -len(sizes) % self.num_replicas]
        return sum(sizes[self.rank :: self.num_replicas])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "yielded": int(self.yielded)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, done = int(state["epoch"]), int(state["yielded"])
        if done >= len(self):  # saved on the epoch's last batch: the run goes on with the next epoch, whole
            epoch, done = epoch + 1, 0
        self.epoch, self.yielded = epoch, done
        self._restored = (epoch, done)


def _known_source(source: str) -> str:
    if source not in (*SOURCES, "self_distill"):
        raise ValueError(f"must be one of {' | '.join(SOURCES)} | self_distill")
    return source


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


class DataSettings(OpenSection):
    """The data keys checked before any file is read (``path``, ``hub_id``, ``split`` and ``distill`` are
    checked where they are used: :func:`data_file`, :mod:`mars.training.self_distill`)."""

    section: ClassVar[str] = "data"
    source: Annotated[str, AfterValidator(_known_source)]
    max_length: Annotated[int, Field(ge=2)]
    batch_size: Annotated[int, Field(ge=1)]
    limit: Annotated[int, Field(ge=1)] | None = None
    num_workers: Annotated[int, Field(ge=0)] | None = None


def check_data_config(data: dict[str, Any]) -> DataSettings:
    """The data settings that need no file and no model: sizes and the source name."""
    return validated(DataSettings, data)
