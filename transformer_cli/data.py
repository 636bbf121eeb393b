"""Stage 1, data: sentencepiece vocab, binarised splits (`tfm prepare`) and token-based batches.

Layout written into `run_dir`:
    spm.model (joint) or spm.src.model + spm.tgt.model (separate)
    data/<split>.<side>.tokens.npy   int32/uint16 token ids of all sentences, concatenated
    data/<split>.<side>.offsets.npy  int64, sentence i is tokens[offsets[i]:offsets[i+1]]
    prepare.json                     manifest: inputs, settings, counts (re-runs reuse it)
Token ids carry no <bos>/<eos>; batching adds them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from tqdm import tqdm

from .config import ExperimentConfig
from .errors import TfmError
from .io_utils import atomic_path, atomic_write_text, count_lines, read_lines

# Fixed special ids, the same in every tfm vocabulary.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")


def corpus_file(prefix: str, lang: str) -> Path:
    """`<prefix>.<lang>` or `<prefix>.<lang>.gz`, whichever exists."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise TfmError(f"corpus file not found: {prefix}.{lang} (nor {prefix}.{lang}.gz)")


def split_files(config: ExperimentConfig, split: str) -> tuple[Path, Path]:
    prefix = getattr(config.data, split)
    return corpus_file(prefix, config.data.src_lang), corpus_file(prefix, config.data.tgt_lang)


def read_parallel(config: ExperimentConfig, split: str) -> tuple[list[str], list[str]]:
    src_path, tgt_path = split_files(config, split)
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise TfmError(
            f"line counts differ: {src_path} has {len(src_lines)} lines, {tgt_path} has {len(tgt_lines)}"
        )
    if split == "train" and config.data.train_limit:
        src_lines, tgt_lines = src_lines[: config.data.train_limit], tgt_lines[: config.data.train_limit]
    return src_lines, tgt_lines


# --------------------------------------------------------------------------- vocabulary


def vocab_paths(run_dir: Path, joint: bool) -> dict[str, Path]:
    if joint:
        return {"src": run_dir / "spm.model", "tgt": run_dir / "spm.model"}
    return {"src": run_dir / "spm.src.model", "tgt": run_dir / "spm.tgt.model"}


def train_sentencepiece(sentences: list[str], target: Path, config: ExperimentConfig) -> None:
    """Train a sentencepiece model on `sentences` and write it atomically to `target`."""
    vocab = config.vocab
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "spm"
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(s for s in sentences if s.strip()),
                model_prefix=str(prefix),
                vocab_size=vocab.size,
                model_type=vocab.model_type,
                character_coverage=vocab.character_coverage,
                input_sentence_size=vocab.input_sentence_size,
                shuffle_input_sentence=True,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=2,
                minloglevel=2,
            )
        except RuntimeError as exc:  # e.g. vocab size too large for the corpus
            raise TfmError(f"sentencepiece training failed (vocab.size={vocab.size}): {exc}") from None
        with atomic_path(target) as tmp_target:
            shutil.copyfile(f"{prefix}.model", tmp_target)


def load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise TfmError(f"sentencepiece model not found: {path} (run `tfm prepare` first)")
    return spm.SentencePieceProcessor(model_file=str(path))


# --------------------------------------------------------------------------- binary format


@dataclass
class TokenArray:
    """Sentences as one flat token array plus offsets; memory-mapped when loaded."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, sentences: list[list[int]], vocab_size: int) -> TokenArray:
        lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.int32
        tokens = np.fromiter((t for s in sentences for t in s), dtype=dtype, count=int(offsets[-1]))
        return cls(tokens, offsets)

    def save(self, stem: Path) -> None:
        for name, array in (("tokens", self.tokens), ("offsets", self.offsets)):
            with atomic_path(stem.with_name(f"{stem.name}.{name}.npy")) as tmp:
                with open(tmp, "wb") as f:
                    np.save(f, array)

    @classmethod
    def load(cls, stem: Path) -> TokenArray:
        paths = [stem.with_name(f"{stem.name}.{name}.npy") for name in ("tokens", "offsets")]
        for p in paths:
            if not p.is_file():
                raise TfmError(f"binarised data not found: {p} (run `tfm prepare` first)")
        return cls(np.load(paths[0], mmap_mode="r"), np.load(paths[1]))


def binary_stem(run_dir: Path, split: str, side: str) -> Path:
    return run_dir / "data" / f"{split}.{side}"


# --------------------------------------------------------------------------- prepare


@dataclass
class PrepareResult:
    run_dir: Path
    reused: bool
    summary: str
    manifest: dict


def _fingerprint(config: ExperimentConfig) -> str:
    """Hash of everything `prepare` depends on: data/vocab settings and input files' size+mtime."""
    inputs = []
    for split in SPLITS:
        for path in split_files(config, split):
            stat = path.stat()
            inputs.append([str(path), stat.st_size, int(stat.st_mtime)])
    payload = json.dumps(
        [config.data.model_dump(), config.vocab.model_dump(), inputs], sort_keys=True
    ).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def _filter_train(
    src: list[list[int]], tgt: list[list[int]], max_len: int, max_ratio: float
) -> tuple[list[int], dict[str, int]]:
    keep, dropped = [], {"empty": 0, "too_long": 0, "length_ratio": 0}
    for i, (s, t) in enumerate(zip(src, tgt)):
        if not s or not t:
            dropped["empty"] += 1
        elif len(s) > max_len or len(t) > max_len:
            dropped["too_long"] += 1
        elif max(len(s), len(t)) / min(len(s), len(t)) > max_ratio and max(len(s), len(t)) > 5:
            # Short pairs (≤ 5 tokens) are exempt: "Ja ." → "Yes ." is a fine 1:2 pair.
            dropped["length_ratio"] += 1
        else:
            keep.append(i)
    return keep, dropped


def _summary_table(stats: dict) -> str:
    header = f"{'split':<6} {'side':<4} {'lines':>8} {'tokens':>10} {'mean':>6} {'p95':>5} {'unk%':>6}"
    rows = [header, "-" * len(header)]
    for split in SPLITS:
        for side in SIDES:
            s = stats[split][side]
            rows.append(
                f"{split:<6} {side:<4} {s['lines']:>8} {s['tokens']:>10} {s['mean_len']:>6.1f} "
                f"{s['p95_len']:>5} {100 * s['unk_rate']:>6.3f}"
            )
    return "\n".join(rows)


def _side_stats(array: TokenArray) -> dict:
    lengths = array.lengths
    n_tokens = int(lengths.sum())
    return {
        "lines": len(array),
        "tokens": n_tokens,
        "mean_len": float(lengths.mean()) if len(lengths) else 0.0,
        "p95_len": int(np.percentile(lengths, 95)) if len(lengths) else 0,
        "unk_rate": float((np.asarray(array.tokens) == UNK_ID).sum() / max(n_tokens, 1)),
    }


def prepare(config: ExperimentConfig, force: bool = False, progress: bool = True) -> PrepareResult:
    """Train the vocab and binarise train/valid/test into `config.run_dir` (idempotent)."""
    run_dir = config.run_path
    manifest_path = run_dir / "prepare.json"
    fingerprint = _fingerprint(config)
    if manifest_path.is_file() and not force:
        manifest = json.loads(manifest_path.read_text())
        expected = [binary_stem(run_dir, sp, si) for sp in SPLITS for si in SIDES]
        files_ok = all(
            p.with_name(f"{p.name}.{n}.npy").is_file() for p in expected for n in ("tokens", "offsets")
        ) and all(p.is_file() for p in vocab_paths(run_dir, config.vocab.joint).values())
        if manifest.get("fingerprint") == fingerprint and files_ok:
            return PrepareResult(run_dir, True, _summary_table(manifest["stats"]), manifest)

    started = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    texts = {split: read_parallel(config, split) for split in SPLITS}

    # Vocabulary: trained on the training data only.
    paths = vocab_paths(run_dir, config.vocab.joint)
    train_src, train_tgt = texts["train"]
    if config.vocab.joint:
        train_sentencepiece(train_src + train_tgt, paths["src"], config)
    else:
        train_sentencepiece(train_src, paths["src"], config)
        train_sentencepiece(train_tgt, paths["tgt"], config)
    processors = {side: load_sentencepiece(paths[side]) for side in SIDES}

    stats: dict = {}
    dropped: dict[str, int] = {}
    bar = tqdm(total=sum(2 * len(texts[s][0]) for s in SPLITS), desc="encoding", unit="sent",
               disable=not progress, leave=False)
    for split in SPLITS:
        encoded = {}
        for side, lines in zip(SIDES, texts[split]):
            encoded[side] = processors[side].encode(lines, out_type=int, num_threads=2)
            bar.update(len(lines))
        if split == "train":
            keep, dropped = _filter_train(encoded["src"], encoded["tgt"], config.data.max_len,
                                          config.data.max_len_ratio)
            encoded = {side: [encoded[side][i] for i in keep] for side in SIDES}
        stats[split] = {}
        for side in SIDES:
            array = TokenArray.from_lists(encoded[side], processors[side].vocab_size())
            array.save(binary_stem(run_dir, split, side))
            stats[split][side] = _side_stats(array)
        del encoded
    bar.close()

    manifest = {
        "fingerprint": fingerprint,
        "src_lang": config.data.src_lang,
        "tgt_lang": config.data.tgt_lang,
        "vocab": {side: str(paths[side]) for side in SIDES},
        "vocab_size": {side: processors[side].vocab_size() for side in SIDES},
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "files": {split: [str(p) for p in split_files(config, split)] for split in SPLITS},
        "train_pairs_read": len(train_src),
        "train_pairs_dropped": dropped,
        "stats": stats,
        "seconds": round(time.perf_counter() - started, 2),
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2))
    return PrepareResult(run_dir, False, _summary_table(stats), manifest)


def load_manifest(run_dir: Path) -> dict:
    path = run_dir / "prepare.json"
    if not path.is_file():
        raise TfmError(f"{path} not found: run `tfm prepare --config ...` first")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- batching


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids + <eos>, right-padded
    tgt_in: torch.Tensor  # (B, T) <bos> y
    tgt_out: torch.Tensor  # (B, T) y <eos>
    n_tgt_tokens: int  # non-pad target tokens (the loss normaliser)

    def to(self, device: torch.device) -> Batch:
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.n_tgt_tokens)


def pad_sequences(seqs: list[np.ndarray], prefix: int | None = None, suffix: int | None = None) -> torch.Tensor:
    """Right-pad id sequences into a (B, max_len) LongTensor, optionally adding a first/last token."""
    extra = (prefix is not None) + (suffix is not None)
    width = max(len(s) for s in seqs) + extra
    out = np.full((len(seqs), width), PAD_ID, dtype=np.int64)
    for row, seq in enumerate(seqs):
        start = 0
        if prefix is not None:
            out[row, 0] = prefix
            start = 1
        out[row, start : start + len(seq)] = seq
        if suffix is not None:
            out[row, start + len(seq)] = suffix
    return torch.from_numpy(out)


def collate(src: list[np.ndarray], tgt: list[np.ndarray]) -> Batch:
    src_t = pad_sequences(src, suffix=EOS_ID)
    tgt_in = pad_sequences(tgt, prefix=BOS_ID)
    tgt_out = pad_sequences(tgt, suffix=EOS_ID)
    return Batch(src_t, tgt_in, tgt_out, int(sum(len(t) + 1 for t in tgt)))


def token_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Group sentence indices into batches of ≤ max_tokens (padding included), bucketed by length.

    Sentences are sorted by length (random tie-break from `seed`) so a batch holds similar lengths,
    then batch order is shuffled: different seeds give different batches and orders.
    """
    rng = np.random.default_rng(seed)
    n = len(src_lens)
    # +1: <eos>/<bos> added at collate time.
    src_w, tgt_w = src_lens + 1, tgt_lens + 1
    order = np.lexsort((rng.random(n), src_w, tgt_w))
    batches, start, longest = [], 0, 0
    for pos in range(n):
        idx = order[pos]
        width = max(longest, src_w[idx], tgt_w[idx])
        if pos > start and width * (pos - start + 1) > max_tokens:
            batches.append(order[start:pos])
            start, width = pos, max(src_w[idx], tgt_w[idx])
        longest = width
    if start < n:
        batches.append(order[start:])
    rng.shuffle(batches)
    return batches


class ParallelData:
    """One binarised split (source + target), memory-mapped."""

    def __init__(self, run_dir: Path, split: str):
        self.src = TokenArray.load(binary_stem(run_dir, split, "src"))
        self.tgt = TokenArray.load(binary_stem(run_dir, split, "tgt"))
        self.split = split

    def __len__(self) -> int:
        return len(self.src)

    def batches(self, max_tokens: int, seed: int) -> list[np.ndarray]:
        return token_batches(self.src.lengths, self.tgt.lengths, max_tokens, seed)

    def collate(self, indices: np.ndarray) -> Batch:
        return collate([self.src[i] for i in indices], [self.tgt[i] for i in indices])

    def iterate(self, max_tokens: int, seed: int) -> Iterator[Batch]:
        for indices in self.batches(max_tokens, seed):
            yield self.collate(indices)


def padding_ratio(batch: Batch) -> float:
    """Fraction of padding positions in a batch (source and target together)."""
    total = batch.src.numel() + batch.tgt_out.numel()
    pads = int((batch.src == PAD_ID).sum()) + int((batch.tgt_out == PAD_ID).sum())
    return pads / max(total, 1)


def count_corpus_lines(path: Path) -> int:
    return count_lines(path)
