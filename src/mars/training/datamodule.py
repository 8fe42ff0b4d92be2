"""The training data as Lightning takes it (:mod:`mars.training.data` reads and tokenizes the rows): length-grouped
batches through a resumable ``StatefulDataLoader`` whose position every checkpoint keeps."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L

from mars.training.data import (
    LengthGroupedSampler,
    Rows,
    TokenizedDataset,
    build_dataset,
    check_data_config,
    collate,
    load_rows,
)


class _IteratorAtFirstBatch:
    """An iterator whose underlying one is made when its first item is drawn, not when it is created."""

    def __init__(self, make: Callable[[], Iterator[Any]]):
        self._make, self._iterator = make, None

    def __iter__(self) -> _IteratorAtFirstBatch:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._make()
        return next(self._iterator)


def resumable_loader_class():
    """``StatefulDataLoader`` whose iteration starts at the first batch drawn.  Lightning calls ``iter()`` on the
    training loader while it sets up, and under FSDP and DeepSpeed that is before the checkpoint (with this
    loader's position) is restored; an iterator made then would start the epoch from its first batch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class ResumableDataLoader(StatefulDataLoader):
        def __iter__(self):
            return _IteratorAtFirstBatch(super().__iter__)

    return ResumableDataLoader


class InstructionDataModule(L.LightningDataModule):
    """Tokenized instruction data in length-grouped batches, through a ``StatefulDataLoader`` whose state
    (the sampler's epoch and the batches trained, consistent with prefetching workers) is saved in every
    checkpoint by this module's ``state_dict``, so a killed run resumes on the next unseen batch and trains
    no row twice.

    Lightning also saves a stateful loader's state in its loop state, but restores it only when the loader
    is first built after the checkpoint is read; ``configure_optimizers`` asks for
    ``trainer.estimated_stepping_batches``, which builds the loader earlier, so that copy is never applied.
    The data module's own state is restored before any loader is built and applied here; under strategies that
    restore a checkpoint after their setup (FSDP, DeepSpeed) the loader exists by then, and the state is applied
    to it before its first batch is drawn (:func:`resumable_loader_class`).
    """

    def __init__(
        self,
        tokenizer,
        *,
        source: str = "offline",
        path: str | None = None,
        hub_id: str | None = None,
        split: str = "train",
        max_length: int = 512,
        batch_size: int = 8,
        limit: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        rows: Rows | None = None,
    ):
        super().__init__()
        check_data_config(
            dict(source=source, max_length=max_length, batch_size=batch_size, limit=limit, num_workers=num_workers)
        )
        self.tokenizer = tokenizer
        self.kw = dict(source=source, path=path, hub_id=hub_id, split=split, limit=limit)
        self.max_length, self.batch_size, self.seed, self.num_workers = max_length, batch_size, seed, num_workers
        self.rows = rows
        self.dataset: TokenizedDataset | None = None
        self.sampler: LengthGroupedSampler | None = None
        self.loader = None
        self._pending_state: dict[str, Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            rows = self.rows if self.rows is not None else load_rows(**self.kw)
            self.dataset = build_dataset(rows, self.tokenizer, self.max_length)
            self.rows = None  # the tokenized rows are all that is needed from here on

    def train_dataloader(self):
        self.setup()
        lengths = [len(e["input_ids"]) for e in self.dataset.examples]
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        self.sampler = LengthGroupedSampler(lengths, self.batch_size, seed=self.seed, num_replicas=replicas, rank=rank)
        pad = self.tokenizer.pad_token_id
        self.loader = resumable_loader_class()(
            self.dataset,
            sampler=self.sampler,
            batch_size=self.batch_size,
            collate_fn=functools.partial(collate, pad_id=pad),
            num_workers=self.num_workers,
        )
        if self._pending_state is not None:
            self.loader.load_state_dict(self._pending_state)
            self._pending_state = None
        return self.loader

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()} if self.loader is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("loader"):
            return
        if self.loader is not None:  # FSDP and DeepSpeed restore after setup, which has built the loader already
            self.loader.load_state_dict(state["loader"])
        else:
            self._pending_state = state["loader"]

    @property
    def num_batches(self) -> int:
        self.setup()
        return math.ceil(len(self.dataset) / self.batch_size)
