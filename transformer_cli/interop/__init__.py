"""Foreign formats: tfm checkpoints to and from other toolkits' model directories.

ct2.py is CTranslate2's format (`tfm export --format ctranslate2`, and reading an exported directory
back, checked); ct2_cache.py keeps the conversion `decode.engine: auto` makes beside a checkpoint;
marian.py imports Marian / OPUS-MT models and tfm's own Hugging Face exports (`tfm import --format
marian`); huggingface.py writes a transformers model directory (`tfm export --format huggingface`:
Marian for post-norm, Pegasus for pre-norm models) with the model card of model_card.py. Formats
only: translating with CTranslate2 is the decoding wing's (decoding/ct2_engine.py).

Entry points: `ct2.export_ctranslate2`, `ct2.read_export`, `ct2_cache.cached_conversion`,
`marian.import_marian`, `huggingface.export_huggingface`.
May import: the model, runtime and experiment wings.
"""
