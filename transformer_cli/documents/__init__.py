"""Documents, not lines: a document in a format (plain text in paragraphs, HTML, XML, Markdown,
subtitles, Word) becomes the sentences to translate and a plan to put their translations back where
they came from; the sentences are translated in batches by any engine, and the document is rebuilt
around them with its structure, whitespace, markup, timings or formatting kept.

plan.py is the `Plan` every format gives and plain text in paragraphs; sentences.py splits
sentences; markup.py is HTML and XML (inline tags projected through the word alignments);
markdown.py, subtitles.py and word.py the other formats; formats.py picks a format, reads a
document within its limit and translates it (docs/translation.md, "Documents").

Entry points: `formats.translate_document`, `formats.plan_document`.
May import: every wing before it (model, runtime, experiment, interop, data, decoding).
"""
