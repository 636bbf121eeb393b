"""The training batches in order, epoch after epoch, resumable, and collated ahead of the step
that trains on them.

Where the stream stands (epoch, batches of it taken) is reported with each update, and the trainer
records it in its progress only when it trains on that update: reading ahead never moves what a
checkpoint saves, so resuming stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..experiment.config import TrainConfig
from .augmented_data import AugmentedData
from .batches import Batch, ParallelData


@dataclass
class Update:
    """One optimizer update's batches (index arrays, every process's), and where the stream stands
    after them; `collated`: this process's share, collated (None: not yet)."""

    indices: list[np.ndarray] | None  # None: max_epochs has ended
    epoch: int
    batch_in_epoch: int
    collated: list[Batch] | None = None


class BatchStream:
    """Each epoch's batches are shuffled by seed + epoch; `next_update(count)` takes the next
    `count`, rolling over into the next epoch."""

    def __init__(self, data: ParallelData | AugmentedData, train_cfg: TrainConfig, epoch: int, batch_in_epoch: int):
        self.data, self.train_cfg = data, train_cfg
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self.batches = data.batches(train_cfg.max_tokens, seed=train_cfg.seed + epoch)

    def next_update(self, count: int) -> Update:
        taken = []
        while len(taken) < count:
            if self.batch_in_epoch >= len(self.batches):
                self.epoch += 1
                self.batch_in_epoch = 0
                if self.train_cfg.max_epochs is not None and self.epoch >= self.train_cfg.max_epochs:
                    return Update(None, self.epoch, self.batch_in_epoch)
                self.batches = self.data.batches(self.train_cfg.max_tokens, seed=self.train_cfg.seed + self.epoch)
            taken.append(self.batches[self.batch_in_epoch])
            self.batch_in_epoch += 1
        return Update(taken, self.epoch, self.batch_in_epoch)


class CollatedUpdates:
    """Updates with this process's batches (rank r takes r, r + N, … of each update) collated: on
    a background thread one update ahead when `ahead` (into pinned memory where `pin`: the copy to
    the GPU then does not block), else when asked for."""

    def __init__(self, stream: BatchStream, count: int, collate: Callable[[np.ndarray], Batch], rank: int,
                 world_size: int, ahead: bool, pin: bool):
        self.stream, self.count, self.collate = stream, count, collate
        self.rank, self.world_size, self.pin = rank, world_size, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tfm-collate") if ahead else None
        self.pending: tuple[Update, Future] | None = None

    def _collated(self, update: Update) -> list[Batch]:
        mine = (update.indices or [])[self.rank :: self.world_size]
        batches = [self.collate(indices) for indices in mine]
        return [b.pin_memory() for b in batches] if self.pin else batches

    def _start(self) -> tuple[Update, Future | None]:
        update = self.stream.next_update(self.count)
        if self.pool is None or update.indices is None:
            return update, None
        return update, self.pool.submit(self._collated, update)

    def next(self) -> Update:
        """The next update, collated (`indices` None once max_epochs has ended)."""
        update, future = self.pending if self.pending is not None else self._start()
        self.pending = None
        if update.indices is None:
            return update
        if self.pool is not None:
            self.pending = self._start()  # the next one collates while this one trains
        update.collated = future.result() if future is not None else self._collated(update)
        return update

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
