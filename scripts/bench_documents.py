#!/usr/bin/env python3
"""Document translation against line translation, on the documents scripts/make_documents.py makes.

Targets: paragraphs (--format text) within 0.5 BLEU of the same sentences translated one a line;
HTML with random inline tags: every tag kept once, the output well-formed, the text within 1.0
BLEU of the plain translation, at least 90% of the tags around one word around that word's
translation (judged where the glossary has the word and its translation occurs once in the
paragraph), and at least 0.7x the speed of plain lines (sentences/s, tfm translate's own count, the
median of --repeats runs), on the default engine and on tfm's.

    python scripts/make_documents.py --src data/multi30k/test_2016_flickr.de.gz \\
        --ref data/multi30k/test_2016_flickr.en.gz --out runs/documents
    tfm glossary --checkpoint runs/de-en/checkpoints/checkpoint_best.pt --src data/multi30k/train.de.gz \\
        --ref data/multi30k/train.en.gz -o runs/documents/glossary.tsv
    python scripts/bench_documents.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt --docs runs/documents
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import sacrebleu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

RATE = re.compile(r"translated (\d+) sentences in ([\d.]+)s")


def tfm(*args: str) -> tuple[str, float]:
    """Run tfm translate; its output and its sentences/s (as it reports them)."""
    done = subprocess.run([sys.executable, "-m", "transformer_cli.cli", "translate", *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise TfmError(f"tfm translate {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    found = RATE.search(done.stderr)
    return done.stdout, int(found.group(1)) / max(float(found.group(2)), 1e-9) if found else float("nan")


def timed(repeats: int, *args: str) -> tuple[str, float]:
    """tfm translate run `repeats` times: its output (the same each time) and its median sentences/s
    (a 2-core machine's single run varies by ±10%)."""
    runs = [tfm(*args) for _ in range(repeats)]
    rates = sorted(rate for _, rate in runs)
    return runs[0][0], rates[len(rates) // 2]


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


def bare(word: str) -> str:
    return word.strip(".,;:!?\"'()").lower()


def judge_tags(page: str, source_page: str, singles: list[dict], glossary: dict[str, str]) -> dict:
    """Tags kept (each data-n once, same name and attributes), well-formed (an XML parser reads the
    page), and single-word tags around the glossary translation of their word."""
    import lxml.etree

    try:
        root = lxml.etree.fromstring(re.sub(r"\A<!DOCTYPE[^>]*>", "", page.strip()).encode())
    except lxml.etree.XMLSyntaxError as exc:
        return {"well_formed": False, "error": str(exc)}
    source = lxml.etree.fromstring(re.sub(r"\A<!DOCTYPE[^>]*>", "", source_page.strip()).encode())
    want = {e.get("data-n"): (e.tag, dict(e.attrib)) for e in source.iter() if e.get("data-n")}
    got: dict[str, list] = {}
    for element in root.iter():
        if element.get("data-n"):
            got.setdefault(element.get("data-n"), []).append((element.tag, dict(element.attrib)))
    kept = sum(got.get(n) == [w] for n, w in want.items())
    paragraphs_out = root.findall(".//p")
    judged = right = 0
    for single in singles:
        target = glossary.get(bare(single["word"]))
        if target is None:
            continue
        text = " ".join("".join(paragraphs_out[single["paragraph"]].itertext()).split())
        if [bare(w) for w in text.split()].count(target) != 1:
            continue
        element = root.find(f".//*[@data-n='{single['n']}']")
        judged += 1
        right += element is not None and bare(" ".join("".join(element.itertext()).split())) == target
    texts = [" ".join("".join(p.itertext()).split()) for p in paragraphs_out]
    return {"well_formed": True, "tags": len(want), "kept_once": kept, "judged": judged, "right": right,
            "texts": texts}


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--docs", type=Path, default=Path("runs/documents"))
    parser.add_argument("--glossary", type=Path, help="source<TAB>target lines (default: DOCS/glossary.tsv)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each timed translation (median; default 3)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise TfmError(f"--repeats {args.repeats}: at least 1")
    if not Path(args.checkpoint).is_file():
        raise TfmError(f"--checkpoint {args.checkpoint}: no such file")
    if not (args.docs / "tagged.src.html").is_file():
        raise TfmError(f"--docs {args.docs}: no documents there (make them with scripts/make_documents.py)")
    docs, model = args.docs, ["--checkpoint", args.checkpoint]
    refs = paragraphs((docs / "paragraphs.tgt.txt").read_text(encoding="utf-8"))
    index = [int(x) for x in (docs / "paragraphs.index").read_text().split()]

    def joined(lines: list[str]) -> list[str]:
        out = [""] * (max(index) + 1)
        for p, line in zip(index, lines):
            out[p] = f"{out[p]} {line}".strip()
        return out

    rows = []
    for label, engine in (("default engine", []), ("tfm's engine", ["--engine", "torch"])):
        lines, line_rate = timed(args.repeats, *model, *engine, "-i", str(docs / "lines.src"))
        text, text_rate = timed(args.repeats, *model, *engine, "--format", "text", "-i", str(docs / "paragraphs.src.txt"))
        rows.append((f"lines ({label})", bleu(joined(lines.splitlines()), refs), line_rate))
        rows.append((f"text paragraphs ({label})", bleu(paragraphs(text), refs), text_rate))
    glossary_path = args.glossary or docs / "glossary.tsv"
    glossary = {}
    if glossary_path.exists():
        for line in glossary_path.read_text(encoding="utf-8").splitlines():
            if "\t" in line:
                source, target = line.split("\t")[:2]
                glossary[bare(source)] = bare(target)
    singles = [json.loads(line) for line in (docs / "tags.jsonl").read_text(encoding="utf-8").splitlines()]
    source_page = (docs / "tagged.src.html").read_text(encoding="utf-8")
    pages = []
    for label, engine in (("default engine", []), ("tfm's engine", ["--engine", "torch"])):
        page, html_rate = timed(args.repeats, *model, *engine, "-i", str(docs / "tagged.src.html"))
        judged = judge_tags(page, source_page, singles, glossary)
        if judged["well_formed"]:
            rows.append((f"html, the page's text ({label})", bleu(judged["texts"], refs), html_rate))
        pages.append((label, judged, html_rate))
    print(f"{'mode':<40} {'BLEU':>6} {'sent/s':>8}")
    for label, score, rate in rows:
        print(f"{label:<40} {score:6.2f} {rate:8.1f}")
    for (label, judged, html_rate), lines_rate in zip(pages, (rows[0][2], rows[2][2])):
        if not judged["well_formed"]:
            print(f"html ({label}): output is not well-formed: {judged['error']}")
            continue
        print(f"html ({label}): tags kept once {judged['kept_once']}/{judged['tags']} "
              f"({100 * judged['kept_once'] / judged['tags']:.1f}%); output well-formed: yes")
        if judged["judged"]:
            print(f"html ({label}): single-word tags around the word's translation: {judged['right']}/"
                  f"{judged['judged']} ({100 * judged['right'] / judged['judged']:.1f}%; judged by {len(glossary)} "
                  "glossary entries)")
        print(f"html ({label}): speed / plain lines on the same engine {html_rate / lines_rate:.2f}x")
    other_formats(docs, model, refs)


def rendered(markdown: str) -> tuple[dict[str, int], list[str]]:
    """Markdown as CommonMark renders it: how many of each inline element, and each paragraph's text."""
    import lxml.html
    from markdown_it import MarkdownIt

    root = lxml.html.fragment_fromstring(MarkdownIt("commonmark").enable("strikethrough").render(markdown),
                                         create_parent="div")
    counts: dict[str, int] = {}
    for element in root.iter("strong", "em", "s", "a"):
        counts[element.tag] = counts.get(element.tag, 0) + 1
    return counts, [" ".join(p.text_content().split()) for p in root.findall("p")]


def other_formats(docs: Path, model: list[str], refs: list[str]) -> None:
    """Markdown (its inline marks kept, its text) and SubRip (timings kept, each cue's text)."""
    source_md = (docs / "tagged.src.md").read_text(encoding="utf-8")
    out_md, md_rate = tfm(*model, "-i", str(docs / "tagged.src.md"))
    want, _ = rendered(source_md)
    got, texts = rendered(out_md)
    print(f"markdown: inline marks {sum(got.values())}/{sum(want.values())} ({got} vs {want}); "
          f"paragraphs {len(texts)}/{len(refs)}; text BLEU {bleu(texts, refs):.2f}; {md_rate:.1f} sent/s")
    source_srt = (docs / "subtitles.src.srt").read_text(encoding="utf-8")
    out_srt, srt_rate = tfm(*model, "-i", str(docs / "subtitles.src.srt"))
    timings = [line for line in out_srt.splitlines() if "-->" in line]
    cues = [" ".join(block.strip().splitlines()[2:]) for block in re.split(r"\n\s*\n", out_srt) if block.strip()]
    lines_ref = (docs / "lines.tgt").read_text(encoding="utf-8").splitlines()
    same_lines = sum(len(a.strip().splitlines()) == len(b.strip().splitlines()) for a, b in
                     zip(re.split(r"\n\s*\n", out_srt), re.split(r"\n\s*\n", source_srt)))
    print(f"subrip: timings kept {timings == [x for x in source_srt.splitlines() if '-->' in x]}; cues {len(cues)}; "
          f"cues with their line count {same_lines}; cue BLEU {bleu(cues, lines_ref):.2f}; {srt_rate:.1f} sent/s")


if __name__ == "__main__":
    run_script(main)
