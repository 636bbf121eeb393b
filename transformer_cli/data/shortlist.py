"""A lexical shortlist: the target pieces a source piece may translate into, for CTranslate2's
vocabulary map (`decode.shortlist`).

Learned from the run's prepared training pairs, in pieces: IBM Model 1 (data/lexical.py's EM)
gives p(t|s) for every source piece s; the map lists each source piece's `top` most probable target
pieces, and the `frequent` most frequent target pieces under the empty key (always candidates), as
Marian's lexical shortlists do. CTranslate2 then restricts each batch's output layer to the union
of its sentences' candidates, which saves the share of the decoder's work the output layer has
(large for a small student with a large vocabulary).

The file is CTranslate2's `vmap.txt` format: `<source piece>\\t<target piece> <target piece> …`,
one line per source piece, the first line's key empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..experiment.config import ShortlistConfig
from ..model.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from ..runtime.errors import TfmError
from ..runtime.files import check_digest, write_with_digest
from .lexical import MAX_ENTRIES, _Side, train_model1

if TYPE_CHECKING:
    from ..experiment.rundir import RunDirectory
    from .batches import TokenArray

SPECIAL = {PAD_ID, UNK_ID, BOS_ID, EOS_ID}  # CTranslate2 always allows <unk>, <s> and </s> itself


@dataclass
class ShortlistResult:
    path: Path
    pairs: int  # training pairs Model 1 learned from
    source_pieces: int  # source pieces with a line of their own
    mean_candidates: float  # target pieces per source line
    seconds: float


def _sample(src: TokenArray, tgt: TokenArray, pairs: int, seed: int) -> np.ndarray:
    """Indices of ≤ `pairs` random training pairs whose Model 1 entries (target × (source + 1))
    stay under MAX_ENTRIES, in corpus order."""
    order = np.random.default_rng(seed).permutation(len(src))[:pairs]
    entries = tgt.lengths[order].astype(np.int64) * (src.lengths[order].astype(np.int64) + 1)
    within = np.cumsum(entries) <= MAX_ENTRIES
    return np.sort(order[within])


def lexical_table(run: RunDirectory, settings: ShortlistConfig, seed: int) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray, int]:
    """Model 1 over the run's training pieces: (source ids, target ids, log p(t|s)) of every entry
    it keeps, and the pairs it learned from."""
    from .batches import TokenArray  # (torch: not where CTranslate2 checks a shortlist)

    src, tgt = (TokenArray.load(run.binary_stem("train", side)) for side in ("src", "tgt"))
    if len(src) == 0:
        raise TfmError(f"{run.root}: the prepared training split is empty: nothing to learn a shortlist from")
    chosen = _sample(src, tgt, settings.sample_pairs, seed)
    src_ids, src_len = src.gather(chosen)
    tgt_ids, tgt_len = tgt.gather(chosen)
    n_source = int(src_ids.max(initial=0)) + 2  # + NULL (id 0): pieces are shifted by one
    n_target = int(tgt_ids.max(initial=0)) + 1
    table = train_model1(_Side(src_ids + 1, np.zeros(0, dtype=np.int64), src_len),
                         _Side(tgt_ids, np.zeros(0, dtype=np.int64), tgt_len), n_source, n_target)
    sources, targets = table.keys // n_target - 1, table.keys % n_target
    return sources, targets, table.log_probs, len(chosen)


def build_shortlist(run: RunDirectory, settings: ShortlistConfig, seed: int = 1) -> ShortlistResult:
    """Write the run's shortlist.txt from the run's prepared training pairs (`tfm shortlist`)."""
    from .batches import TokenArray
    from .prepare import load_sentencepiece

    started = time.perf_counter()
    manifest = run.load_manifest()
    src_sp, tgt_sp = (load_sentencepiece(run.vocab_file(manifest, side)) for side in ("src", "tgt"))
    sources, targets, log_probs, pairs = lexical_table(run, settings, seed)
    usable = (sources >= 0) & ~np.isin(targets, list(SPECIAL))  # NULL's entries and special pieces out
    sources, targets, log_probs = sources[usable], targets[usable], log_probs[usable]
    order = np.lexsort((-log_probs, sources))  # by source piece, most probable target first
    sources, targets = sources[order], targets[order]
    starts = np.flatnonzero(np.r_[True, sources[1:] != sources[:-1]]) if len(sources) else np.zeros(0, dtype=int)
    rank = np.arange(len(sources)) - np.repeat(starts, np.diff(np.r_[starts, len(sources)]))
    sources, targets = sources[rank < settings.top], targets[rank < settings.top]

    counts = np.bincount(TokenArray.load(run.binary_stem("train", "tgt")).tokens, minlength=tgt_sp.vocab_size())
    counts[list(SPECIAL)] = 0
    frequent = [int(i) for i in np.argsort(-counts, kind="stable")[:settings.frequent] if counts[i] > 0]
    lines = ["\t" + " ".join(tgt_sp.id_to_piece(i) for i in frequent)]
    bounds = np.flatnonzero(np.r_[True, sources[1:] != sources[:-1], True]) if len(sources) else np.zeros(1, dtype=int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = src_sp.id_to_piece(int(sources[a]))
        if int(sources[a]) in SPECIAL or any(c.isspace() for c in piece):
            continue
        lines.append(piece + "\t" + " ".join(tgt_sp.id_to_piece(int(t)) for t in targets[a:b]))
    path = run.shortlist_file
    text = "\n".join(lines) + "\n"
    write_with_digest(path, text)
    candidates = [len(line.split("\t")[1].split()) for line in lines[1:]]
    return ShortlistResult(path, pairs, len(lines) - 1, float(np.mean(candidates)) if candidates else 0.0,
                           time.perf_counter() - started)


def check_shortlist(path: Path, tgt_sp=None) -> None:
    """A shortlist must be CTranslate2's vmap format, not empty, list only pieces of the target
    vocabulary `tgt_sp` (one made for another run would silently restrict the output to wrong
    pieces; None: not checked) and, where its digest file is beside it, match it. CTranslate2
    crashes (SIGSEGV) on an empty map: nothing reaches it unchecked."""
    if not path.is_file():
        raise TfmError(f"{path}: not a file (a lexical shortlist: make it with `tfm shortlist`)")
    if path.stat().st_size == 0:
        raise TfmError(f"{path}: empty (a lexical shortlist: make it again with `tfm shortlist`)")
    check_digest(path, "make it again with `tfm shortlist`")
    known = {tgt_sp.id_to_piece(i) for i in range(tgt_sp.get_piece_size())} if tgt_sp is not None else None
    number = 0
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                key, tab, candidates = line.rstrip("\n").partition("\t")
                if not tab:
                    raise TfmError(f"{path} line {number}: not '<source piece><TAB><target pieces>' (a lexical "
                                   "shortlist: make it again with `tfm shortlist`)")
                unknown = next((p for p in candidates.split() if p not in known), None) if known else None
                if unknown is not None:
                    raise TfmError(f"{path} line {number}: {unknown!r} is not a piece of this model's target vocabulary "
                                   "(a shortlist made for another run: make it again with `tfm shortlist`)")
    except UnicodeDecodeError:
        raise TfmError(f"{path}: not UTF-8 text (a lexical shortlist: make it again with `tfm shortlist`)") from None
    except OSError as exc:
        raise TfmError(f"{path}: cannot be read ({exc.strerror})") from None
    if number == 0:
        raise TfmError(f"{path}: empty (a lexical shortlist: make it again with `tfm shortlist`)")
