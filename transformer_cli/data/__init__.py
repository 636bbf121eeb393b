"""Stage 1, prepare: raw parallel text in, a sentencepiece model and encoded splits out; and the
batches training reads.

prepare.py is `tfm prepare` (reading, checking, encoding, the manifest); corpus.py reads corpora
(plain or gzipped, several files, line checks); batches.py groups encoded pairs into token-bucketed
batches; batch_stream.py feeds them to training ahead of time; augment.py changes text as people type
it (case, typos, punctuation) and augmented_data.py draws each epoch's training pairs through it; language_tags.py the `>>de<<` tags of
multilingual runs; language_id.py tells which language a line is in. Cleaning the training split:
filters.py (which pairs are dropped and why), lexical.py (the IBM Model 1 score of misaligned pairs),
model_filter.py (misaligned and partly aligned pairs scored by translation models), cleaning.py (the
filters built from the config, duplicates, the report, `--dropped`). shortlist.py learns a run's
lexical shortlist (`tfm shortlist`).

Entry points: `prepare.prepare`, `batches.ParallelData`, `batches.token_batches`.
May import: the model, runtime, experiment and interop wings (the model filter scores with a
CTranslate2 conversion).
"""
