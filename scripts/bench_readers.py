"""The document readers alone, without a model: each format of scripts/make_documents.py's
documents planned and rebuilt (every sentence "translated" as itself, word i aligned to word i),
the fastest of --repeats runs (the median swings by 20% between runs on a 2-core VM), and a digest
of what was rebuilt.

    python scripts/bench_readers.py --docs runs/documents

Run from two checkouts (PYTHONPATH=OTHER_CHECKOUT python scripts/bench_readers.py …) it compares
readers where a model of one cannot be read by the other. Target: the same sentences and the same
rebuilt documents (digests equal), and each format's time within 10% or faster.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

# appended, not put first: PYTHONPATH=OTHER_CHECKOUT then measures that checkout's readers
sys.path.append(str(Path(__file__).resolve().parents[1]))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402

DOCUMENTS = {"html": "tagged.src.html", "markdown": "tagged.src.md", "srt": "subtitles.src.srt",
             "text": "paragraphs.src.txt"}


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, required=True, help="scripts/make_documents.py's --out folder.")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from transformer_cli.decoding.translation import Translation
    from transformer_cli.documents.formats import plan_document

    print(f"{'format':<10} {'sentences':>9} {'ms':>8}  rebuilt (sha256)")
    for fmt, name in DOCUMENTS.items():
        text = (args.docs / name).read_text(encoding="utf-8")
        times, rebuilt, sentences = [], "", 0
        for _ in range(args.repeats):
            started = time.perf_counter()
            plan = plan_document(text, fmt, "de")
            done = plan.rebuild([Translation(s, 0.0, 0, " ".join(f"{i}-{i}" for i in range(len(s.split()))))
                                 for s in plan.sentences])
            times.append(time.perf_counter() - started)
            rebuilt, sentences = done if isinstance(done, str) else done.decode("utf-8"), len(plan.sentences)
        digest = hashlib.sha256(rebuilt.encode("utf-8")).hexdigest()[:16]
        print(f"{fmt:<10} {sentences:>9} {1000 * min(times):>8.1f}  {digest}")


if __name__ == "__main__":
    run_script(main)
