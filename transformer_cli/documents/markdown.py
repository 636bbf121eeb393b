"""Markdown (CommonMark, parsed by markdown-it-py): the text of each paragraph, heading, list item and
quote is translated, and its inline markup (**strong**, *emphasis*, ~~struck~~, [links](…)) is put
back around the translated words through the alignments, as for HTML (documents/markup.py). What is
not prose stays as it was: code blocks and `code spans` (a code span lands on its copy in the
translation), images, autolinks, inline HTML that is not an element around words (`<br>`, a comment), tables, and each line's block markers ("# ", "> ",
"- ", indentation). A paragraph that ran over several lines comes out on one line (Markdown joins
them anyway)."""

from __future__ import annotations

import functools
import re
from typing import Any

from ..decoding.translation import Translation
from .markup import Run, Span, plan_run, sentences_in_markup, translated_with_spans
from .plan import Plan

OPENING = {"strong_open", "em_open", "s_open", "link_open"}
CLOSING = {"strong_close", "em_close", "s_close", "link_close"}


HTML_OPENING = re.compile(r"<([A-Za-z][A-Za-z0-9-]*)(?:\s[^<>]*)?>\Z")
HTML_CLOSING = re.compile(r"</([A-Za-z][A-Za-z0-9-]*)\s*>\Z")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def inline_run(children: list[Any]) -> Run:
    """An inline token's children as a run: its text, and its markup as spans (element: the
    (opening, closing) marks, or for what is kept, the markup as it is written). Inline HTML that
    opens and closes an element (`<span>…</span>`) is a span like emphasis: it follows its words."""
    run = Run()
    into, opened = [run.spans], []
    html: dict[int, str] = {}  # id of an open span of inline HTML → its element's name

    def end_html() -> None:  # inline HTML left open where its parent ends: it ends there too
        while opened and id(opened[-1]) in html:
            opened.pop().end = len(run.text)
            into.pop()

    for token in children:
        start = len(run.text)
        if token.type == "html_inline" and (tag := HTML_OPENING.match(token.content)) and \
                tag[1].lower() not in VOID and not token.content.endswith("/>"):
            span = Span((token.content, ""), start, start, False)
            into[-1].append(span)
            opened.append(span)
            into.append(span.children)
            html[id(span)] = tag[1].lower()
        elif token.type == "html_inline" and (tag := HTML_CLOSING.match(token.content)) and opened and \
                html.get(id(opened[-1])) == tag[1].lower():
            span = opened.pop()
            into.pop()
            span.end, span.element = len(run.text), (span.element[0], token.content)
        elif token.type == "text":
            run.text += token.content
        elif token.type in ("softbreak", "hardbreak"):
            run.text += " "
        elif token.type == "link_open" and token.markup == "autolink":
            opened.append(Span(f"<{token.attrs.get('href', '')}>", start, start, True))
            into.append([])  # its text is the address: not translated, the span keeps it
        elif token.type in OPENING:
            span = Span(marks(token), start, start, False)
            into[-1].append(span)
            opened.append(span)
            into.append(span.children)
        elif token.type in CLOSING and opened:
            end_html()
            span = opened.pop()
            into.pop()
            span.end = len(run.text)
            if span.kept:
                into[-1].append(span)
        elif token.type == "code_inline":
            run.text += token.content
            into[-1].append(Span(f"{token.markup}{token.content}{token.markup}", start, len(run.text), True))
        elif token.type == "image":
            title = f' "{token.attrs["title"]}"' if token.attrs.get("title") else ""
            into[-1].append(Span(f"![{token.content}]({token.attrs.get('src', '')}{title})", start, start, True))
        elif token.type == "html_inline":  # a comment, a void element, a closing tag never opened
            into[-1].append(Span(token.content, start, start, True))
    end_html()
    return run


def marks(token: Any) -> tuple[str, str]:
    if token.type == "link_open":
        title = f' "{token.attrs["title"]}"' if token.attrs.get("title") else ""
        return "[", f"]({token.attrs.get('href', '')}{title})"
    return token.markup, token.markup


HTML_TAGS = {"**": "strong", "__": "strong", "*": "em", "_": "em", "~~": "s", "~": "s"}


def render(text: str, lo: int, hi: int, spans: list[Span], as_html: bool = False) -> str:
    """[lo, hi) of the translated text with its spans' markup around their words (`as_html`:
    emphasis as inline HTML tags, which CommonMark reads wherever they stand)."""
    out, at = [], lo
    for span in spans:
        a, b = span.target
        out.append(text[at:a])
        if span.kept:
            out.append(span.element)
            if a == b and span.element and b < hi and not text[b].isspace():  # in front of a word: a space
                out.append(" ")
        else:
            inner = render(text, a, b, span.children, as_html)
            core = inner.strip()
            lead, trail = inner[: len(inner) - len(inner.lstrip())], inner[len(inner.rstrip()):]
            opening, closing = span.element
            # Emphasis around nothing is no emphasis in Markdown: one whose words were translated
            # nowhere (dropped, or merged into a sibling's) stays an empty inline HTML element, as HTML
            # mode keeps an empty element and an empty link stays "[](…)".
            if opening in HTML_TAGS and (as_html or not core):
                opening, closing = f"<{HTML_TAGS[opening]}>", f"</{HTML_TAGS[opening]}>"
            out.append(f"{lead}{opening}{core}{closing}{trail}")
        at = b
    out.append(text[at:hi])
    return "".join(out)


def emphasis(spans: list[Span], text: str) -> int:
    """How many emphasis spans (strong, emphasis, struck) around words of the text a run's markup holds."""
    return sum((not span.kept and span.element[0] in HTML_TAGS and bool(text[span.target[0]:span.target[1]].strip()))
               + emphasis(span.children, text) for span in spans)


@functools.lru_cache(maxsize=1)
def inline_parser() -> Any:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["strikethrough"])


def rendered_run(text: str, spans: list[Span]) -> str:
    """The translated run in Markdown. Where its delimiters would not read back as the emphasis they
    were (two runs of stars side by side, "**word****.**", or a star between a letter and
    punctuation, "city*.*": CommonMark's flanking rules), the run's emphasis is written as inline
    HTML tags instead (<strong>, <em>, <s>), which CommonMark keeps as they are: no mark is lost."""
    made = render(text, 0, len(text), spans)
    wanted = emphasis(spans, text)
    if wanted:
        tokens = inline_parser().parseInline(made)[0].children or []
        if sum(token.type in ("strong_open", "em_open", "s_open") for token in tokens) < wanted:
            return render(text, 0, len(text), spans, as_html=True)
    return made


def plan_markdown(document: str, lang: str | None) -> Plan:
    """The sentences of every paragraph, heading, list item and quote; the document rebuilt with
    their translations in place of their lines."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(document)
    lines = document.split("\n")
    places: list[tuple[int, int, str, str, Run]] = []  # first line, lines, what comes before and after, run
    sentences: list[str] = []
    opened: list[str] = []
    for token in tokens:
        if token.nesting == 1:
            opened.append(token.type)
        elif token.nesting == -1 and opened:
            opened.pop()
        if token.type != "inline" or not token.map or not token.content.strip() or {"th_open", "td_open"} & set(opened):
            continue
        content = token.content.split("\n")
        first, last = lines[token.map[0]], lines[token.map[0] + len(content) - 1]
        start, end = first.find(content[0]), last.rfind(content[-1])
        if start < 0 or end < 0:
            continue  # not where the parser says: left as it is
        run = inline_run(token.children or [])
        plan_run(run, lang, sentences)
        places.append((token.map[0], len(content), first[:start], last[end + len(content[-1]):], run))

    def rebuild(translations: list[Translation]) -> str:
        out: list[str | None] = list(lines)
        for first, count, before, after, run in places:
            text = translated_with_spans(run, translations)
            out[first] = before + rendered_run(text, run.spans) + after
            for k in range(1, count):
                out[first + k] = None
        return "\n".join(line for line in out if line is not None)

    return Plan(sentences, rebuild, alignment=True, aligned=sentences_in_markup([run for *_, run in places]))
