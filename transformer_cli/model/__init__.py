"""Stage 2, the model: the paper's Transformer and nothing of the toolkit.

transformer.py is "Attention Is All You Need" module by module (embeddings, sinusoidal positions,
multi-head attention, the position-wise feed-forward network, Add & Norm, encoder and decoder
layers); kernels.py the fused attention and feed-forward kernels it calls; decoder_state.py the
keys and values an incremental decoder keeps; lengths.py how long its input and output may be
(the position table); special_tokens.py the ids every stage agrees on; cpu_inference.py the same
weights laid out for CPU decoding (packed for oneDNN, or int8); shape.py a model's shape (the sizes
its weights' shapes follow), the one definition the named shapes and the config's keys take.

Entry points: `Transformer`, `TransformerConfig`, `lengths.source_token_limit`.
May import: nothing outside this wing (tests/test_layout.py), so the model reads on its own.
"""
