import copy
import math

import pytest
import torch
import torch.nn.functional as F

from transformer_cli.experiment.checkpoint import load_checkpoint, save_checkpoint
from transformer_cli.model.cpu_inference import fold_query_scale
from transformer_cli.model.decoder_state import BeamKVCache, KVCache
from transformer_cli.model.kernels import attention_softmax, causal_mask, matmul_attention, single_query_attention
from transformer_cli.model.transformer import (
    CAUSAL,
    MultiHeadAttention,
    PositionalEncoding,
    Transformer,
    TransformerConfig,
    decoder_self_attention_mask,
    padding_mask,
    sinusoidal_table,
)


def tiny_config(**overrides) -> TransformerConfig:
    base = dict(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4, enc_layers=2, dec_layers=2,
                d_ff=64, dropout=0.1, max_positions=64)
    return TransformerConfig(**{**base, **overrides})


def test_padding_mask_exact():
    tokens = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    expected = torch.tensor([[True, True, False, False], [True, False, False, False]])
    mask = padding_mask(tokens, pad_id=0)
    assert mask.shape == (2, 1, 1, 4)
    assert torch.equal(mask[:, 0, 0], expected)


def test_decoder_mask_is_causal_and_hides_padding():
    tgt = torch.tensor([[2, 9, 9, 0]])
    mask = decoder_self_attention_mask(tgt, pad_id=0)
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert mask.shape == (1, 1, 4, 4)
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(causal_mask(3)[0, 0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_attention_matches_naive_softmax_implementation():
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=4).eval()
    q_in, kv_in = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    mask = padding_mask(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), pad_id=0)
    out, _ = mha(q_in, kv_in, mask)

    # Naive: per head softmax(Q Kᵀ / sqrt(dk)) V with -inf on padded keys, concat, project.
    q = mha.q_proj(q_in).view(2, 3, 4, 4).transpose(1, 2)
    k, v = (t.view(2, 5, 4, 4).transpose(1, 2) for t in mha.kv_proj(kv_in).chunk(2, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    scores = scores.masked_fill(~mask, float("-inf"))
    naive = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 3, 16)
    assert torch.allclose(out, mha.out_proj(naive), atol=1e-6)

    out_w, weights = mha(q_in, kv_in, mask, need_weights=True)
    assert torch.allclose(out_w, out, atol=1e-6)
    assert weights.shape == (2, 4, 3, 5)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 3))
    assert (weights[0, :, :, 3:] == 0).all()  # padded keys get no weight


def test_fused_self_attention_matches_naive_implementation():
    """Self-attention's one Q|K|V matmul: rows 0..D-1 are Q, D..2D-1 K, 2D..3D-1 V."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=4, self_attention=True).eval()
    x = torch.randn(2, 5, 16)
    mask = padding_mask(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), pad_id=0)
    w, b = mha.qkv_proj.weight, mha.qkv_proj.bias
    q, k, v = (torch.nn.functional.linear(x, w[i * 16:(i + 1) * 16], b[i * 16:(i + 1) * 16])
               .view(2, 5, 4, 4).transpose(1, 2) for i in range(3))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(4)).masked_fill(~mask, float("-inf"))
    naive = mha.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(mha(x, x, mask)[0], naive, atol=1e-6)
    causal = causal_mask(5)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(4)).masked_fill(~causal, float("-inf"))
    naive = mha.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(mha(x, x, CAUSAL)[0], naive, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_attention_on_cpu_matches_fp32(causal):
    # Under CPU bf16 autocast the attention core runs in fp32 (faster there); the result must
    # still agree with the fp32 module to bf16 precision, with and without the causal mask.
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=32, n_heads=4).eval()
    x = torch.randn(3, 7, 32)
    mask = CAUSAL if causal else padding_mask(torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 7]), pad_id=0)
    reference, _ = mha(x, x, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mha(x, x, mask)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_matmul_attention_equals_sdpa_values_and_gradients(causal):
    """The bf16 CPU training path (two matmuls, fp32 softmax) computes SDPA exactly, gradients too."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None if causal else padding_mask(torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4]), pad_id=0)
    ours = matmul_attention(q, k, v, mask, is_causal=causal)
    ours.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    reference.sum().backward()
    assert torch.allclose(ours, reference, atol=1e-12)
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(mine, theirs, atol=1e-12)
    if causal:  # the last key never reaches the first query: its gradient from that row is zero
        q.grad = k.grad = v.grad = None
        matmul_attention(q, k, v, None, is_causal=True)[:, :, 0].sum().backward()
        assert torch.count_nonzero(k.grad[:, :, 1:]) == 0


def test_bf16_training_attention_on_cpu_takes_the_matmul_path_and_matches_fp32():
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=32, n_heads=4, self_attention=True).train()  # dropout 0: deterministic
    x = torch.randn(3, 7, 32)
    reference, _ = mha(x, x, CAUSAL)
    calls = []
    import transformer_cli.model.kernels as kernels

    original = kernels.matmul_attention
    kernels.matmul_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = mha(x, x, CAUSAL)
    finally:
        kernels.matmul_attention = original
    assert calls and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=3e-2, rtol=3e-2)


def test_sinusoidal_values_at_known_positions():
    table = sinusoidal_table(100, 8)
    assert torch.allclose(table[0], torch.tensor([0.0, 1.0] * 4))
    pos, d = 7, 8
    for i in range(4):
        angle = pos / 10000 ** (2 * i / d)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    pe = PositionalEncoding(8, 100, dropout=0.0)
    x = torch.zeros(1, 3, 8)
    assert torch.allclose(pe(x, offset=5)[0], table[5:8])


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
@pytest.mark.parametrize("room", [32, 1])  # 1: the self-attention caches grow (1 → 2 → 4 → 8 positions)
def test_incremental_decoding_equals_full_forward(norm, positional, room):
    torch.manual_seed(0)
    model = Transformer(tiny_config(norm_position=norm, positional=positional)).eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt_in = torch.tensor([[2, 11, 12, 13, 14, 15], [2, 16, 17, 18, 19, 20]])
    with torch.no_grad():
        full = model(src, tgt_in)  # (B, T, V)
        memory, src_mask = model.encode(src)
        state = model.init_state(memory, src_mask, max_len=room)
        steps = torch.stack([model.decode_step(tgt_in[:, t], state) for t in range(tgt_in.size(1))], dim=1)
    assert torch.allclose(steps, full, atol=1e-5), (steps - full).abs().max()


def test_reordered_decoding_rows_continue_as_their_new_prefixes():
    """After a reorder (rows duplicated, dropped, swapped: what beam search does), each row decodes
    exactly as the full forward pass of the prefix it inherited plus its new tokens."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [5, 6, 7, 8, 3], [5, 6, 7, 8, 3]])
    before = torch.tensor([[2, 11, 12], [2, 13, 14], [2, 15, 16]])  # 3 steps on 3 rows
    rows = torch.tensor([2, 2, 0])  # row 1 dropped, row 2 duplicated, row 0 moved
    after = torch.tensor([[17, 18], [19, 20], [21, 22]])  # then 2 more steps
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        state = model.init_state(memory, src_mask, max_len=3)
        for t in range(before.size(1)):
            model.decode_step(before[:, t], state)
        state = state.reorder(rows, torch.tensor([0, 1, 2]))
        steps = torch.stack([model.decode_step(after[:, t], state) for t in range(after.size(1))], dim=1)
        full = model(src, torch.cat([before[rows], after], dim=1))[:, before.size(1):]  # (3, 2, V)
    assert torch.allclose(steps, full, atol=1e-5), (steps - full).abs().max()


def test_single_query_attention_shared_keys_equal_copied_keys_and_sdpa():
    """Beams that share a sentence's cross-attention K/V (grouped queries) give exactly what
    copies of it per beam give, and both equal torch's fused attention, padding masked."""
    torch.manual_seed(0)
    sentences, beams, heads, keys, d_head = 3, 4, 2, 7, 8
    q = torch.randn(sentences * beams, heads, 1, d_head)
    k, v = torch.randn(sentences, heads, keys, d_head), torch.randn(sentences, heads, keys, d_head)
    mask = torch.ones(sentences, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., 5:] = False  # sentence 1 has 2 padded source positions
    copied = [t.repeat_interleave(beams, dim=0) for t in (k, v, mask)]
    shared = single_query_attention(q, k, v, mask)
    assert shared.shape == (sentences * beams, heads, 1, d_head)
    assert torch.allclose(shared, single_query_attention(q, *copied), atol=1e-6)
    assert torch.allclose(shared, F.scaled_dot_product_attention(q, *copied[:2], attn_mask=copied[2]), atol=1e-6)
    v_pad = v.clone()
    v_pad[1, :, 5:] = 1e6  # padded positions must get zero weight
    assert torch.allclose(single_query_attention(q, k, v_pad, mask), shared, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [1, 5, 15, 16, 40])  # below 16 keys on many rows: the vectorised path
def test_attention_softmax_equals_torch_softmax_on_every_path(dtype, keys):
    torch.manual_seed(0)
    scores = (torch.randn(160, 4, 1, keys) * 4).to(dtype)  # 640 rows: enough for the short-row path
    scores[::3, :, :, 0] = float("-inf")  # masked keys get zero weight
    if keys == 1:
        scores[::3] = 0.0  # (a row must keep one real key)
    expected = scores.float().softmax(dim=-1)
    with torch.no_grad():
        got = attention_softmax(scores.clone())
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5), (got - expected).abs().max()
    if keys > 1:
        assert bool((got[::3, :, :, 0] == 0).all())
    assert torch.allclose(got.sum(-1), torch.ones(160, 4, 1), atol=1e-5)


def test_single_query_attention_on_many_rows_equals_sdpa():
    """Enough rows and few keys for the vectorised short-row softmax; the result is SDPA's."""
    torch.manual_seed(0)
    sentences, beams, heads, keys, d_head = 32, 5, 4, 9, 16
    q = torch.randn(sentences * beams, heads, 1, d_head)
    k, v = torch.randn(sentences, heads, keys, d_head), torch.randn(sentences, heads, keys, d_head)
    mask = torch.ones(sentences, 1, 1, keys, dtype=torch.bool)
    mask[::2, ..., 6:] = False
    copied = [t.repeat_interleave(beams, dim=0) for t in (k, v, mask)]
    with torch.no_grad():
        got = single_query_attention(q, k, v, mask)
        self_attention = single_query_attention(q, *copied[:2], None)  # one set of keys per row
    assert torch.allclose(got, F.scaled_dot_product_attention(q, *copied[:2], attn_mask=copied[2]), atol=1e-5)
    assert torch.allclose(self_attention, F.scaled_dot_product_attention(q, *copied[:2]), atol=1e-5)


def test_beam_rows_decode_like_copies_of_their_sentence():
    """init_state(beams=K) keeps one cross-attention K/V per sentence for its K decoding rows:
    every row's logits equal decoding that row's sentence alone."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tokens = torch.tensor([[2, 2, 2], [11, 12, 13], [14, 15, 16]])  # 3 steps × (2 sentences · 3 beams)
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        grouped = model.init_state(memory, src_mask, beams=3)
        copied = model.init_state(memory.repeat_interleave(3, 0), src_mask.repeat_interleave(3, 0))
        for step in tokens:
            row_tokens = step.repeat(2)  # (6,)
            assert torch.allclose(model.decode_step(row_tokens, grouped), model.decode_step(row_tokens, copied),
                                  atol=1e-5)
        # Dropping sentence 0 keeps sentence 1's rows and its K/V.
        keep_rows, keep_sentences = torch.arange(3, 6), torch.tensor([1])
        grouped, copied = grouped.reorder(keep_rows, keep_sentences), copied.reorder(keep_rows, keep_rows)
        assert torch.allclose(model.decode_step(tokens[1], grouped), model.decode_step(tokens[1], copied), atol=1e-5)


def with_beam_caches(model: Transformer, state, sentences: int, beams: int, dtype: torch.dtype):
    """`state` with BeamKVCache self-attention caches of `dtype` (init_state picks them for bf16 only)."""
    d_head = model.cfg.d_model // model.cfg.n_heads
    like = state.layers[0].cross_attn.key
    for layer in state.layers:
        layer.self_attn = BeamKVCache.empty(sentences, beams, model.cfg.n_heads, d_head, like, dtype)
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_beam_cache_decodes_like_copied_row_caches(dtype):
    """Beams pick random new parents within their sentence at every step (what beam search does),
    for more steps than the cache's first capacity (it grows), and a sentence leaves the batch half
    way: the slot cache with its ancestry masks gives every row the logits of per-row caches that
    copy each row's prefix."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval().to(dtype)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0], [11, 12, 13, 3, 0]])
    k, steps = 3, 3 * BeamKVCache.GROW - 2
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        slots = with_beam_caches(model, model.init_state(memory, src_mask, beams=k), 3, k, dtype)
        copies = model.init_state(memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0), max_len=2)
        assert isinstance(copies.layers[0].self_attn, KVCache)
        n = 3
        for step in range(steps):
            tokens = torch.randint(4, 50, (n * k,), generator=generator)
            got, expected = model.decode_step(tokens, slots), model.decode_step(tokens, copies)
            tolerance = 1e-5 if dtype == torch.float32 else 0.05 * float(expected.abs().max())
            assert torch.allclose(got.float(), expected.float(), atol=tolerance), (step, (got - expected).abs().max())
            parents = torch.randint(0, k, (n, k), generator=generator)  # (N, K) beam within the sentence
            if step == steps // 2:  # the middle sentence finishes
                keep = torch.tensor([0, 2])
                rows = (parents[keep] + keep[:, None] * k).view(-1)
                slots, copies, n = slots.reorder(rows, keep), copies.reorder(rows, rows), 2
            else:
                rows = (parents + torch.arange(n)[:, None] * k).view(-1)
                slots, copies = slots.reorder(rows), copies.reorder(rows, rows)
    assert slots.layers[0].self_attn.capacity == 3 * BeamKVCache.GROW


@pytest.mark.parametrize("cache_kind", ["rows", "slots"])
def test_first_beam_step_with_one_row_per_sentence_decodes_like_k_identical_rows(cache_kind):
    """Beam search decodes its first step with one row per sentence (all K beams are still the
    same): both cache kinds store that step for every beam, and after the beams pick parents the
    next steps give exactly the logits of a search that ran the first step on all K rows."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    n, k = 2, 3
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        memory, src_mask = model.encode(src)

        def state():
            s = model.init_state(memory, src_mask, beams=k)
            return with_beam_caches(model, s, n, k, torch.float32) if cache_kind == "slots" else s

        one, all_rows = state(), state()
        first_one = model.decode_step(torch.full((n,), 2), one)  # (N, V)
        first_all = model.decode_step(torch.full((n * k,), 2), all_rows)  # (N·K, V)
        assert first_one.shape == (n, model.cfg.tgt_vocab_size)
        assert torch.allclose(first_one.repeat_interleave(k, 0), first_all, atol=1e-5)
        parents = torch.arange(k - 1, -1, -1).expand(n, k)  # first: every beam continues another one
        for _ in range(4):
            rows = (parents + torch.arange(n)[:, None] * k).reshape(-1)
            one, all_rows = one.reorder(rows), all_rows.reorder(rows)
            parents = torch.randint(0, k, (n, k), generator=generator)
            tokens = torch.randint(4, 50, (n * k,), generator=generator)
            got, expected = model.decode_step(tokens, one), model.decode_step(tokens, all_rows)
            assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
        with pytest.raises(ValueError, match="rows at step"):  # one row per sentence only at step 0
            model.decode_step(torch.full((n,), 2), one)


def test_folding_the_query_scale_changes_no_output():
    """fold_query_scale moves 1/√Dh into the query projections (Dh = 16: exactly 1/4): training-style
    forward passes, the weights returned for plots and incremental decoding give the same numbers."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(d_model=32, n_heads=2)).eval()  # Dh = 16
    for module in model.modules():  # biases start at zero: make the query biases matter
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.normal_(module.bias, std=0.5)
    folded = copy.deepcopy(model)
    assert all(fold_query_scale(m) for m in folded.modules() if isinstance(m, MultiHeadAttention))
    assert not any(fold_query_scale(m) for m in folded.modules() if isinstance(m, MultiHeadAttention))  # once
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt_in = torch.tensor([[2, 11, 12, 13], [2, 16, 17, 18]])
    with torch.no_grad():
        assert torch.allclose(folded(src, tgt_in), model(src, tgt_in), atol=1e-6, rtol=0)
        for m in (folded, model):  # the weights returned for plots
            m.decode(tgt_in, *m.encode(src, need_weights=True), need_weights=True)
        for wa, wb in zip(folded.cross_attention_weights() + folded.encoder_attention_weights(),
                          model.cross_attention_weights() + model.encoder_attention_weights()):
            assert torch.allclose(wa, wb, atol=1e-6, rtol=0)
        states = [m.init_state(*m.encode(src), beams=2) for m in (folded, model)]
        for t in range(tgt_in.size(1)):
            tokens = tgt_in[:, t].repeat_interleave(2)
            got, expected = (m.decode_step(tokens, st) for m, st in zip((folded, model), states))
            assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    odd = MultiHeadAttention(32, 4)  # Dh = 8: 1/√8 is not a power of two, so nothing is folded
    weight = odd.q_proj.weight.detach().clone()
    assert not fold_query_scale(odd) and torch.equal(odd.q_proj.weight, weight)


def test_beam_cache_refuses_a_parent_from_another_sentence():
    cache = BeamKVCache.empty(2, 3, 4, 8, torch.zeros(1), torch.float32)
    with pytest.raises(ValueError, match="same sentence"):
        cache.index_select(torch.tensor([0, 1, 3, 3, 4, 5]))  # row 2 (sentence 0) would continue row 3 (sentence 1)
    cache.index_select(torch.tensor([2, 2, 0, 5, 3, 3]))  # within each sentence: fine


def test_bf16_beam_state_on_cpu_uses_the_beam_cache():
    model = Transformer(tiny_config()).eval().to(torch.bfloat16)
    with torch.no_grad():
        memory, src_mask = model.encode(torch.tensor([[5, 6, 3]]))
        assert isinstance(model.init_state(memory, src_mask, beams=4).layers[0].self_attn, BeamKVCache)
        assert isinstance(model.init_state(memory, src_mask, beams=1).layers[0].self_attn, KVCache)
        assert isinstance(model.float().init_state(memory.float(), src_mask, beams=4).layers[0].self_attn, KVCache)


def test_checkpoints_from_before_fused_qkv_load_with_identical_outputs(tmp_path):
    """Self-attention's Q and K|V projections were two Linear layers (q_proj, kv_proj) before they
    were fused into qkv_proj: such checkpoints still load, strictly, and compute the same."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    d = model.cfg.d_model
    old_format = {}
    for name, tensor in model.state_dict().items():
        if "qkv_proj." in name:
            prefix, kind = name.split("qkv_proj.")
            old_format[f"{prefix}q_proj.{kind}"], old_format[f"{prefix}kv_proj.{kind}"] = tensor[:d], tensor[d:]
        else:
            old_format[name] = tensor
    assert any(".self_attn.q_proj." in name for name in old_format)
    path = tmp_path / "old.pt"
    save_checkpoint(path, {"model": old_format})
    torch.manual_seed(1)
    loaded = Transformer(tiny_config()).eval()
    loaded.load_state_dict(load_checkpoint(path)["model"])  # strict: no missing or unexpected keys
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt_in = torch.tensor([[2, 11, 12], [2, 16, 17]])
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt_in), model(src, tgt_in))


def test_tied_and_shared_embeddings_and_parameter_count():
    shared = Transformer(tiny_config())
    assert shared.output_proj.weight is shared.tgt_embed.embedding.weight
    assert shared.src_embed is shared.tgt_embed
    separate = Transformer(tiny_config(share_embeddings=False, tie_output=False))
    assert separate.num_parameters() == shared.num_parameters() + 2 * 50 * 32
    with pytest.raises(ValueError, match="joint vocabulary"):
        Transformer(tiny_config(tgt_vocab_size=60))


def test_padding_does_not_change_the_output():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    alone = model(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7, 8]]))
    padded = model(torch.tensor([[5, 6, 3, 0, 0]]), torch.tensor([[2, 7, 8, 0]]))
    assert torch.allclose(alone, padded[:, :3], atol=1e-5)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_keeps_expected_fraction_and_scale(p):
    from transformer_cli.model.transformer import Dropout

    torch.manual_seed(0)
    drop = Dropout(p).train()
    x = torch.ones(1000, 1000)
    y = drop(x)
    kept = (y != 0).float().mean().item()
    assert kept == pytest.approx(1 - p, abs=0.004)  # p resolved to 1/256: ≤ 0.002 off, plus sampling
    assert y.sum().item() / x.numel() == pytest.approx(1.0, abs=0.005)  # unbiased: E[y] = x
    values = y.unique()
    assert len(values) == 2 and values[0] == 0 and values[1].item() == pytest.approx(256 / (256 - round(p * 256)))
    assert torch.equal(drop.eval()(x), x)
    # masks are random, not a fixed pattern: two draws differ, and neighbouring elements are independent
    z = drop.train()(x)
    assert not torch.equal(y, z)
    a, b = (y[:, 0::2] != 0).float(), (y[:, 1::2] != 0).float()
    assert (a * b).mean().item() == pytest.approx((1 - p) ** 2, abs=0.005)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_scales_kept_values_exactly_and_backpropagates_through_the_same_mask(dtype):
    """A kept value is x · 256/(256 − d) computed in fp32 and rounded once to x's dtype (in bf16 the
    scale itself is not rounded to bf16 first), a dropped one is 0, and the gradient flows through
    the same mask."""
    from transformer_cli.model.transformer import Dropout

    torch.manual_seed(0)
    x = (torch.randn(64, 300) * 3).to(dtype).requires_grad_()
    y = Dropout(0.3).train()(x)
    scale = 256 / (256 - round(0.3 * 256))
    kept = y != 0
    assert y.dtype == dtype and 0.6 < kept.float().mean().item() < 0.8
    scale32 = torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(y[kept], (x.detach()[kept].float() * scale32).to(dtype)), "scale rounded twice"
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(grad, (kept.float() * scale32).to(dtype))


def test_decoder_returns_cross_attention_weights_on_request():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    src = torch.tensor([[5, 6, 7, 3, 0]])
    tgt_in = torch.tensor([[2, 8, 9]])
    memory, src_mask = model.encode(src)
    plain = model.decode(tgt_in, memory, src_mask)
    with_weights = model.decode(tgt_in, memory, src_mask, need_weights=True)
    assert torch.allclose(plain, with_weights, atol=1e-5)
    weights = model.cross_attention_weights()
    assert len(weights) == 2 and weights[0].shape == (1, 4, 3, 5)
    assert torch.allclose(weights[0].sum(-1), torch.ones(1, 4, 3), atol=1e-6)
    assert (weights[0][..., 4] == 0).all()  # the padded source position gets no attention


def test_ffn_dropout_follows_activation_dropout_where_it_is_set():
    """model.activation_dropout drops out the FFN's hidden activations (0.0: none, as the paper);
    unset, the FFN uses `dropout`, as before the key existed. Residual dropout is unaffected."""
    from transformer_cli.model.transformer import DecoderLayer, EncoderLayer

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    for layer_class in (EncoderLayer, DecoderLayer):
        paper = layer_class(TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=16, n_heads=2, d_ff=64,
                                              dropout=0.5, activation_dropout=0.0)).train()
        assert torch.equal(paper.ffn(x), paper.ffn(x))  # no dropout inside the FFN
        assert paper.ffn_add_norm.dropout.p == 0.5
        unset = layer_class(TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=16, n_heads=2, d_ff=64,
                                              dropout=0.5)).train()
        assert unset.ffn.dropout.p == 0.5 and not torch.equal(unset.ffn(x), unset.ffn(x))
