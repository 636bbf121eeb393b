"""Terminology made from parallel text, for `tfm translate --glossary` and `--constraints`.

- `tfm glossary`: a small glossary by word alignment: the first `lines` source lines are translated
  with tfm's engine and `--alignment` (greedy); each source word's aligned target words are counted,
  and the `entries` most frequent content words (4+ letters, a target of 3+ letters) are kept whose
  alignment is consistent (the same target word in at least `agreement` of the source word's
  occurrences) and confirmed by the references (the target word in the reference of at least
  `agreement` of the lines holding the source word). Writes `source term<TAB>target term` lines.
- `tfm sample-constraints`: constraints sampled from references, as Post & Vilar (2018) measured
  lexically constrained decoding: for each sentence, 1–2 phrases of 1–3 consecutive reference words
  (not overlapping), seeded; punctuation at a phrase's ends is dropped ("fence." → "fence"). Writes
  `source<TAB>phrase[<TAB>phrase]` lines.
"""

from __future__ import annotations

import collections
import random
import re
import string
from pathlib import Path

from ..runtime.errors import TfmError
from ..runtime.files import atomic_write_text, read_lines

WORD = re.compile(r"^[^\W\d_]+$")  # letters only


def bare(word: str) -> str:
    return word.strip(".,;:!?\"'()")


def extract(sources: list[str], references: list[str], hypotheses: list[str], alignments: list[str],
            entries: int, agreement: float) -> list[tuple[str, str, int]]:
    """(source word, target word, occurrences) for the glossary, most frequent first."""
    aligned: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    occurrences: collections.Counter = collections.Counter()
    lines_with: dict[str, list[int]] = collections.defaultdict(list)
    for number, (source, hypothesis, pairs) in enumerate(zip(sources, hypotheses, alignments)):
        src_words, tgt_words = source.split(), hypothesis.split()
        seen = set()
        for pair in pairs.split():
            i, j = map(int, pair.split("-"))
            if i < len(src_words) and j < len(tgt_words):
                aligned[bare(src_words[i]).lower()][bare(tgt_words[j])] += 1
        for word in src_words:
            key = bare(word).lower()
            occurrences[key] += 1
            if key not in seen:
                lines_with[key].append(number)
                seen.add(key)
    chosen = []
    for word, count in occurrences.most_common():
        if len(chosen) == entries:
            break
        if len(word) < 4 or not WORD.match(word) or not aligned[word]:
            continue
        target, together = aligned[word].most_common(1)[0]
        if len(target) < 3 or not WORD.match(target) or together < agreement * count:
            continue
        pattern = re.compile(rf"(?<![^\W_]){re.escape(target)}(?![^\W_])")
        confirmed = sum(bool(pattern.search(references[n])) for n in lines_with[word])
        if confirmed >= agreement * len(lines_with[word]) and all(target != t for _, t, _ in chosen):
            chosen.append((word, target, count))
    return chosen


def extract_glossary(checkpoint: Path, src: Path, ref: Path, lines: int, entries: int, agreement: float,
                     output: Path) -> dict:
    """Write the glossary of the first `lines` pairs of `src`/`ref` to `output`; a summary to print."""
    from .torch_engine import Translator  # torch: only here

    sources, references = _parallel(src, ref, lines)
    translator = Translator.from_checkpoint(checkpoint, device="cpu",
                                            overrides=["decode.alignment=true", "decode.beam=1"])
    try:
        found = translator.translate(sources)
    finally:
        translator.close()
    chosen = extract(sources, references, [t[0].text for t in found], [t[0].alignment or "" for t in found],
                     entries, agreement)
    atomic_write_text(output, "".join(f"{s}\t{t}\n" for s, t, _ in chosen))
    return {"lines": len(sources), "entries": len(chosen), "examples": [f"{s} → {t} ({n})" for s, t, n in chosen[:8]]}


EDGES = string.punctuation + "“”‘’«»„"


def sample_phrases(reference: str, rng: random.Random) -> list[str]:
    """1–2 phrases of 1–3 consecutive words of `reference`, not overlapping, in sentence order."""
    words = reference.split()
    wanted = rng.randint(1, 2)
    taken: set[int] = set()
    phrases: list[tuple[int, str]] = []
    for _ in range(20):  # a short reference may not hold two
        if len(phrases) == wanted or not words:
            break
        size = min(rng.randint(1, 3), len(words))
        start = rng.randrange(len(words) - size + 1)
        span = set(range(start, start + size))
        if span & taken:
            continue
        phrase = " ".join(words[start : start + size]).strip(EDGES)
        if phrase:
            taken |= span
            phrases.append((start, phrase))
    return [p for _, p in sorted(phrases)]


def sample_constraints(sources: list[str], references: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for source, reference in zip(sources, references):
        phrases = [p for p in sample_phrases(reference, rng) if "\t" not in p]
        rows.append("\t".join([source, *phrases]) if phrases else f"{source}\t")
    return rows


def write_sampled_constraints(src: Path, ref: Path, seed: int, output: Path) -> int:
    """Write sampled constraints for every pair of `src`/`ref` to `output`; returns the lines written."""
    sources, references = _parallel(src, ref, None)
    atomic_write_text(output, "\n".join(sample_constraints(sources, references, seed)) + "\n")
    return len(sources)


def _parallel(src: Path, ref: Path, lines: int | None) -> tuple[list[str], list[str]]:
    sources, references = read_lines(src), read_lines(ref)
    if len(sources) != len(references):
        raise TfmError(f"--src {src} has {len(sources)} lines, --ref {ref} {len(references)}: they must be parallel")
    return sources[:lines], references[:lines]
