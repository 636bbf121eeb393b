"""What a batch is: the binarised splits `tfm prepare` writes, read back memory-mapped
(`TokenArray`, `ParallelData`), grouped into token-bucketed batches (`token_batches`) and padded
into tensors (`pad_batch`, `collate` → `Batch`). Training, validation, decoding and the model
importers use this; the prepare stage itself is data/prepare.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..experiment.directions import epoch_sample, split_ranges
from ..experiment.rundir import RunDirectory
from ..model.special_tokens import BOS_ID, EOS_ID, PAD_ID
from ..runtime.errors import TfmError


def array_path(stem: Path, name: str) -> Path:
    return stem.with_name(f"{stem.name}.{name}.npy")


@dataclass
class TokenArray:
    """Sentences as one flat token array plus offsets; memory-mapped when loaded."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """(N,) int32 sentence lengths, computed once (an epoch's batching reads them)."""
        return np.diff(self.offsets).astype(np.int32)

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sentences `indices` as (their tokens end to end (N,) int64, their lengths (B,)): one
        fancy index into the memory-mapped tokens instead of a memmap slice per sentence."""
        indices = np.asarray(indices, dtype=np.int64)
        starts = self.offsets[indices].astype(np.int64)
        lengths = self.offsets[indices + 1].astype(np.int64) - starts
        first = np.cumsum(lengths) - lengths  # where each sentence starts in the result
        positions = np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()))
        return np.asarray(self.tokens[positions], dtype=np.int64), lengths

    @classmethod
    def load(cls, stem: Path) -> TokenArray:
        paths = [array_path(stem, name) for name in ("tokens", "offsets")]
        for p in paths:
            if not p.is_file():
                raise TfmError(f"binarised data not found: {p} (run `tfm prepare` first)")
        return cls(np.load(paths[0], mmap_mode="r"), np.load(paths[1]))


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids + <eos>, right-padded
    tgt_in: torch.Tensor  # (B, T) <bos> y
    tgt_out: torch.Tensor  # (B, T) y <eos>
    n_tgt_tokens: int  # non-pad target tokens (the loss normaliser)
    n_src_tokens: int = 0  # non-pad source tokens
    # The flat positions of the real target tokens in tgt_out and those tokens (N,), (N,): found on
    # the host when the batch is made, so that the device never reports a count back mid-step.
    rows: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.src), move(self.tgt_in), move(self.tgt_out), self.n_tgt_tokens, self.n_src_tokens,
                     move(self.rows), move(self.targets))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, so that `.to(cuda)` copies without blocking."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.src), pin(self.tgt_in), pin(self.tgt_out), self.n_tgt_tokens, self.n_src_tokens,
                     pin(self.rows), pin(self.targets))


def pad_flat(tokens: np.ndarray, lengths: np.ndarray, prefix: int | None = None,
             suffix: int | None = None) -> torch.Tensor:
    """Sequences given as their tokens end to end (N,) and their lengths (B,) → a right-padded
    (B, max_len + extra) LongTensor, each with an optional first/last token: one scatter of all
    tokens, not a loop over rows. (A training batch has hundreds of rows, and on a GPU the thread
    that collates ahead holds Python's lock for as long as it loops, while the training thread
    waits for it to queue its kernels.)"""
    start = int(prefix is not None)
    width = int(lengths.max(initial=0)) + start + int(suffix is not None)
    out = np.full((len(lengths), width), PAD_ID, dtype=np.int64)
    if prefix is not None:
        out[:, 0] = prefix
    if len(tokens):
        rows = np.repeat(np.arange(len(lengths)), lengths)  # (N,) each token's row
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)  # (N,) the flat index of its row's first token
        out[rows, np.arange(len(tokens)) - first + start] = tokens
    if suffix is not None:
        out[np.arange(len(lengths)), start + lengths] = suffix
    return torch.from_numpy(out)


def flatten(seqs: list[np.ndarray] | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences → (their tokens end to end (N,), their lengths (B,))."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if lengths.sum() else np.zeros(0, np.int64)
    return tokens, lengths


def pad_batch(seqs: list[np.ndarray] | list[list[int]], prefix: int | None = None,
              suffix: int | None = None) -> torch.Tensor:
    """Right-pad id sequences with PAD_ID into a (B, max_len) LongTensor, optionally adding a
    first/last token to each: the one padding of batches for training, decoding and attention maps."""
    return pad_flat(*flatten(seqs), prefix=prefix, suffix=suffix)


def collate_flat(src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray]) -> Batch:
    """A batch from its sources and targets, each as (tokens end to end, lengths) (`flatten`)."""
    src_t = pad_flat(*src, suffix=EOS_ID)
    tgt_in = pad_flat(*tgt, prefix=BOS_ID)
    tgt_out = pad_flat(*tgt, suffix=EOS_ID)
    flat = tgt_out.view(-1)
    rows = (flat != PAD_ID).nonzero().squeeze(1)
    batch_size = len(tgt[1])  # each sentence adds one <eos> to the counts
    return Batch(src_t, tgt_in, tgt_out, int(tgt[1].sum()) + batch_size, int(src[1].sum()) + batch_size,
                 rows, flat.index_select(0, rows))


def collate(src: list[np.ndarray], tgt: list[np.ndarray]) -> Batch:
    return collate_flat(flatten(src), flatten(tgt))


def token_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Group sentence indices into batches of ≤ max_tokens (padding included), bucketed by length.

    Sentences are sorted by width = max(source, target) length (then target, source, and a random
    tie-break from `seed`), so widths only grow along the order and a batch from `start` to `end`
    costs width[end - 1] · (end - start). Each batch is the longest run that fits, found by
    bisection: the Python loop runs once per batch, not once per sentence (10M pairs: ~1 s).
    Batch order is shuffled: different seeds give different batches and orders.
    """
    rng = np.random.default_rng(seed)
    n = len(src_lens)
    widths = np.maximum(src_lens, tgt_lens).astype(np.int64) + 1  # +1: <eos>/<bos> added at collate time
    # One 64-bit sort key, 16 bits each: width, target, source, random (np.lexsort of four keys
    # is ~5x slower on 10M sentences).
    fields = (widths, tgt_lens, src_lens, rng.integers(0, 1 << 16, n))
    key = np.zeros(n, dtype=np.uint64)
    for value in fields:
        key = (key << np.uint64(16)) | np.minimum(value, (1 << 16) - 1).astype(np.uint64)
    order = np.argsort(key)
    sorted_widths = widths[order]
    batches, start = [], 0
    while start < n:
        # At most max_tokens // width[start] sentences fit; widths only grow, so bisect the end.
        lo, hi = start + 1, min(n, start + max(1, max_tokens // int(sorted_widths[start])))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sorted_widths[mid - 1] * (mid - start) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        batches.append(order[start:lo])
        start = lo
    rng.shuffle(batches)
    return batches


class ParallelData:
    """One binarised split (source + target), memory-mapped. `temperature`: a multilingual split's
    epochs draw its directions at temperature-sampling rates (directions.epoch_sample); None, or a
    split of one direction: every pair once per epoch."""

    def __init__(self, run: RunDirectory, split: str, temperature: float | None = None):
        self.src = TokenArray.load(run.binary_stem(split, "src"))
        self.tgt = TokenArray.load(run.binary_stem(split, "tgt"))
        self.split = split
        self.directions = split_ranges(run.load_manifest().directions, split) if run.manifest_file.is_file() else []
        self.temperature = temperature if len(self.directions) > 1 else None

    def __len__(self) -> int:
        return len(self.src)

    def epoch_pairs(self, seed: int) -> np.ndarray:
        """(M,) the pairs of the epoch `seed` draws: every pair once, or a multilingual split's
        directions at their temperature rates (repeats allowed)."""
        if self.temperature is None:
            return np.arange(len(self), dtype=np.int64)
        return epoch_sample(self.directions, self.temperature, seed)

    def batches(self, max_tokens: int, seed: int) -> list[np.ndarray]:
        if self.temperature is None:
            return token_batches(self.src.lengths, self.tgt.lengths, max_tokens, seed)
        drawn = epoch_sample(self.directions, self.temperature, seed)  # (N,) pair indices, repeats allowed
        return [drawn[b] for b in token_batches(self.src.lengths[drawn], self.tgt.lengths[drawn], max_tokens, seed)]

    def collate(self, indices: np.ndarray) -> Batch:
        return collate_flat(self.src.gather(indices), self.tgt.gather(indices))

    def target_tokens(self, indices: np.ndarray) -> int:
        """The target tokens of a batch's pairs, each with its <eos> (the loss's normaliser)."""
        return int(self.tgt.lengths[indices].sum()) + len(indices)

    def iterate(self, max_tokens: int, seed: int) -> Iterator[Batch]:
        for indices in self.batches(max_tokens, seed):
            yield self.collate(indices)


def padding_ratio(batch: Batch) -> float:
    """Fraction of padding positions in a batch (source and target together), from its counts:
    nothing is read back from the device."""
    total = batch.src.numel() + batch.tgt_out.numel()
    return (total - batch.n_src_tokens - batch.n_tgt_tokens) / max(total, 1)
