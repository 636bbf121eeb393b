"""Constraints sampled from references, as Post & Vilar (2018) measured lexically constrained
decoding: for each sentence, 1–2 phrases of 1–3 consecutive reference words (not overlapping),
seeded. Writes a `tfm translate --constraints` / `tfm evaluate --constraints` file:
source<TAB>phrase[<TAB>phrase].

    python scripts/sample_constraints.py --src data/multi30k/test_2016_flickr.de.gz \
        --ref data/multi30k/test_2016_flickr.en.gz --seed 1 -o test2016.constraints.tsv

Punctuation at a phrase's ends is dropped ("fence." → "fence"): a term is words, as a user writes it.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.runtime.files import atomic_write_text, read_lines  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        sys.exit(f"error: {args.src} has {len(sources)} lines, {args.ref} {len(references)}")
    atomic_write_text(Path(args.output), "\n".join(sample_constraints(sources, references, args.seed)) + "\n")


if __name__ == "__main__":
    main()
