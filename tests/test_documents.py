"""Documents: plain text in paragraphs, HTML and XML keep their structure through translation,
inline tags follow the words they wrapped through the alignments, and bad documents are one-line
errors. Structure is checked with translators that are plain functions (whose alignments are
known); the command line with a real tiny model."""

from __future__ import annotations

import io
import re

import lxml.etree
import lxml.html
import pytest

from tests.conftest import tfm, tfm_in_process
from transformer_cli.decoding.translation import Translation
from transformer_cli.documents.formats import document_format, read_document
from transformer_cli.documents.markdown import plan_markdown
from transformer_cli.documents.markup import plan_markup
from transformer_cli.documents.plan import plan_text
from transformer_cli.documents.sentences import sentence_spans
from transformer_cli.documents.subtitles import plan_subtitles, wrap
from transformer_cli.runtime.errors import TfmError


def same(sentences: list[str]) -> list[Translation]:
    """Each sentence as it is, every word aligned to itself."""
    return [Translation(s, 0.0, 1, " ".join(f"{i}-{i}" for i in range(len(s.split())))) for s in sentences]


def reversed_words(sentences: list[str]) -> list[Translation]:
    """Each sentence's words in reverse order, upper-cased, each aligned to where it went."""
    out = []
    for s in sentences:
        words = s.split()
        n = len(words)
        out.append(Translation(" ".join(w.upper() for w in reversed(words)), 0.0, n,
                               " ".join(f"{i}-{n - 1 - i}" for i in range(n))))
    return out


def tags_of(markup: str) -> list[tuple[str, tuple]]:
    """Every element's tag and attributes, in document order (the tag tree's content, sorted)."""
    root = lxml.html.fragment_fromstring(markup, create_parent="div")
    return sorted((e.tag, tuple(sorted(e.attrib.items()))) for e in root.iter() if isinstance(e.tag, str))


def test_sentences_are_split_by_punctuation_not_by_line_breaks():
    text = "Dr. Müller kam an. Er sagte\nnichts! Dann ging er"
    assert [text[a:b] for a, b in sentence_spans(text, "de")] == ["Dr. Müller kam an.", "Er sagte\nnichts!",
                                                                 "Dann ging er"]
    assert sentence_spans("   \n ", "de") == []


def test_a_sentence_starting_with_a_number_is_split_off_but_abbreviations_and_ordinals_stay():
    # sentencex alone keeps "Landschaft. 2 Mädchen sitzen." as one German sentence
    text = "Sechs Leute fahren durch eine Landschaft. 2 Mädchen sitzen. Er kam am 3. Mai an. Siehe Nr. 5 und ca. 30 Bilder."
    assert [text[a:b] for a, b in sentence_spans(text, "de")] == [
        "Sechs Leute fahren durch eine Landschaft.", "2 Mädchen sitzen.", "Er kam am 3. Mai an.",
        "Siehe Nr. 5 und ca. 30 Bilder."]


def test_text_keeps_paragraphs_blank_lines_and_whitespace():
    document = "  Ein Mann läuft. Eine Frau\nsitzt.\n\n\n\tZwei Hunde!\nDrei Katzen?  \n\n"
    plan = plan_text(document, "de")
    assert plan.sentences == ["Ein Mann läuft.", "Eine Frau sitzt.", "Zwei Hunde!", "Drei Katzen?"]
    assert plan.rebuild(same(plan.sentences)) == document.replace("Frau\nsitzt", "Frau sitzt")
    translated = plan_text(document, "de").rebuild(reversed_words(plan.sentences))
    assert translated == "  LÄUFT. MANN EIN SITZT. FRAU EINE\n\n\n\tHUNDE! ZWEI\nKATZEN? DREI  \n\n"
    assert plan_text("", "de").sentences == [] and plan_text("", "de").rebuild([]) == ""


HTML = ('<!DOCTYPE html>\n<html><head><title>T</title><style>p { color: red }</style></head><body>\n'
        '<h1 class="x">Ein Titel</h1>\n'
        '<p>Ein <b>schwarzer</b> Hund läuft. Eine <a href="/x?a=1&amp;b=2">Frau <i>sitzt</i></a> hier.</p>\n'
        '<!-- a comment --><ul><li>Eins &amp; zwei</li><li>Ein <code>x &lt; 1</code> Test.</li></ul>\n'
        '<pre>  kept   as is </pre><p translate="no">Nicht übersetzen.</p><p>Zeile<br>zwei <img src="a.png"> drei.</p>\n'
        '<script>var s = "<b>";</script></body></html>\n')


def test_html_translated_as_itself_is_itself():
    plan = plan_markup(HTML, "de")
    assert "Nicht übersetzen." not in plan.sentences and not any("color" in s or "var" in s for s in plan.sentences)
    assert plan.sentences[:4] == ["T", "Ein Titel", "Ein schwarzer Hund läuft.", "Eine Frau sitzt hier."]
    assert plan.rebuild(same(plan.sentences)) == HTML.replace(' <img src="a.png"> drei', ' <img src="a.png">drei')


def test_every_text_a_reader_sees_is_translated_and_code_is_not():
    document = ('<html><head><title>Der Titel.</title><style>p { x: 1 }</style></head><body>'
                '<noscript><p>Bitte Skripte einschalten.</p></noscript><svg><text x="1">Ein Hund.</text></svg>'
                '<template><p>Eine Vorlage.</p></template><textarea>Ihr Name.</textarea>'
                '<pre>Vorformatiert.</pre><p>Mit <code>Code</code> darin.</p><math><mi>Formel</mi></math>'
                '<script>var Skript;</script></body></html>')
    plan = plan_markup(document, "de")
    assert plan.sentences == ["Der Titel.", "Bitte Skripte einschalten.", "Ein Hund.", "Eine Vorlage.", "Ihr Name.",
                              "Mit Code darin."]
    out = plan.rebuild(reversed_words(plan.sentences))
    assert "<title>TITEL. DER</title>" in out and ">HUND. EIN</text>" in out and "<textarea>NAME. IHR</textarea>" in out
    assert "<pre>Vorformatiert.</pre>" in out and "<code>Code</code>" in out and "Formel" in out
    assert not out.startswith("<!DOCTYPE")  # none added


def test_inline_tags_follow_their_words_and_stay_nested():
    document = '<p>Ein <b>schwarzer</b> Hund läuft. Eine <a href="/x">Frau <i>sitzt</i></a> hier.</p>'
    plan = plan_markup(document, "de")
    out = plan.rebuild(reversed_words(plan.sentences))
    assert out == '<p>LÄUFT. HUND <b>SCHWARZER</b> EIN HIER. <a href="/x"><i>SITZT</i> FRAU</a> EINE</p>'
    assert tags_of(out) == tags_of(document)


def test_kept_content_untranslated_parts_and_entities_survive():
    plan = plan_markup(HTML, "de")
    out = plan.rebuild(reversed_words(plan.sentences))
    for kept in ("<style>p { color: red }</style>", "<pre>  kept   as is </pre>", '<p translate="no">Nicht übersetzen.</p>',
                 "<!-- a comment -->", '<script>var s = "<b>";</script>', "<code>x &lt; 1</code>", '<img src="a.png">',
                 'href="/x?a=1&amp;b=2"', "ZWEI &amp; EINS"):
        assert kept in out, kept
    assert out.startswith("<!DOCTYPE html>\n<html>")
    assert len(lxml.html.document_fromstring(out).findall(".//li")) == 2


def test_a_tag_spanning_two_sentences_is_kept_once_around_both():
    document = "<p>Er kam <b>spät. Sie ging</b> früh.</p>"
    plan = plan_markup(document, "de")
    assert plan.sentences == ["Er kam spät.", "Sie ging früh."]
    out = plan.rebuild(same(plan.sentences))
    assert out == document
    out = plan.rebuild(reversed_words(plan.sentences))
    assert out.count("<b>") == 1 and out.count("</b>") == 1 and "SPÄT." in out.split("<b>")[1].split("</b>")[0]


def test_crossing_alignments_still_give_well_formed_nested_tags():
    document = "<p><b>eins <i>zwei</i></b> <u>drei</u> vier.</p>"
    plan = plan_markup(document, "xx")

    def crossing(sentences):  # "zwei" lands outside its parent's words, "drei" inside them
        return [Translation("DREI EINS VIER ZWEI.", 0.0, 4, "0-1 1-3 2-0 3-2")]

    out = plan.rebuild(crossing(plan.sentences))
    lxml.etree.fromstring(out)  # well-formed
    assert tags_of(out) == tags_of(document)
    assert re.sub("<[^>]+>", "", out) == "DREI EINS VIER ZWEI."


def test_malformed_html_comes_out_well_formed_with_all_its_text():
    document = "<p>Ein <b>Hund <i>läuft</b> schnell.<p>Zweiter Absatz &amp co"
    plan = plan_markup(document, "de")
    out = plan.rebuild(same(plan.sentences))
    lxml.etree.fromstring(f"<div>{out}</div>")
    assert " ".join(re.sub("<[^>]+>", " ", out).split()) == "Ein Hund läuft schnell. Zweiter Absatz &amp; co"


def test_markup_nested_deeper_than_the_parser_keeps_is_refused_not_lost():
    deep = "<div>" * 300 + "Hallo Welt." + "</div>" * 300
    with pytest.raises(TfmError, match="nested more than 256 deep"):
        plan_markup(deep, "de")
    with pytest.raises(TfmError, match="Excessive depth"):
        plan_markup(f"<doc>{deep}</doc>", "de", xml=True)
    fine = "<div>" * 200 + "Hallo Welt." + "</div>" * 200
    plan = plan_markup(fine, "de")
    assert plan.sentences == ["Hallo Welt."] and plan.rebuild(same(plan.sentences)) == fine


def test_xml_mixed_content_namespaces_and_declaration_are_kept():
    document = ('<?xml version="1.0" encoding="UTF-8"?>\n<doc xmlns:x="urn:x"><title>Ein Titel</title>\n'
                '  <para x:id="1">Text <x:emph>hier</x:emph> &amp; da.<?pi data?></para>\n'
                '  <code>nicht &lt;übersetzen&gt;</code>\n</doc>\n')
    plan = plan_markup(document, "de", xml=True)
    assert plan.sentences == ["Ein Titel", "Text hier & da."]
    assert plan.rebuild(same(plan.sentences)) == document
    with pytest.raises(TfmError, match="line 1: .*"):
        plan_markup("<doc><a></doc>", "de", xml=True)


SRT = ("1\r\n00:00:01,000 --> 00:00:04,000\r\nEin Mann läuft\r\nüber die Straße.\r\n\r\n"
       "2\r\n00:00:05,000 --> 00:00:07,500 X1:10\r\n- Hallo.\r\n- Guten Tag, Herr Müller.\r\n\r\n"
       "3\r\n00:00:08,000 --> 00:00:09,000\r\nZwei Hunde. Drei Katzen.\r\n")
VTT = ("WEBVTT - a title\n\nNOTE kept as it is\n\nSTYLE\n::cue { color: yellow }\n\n"
       "intro\n00:01.000 --> 00:04.000 align:start position:10%\nEin Mann läuft über die Straße.\n\n"
       "01:02:03.000 --> 01:02:04.500\n- Hallo.\n- Tschüss.\n")


def timings(document: str) -> list[str]:
    return [line for line in document.splitlines() if "-->" in line]


@pytest.mark.parametrize("document, vtt", [(SRT, False), (VTT, True)])
def test_subtitles_keep_cues_timings_and_line_counts(document, vtt):
    plan = plan_subtitles(document, "de", vtt=vtt)
    assert "Ein Mann läuft über die Straße." in plan.sentences and "Hallo." in plan.sentences
    assert plan.rebuild(same(plan.sentences)) == document
    out = plan.rebuild(reversed_words(plan.sentences))
    assert timings(out) == timings(document)
    cue_lines = [len(block.strip().splitlines()) for block in re.split(r"\r?\n\r?\n", out)]
    assert cue_lines == [len(block.strip().splitlines()) for block in re.split(r"\r?\n\r?\n", document)]
    assert ("\r\n" in out) == ("\r\n" in document) and "- HALLO." in out


@pytest.mark.parametrize("document, fmt, says", [
    ("Ein Mann läuft.\n\nEin Hund bellt.\n", "srt", "line 1: text without a timing line"),
    ("1\n00:00:01,000 --> 00:00:02,000\nEins.\n\n2\n00:00:03,000 -> 00:00:04,000\nZwei.\n", "srt",
     "line 5: text without a timing line"),
    ("WEBVTT\n\n00:01.000 --> 00:02.000\nEins.\n\n00:03.000 - 00:04.000\nZwei.\n", "vtt",
     "line 6: text without a timing line"),
    ("<html><body><p>Ein Mann läuft.</p></body></html>\n", "srt", "line 1: text without a timing line"),
    ("<!DOCTYPE html>\n<html><body><p>Ein Mann läuft.</p>\n</body></html>\n", "markdown",
     "--format markdown: nothing to translate found"),
])
def test_a_document_that_does_not_match_its_format_is_an_error_never_a_copy(document, fmt, says):
    from transformer_cli.documents.formats import plan_document

    with pytest.raises(TfmError, match=re.escape(says)):
        plan_document(document, fmt, "de")


def test_documents_without_text_to_translate_still_come_back_as_they_were():
    from transformer_cli.documents.formats import plan_document

    for document, fmt in [("WEBVTT\n\nNOTE nur eine Notiz\n", "vtt"), ('<p><img src="a.png"></p>', "html"),
                          ("<html><head><script>var hund = 1;</script></head></html>", "html"),
                          ("  \n\n", "text"), ("", "markdown")]:
        plan = plan_document(document, fmt, "de")
        assert plan.sentences == [] and plan.rebuild([]) == document  # (no DOCTYPE added where there was none)


MARKED_SRT = ("1\n00:00:01,000 --> 00:00:04,000\n{\\an8}<i>Ein Mann läuft</i>\n<i>über die Straße.</i>\n\n"
              "2\n00:00:05,000 --> 00:00:06,000\n<i>Ein <b>schwarzer</b> Hund.</i>\n\n"
              "3\n00:00:07,000 --> 00:00:08,000\n<font color=\"#ff0000\">Rot und grün.</font>\n")
MARKED_VTT = ("WEBVTT\n\n00:01.000 --> 00:04.000\n<v Hans Müller>Ein Mann <b>läuft</b> hier.\n\n"
              "00:05.000 --> 00:06.000\n<c.yellow>Gelb</c> ist <00:05.500>schön.\n")


@pytest.mark.parametrize("document, vtt, expected", [
    (MARKED_SRT, False, ["{\\an8}<i>STRASSE. DIE ÜBER</i>", "<i>LÄUFT MANN</i> EIN", "<i>HUND. <b>SCHWARZER</b> EIN</i>",
                         '<font color="#ff0000">GRÜN. UND ROT</font>']),
    (MARKED_VTT, True, ["<v Hans Müller>HIER. <b>LÄUFT</b> MANN EIN", "<00:05.500>SCHÖN. IST <c.yellow>GELB</c>"]),
])
def test_cue_markup_is_kept_and_follows_its_words(document, vtt, expected):
    plan = plan_subtitles(document, "de", vtt=vtt)
    assert not any("<" in s or "{" in s for s in plan.sentences)  # the model sees text only
    assert plan.rebuild(same(plan.sentences)) == document
    out = plan.rebuild(reversed_words(plan.sentences))
    assert [line for line in out.splitlines() if line and "-->" not in line and not line.isdigit()
            and line != "WEBVTT"] == expected
    # Markup around a whole cue, and codes at its start, need no alignments: only the cues with
    # markup inside are aligned.
    assert plan.alignment and plan.aligned == {0, 1}
    assert wrap('<font color="red">Ein sehr langer Satz</font> mit vielen Wörtern', 2) == [
        '<font color="red">Ein sehr langer Satz</font>', "mit vielen Wörtern"]


def test_an_entity_reference_keeps_its_sentence_whole_and_takes_the_place_of_its_translation():
    document = ('<?xml version="1.0"?>\n<!DOCTYPE d [<!ENTITY hund "Hund"><!ENTITY x SYSTEM "x.xml">]>\n'
                '<d><p>Der &hund; bellt laut.</p><p>Ein &x; hier.</p></d>\n')
    plan = plan_markup(document, "de", xml=True)
    assert plan.sentences == ["Der Hund bellt laut.", "Ein x hier."]  # what it stands for, else its name
    assert plan.rebuild(same(plan.sentences)) == plan_markup(document, "de", xml=True).rebuild(same(plan.sentences))
    out = plan.rebuild(reversed_words(plan.sentences))
    assert "<p>LAUT. BELLT &hund; DER</p>" in out and "<p>HIER. &x; EIN</p>" in out


def test_inline_html_in_markdown_follows_its_words_and_stays_well_formed():
    document = "<span>Ein Mann</span> im HTML.\n\nEin **fetter <em>und</em> schräger** Satz.<br>\n"
    plan = plan_markdown(document, "de")
    assert plan.sentences == ["Ein Mann im HTML.", "Ein fetter und schräger Satz."]
    assert plan.rebuild(same(plan.sentences)) == document
    assert plan.rebuild(reversed_words(plan.sentences)) == (
        "HTML. IM <span>MANN EIN</span>\n\nSATZ. **SCHRÄGER <em>UND</em> FETTER** EIN<br>\n")


def test_wrapping_balances_lines_at_spaces():
    assert wrap("a bb ccc dddd eeeee ffffff", 2) == ["a bb ccc dddd", "eeeee ffffff"]
    assert wrap("one two three four five six seven eight nine", 3) == ["one two three", "four five six",
                                                                      "seven eight nine"]
    assert wrap("single", 2) == ["single"] and wrap("a b", 3) == ["a", "b"]
    assert len(wrap("wa " * 200_000, 100_000)) == 100_000  # one pass over the words (a cue of 100k lines)
    with pytest.raises(TfmError, match="WEBVTT"):
        plan_subtitles("1\n00:00:01,000 --> 00:00:02,000\nx\n", "de", vtt=True)


MARKDOWN = """# Ein *Titel* ##

Ein **schwarzer** Hund läuft über die [grüne Wiese](https://x.org "T"). Zwei `code` Kinder.

> Zitat mit _Betonung_.

- Punkt eins
- Punkt ![Bild](a.png) zwei

Setext Titel
============

| Tabelle | bleibt |
|---|---|
| wie | sie ist |

```python
code = "bleibt"
```
"""


def test_markdown_translated_as_itself_is_itself_and_keeps_what_is_not_prose():
    plan = plan_markdown(MARKDOWN, "de")
    assert plan.sentences == ["Ein Titel", "Ein schwarzer Hund läuft über die grüne Wiese.", "Zwei code Kinder.",
                              "Zitat mit Betonung.", "Punkt eins", "Punkt zwei", "Setext Titel"]
    assert plan.rebuild(same(plan.sentences)) == MARKDOWN
    out = plan.rebuild(reversed_words(plan.sentences))
    for kept in ("| Tabelle | bleibt |\n|---|---|\n| wie | sie ist |", '```python\ncode = "bleibt"\n```',
                 "![Bild](a.png)", "============", "# *TITEL* EIN ##", "> _BETONUNG_. MIT ZITAT", "**SCHWARZER**",
                 '](https://x.org "T")'):
        assert kept in out, (kept, out)


def test_a_markdown_paragraph_over_several_lines_becomes_one():
    plan = plan_markdown("> Ein *Hund*\n> läuft.\n\nEnde.\n", "de")
    assert plan.sentences == ["Ein Hund läuft.", "Ende."]
    assert plan.rebuild(same(plan.sentences)) == "> Ein *Hund* läuft.\n\nEnde.\n"


def rendered_marks(markdown: str) -> list[str]:
    """The inline elements CommonMark renders the Markdown into, in order."""
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("strikethrough").render(markdown)
    root = lxml.html.fragment_fromstring(html, create_parent="div")
    return [e.tag for e in root.iter("strong", "em", "s", "a")]


def test_markdown_marks_that_delimiters_cannot_hold_are_written_as_inline_html():
    # both marks land on "KICKS.": "**KICKS****.**" would read back as one, so the run is written in tags
    plan = plan_markdown("Er **tritt** **fest.**\n", "de")
    out = plan.rebuild([Translation("HE KICKS.", 0.0, 2, "0-0 1-1 2-1")])
    assert out == "HE <strong>KICKS</strong><strong>.</strong>\n"
    assert rendered_marks(out) == rendered_marks("Er **tritt** **fest.**") == ["strong", "strong"]
    # a mark whose word went into its sibling's translation stays, empty (as HTML keeps an empty element)
    plan = plan_markdown("*Leute* *stehen*.\n", "de")
    out = plan.rebuild([Translation("PEOPLE.", 0.0, 2, "0-0 1-0")])
    assert out == "*PEOPLE*<em></em>.\n" and rendered_marks(out) == ["em", "em"]
    # where the delimiters read back, the run stays Markdown
    assert plan.rebuild(same(plan.sentences)) == "*Leute* *stehen*.\n"


def word_document() -> bytes:
    """A .docx with formatted runs, a link, a table (a merged cell), a header and an empty paragraph."""
    import docx

    document = docx.Document()
    document.sections[0].header.paragraphs[0].text = "Eine Kopfzeile."
    paragraph = document.add_paragraph("Ein ")
    paragraph.add_run("schwarzer").bold = True
    paragraph.add_run(" Hund läuft. Eine ")
    paragraph.add_run("Frau").italic = True
    paragraph.add_run(" sitzt.")
    document.add_paragraph("")
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text = "Zelle eins."
    table.cell(0, 0).merge(table.cell(0, 1))
    table.cell(1, 0).text = "Zelle zwei."
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def test_word_runs_keep_their_formatting_over_the_translated_words():
    import docx

    from transformer_cli.documents.word import plan_word

    plan = plan_word(word_document(), "de")
    assert plan.sentences == ["Ein schwarzer Hund läuft.", "Eine Frau sitzt.", "Zelle eins.", "Zelle zwei.",
                              "Eine Kopfzeile."]
    same_doc = docx.Document(io.BytesIO(plan.rebuild(same(plan.sentences))))
    assert [p.text for p in same_doc.paragraphs] == ["Ein schwarzer Hund läuft. Eine Frau sitzt.", ""]
    out = docx.Document(io.BytesIO(plan.rebuild(reversed_words(plan.sentences))))
    runs = out.paragraphs[0].runs
    assert out.paragraphs[0].text == "LÄUFT. HUND SCHWARZER EIN SITZT. FRAU EINE"
    assert [(r.text, bool(r.bold), bool(r.italic)) for r in runs if r.text.strip()][1:] != []
    assert all(run.text.strip() in ("", "SCHWARZER EIN", "SCHWARZER") for run in runs if run.bold)
    assert [c.text for c in out.tables[0].rows[0].cells] == ["EINS. ZELLE", "EINS. ZELLE"]  # one merged cell
    assert out.sections[0].header.paragraphs[0].text == "KOPFZEILE. EINE"
    with pytest.raises(TfmError, match="not a Word"):
        plan_word(b"PK\x03\x04 not really a zip", "de")


def zip_bomb(document: bytes, member: str, unpacked_mb: int, members: int = 1) -> bytes:
    """`document` (a .docx) with `members` parts named `member` (a number after the first) that each
    unpack to `unpacked_mb` MB of zeros: a few kB per 10 MB on disk."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(document)) as original, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bomb:
        names = [member] + [f"{member}.{k}" for k in range(1, members)]
        for info in original.infolist():
            if info.filename not in names:
                bomb.writestr(info, original.read(info))
        for name in names:
            with bomb.open(name, "w") as part:
                for _ in range(unpacked_mb):
                    part.write(bytes(1 << 20))
    return out.getvalue()


@pytest.mark.parametrize("member, unpacked_mb, members, says", [
    ("word/document.xml", 33, 1, "word/document.xml in the Word document unpacks to more than 32 MB"),
    ("word/media/image1.png", 40, 1, "word/media/image1.png in the Word document unpacks to more than 32 MB"),
    ("customXml/item9.xml", 30, 5, "the Word document unpacks to more than 128 MB"),
])
@pytest.mark.slow
def test_a_word_document_is_read_only_within_its_unpacked_limits(member, unpacked_mb, members, says):
    from transformer_cli.documents.word import DocumentTooLarge, plan_word

    bomb = zip_bomb(word_document(), member, unpacked_mb, members)
    assert len(bomb) < unpacked_mb * members * 5_000  # kB on disk, a hundred MB and more unpacked
    with pytest.raises(DocumentTooLarge, match=re.escape(says)):
        plan_word(bomb, "de")
    assert plan_word(zip_bomb(word_document(), "word/media/image1.png", 30), "de").sentences[0] == \
        "Ein schwarzer Hund läuft."  # just under the limit: read


def test_a_zip_bomb_is_one_line_and_exit_2_from_tfm_translate(reverse_model, tmp_path):
    bomb = tmp_path / "bomb.docx"
    bomb.write_bytes(zip_bomb(word_document(), "word/document.xml", 200))
    result = tfm("translate", "--checkpoint", str(reverse_model[1].best_checkpoint), "-i", str(bomb),
                 "-o", str(tmp_path / "out.docx"))
    assert result.returncode == 2 and "unpacks to more than 32 MB" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.docx").exists()


def test_empty_and_blank_documents_come_back_as_they_were():
    for fmt_plan in (plan_text, plan_markup, plan_markdown, plan_subtitles):
        for document in ("", "\n  \n"):
            plan = fmt_plan(document, "de")
            assert plan.sentences == [] and plan.rebuild([]) == document


@pytest.mark.slow
def test_a_large_document_is_planned_and_rebuilt_within_the_limits():
    """Large documents are planned and rebuilt exactly: 2 MB of HTML and of text (a fifth of the
    10 MB limit: the whole limit took minutes of the suite for no other check), 10,000 tags in one
    run of text (each projected within its own sentence, not against all of them)."""
    paragraph = "<p>Ein <b>Mann</b> läuft über die Straße. Eine Frau sitzt auf einer <i>Bank</i>.</p>\n"
    document = paragraph * (2_000_000 // len(paragraph))
    plan = plan_markup(document, "de")
    assert len(plan.sentences) == 2 * document.count("<p>")
    out = plan.rebuild(same(plan.sentences))
    assert out == document
    one_run = "<p>" + "Ein <b>Mann</b> läuft über <i>die</i> Straße. " * 5000 + "</p>"  # 10,000 tags in one run:
    plan = plan_markup(one_run, "de")  # each projected within its own sentence (0.4 s; 33 s when each looked at all)
    assert len(plan.sentences) == 5000 and plan.rebuild(same(plan.sentences)) == one_run
    text = "Ein Mann läuft über die Straße. Eine Frau sitzt.\n\n" * 40_000
    assert plan_text(text, "de").rebuild(same(plan_text(text, "de").sentences)) == text
    with pytest.raises(TfmError, match="over 1 MB"):
        read_document(io.BytesIO(b"x" * (2 << 20)), "big.txt", limit=1 << 20)


@pytest.mark.parametrize("data, says", [(b"ab\0cd", "NUL"), (b"ok\n\xff\xfe bad", "line 2: not UTF-8")])
def test_binary_or_undecodable_input_is_refused(data, says):
    with pytest.raises(TfmError, match=says):
        read_document(io.BytesIO(data), "doc.txt")


def test_the_format_comes_from_the_option_or_the_extension():
    from pathlib import Path

    assert document_format(None, Path("a.HTML")) == "html" and document_format(None, Path("a.xhtml")) == "xml"
    assert document_format(None, Path("test.de")) == "lines" and document_format(None, None) == "lines"
    assert document_format(None, Path("sentences.txt")) == "lines"  # as tfm translate always read it
    assert document_format("text", Path("a.html")) == "text"
    with pytest.raises(TfmError, match="not text"):
        document_format(None, Path("report.pdf"))
    with pytest.raises(TfmError, match="choose lines, text, html, xml, markdown, srt, vtt, docx"):
        document_format("pdf", None)
    assert document_format(None, Path("notes.md")) == "markdown" and document_format(None, Path("a.vtt")) == "vtt"
    assert document_format(None, Path("report.DOCX")) == "docx"


def test_the_command_line_translates_documents_as_it_translates_their_sentences(reverse_model, tmp_path):
    config, summary = reverse_model
    checkpoint = str(summary.best_checkpoint)
    lines = ["wa wb wc", "wd we", "wf wg wh wi"]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "doc.txt").write_text(f"  {lines[0]}\n\n\n{lines[1]}\n\n{lines[2]}\n")
    settings = ["--checkpoint", checkpoint, "--set", "decode.precision=fp32", "--engine", "torch"]
    plain = tfm_in_process("translate", *settings, "-i", tmp_path / "lines.txt")  # the command line, in this process
    assert plain.exit_code == 0, plain.stderr
    expected = plain.stdout.splitlines()
    doc = tfm_in_process("translate", *settings, "-i", tmp_path / "doc.txt", "--format", "text", "-o",
                         tmp_path / "out.txt")
    assert doc.exit_code == 0, doc.stderr
    assert (tmp_path / "out.txt").read_text() == f"  {expected[0]}\n\n\n{expected[1]}\n\n{expected[2]}\n"


def test_tags_follow_their_words_through_a_real_models_alignments(reverse_model, tmp_path):
    """The reverse model writes its input backwards: a tag around one word must come out around that
    word, wherever it went."""
    config, summary = reverse_model
    from transformer_cli.runtime.files import read_lines

    sources = [line for line in read_lines(f"{config.data.test}.src.gz") if len(line.split()) >= 4][:40]
    body = []
    for k, line in enumerate(sources):
        words = line.split()
        words[k % len(words)] = f'<b data-n="{k}">{words[k % len(words)]}</b>'
        body.append(f"<p>{' '.join(words)}</p>")
    (tmp_path / "doc.html").write_text("\n".join(body) + "\n")
    done = tfm_in_process("translate", "--checkpoint", summary.best_checkpoint, "--set", "decode.precision=fp32",
                          "-i", tmp_path / "doc.html", "-o", tmp_path / "out.html")
    assert done.exit_code == 0, done.stderr
    root = lxml.etree.fromstring(f"<div>{(tmp_path / 'out.html').read_text()}</div>")
    right = sum(root.find(f".//b[@data-n='{k}']").text == line.split()[k % len(line.split())]
                for k, line in enumerate(sources))
    assert len(root.findall(".//b")) == len(sources) and right >= 0.8 * len(sources), right


def test_only_sentences_with_markup_are_aligned_and_the_page_is_the_same(reverse_model):
    """Aligning is a forced pass over each translation: sentences without markup skip it, and the
    page comes out as when every sentence was aligned."""
    from transformer_cli.decoding.torch_engine import Translator
    from transformer_cli.documents import formats

    page = ("<h1>wa wb wc.</h1>\n<p>wd we. wf <b>wg</b> wh. wi wj.</p>\n"
            "<p>wk <a href='x'>wl wm</a>.</p>\n<p>wn wo wp.</p>\n")
    engine = Translator.from_checkpoint(reverse_model[1].best_checkpoint, device="cpu",
                                        overrides=["decode.precision=fp32", "decode.workers=1", "decode.batch_size=1"])
    engine.decode = engine.decode.model_copy(update={"alignment": True})
    aligned: list[str] = []
    align = engine.align
    engine.align = lambda lines, *args: (aligned.extend(lines), align(lines, *args))[1]
    try:
        plan = formats.plan_document(page, "html", None)
        assert [plan.sentences[i] for i in sorted(plan.aligned)] == ["wf wg wh.", "wk wl wm."]
        out, sentences, _ = formats.translate_document(engine, page, "html")
        assert sorted(aligned) == ["wf wg wh.", "wk wl wm."] and sentences == len(plan.sentences) == 6
        every = formats.plan_document(page, "html", None)
        translations = formats.translated(engine, every.sentences, None)  # all of them aligned
        assert out == every.rebuild(translations)
        assert out.count("<b>") == 1 and out.count("<a href") == 1
    finally:
        engine.close()


@pytest.mark.parametrize("args, says", [
    (["--format", "pdf"], "--format pdf: choose"),
    (["--format", "html", "--json"], "one translation per sentence"),
    (["--format", "text", "--nbest", "2", "--beam", "2"], "one translation per sentence"),
])
def test_bad_document_options_are_one_line_errors(reverse_model, tmp_path, args, says):
    (tmp_path / "in.txt").write_text("wa wb\n")
    done = tfm_in_process("translate", "--checkpoint", reverse_model[1].best_checkpoint, "-i", tmp_path / "in.txt", *args)
    assert done.exit_code == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_markup_on_ctranslate2_keeps_its_tags_through_tfm_engines_alignments(reverse_model, tmp_path):
    pytest.importorskip("ctranslate2")
    (tmp_path / "page.html").write_text("<p>wa <b>wb</b> wc <i>wd</i></p>\n")
    done = tfm_in_process("translate", "--checkpoint", reverse_model[1].best_checkpoint, "--engine", "ctranslate2",
                          "-i", tmp_path / "page.html", "-o", tmp_path / "page.out.html")
    assert done.exit_code == 0, done.stderr
    assert "word alignments by tfm's engine" in done.stderr
    page = (tmp_path / "page.out.html").read_text()
    assert page.count("<b>") == page.count("</b>") == page.count("<i>") == page.count("</i>") == 1, page


def test_bad_documents_are_one_line_errors_and_write_nothing(reverse_model, tmp_path):
    checkpoint = reverse_model[1].best_checkpoint
    (tmp_path / "bad.xml").write_text("<doc>\n<a>text</doc>\n")
    (tmp_path / "nul.html").write_bytes(b"<p>a\0b</p>")
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.4")
    (tmp_path / "cut.docx").write_bytes(word_document()[:300])
    for name, says in (("bad.xml", "line 2"), ("nul.html", "NUL"), ("report.pdf", "not text"),
                       ("cut.docx", "not a Word (.docx) document")):
        done = tfm_in_process("translate", "--checkpoint", checkpoint, "-i", tmp_path / name, "-o", tmp_path / "out")
        assert done.exit_code == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert f"error: {tmp_path / name}: " in done.stderr  # the message names the file
        assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- linear time on hostile input


def seconds_of(work, repeats: int = 5) -> float:
    import time

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def grows_linearly(make, work, size: int, repeats: int = 7) -> tuple[float, float]:
    """CPU seconds of this thread for `work` on `make(size)` and on `make(2 * size)` (doubled input, ~double
    the time): the two timed in turn `repeats` times, and the pair whose ratio is the median returned.
    CPU time, not wall time, and in turn: the suite runs beside mypy and another worker on two cores,
    where wall time read a doubled cue's linear scan at 2.8x and 4.6x."""
    import gc

    # The suite's objects frozen out of the collector's passes: in its large heap a full pass costs as
    # much as the scan (CPU time read a linear cue scan at 4.8x there).
    gc.collect()
    gc.freeze()
    try:
        return _timed_pairs(make, work, size, repeats)
    finally:
        gc.unfreeze()


def _timed_pairs(make, work, size: int, repeats: int) -> tuple[float, float]:
    import time

    inputs, pairs = (make(size), make(2 * size)), []
    for _ in range(repeats):
        pair = []
        for document in inputs:
            started = time.thread_time()
            work(document)
            pair.append(time.thread_time() - started)
        pairs.append((pair[0], pair[1]))
    pairs.sort(key=lambda p: p[1] / max(p[0], 1e-9))
    return pairs[len(pairs) // 2]


@pytest.mark.parametrize("unit", ["<!--", "<script>", "<style a=1>", "<a", "<!--<script>"])
def test_what_a_reader_sees_of_markup_is_read_in_linear_time(unit):
    """Unclosed comments, code elements and tags (the lazy regex rescanned to the end for each:
    160 kB of `<!--` froze the server for 78 s): twice the input, at most ~2.5x the time."""
    from transformer_cli.documents.formats import without_markup

    small, large = grows_linearly(lambda n: unit * n + " text", without_markup, 40_000)
    assert large <= 2.5 * small + 0.01, (small, large)  # (+10 ms: a busy test machine's noise)
    assert large < 0.5


def test_what_a_reader_sees_of_markup_is_what_the_old_scan_saw():
    """The scan the linear one replaced, on closed and unclosed constructs alike."""
    from transformer_cli.documents.formats import without_markup

    old = re.compile(r"<(script|style)\b.*?</\1\s*>|<!--.*?-->|<[^>]*>", re.S | re.I)
    for document in ("a <b>c</b> d", "<script>x<y></script>z", "<!-- c -->t", "<!-- open t > u", "a < b",
                     "<STYLE a>q</style >r<p>", "x<script>never", "<!--<!---->y", "a<b<c>d", "<script>a</script>"
                     "<script>b", "<!-- a --> b <!-- c", "Ein <i>Hund</i> läuft.<!---->"):
        assert without_markup(document).split() == old.sub(" ", document).split(), document


@pytest.mark.parametrize("fmt, unit", [("html", "<!--"), ("markdown", "<!--"), ("xml", "<!--")])
def test_a_document_of_unclosed_comments_is_refused_in_linear_time(fmt, unit):
    """The whole path a request takes (`read_document`'s plan): the CLI took 18.6 s for 80 kB."""
    from transformer_cli.documents.formats import plan_document

    def refused(document: str) -> None:
        with pytest.raises(TfmError):
            plan_document(document, fmt, "de")

    small, large = grows_linearly(lambda n: unit * n + " Ein Hund", refused, 10_000)
    assert large <= 2.5 * small + 0.005, (small, large)


def test_a_cue_of_stray_closing_tags_is_read_in_linear_time():
    """20,000 `<b>` then 20,000 stray `</x>` in a 140 kB cue took 68 s (the open tags searched for every
    closing tag), then a RecursionError."""
    from transformer_cli.documents.subtitles import cue_markup

    small, large = grows_linearly(lambda n: "<b>" * n + "Hallo" + "</x>" * n, cue_markup, 4_000)
    assert large <= 2.5 * small + 0.005, (small, large)


def test_a_cue_nested_deeper_than_anything_walks_is_translated_with_all_its_tags():
    """3,000 nested `<i>` (12 kB): a RecursionError in the CLI, 500 from the server. Spans nest to
    MAX_NESTING; the tags deeper stay where they stood, every one of them kept."""
    from transformer_cli.documents.subtitles import MAX_NESTING, cue_markup

    depth = 3_000
    cue = "<i>" * depth + "Ein Hund läuft." + "</i>" * depth
    plain, spans = cue_markup(cue)
    assert plain == "Ein Hund läuft."
    nesting, level = 0, spans
    while level:
        nesting, level = nesting + 1, level[0].children
    assert nesting == MAX_NESTING + 1  # the spans, and the points inside the deepest
    plan = plan_subtitles(f"1\n00:00:01,000 --> 00:00:02,000\n{cue}\n", "de")
    out = plan.rebuild(same(plan.sentences))
    assert out.count("<i>") == depth and out.count("</i>") == depth and "Ein Hund läuft." in out


def word_xml_document(body: str) -> bytes:
    """A minimal .docx whose document.xml holds `body` (raw WordprocessingML)."""
    import zipfile

    namespace = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in zipfile.ZipFile(io.BytesIO(word_document())).infolist():
            if info.filename != "word/document.xml":
                archive.writestr(info, zipfile.ZipFile(io.BytesIO(word_document())).read(info))
        archive.writestr("word/document.xml", f'<?xml version="1.0"?><w:document {namespace}><w:body>{body}'
                                              "</w:body></w:document>")
    return out.getvalue()


@pytest.mark.parametrize("body, says", [
    ("<w:p><w:r><w:t>x</w:t></w:r></w:p>" * 100_001, "more than 100,000 paragraphs"),
    ("<w:p>" + "<w:r><w:t>x</w:t></w:r>" * 500_001 + "</w:p>", "more than 500,000 runs"),
])
def test_a_word_document_of_too_many_paragraphs_is_refused_before_it_is_built(body, says):
    """700,000 one-word paragraphs (28 MB unpacked, within the size limits) cost the server 155 s and
    1.2 GB before its line limit refused them: counted while the XML streams, nothing kept."""
    import resource
    import time

    from transformer_cli.documents.word import DocumentTooLarge, plan_word

    document = word_xml_document(body)
    started, peak = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DocumentTooLarge, match=says):
        plan_word(document, "de")
    assert time.perf_counter() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # kB: no tree of it was built


def test_a_word_document_with_a_damaged_byte_is_one_line():
    """A flipped byte in the archive: zlib.error (or a bad CRC) from the unpacking check, now a TfmError."""
    from transformer_cli.documents.word import plan_word

    document = word_xml_document("<w:p><w:r><w:t>Ein Hund läuft.</w:t></w:r></w:p>" * 200)
    assert plan_word(document, "de").sentences[0] == "Ein Hund läuft."
    for at in range(100, len(document) - 30, max(1, len(document) // 40)):
        damaged = bytearray(document)
        damaged[at] ^= 0xFF
        try:
            plan_word(bytes(damaged), "de")
        except TfmError as exc:
            assert "\n" not in str(exc)


def test_two_cues_without_a_blank_line_between_them_are_two_cues():
    """The second cue's number and timing were translated as words, and the cue was gone."""
    srt = ("1\n00:00:01,000 --> 00:00:02,000\nEin Hund läuft.\n2\n00:00:03,000 --> 00:00:04,000\nEine Katze.\n\n"
           "3\n00:00:05,000 --> 00:00:06,000\nDrei Wörter hier.\n00:00:07,000 --> 00:00:08,000\nVier.\n")
    plan = plan_subtitles(srt, "de")
    assert plan.sentences == ["Ein Hund läuft.", "Eine Katze.", "Drei Wörter hier.", "Vier."]
    assert plan.rebuild(same(plan.sentences)) == srt
    out = plan.rebuild(reversed_words(plan.sentences))
    assert [line for line in out.splitlines() if "-->" in line or line.isdigit()] == [
        line for line in srt.splitlines() if "-->" in line or line.isdigit()]
    assert "LÄUFT. HUND EIN" in out and "KATZE. EINE" in out
