"""Stage 4, prediction: raw lines in, translations out, with either engine.

translation.py is what every engine shares (the `TranslationEngine` interface, streaming, empty and
over-long lines, n-best); engine.py picks the engine (`decode.engine`); torch_engine.py is tfm's own
(batches, worker processes, ensembles) over search.py (greedy, beam and sampling searches);
ct2_engine.py is CTranslate2's. Around the search: constraints.py, terms.py and top_k.py
(terminology), glossary.py (terminology made from parallel text), ensemble.py, alignment.py (word
alignments), budget.py (what a search may cost, checked before it starts, and its deadline),
workers.py (decoding processes), hypothesis.py (what a search returns); distill.py is `tfm distill` (a
teacher's translation of a run's training source, resumable).

Entry points: `engine.open_engine`, `translation.translate_stream`, `torch_engine.Translator`.
May import: the model, runtime, experiment, interop and data wings.
"""
