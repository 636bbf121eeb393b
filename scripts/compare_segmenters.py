#!/usr/bin/env python3
"""Sentence segmenters side by side: pysbd, sentencex, tfm's (sentencex with one boundary added
back) and a plain punctuation rule split
paragraphs made of known sentences (consecutive test-set sentences joined by a space, 2–6 a
paragraph); each is scored by its sentence boundaries (precision, recall, F1), the share of
paragraphs split exactly right, and its speed.

    python scripts/compare_segmenters.py                       # Multi30k test2016 de/en/fr/cs, WMT14 de/en
    python scripts/compare_segmenters.py --sets multi30k --lines 500

Each corpus is found by data/get_data.sh. The figures choose tfm's segmenter (docs/translation.md)."""

from __future__ import annotations

import gzip
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

SETS = {"multi30k": ("test_2016_flickr", ["de", "en", "fr", "cs"]), "wmt14": ("newstest2014", ["de", "en"])}


def corpus_lines(corpus: str, name: str, lang: str, limit: int) -> list[str]:
    folder = ROOT / "data" / corpus
    path = folder / f"{name}.{lang}.gz"
    if not path.exists():
        subprocess.run(["bash", str(ROOT / "data" / "get_data.sh"), corpus], check=True, stdout=sys.stderr)
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [line.strip() for line in lines if line.strip()][:limit]


def paragraphs(sentences: list[str], seed: int) -> list[list[str]]:
    rng, made, i = random.Random(seed), [], 0
    while i < len(sentences):
        k = rng.randint(2, 6)
        made.append(sentences[i : i + k])
        i += k
    return made


def boundaries(parts: list[str]) -> set[int]:
    """Where each sentence but the last ends, in characters of the joined text (spaces not counted)."""
    ends, at = set(), 0
    for part in parts[:-1]:
        at += len(part.replace(" ", ""))
        ends.add(at)
    return ends


def punctuation_rule(lang: str, text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text)


def pysbd_segmenter(lang: str):
    try:
        import pysbd
    except ImportError:
        raise TfmError("compare_segmenters.py needs pysbd: pip install pysbd") from None

    segmenter = pysbd.Segmenter(language=lang if lang in pysbd.languages.LANGUAGE_CODES else "en", clean=False)
    return segmenter.segment


def sentencex_segmenter(lang: str):
    import sentencex

    return lambda text: list(sentencex.segment(lang, text))


def tfm_segmenter(lang: str):
    from transformer_cli.documents.sentences import sentence_spans

    return lambda text: [text[start:end] for start, end in sentence_spans(text, lang)]


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--lines", type=int, default=1000, help="Sentences of each test set (default 1000).")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{'set':<10} {'lang':<4} {'segmenter':<12} {'P':>6} {'R':>6} {'F1':>6} {'exact':>6} {'sent/s':>9}")
    for corpus in args.sets:
        name, langs = SETS[corpus]
        for lang in langs:
            groups = paragraphs(corpus_lines(corpus, name, lang, args.lines), args.seed)
            makers = {"pysbd": lambda lang=lang: pysbd_segmenter(lang),
                      "sentencex": lambda lang=lang: sentencex_segmenter(lang),
                      "tfm": lambda lang=lang: tfm_segmenter(lang),
                      "punctuation": lambda lang=lang: lambda text: punctuation_rule(lang, text)}
            for label, make in makers.items():
                segment = make()
                found = hit = wanted = exact = 0
                started = time.perf_counter()
                outputs = [segment(" ".join(group)) for group in groups]
                seconds = time.perf_counter() - started
                for group, parts in zip(groups, outputs):
                    truth = boundaries(group)
                    got = boundaries([p.strip() for p in parts if p.strip()])
                    found, hit, wanted = found + len(got), hit + len(got & truth), wanted + len(truth)
                    exact += got == truth
                p, r = hit / max(found, 1), hit / max(wanted, 1)
                f1 = 2 * p * r / max(p + r, 1e-9)
                sentences = sum(map(len, groups))
                print(f"{corpus:<10} {lang:<4} {label:<12} {100 * p:6.1f} {100 * r:6.1f} {100 * f1:6.1f} "
                      f"{100 * exact / len(groups):6.1f} {sentences / seconds:9.0f}", flush=True)


if __name__ == "__main__":
    run_script(main)
