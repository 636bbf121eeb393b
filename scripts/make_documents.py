#!/usr/bin/env python3
"""Documents made from a test set, to measure document translation against line translation:

- paragraphs.{src,tgt}.txt: consecutive sentences joined into paragraphs of 2–6 (blank lines between);
- tagged.src.html: the same paragraphs as <p> elements, with random inline tags (<b>, <i>, <em>,
  <strong>, <span class>, <a href>) around spans of 1–3 words, some nested, each numbered by a
  data-n attribute; tags.jsonl: for each tag around a single word, its number and the word (what
  bench_documents.py judges the projection by);
- tagged.src.md: the same tagged paragraphs in Markdown (**strong**, *emphasis*, ~~struck~~, links);
- subtitles.src.srt: the sentences as SubRip cues, two lines where a sentence has over 6 words;
- lines.{src,tgt}: the sentences one a line, and paragraphs.index: each sentence's paragraph.

    python scripts/make_documents.py --src data/multi30k/test_2016_flickr.de.gz \\
        --ref data/multi30k/test_2016_flickr.en.gz --out runs/documents
"""

from __future__ import annotations

import gzip
import html
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import check_output  # noqa: E402

TAGS = [("b", ""), ("i", ""), ("em", ""), ("strong", ""), ("span", ' class="hl"'), ("a", ' href="https://example.org/{n}"')]


def read(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return [line.strip() for line in lines]


def tagged_sentence(words: list[str], rng: random.Random, counter: list[int], singles: list[dict],
                    paragraph: int) -> str:
    """The sentence's words with 0–3 non-overlapping tags around spans of 1–3 words (a quarter of
    the longer spans with a second tag inside, around one word)."""
    marks: dict[int, list[str]] = {}  # word index → opening tags before it
    ends: dict[int, list[str]] = {}  # word index → closing tags after it
    free = list(range(len(words)))
    for _ in range(rng.randint(0, 3)):
        if not free:
            break
        start = rng.choice(free)
        length = min(rng.randint(1, 3), len(words) - start)
        span = list(range(start, start + length))
        if any(i not in free for i in span):
            continue
        for i in span:
            free.remove(i)
        spans = [(span[0], span[-1])]
        if length > 1 and rng.random() < 0.25:
            inner = rng.choice(span)
            spans.append((inner, inner))
        for first, last in spans:
            name, attributes = rng.choice(TAGS)
            counter[0] += 1
            marks.setdefault(first, []).append(f'<{name} data-n="{counter[0]}"{attributes.format(n=counter[0])}>')
            ends.setdefault(last, []).insert(0, f"</{name}>")
            if first == last:
                singles.append({"paragraph": paragraph, "tag": name, "n": counter[0], "word": words[first]})
    out = []
    for i, word in enumerate(words):
        out.append("".join(marks.get(i, [])) + html.escape(word, quote=False) + "".join(ends.get(i, [])))
    return " ".join(out)


MARKDOWN = {"b": ("**", "**"), "strong": ("**", "**"), "i": ("*", "*"), "em": ("*", "*"), "span": ("~~", "~~")}


def as_markdown(markup: str) -> str:
    """A tagged paragraph in Markdown: <b>/<strong> → **, <i>/<em> → *, <span> → ~~, <a href> → [..](..)."""
    out, stack, at = [], [], 0
    for match in re.finditer(r"<(/?)(\w+)([^>]*)>", markup):
        out.append(html.unescape(markup[at:match.start()]))
        at = match.end()
        closing_tag, name, attributes = match.group(1), match.group(2), match.group(3)
        if not closing_tag:
            href = re.search(r'href="([^"]+)"', attributes)
            stack.append((name, href.group(1) if href else ""))
            out.append("[" if name == "a" else MARKDOWN[name][0])
        else:
            name, href = stack.pop()
            out.append(f"]({href})" if name == "a" else MARKDOWN[name][1])
    out.append(html.unescape(markup[at:]))
    return "".join(out)


def timestamp(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


WRITTEN = {"lines.src", "lines.tgt", "paragraphs.index", "paragraphs.src.txt", "paragraphs.tgt.txt", "tagged.src.html",
           "tagged.src.md", "subtitles.src.srt", "tags.jsonl"}  # what --out receives


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/documents"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for path in (args.src, args.ref):
        if not path.is_file():
            raise TfmError(f"{path}: no such file")
    check_output(args.out, {"--src": [args.src], "--ref": [args.ref]}, flag="--out", directory=True, names=WRITTEN,
                 ours=lambda folder: (folder / "tags.jsonl").is_file())  # documents made before: made anew
    sources, references = read(args.src), read(args.ref)
    rng = random.Random(args.seed)
    groups, i = [], 0
    while i < len(sources):
        k = rng.randint(2, 6)
        groups.append(range(i, min(i + k, len(sources))))
        i += k
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lines.src").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (args.out / "lines.tgt").write_text("\n".join(references) + "\n", encoding="utf-8")
    (args.out / "paragraphs.index").write_text("".join(f"{p}\n" for p, g in enumerate(groups) for _ in g))
    for side, lines in (("src", sources), ("tgt", references)):
        text = "\n\n".join(" ".join(lines[j] for j in group) for group in groups) + "\n"
        (args.out / f"paragraphs.{side}.txt").write_text(text, encoding="utf-8")
    counter, singles, body = [0], [], []
    for p, group in enumerate(groups):
        body.append("<p>" + " ".join(tagged_sentence(sources[j].split(), rng, counter, singles, p) for j in group)
                    + "</p>")
    page = "<!DOCTYPE html>\n<html><head><title>test</title></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    (args.out / "tagged.src.html").write_text(page, encoding="utf-8")
    (args.out / "tagged.src.md").write_text("\n\n".join(as_markdown(p[3:-4]) for p in body) + "\n", encoding="utf-8")
    cues = []
    for k, sentence in enumerate(sources):
        words = sentence.split()
        text = sentence if len(words) <= 6 else " ".join(words[: len(words) // 2]) + "\n" + " ".join(words[len(words) // 2:])
        cues.append(f"{k + 1}\n{timestamp(3 * k)} --> {timestamp(3 * k + 2.5)}\n{text}\n")
    (args.out / "subtitles.src.srt").write_text("\n".join(cues), encoding="utf-8")
    (args.out / "tags.jsonl").write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in singles),
                                         encoding="utf-8")
    print(f"{len(sources)} sentences, {len(groups)} paragraphs, {counter[0]} tags ({len(singles)} around one word) "
          f"→ {args.out}")


if __name__ == "__main__":
    run_script(main)
