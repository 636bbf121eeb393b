"""Streaming access to parallel corpora for `tfm prepare`: memory stays flat whatever the size.

- `parallel_chunks` reads a source and a target file in lock-step, `chunk_lines` pairs at a time,
  as raw bytes (decoding happens in the encoding workers, in parallel).
- `corpora_chunks` does that for several corpora one after the other (a training set may be
  several: real and back-translated pairs).
- `sample_pairs` draws a uniform random sample in one pass (reservoir sampling) for sentencepiece.
- `ordered_map` runs `encode_chunk` over the chunks in `workers` processes, yielding results in input
  order with a bounded number of chunks in flight, and `NpyAppender` writes a growing `.npy` array to disk.
No torch here: worker processes start quickly and never touch torch's thread pools.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm

from ..runtime.errors import TfmError
from ..runtime.files import AtomicStream, decode_line, iter_raw_lines, named_after, text_file_problem
from ..runtime.signals import die_with_parent
from .filters import DirectionFilters, pair_hashes

UNK_ID = 1  # as data.UNK_ID (kept here so workers import nothing heavy)


# --------------------------------------------------------------------------- reading


def _mismatch(src: Path, tgt: Path, n_src: int, n_tgt: int) -> TfmError:
    why = next((f"; {path}: {problem}" for path in (src, tgt) if (problem := text_file_problem(path))), "")
    return TfmError(f"line counts differ: {src} has {n_src} lines, {tgt} has {n_tgt}{why}")


@dataclass
class RawChunk:
    first_line: int  # 1-based number of the chunk's first line in the files
    src: list[bytes]
    tgt: list[bytes]


def parallel_chunks(src: Path, tgt: Path, chunk_lines: int, limit: int | None = None) -> Iterator[RawChunk]:
    """Line-aligned chunks of the two files; unequal line counts raise a TfmError naming both."""
    src_lines, tgt_lines = iter_raw_lines(src), iter_raw_lines(tgt)
    read = 0
    while limit is None or read < limit:
        n = chunk_lines if limit is None else min(chunk_lines, limit - read)
        s, t = list(itertools.islice(src_lines, n)), list(itertools.islice(tgt_lines, n))
        if len(s) != len(t):
            n_src = read + len(s) + sum(1 for _ in src_lines)
            n_tgt = read + len(t) + sum(1 for _ in tgt_lines)
            raise _mismatch(src, tgt, n_src, n_tgt)
        if not s:
            return
        yield RawChunk(read + 1, s, t)
        read += len(s)
        if len(s) < n:  # both files ended inside this chunk, together
            return


Corpus = tuple[Path, Path]  # (source file, target file)


def corpora_chunks(corpora: list[Corpus], chunk_lines: int, limit: int | None = None
                   ) -> Iterator[tuple[int, RawChunk]]:
    """`parallel_chunks` of each corpus in turn, with the corpus's number in `corpora`; `limit`
    counts pairs over all of them. A corpus listed twice is read twice (a way to up-weight it)."""
    read = 0
    for number, corpus in enumerate(corpora):
        if limit is not None and read >= limit:
            return
        for chunk in parallel_chunks(*corpus, chunk_lines, None if limit is None else limit - read):
            read += len(chunk.src)
            yield number, chunk


def sample_pairs(corpora: list[Corpus], k: int, seed: int, limit: int | None = None, skip_invalid: bool = False
                 ) -> tuple[list[str], list[str], int]:
    """A uniform random sample of ≤ k pairs (all of them when the corpora are smaller), in corpus order.

    Reservoir sampling (Algorithm R) over one pass: memory holds k pairs, never the corpus.
    Returns (source sentences, target sentences, pairs read). k ≤ 0 keeps every pair. A pair that
    is not valid UTF-8 is an error, or left out of the sample (`skip_invalid`: the text filter
    drops it from the training data).
    """
    rng = random.Random(seed)
    reservoir: list[tuple[int, int, bytes, bytes]] = []  # (corpus number, line number, source, target)
    seen = 0
    for which, chunk in corpora_chunks(corpora, 100_000, limit):
        for offset, pair in enumerate(zip(chunk.src, chunk.tgt)):
            item = (which, chunk.first_line + offset, *pair)
            if k <= 0 or seen < k:
                reservoir.append(item)
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    reservoir[j] = item
            seen += 1
    reservoir.sort(key=lambda item: item[:2])
    decoded = [(decode_or_none(s, corpora[c][0], n, skip_invalid), decode_or_none(t, corpora[c][1], n, skip_invalid))
               for c, n, s, t in reservoir]
    decoded = [(s, t) for s, t in decoded if s is not None and t is not None]
    return [s for s, _ in decoded], [t for _, t in decoded], seen


def count_lines(path: Path, limit: int | None = None) -> int:
    """Lines of a plain or gzipped file (at most `limit`)."""
    return sum(1 for _ in itertools.islice(iter_raw_lines(path), limit))


def sample_lines(paths: list[Path], k: int, seed: int, limit: int | None = None) -> list[str]:
    """A uniform random sample of ≤ k lines of the files (each read to `limit` lines), in file order:
    one language's share of a multilingual vocabulary's sentences. k ≤ 0 keeps every line."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, int, bytes]] = []  # (file number, line number, text)
    seen = 0
    for which, path in enumerate(paths):
        for number, raw in enumerate(itertools.islice(iter_raw_lines(path), limit), start=1):
            if k <= 0 or seen < k:
                reservoir.append((which, number, raw))
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    reservoir[j] = (which, number, raw)
            seen += 1
    reservoir.sort(key=lambda item: item[:2])
    return [decode_line(raw, paths[which], number) for which, number, raw in reservoir]


# --------------------------------------------------------------------------- encoding


@dataclass
class EncodeTask:
    chunk: RawChunk
    src_path: str
    tgt_path: str
    token_dtype: str  # "uint16" or "int32"
    max_len: int | None = None  # training filters; None keeps every pair (valid/test)
    max_len_ratio: float | None = None
    truncate_to: int | None = None  # valid/test: longer sentences are cut to this many tokens
    source_tag: str | None = None  # a multilingual run's target-language tag, put before each source
    direction: int = 0  # which of the run's directions the pairs are (reported with the result)
    filtered: bool = False  # training: the direction's text filters run first (init_encoder's filters)
    keep_dropped: bool = False  # return every dropped pair's text (`tfm prepare --dropped`)
    hash_by: str | None = None  # "pair" or "source": return an 8-byte hash of each kept pair (duplicates)


@dataclass
class EncodedSide:
    tokens: np.ndarray  # (sum of lengths,) ids of all kept sentences, concatenated
    lengths: np.ndarray  # (kept,) int32
    unk: int


@dataclass
class DroppedPair:
    reason: str
    line: int  # in the corpus files
    src: str | None  # None: not valid UTF-8
    tgt: str | None


@dataclass
class EncodedChunk:
    src: EncodedSide
    tgt: EncodedSide
    read: int
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: list[int] = field(default_factory=list)  # line numbers of truncated pairs
    direction: int = 0
    # the first EXAMPLES dropped pairs of each reason, or every one (task.keep_dropped)
    dropped_pairs: list[DroppedPair] = field(default_factory=list)
    kept_lines: np.ndarray | None = None  # (kept,) line numbers, with hashes
    hashes: np.ndarray | None = None  # (kept,) uint64 (task.hash_by)
    kept_text: list[tuple[str, str]] | None = None  # with keep_dropped and hashes: duplicates' text


EXAMPLES = 3  # dropped pairs of each reason a chunk reports (the report shows a few)


_processors: dict[str, spm.SentencePieceProcessor] = {}
_filters: list[DirectionFilters] = []  # per direction, for training chunks


def init_encoder(src_model: str, tgt_model: str, filters: list[DirectionFilters] | None = None) -> None:
    """Load the sentencepiece models once per worker process, and take the directions' filters
    (their lexical models are large: they travel once per worker, not with every chunk)."""
    _processors["src"] = spm.SentencePieceProcessor(model_file=src_model)
    _processors["tgt"] = spm.SentencePieceProcessor(model_file=tgt_model)
    _filters[:] = filters or []


def _flatten(encoded: list[list[int]], keep: np.ndarray, dtype: str) -> EncodedSide:
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum()))
    if not keep.all():
        flat = flat[np.repeat(keep, lengths)]
        lengths = lengths[keep]
    return EncodedSide(flat, lengths.astype(np.int32), int((flat == UNK_ID).sum()))


def subset_side(side: EncodedSide, keep: np.ndarray) -> EncodedSide:
    """The sentences of `side` where `keep` (bool, one per sentence)."""
    tokens = side.tokens[np.repeat(keep, side.lengths)]
    return EncodedSide(tokens, side.lengths[keep], int((tokens == UNK_ID).sum()))


def training_filter(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_ratio: float
                    ) -> list[str | None]:
    """Each pair's reason to be dropped by its lengths in pieces, or "" (kept)."""
    empty = (src_len == 0) | (tgt_len == 0)
    too_long = ~empty & ((src_len > max_len) | (tgt_len > max_len))
    longer, shorter = np.maximum(src_len, tgt_len), np.maximum(np.minimum(src_len, tgt_len), 1)
    # Short pairs (≤ 5 tokens) are exempt: "Ja ." → "Yes ." is a fine 1:2 pair.
    ratio = ~empty & ~too_long & (longer / shorter > max_ratio) & (longer > 5)
    return np.select([empty, too_long, ratio], ["empty", "too_long", "length_ratio"], "").tolist()


def decode_or_none(raw: bytes, path: str, number: int, lenient: bool) -> str | None:
    """The line's text; None for invalid UTF-8 when `lenient` (the text filter drops it)."""
    if not lenient:
        return decode_line(raw, path, number)
    try:
        return decode_line(raw, path, number)
    except TfmError:
        return None


def encode_chunk(task: EncodeTask) -> EncodedChunk:
    chunk = task.chunk
    lenient = task.filtered and _filters[task.direction].on("text")
    src_text = [decode_or_none(raw, task.src_path, chunk.first_line + i, lenient) for i, raw in enumerate(chunk.src)]
    tgt_text = [decode_or_none(raw, task.tgt_path, chunk.first_line + i, lenient) for i, raw in enumerate(chunk.tgt)]
    reasons = _filters[task.direction].reasons(src_text, tgt_text) if task.filtered else [None] * len(src_text)
    rows = [i for i, r in enumerate(reasons) if r is None]  # the pairs still kept: only they are encoded
    src_kept, tgt_kept = [src_text[i] for i in rows], [tgt_text[i] for i in rows]
    if task.source_tag is not None:  # as `tfm translate --tgt-lang` writes it; an empty line stays empty
        src_kept = [f"{task.source_tag} {text}" if text.strip() else text for text in src_kept]
    # One thread per worker: parallelism comes from the worker processes (sentencepiece would
    # otherwise start a thread per core inside every worker).
    src_ids = _processors["src"].encode(src_kept, out_type=int, num_threads=1)
    tgt_ids = _processors["tgt"].encode(tgt_kept, out_type=int, num_threads=1)
    truncated: list[int] = []
    if task.truncate_to is not None:
        n = task.truncate_to
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
            if len(s) > n or len(t) > n:
                src_ids[i], tgt_ids[i] = s[:n], t[:n]
                truncated.append(chunk.first_line + rows[i])
    keep = np.ones(len(rows), dtype=bool)
    if task.max_len is not None:
        src_len = np.fromiter(map(len, src_ids), dtype=np.int64, count=len(src_ids))
        tgt_len = np.fromiter(map(len, tgt_ids), dtype=np.int64, count=len(tgt_ids))
        for i, reason in enumerate(training_filter(src_len, tgt_len, task.max_len, task.max_len_ratio or float("inf"))):
            if reason:
                reasons[rows[i]], keep[i] = reason, False
    result = EncodedChunk(_flatten(src_ids, keep, task.token_dtype), _flatten(tgt_ids, keep, task.token_dtype),
                          len(src_text), dict(Counter(r for r in reasons if r)), truncated, task.direction)
    shown: Counter = Counter()
    for i, reason in enumerate(reasons):
        if reason and (task.keep_dropped or shown[reason] < EXAMPLES):
            shown[reason] += 1
            result.dropped_pairs.append(DroppedPair(reason, chunk.first_line + i, src_text[i], tgt_text[i]))
    if task.hash_by:
        final = [i for i, r in enumerate(reasons) if r is None]
        result.kept_lines = np.asarray(final, dtype=np.int64) + chunk.first_line
        result.hashes = pair_hashes([src_text[i] for i in final], [tgt_text[i] for i in final], task.hash_by,
                                    task.direction)
        if task.keep_dropped:
            result.kept_text = [(src_text[i], tgt_text[i]) for i in final]
    return result


def _start_worker(parent: int, initializer: Callable, initargs: tuple) -> None:
    die_with_parent(parent)  # a kill -9 of `tfm prepare` leaves no encoder behind
    initializer(*initargs)


def ordered_map(fn: Callable, tasks: Iterator, workers: int, initializer: Callable, initargs: tuple
                ) -> Iterator:
    """`map(fn, tasks)` over `workers` processes, in input order, with ≤ 2·workers tasks in flight.

    (`multiprocessing.Pool.imap` would read the whole input ahead into its queue.)
    With one worker everything runs in this process: no start-up or pickling cost.
    """
    if workers <= 1:
        initializer(*initargs)
        yield from map(fn, tasks)
        return
    # spawn: children start clean (no copy of torch's thread pools or of the parent's memory).
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (os.getpid(), initializer, initargs)) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --------------------------------------------------------------------------- writing


class NpyAppender(AtomicStream):
    """A 1-D `.npy` file written piece by piece: placeholder header, data, then the real header.

    For 1-D arrays numpy's version-1.0 header is padded to 128 bytes whatever the length, so
    the header can be rewritten in place once the length is known. The file appears at `target`
    (atomically) only on `close()`.
    """

    def __init__(self, target: Path, dtype: np.dtype):
        super().__init__(target)
        self.dtype, self.count = np.dtype(dtype), 0
        self._header_size = self._write_header(0)

    def _write_header(self, count: int) -> int:
        self._file.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (count,)}
        np.lib.format.write_array_header_1_0(self._file, header)
        return self._file.tell()

    def append(self, array: np.ndarray) -> None:
        self.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self.count += len(array)

    def close(self) -> None:
        try:
            if self._write_header(self.count) != self._header_size:
                raise RuntimeError("npy header size changed")  # cannot happen for 1-D arrays
        except OSError as exc:
            raise named_after(exc, self.target) from None
        super().close()
