"""The training split with each epoch's pairs drawn afresh through data/augment.py's modifiers
(`data.augment`; `draws: once` keeps each pair's first draw every epoch): `AugmentedData` stands where the split's `ParallelData` stands. Its `batches`
decodes the epoch's drawn pairs with the run's sentencepiece models, changes them, encodes them
again and buckets the epoch by the new lengths; `collate` reads the changed pairs from the epoch's
store. The draws follow from the epoch's seed alone (train.seed + epoch), so a resumed run draws
what an unbroken one would, and every process of a torchrun draws the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm

from ..experiment.config import AugmentConfig, ExperimentConfig
from ..experiment.rundir import RunDirectory
from .augment import Draw, apply_modifiers, draw_modifiers
from .batches import Batch, ParallelData, collate_flat, flatten, token_batches
from .language_tags import TAG


@dataclass
class EpochStore:
    """The pairs one epoch changed, encoded: batch index `first + k` is pair k here."""

    first: int
    src: list[list[int]]
    tgt: list[list[int]]
    pairs: list[int]  # the prepared pair each one was made from


class AugmentedData:
    """The training split with each epoch's pairs drawn through the modifiers, read as `ParallelData`
    is (`batches(max_tokens, seed)`, `collate(indices)`, `target_tokens(indices)`). A changed pair's
    batch index lies past the split's pairs, in its epoch's store; the two latest epochs' stores are
    kept (an update may span an epoch's end)."""

    def __init__(self, data: ParallelData, cfg: AugmentConfig, src_sp, tgt_sp, max_len: int, seed: int = 0):
        self.data, self.cfg, self.src_sp, self.tgt_sp, self.max_len = data, cfg, src_sp, tgt_sp, max_len
        self.seed = seed  # train.seed: `draws: once` draws each pair's change from it
        self.once: dict[int, Draw] | None = None
        self.split = data.split
        self.stores: list[EpochStore] = []
        self.next_index = len(data)
        self.tag_ids = {i for i in range(src_sp.get_piece_size()) if TAG.fullmatch(src_sp.id_to_piece(i))}

    def __len__(self) -> int:
        return len(self.data)

    def _changed(self, pair: int, draw: Draw, rng: random.Random) -> tuple[list[int], list[int]] | None:
        """Pair `pair` changed as drawn, encoded; None where nothing changed or it grew past max_len."""
        src_ids = [int(i) for i in self.data.src[pair]]
        tag = src_ids[:1] if src_ids and src_ids[0] in self.tag_ids else []
        src_text, tgt_text = self.src_sp.decode(src_ids[len(tag):]), self.tgt_sp.decode(self.data.tgt[pair].tolist())
        src, tgt = apply_modifiers(src_text, tgt_text, draw, self.cfg.typo_words, rng)
        if (src, tgt) == (src_text, tgt_text):
            return None
        new_src = tag + self.src_sp.encode(src, out_type=int)
        new_tgt = self.tgt_sp.encode(tgt, out_type=int)
        if not new_src or not new_tgt or max(len(new_src), len(new_tgt)) > self.max_len:
            return None
        return new_src, new_tgt

    def batches(self, max_tokens: int, seed: int) -> list[np.ndarray]:
        drawn = self.data.epoch_pairs(seed)  # (M,) the epoch's pair indices
        keys = drawn.astype(np.int64)  # (M,) batch indices: a changed pair's points into the store
        src_lens = self.data.src.lengths[drawn].astype(np.int64)
        tgt_lens = self.data.tgt.lengths[drawn].astype(np.int64)
        store = EpochStore(self.next_index, [], [], [])
        for position, draw, typing_seed in self._draws(drawn, seed):
            pair = int(drawn[position])
            changed = self._changed(pair, draw, random.Random(typing_seed))
            if changed is None:
                continue
            keys[position] = store.first + len(store.src)
            src_lens[position], tgt_lens[position] = len(changed[0]), len(changed[1])
            store.src.append(changed[0])
            store.tgt.append(changed[1])
            store.pairs.append(pair)
        self.next_index += len(store.src)
        self.stores = [*self.stores[-1:], store]
        return [keys[b] for b in token_batches(src_lens, tgt_lens, max_tokens, seed)]

    def _draws(self, drawn: np.ndarray, seed: int) -> list[tuple[int, Draw, str]]:
        """The epoch's changes: (position in `drawn`, the change, its typos' seed). `draws: epoch`
        draws them from the epoch's seed; `once` from train.seed alone, per pair, the same every epoch."""
        if self.cfg.draws == "epoch":
            return [(position, draw, f"{seed}:{position}:{int(drawn[position])}")
                    for position, draw in draw_modifiers(self.cfg, np.random.default_rng((seed, 0xA06)), len(drawn))]
        if self.once is None:  # (pairs,) each prepared pair's one change
            self.once = dict(draw_modifiers(self.cfg, np.random.default_rng((self.seed, 0x0CE)), len(self.data)))
        return [(position, self.once[pair], f"{self.seed}:once:{pair}")
                for position, pair in enumerate(drawn.tolist()) if pair in self.once]

    def _pairs(self, indices: np.ndarray) -> tuple[list, list]:
        """The source and target ids of a batch's pairs, as prepared or as their epoch changed them."""
        src: list = []
        tgt: list = []
        for index in indices.tolist():
            if index < len(self.data):
                src.append(self.data.src[index])
                tgt.append(self.data.tgt[index])
                continue
            store = next(s for s in reversed(self.stores) if s.first <= index)
            src.append(store.src[index - store.first])
            tgt.append(store.tgt[index - store.first])
        return src, tgt

    def collate(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        if not (indices >= len(self.data)).any():
            return self.data.collate(indices)
        src, tgt = self._pairs(indices)
        return collate_flat(flatten(src), flatten(tgt))

    def target_tokens(self, indices: np.ndarray) -> int:
        """The target tokens of a batch's pairs, each with its <eos> (the loss's normaliser): the
        prepared lengths, and the changed pairs' own."""
        indices = np.asarray(indices, dtype=np.int64)
        prepared = indices[indices < len(self.data)]
        changed = indices[indices >= len(self.data)]
        return self.data.target_tokens(prepared) + (sum(len(t) for t in self._pairs(changed)[1]) + len(changed))


def training_split(run: RunDirectory, config: ExperimentConfig, spm_files: dict[str, bytes]) -> ParallelData | AugmentedData:
    """The training split as training reads it: with each epoch's pairs augmented where the config's
    data.augment sets a rate, else as prepared."""
    data = ParallelData(run, "train", config.data.temperature)
    if not config.data.augment.enabled:
        return data
    src_sp, tgt_sp = (spm.SentencePieceProcessor(model_proto=spm_files[side]) for side in ("src", "tgt"))
    return AugmentedData(data, config.data.augment, src_sp, tgt_sp,
                         min(config.data.max_len, config.model.max_positions - 2), config.train.seed)


def describe(cfg: AugmentConfig) -> str:
    """The console's line: each modifier's rate."""
    rates = ", ".join(f"{name} {getattr(cfg, name):.0%}" for name in ("upper", "title", "lower", "typos", "end_punctuation")
                      if getattr(cfg, name))
    when = "drawn each epoch" if cfg.draws == "epoch" else "drawn once per pair"
    return f"augmentation, {when}: {rates} of the pairs (typos: {cfg.typo_words:.1%} of a source's words)"
