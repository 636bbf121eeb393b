"""A small glossary from parallel text by word alignment: translate the first --lines source lines
with tfm's engine and `--alignment` (greedy), count which target word each source word aligns to,
and keep the --entries most frequent content words (4+ letters, a target of 3+ letters) whose
alignment is consistent (the same target word in at least --agreement of the source word's
occurrences) and confirmed by the references (the target word in the reference of at least
--agreement of the lines holding the source word). Writes `source term<TAB>target term` lines,
the `tfm translate --glossary` format.

    python scripts/extract_glossary.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/train.de.gz --ref data/multi30k/train.en.gz -o glossary.de-en.tsv
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.runtime.files import atomic_write_text, read_lines  # noqa: E402
from transformer_cli.decoding.torch_engine import Translator  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--agreement", type=float, default=0.6)
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    sources, references = read_lines(args.src)[: args.lines], read_lines(args.ref)[: args.lines]
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu",
                                            overrides=["decode.alignment=true", "decode.beam=1"])
    found = translator.translate(sources)
    translator.close()
    chosen = extract(sources, references, [t[0].text for t in found], [t[0].alignment or "" for t in found],
                     args.entries, args.agreement)
    atomic_write_text(Path(args.output), "".join(f"{s}\t{t}\n" for s, t, _ in chosen))
    print(json.dumps({"lines": len(sources), "entries": len(chosen),
                      "examples": [f"{s} → {t} ({n})" for s, t, n in chosen[:8]]}, ensure_ascii=False))


if __name__ == "__main__":
    main()
