"""HTML and XML, parsed by lxml: the text of each block is translated sentence by sentence, and the
inline tags inside it (<b>, <a href>, <span>, …) are put back around the words that translate the
words they wrapped, through the engine's word alignments (as Bergamot's translator does).

A block's text runs from a block boundary to the next: a block element (<p>, <li>, <td>, …), <br>,
a comment, and what is not translated (<script>, <style>, <pre>, <code> standing alone, elements
marked translate="no" or class="notranslate") end a run and stay where they are. Inline
elements inside a run are flattened into character spans of its text; after translation each span
is projected onto the target words aligned to the source words it covered (their hull; where no
word of it is aligned, the same relative place in the sentence), then nested as in the source:
a child inside its parent's span, siblings side by side. Inline code (<code>, <kbd>, <samp>,
<var>, and untranslated inline elements) keeps its content: its projected words are replaced by
the element as it was. Every tag is kept once, attributes as they were, and the output is
well-formed (lxml writes it). XML has no block/inline vocabulary: there a child is inline where
its parent has text of its own beside it (mixed content).
"""

from __future__ import annotations

import bisect
import copy
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from ..decoding.translation import Translation
from ..runtime.errors import TfmError
from .plan import Plan, split_run

INLINE = {"a", "abbr", "b", "bdi", "bdo", "big", "cite", "data", "del", "dfn", "em", "font", "i", "img", "ins",
          "label", "mark", "q", "s", "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u", "wbr"}
KEPT_INLINE = {"code", "kbd", "samp", "var", "img", "wbr", "input", "svg", "math", "button", "select"}
# Not text a reader reads: code, style, preformatted text, formulas. A reader does see the <title>
# (in <head>), <noscript> (without scripts), <svg> <text>, a <template>'s content once shown and a
# <textarea>'s: those are translated (docs/translation.md#documents).
UNTRANSLATED = {"script", "style", "pre", "code", "kbd", "samp", "var", "math"}
BREAKS = {"br", "hr"}
WORD = re.compile(r"\S+")


def untranslated(element: Any) -> bool:
    return (local_name(element) in UNTRANSLATED or element.get("translate") == "no"
            or "notranslate" in (element.get("class") or "").split())


def local_name(element: Any) -> str:
    tag = element.tag
    return tag.rsplit("}", 1)[-1].lower() if isinstance(tag, str) else ""


@dataclass
class Span:
    """An inline element over [start, end) of its run's text; `kept`: its content stays as it was."""

    element: Any  # the element as it was (a copy keeps its tag, attributes and, if kept, content)
    start: int
    end: int
    kept: bool
    children: list[Span] = field(default_factory=list)
    target: tuple[int, int] = (0, 0)  # [start, end) in the translated run's text
    replaces: bool = False  # kept, and put in place of the words its text translated into (an entity)


@dataclass
class Run:
    """Text between two block boundaries of one element: where it starts (the element's text, or a
    child's tail), the inline children it holds, its text and their spans."""

    parent: Any = None
    anchor: Any = None  # None: parent.text; else the child whose tail the run starts in
    members: list = field(default_factory=list)
    text: str = ""
    spans: list[Span] = field(default_factory=list)
    pieces: list[str | tuple[int, int, int]] = field(default_factory=list)  # kept text; (sentence, start, end)

    def add_inline(self, element: Any, into: list[Span], xml: bool) -> None:
        start = len(self.text)
        entity = is_entity(element)
        kept = entity or untranslated(element) or local_name(element) in KEPT_INLINE and not xml
        span = Span(copy.deepcopy(element) if kept else shallow(element), start, start, kept)
        if entity:  # `&name;` stays in its sentence as what it stands for; it replaces that text's translation
            self.text += entity_text(element)
            span.replaces = True
        elif kept:
            self.text += element.text_content() if hasattr(element, "text_content") else "".join(element.itertext())
        else:
            self.text += element.text or ""
            for child in element:
                self.add_inline(child, span.children, xml)
                self.text += child.tail or ""
        span.end = len(self.text)
        into.append(span)


def shallow(element: Any) -> Any:
    """The element without its content: tag, attributes (and namespace map)."""
    made = copy.copy(element)
    for child in list(made):
        made.remove(child)
    made.text = made.tail = None
    return made


def is_entity(element: Any) -> bool:
    """An unresolved entity reference (`&name;` of a DTD, XML read without resolving entities)."""
    import lxml.etree

    return element.tag is lxml.etree.Entity


def entity_text(entity: Any) -> str:
    """What an entity reference stands for, as the model should read it: its declaration's text in
    the document's own DTD where that is plain text, else its name."""
    dtd = entity.getroottree().docinfo.internalDTD
    declared = next((e.content for e in dtd.iterentities() if e.name == entity.name), None) if dtd is not None else None
    return declared if declared and "<" not in declared and "&" not in declared else entity.name


def is_inline(child: Any, parent_has_text: bool, xml: bool) -> bool:
    if is_entity(child):
        return True
    if not isinstance(child.tag, str) or local_name(child) in BREAKS:
        return False  # a comment, a processing instruction, a line break: a boundary, kept in place
    if xml:
        return parent_has_text
    name = local_name(child)
    if name in INLINE or name in KEPT_INLINE:
        return not any(local_name(d) not in INLINE | KEPT_INLINE for d in child.iterdescendants() if isinstance(d.tag, str))
    return False


def runs_of(root: Any, xml: bool) -> list[Run]:
    """Every run of text to translate under `root`, in document order."""
    found: list[Run] = []

    def walk(element: Any) -> None:
        if untranslated(element):
            return
        has_text = bool((element.text or "").strip()) or any((c.tail or "").strip() for c in element)
        run = Run(element, None, text=element.text or "")
        for child in element:
            if is_inline(child, has_text, xml):
                run.members.append(child)
                run.add_inline(child, run.spans, xml)
                run.text += child.tail or ""
                continue
            found.append(run)
            if isinstance(child.tag, str) and local_name(child) not in BREAKS:
                walk(child)
            run = Run(element, child, text=child.tail or "")
        found.append(run)

    walk(root)
    return [run for run in found if run.text.strip()]


@dataclass
class Sentence:
    """One translated sentence of a run: its words on both sides (character spans: source in the
    run's text, target in the translated run's) and which target words each source word links to."""

    source: tuple[int, int]
    target: tuple[int, int]
    src_words: list[tuple[int, int]]
    tgt_words: list[tuple[int, int]]
    links: dict[int, list[int]]

    @property
    def src_starts(self) -> list[int]:
        if not hasattr(self, "_starts"):
            self._starts = [a for a, _ in self.src_words]
        return self._starts


def translated_run(run: Run, translations: list[Translation]) -> tuple[str, list[Sentence]]:
    """The run's text with each sentence replaced by its translation, and the sentences' word maps."""
    text, sentences = "", []
    for piece in run.pieces:
        if isinstance(piece, str):
            text += piece
            continue
        number, start, end = piece
        translation = translations[number]
        links: dict[int, list[int]] = {}
        for pair in (translation.alignment or "").split():
            i, j = pair.split("-")
            links.setdefault(int(i), []).append(int(j))
        sentences.append(Sentence((start, end), (len(text), len(text) + len(translation.text)),
                                  [(start + m.start(), start + m.end()) for m in WORD.finditer(run.text[start:end])],
                                  [(len(text) + m.start(), len(text) + m.end()) for m in WORD.finditer(translation.text)],
                                  links))
        text += translation.text
    return text, sentences


def project(start: int, end: int, sentences: list[Sentence], source: str, text: str,
            ends: list[int] | None = None) -> tuple[int, int]:
    """Where the source characters [start, end) land in the translated text, without punctuation at
    either end that the source span leaves out ("<b>word</b>." → "<b>Wort</b>.")."""
    lo, hi = hull(start, end, sentences, source, text, ends)
    wrapped = source[start:end].strip()
    while hi > lo + 1 and is_punctuation(text[hi - 1]) and not (wrapped and is_punctuation(wrapped[-1])):
        hi -= 1
    while hi > lo + 1 and is_punctuation(text[lo]) and not (wrapped and is_punctuation(wrapped[0])):
        lo += 1
    return lo, hi


def is_punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P")


def words_over(sentence: Sentence, start: int, end: int) -> list[int]:
    """The numbers of the sentence's source words that overlap [start, end), by bisection."""
    starts = sentence.src_starts
    first = max(bisect.bisect_right(starts, start) - 1, 0)
    last = bisect.bisect_left(starts, end)
    return [i for i in range(first, last) if sentence.src_words[i][1] > start]


def first_word_from(sentence: Sentence, at: int) -> int | None:
    """The number of the first source word that ends after `at` (the word an empty span precedes)."""
    i = max(bisect.bisect_right(sentence.src_starts, at) - 1, 0)
    while i < len(sentence.src_words) and sentence.src_words[i][1] <= at:
        i += 1
    return i if i < len(sentence.src_words) else None


def sharpened(sentence: Sentence, start: int, end: int, source: str, text: str) -> list[int]:
    """The target words (numbers) the source words over [start, end) of one sentence link to, less the
    links attention alignments are known to add. The decoder looks at the next content word while it
    writes a function word ("Ein <b>Mann</b>" → "a man": "a" links to "Mann"), so short target words
    (three letters or fewer) at the edges of what one content word links to are left out, and so are
    those next to a source neighbour without links of its own; links outside the largest run of
    near target words (adjacent for one source word, at most two words apart for several) are
    dropped: a stray link to a far word would stretch the tag over half the sentence."""
    covered = words_over(sentence, start, end)
    targets = sorted({j for i in covered for j in sentence.links.get(i, []) if j < len(sentence.tgt_words)})
    if not targets:
        return []

    def short(j: int) -> bool:
        a, b = sentence.tgt_words[j]
        return len(text[a:b].strip(PUNCTUATION)) <= 3

    def unaligned(i: int) -> bool:
        return 0 <= i < len(sentence.src_words) and not sentence.links.get(i)

    runs: list[list[int]] = [[targets[0]]]
    gap = 1 if len(covered) == 1 else 3  # target words between two links that still make one run
    for j in targets[1:]:
        runs[-1].append(j) if j - runs[-1][-1] <= gap else runs.append([j])
    targets = max(runs, key=len)
    if len(covered) == 1:
        a, b = sentence.src_words[covered[0]]
        if len(source[a:b].strip(PUNCTUATION)) > 3:  # a content word: its short edges are someone else's
            while len(targets) > 1 and short(targets[0]):
                targets = targets[1:]
            while len(targets) > 1 and short(targets[-1]):
                targets = targets[:-1]
        return targets
    if len(targets) > 1 and unaligned(covered[0] - 1) and short(targets[0]):
        targets = targets[1:]
    if len(targets) > 1 and unaligned(covered[-1] + 1) and short(targets[-1]):
        targets = targets[:-1]
    return targets


PUNCTUATION = ".,;:!?\"'()[]{}«»„“”‚‘’-–—…"


def hull(start: int, end: int, sentences: list[Sentence], source: str, text: str,
         ends: list[int] | None = None) -> tuple[int, int]:
    """Where the source characters [start, end) land in the translated text: the hull of the target
    words aligned to the source words they cover (`sharpened`; for an empty span, to the word after it); where
    none is aligned, the same relative place of the nearest sentence, widened to whole words."""
    def aligned(sentence: Sentence, i: int) -> list[tuple[int, int]]:
        return [sentence.tgt_words[j] for j in sentence.links.get(i, []) if j < len(sentence.tgt_words)]

    # The sentences around the span, found by bisection: a run may hold thousands of sentences and
    # spans, and each span looks only at its own (the work grows with the run, not its square).
    ends = ends if ends is not None else [s.source[1] for s in sentences]
    first = bisect.bisect_left(ends, start)  # the first sentence that ends at or after the span's start
    around: list[Sentence] = []
    for k in range(first, len(sentences)):
        if sentences[k].source[0] >= max(end, start + 1) and around:
            break
        around.append(sentences[k])
    if end > start:
        hits = [sentence.tgt_words[j] for sentence in around for j in sharpened(sentence, start, end, source, text)]
        if hits:
            return min(a for a, _ in hits), max(b for _, b in hits)
    else:
        after = next(((sentence, i) for sentence in around for i in [first_word_from(sentence, start)] if i is not None),
                     None)
        hits = aligned(*after) if after is not None else []
        if hits:
            return min(a for a, _ in hits), min(a for a, _ in hits)
    if not sentences:
        return len(text), len(text)
    near = min(around or sentences[-1:], key=lambda s: 0 if s.source[0] <= start <= s.source[1] else min(
        abs(start - s.source[0]), abs(start - s.source[1])))
    (s0, s1), (t0, t1) = near.source, near.target

    def place(at: int) -> int:
        return t0 + round((min(max(at, s0), s1) - s0) / max(s1 - s0, 1) * (t1 - t0))

    lo, hi = place(start), place(end)
    if end > start:  # whole words: out to the word boundaries around the place
        while lo > t0 and not text[lo - 1].isspace():
            lo -= 1
        while hi < t1 and not text[hi].isspace() and hi > lo:
            hi += 1
        if hi == lo:
            hi = next((b for a, b in near.tgt_words if b > lo), lo)
    return lo, hi


def kept_place(content: str, projected: tuple[int, int], text: str) -> tuple[int, int]:
    """Where an element kept as it was (inline code) goes: over the copy of its text in the
    translation nearest to where it was projected (the model copies what it cannot translate), or,
    where the translation has no copy, in front of the projected words, which stay."""
    content = content.strip()
    if not content:
        return projected[0], projected[0]
    window = 2000 + len(content)  # a copy nearby: one search a span, not one over the whole run
    found = [at for at in (text.rfind(content, max(projected[0] - window, 0), projected[0] + len(content)),
                           text.find(content, projected[0], projected[0] + window)) if at >= 0]
    if not found:
        return projected[0], projected[0]
    at = min(found, key=lambda position: abs(position - projected[0]))
    return at, at + len(content)


def settle(spans: list[Span], lo: int, hi: int, text: str) -> None:
    """Nest the projected spans as in the source: each inside its parent's, siblings one after the
    other in target order. Where two overlap, the earlier one ends where the later one starts (the
    narrower projection is the more precise one), or, starting together, the later one follows."""
    for span in spans:
        a = min(max(span.target[0], lo), hi)
        span.target = (a, min(max(span.target[1], a), hi))
    spans.sort(key=lambda span: span.target)
    for before, after in zip(spans, spans[1:]):
        if after.target[0] < before.target[1] and after.target[0] > before.target[0]:
            end = after.target[0]
            while end > before.target[0] + 1 and text[end - 1].isspace():
                end -= 1
            before.target = (before.target[0], end)
    previous = lo
    for span in spans:
        a = max(span.target[0], previous)
        span.target = (a, max(span.target[1], a))
        previous = span.target[1]
    for span in spans:
        settle(span.children, *span.target, text)


def fill(text: str, lo: int, hi: int, spans: list[Span]) -> tuple[str, list]:
    """The text before the first element and the elements (with their text and tails) that make
    [lo, hi) of the translated run, spans settled."""
    leading, made, at, pad = None, [], lo, False
    for span in spans:
        a, b = span.target
        if made:
            made[-1].tail = padded(text[at:a], pad)
        else:
            leading = text[at:a]
        pad = span.kept and a == b and bool(span.element.text or len(span.element))  # inline code the model dropped
        element = copy.deepcopy(span.element) if span.kept else copy.copy(span.element)
        element.tail = None
        if not span.kept:
            element.text, children = fill(text, a, b, span.children)
            for child in children:
                element.append(child)
        made.append(element)
        at = b
    if made:
        made[-1].tail = padded(text[at:hi], pad)
    else:
        leading = text[at:hi]
    return leading or "", made


def padded(tail: str, pad: bool) -> str:
    """The text after an element inserted in front of a word: a space between them."""
    return " " + tail if pad and tail and not tail[0].isspace() else tail


def translated_with_spans(run: Run, translations: list[Translation]) -> str:
    """The run's translated text; each span's `target` set to where it goes there, nested."""
    text, sentences = translated_run(run, translations)

    ends = [sentence.source[1] for sentence in sentences]

    def place(spans: list[Span]) -> None:
        for span in spans:
            span.target = project(span.start, span.end, sentences, run.text, text, ends)
            if span.kept and not span.replaces:
                span.target = kept_place(run.text[span.start:span.end], span.target, text)
            place(span.children)

    place(run.spans)
    settle(run.spans, 0, len(text), text)
    return text


def rebuild_run(run: Run, translations: list[Translation]) -> None:
    text = translated_with_spans(run, translations)
    leading, elements = fill(text, 0, len(text), run.spans)
    if run.anchor is None:
        run.parent.text, index = leading, 0
    else:
        run.anchor.tail, index = leading, run.parent.index(run.anchor) + 1
    # The run's inline children follow the anchor together: replaced in one slice (with their tails,
    # which were the run's text), not one by one (each removal and insertion shifts the rest).
    run.parent[index:index + len(run.members)] = elements


def sentences_in_markup(runs: list[Run]) -> set[int]:
    """The sentences an inline span lies in or touches: only their alignments place tags (a run's
    spans hold their nested ones)."""
    return {piece[0] for run in runs for piece in run.pieces if isinstance(piece, tuple)
            and any(span.start <= piece[2] and span.end >= piece[1] for span in run.spans)}


def plan_run(run: Run, lang: str | None, sentences: list[str]) -> None:
    """Split the run's text into sentences (appended to `sentences`) and the text between them."""
    run.pieces = split_run(run.text, lang, sentences, spans=True)


XML_DECLARATION = re.compile(r"\A\s*<\?xml[^>]*\?>")
HTML_DOCUMENT = re.compile(r"<!doctype|<html[\s>]", re.IGNORECASE)
DOCTYPE = re.compile(r"<!doctype", re.IGNORECASE)


def parse(document: str, xml: bool) -> tuple[Any, Any]:
    """The element whose content is translated, and what writes the document back from it."""
    import lxml.etree
    import lxml.html

    trailing = document[len(document.rstrip()):]
    if xml:
        declaration = XML_DECLARATION.match(document)
        body = document[declaration.end():] if declaration else document
        parser = lxml.etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)
        try:
            root = lxml.etree.fromstring(body, parser)
        except lxml.etree.XMLSyntaxError as exc:
            raise TfmError(f"not well-formed XML: line {exc.lineno}: {exc.msg}") from None
        head = declaration.group(0).strip() + "\n" if declaration else ""
        return root, lambda: head + lxml.etree.tostring(root.getroottree(), encoding="unicode") + trailing
    parser = lxml.html.HTMLParser()
    if HTML_DOCUMENT.search(document[:4096]):
        root = lxml.html.document_fromstring(document, parser=parser)
    else:
        root = lxml.html.fragment_fromstring(document, create_parent="div", parser=parser)
    too_deep = next((e for e in parser.error_log if "depth" in e.message.lower()), None)
    if too_deep is not None:  # libxml2 would drop what lies deeper: refused rather than lost
        raise TfmError(f"line {too_deep.line}: elements nested more than 256 deep (libxml2's limit)")
    if HTML_DOCUMENT.search(document[:4096]):
        tree = root.getroottree()
        if not DOCTYPE.search(document[:4096]):  # libxml2 gives every document one: none is added
            return root, lambda: lxml.html.tostring(root, encoding="unicode") + trailing
        return root, lambda: lxml.html.tostring(tree, encoding="unicode", doctype=tree.docinfo.doctype) + trailing

    def inner() -> str:  # the fragment without the <div> that held it
        written = lxml.html.tostring(root, encoding="unicode")
        return written[len("<div>"):-len("</div>")]

    return root, inner


def plan_markup(document: str, lang: str | None, xml: bool = False) -> Plan:
    """HTML (`xml`: XML): the sentences of every run of text, and the document rebuilt around their
    translations with the inline tags projected through the alignments."""
    if not document.strip():
        return Plan([], lambda translations: document)
    def planned() -> tuple[list[Run], list[str], Any]:
        root, write = parse(document, xml)
        runs, sentences = runs_of(root, xml), []
        for run in runs:
            plan_run(run, lang, sentences)
        return runs, sentences, write

    first = [planned()]
    sentences = first[0][1]

    def rebuild(translations: list[Translation]) -> str:
        runs, _, write = first.pop() if first else planned()  # a tree is rebuilt once: parsed anew after
        for run in runs:
            rebuild_run(run, translations)
        return write()

    return Plan(sentences, rebuild, alignment=True, aligned=sentences_in_markup(first[0][0]))
