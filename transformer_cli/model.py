"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), one file, top to bottom.

Shapes: B batch, S source length, T target length, H heads, D d_model, Dh = D / H, V vocab.
Masks are boolean with True = "may attend", the convention of F.scaled_dot_product_attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TransformerConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: str = "relu"  # relu | gelu
    norm_position: str = "post"  # post (paper) | pre
    positional: str = "sinusoidal"  # sinusoidal (paper) | learned
    max_positions: int = 1024
    share_embeddings: bool = True
    tie_output: bool = True
    pad_id: int = 0


# --------------------------------------------------------------------------- masks


CAUSAL = "causal"  # mask argument meaning "position t attends to positions ≤ t" (SDPA is_causal)


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) ids → (B, 1, 1, L): True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | None = None) -> torch.Tensor:
    """(1, 1, T, T): position t may attend to positions ≤ t."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def decoder_self_attention_mask(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, T, T): causal AND key is not padding."""
    return causal_mask(tgt_in.size(1), tgt_in.device) & padding_mask(tgt_in, pad_id)


# --------------------------------------------------------------------------- components


class Dropout(nn.Module):
    """nn.Dropout, with a cheaper random mask on CPU.

    On CPU torch draws one 32-bit random number per element from a single-threaded generator
    (≈15% of a training step here); we draw one 64-bit number per eight elements and compare each
    byte with p. So p is resolved to 1/256 (0.1 → 26/256 = 0.1016, 0.3 → 77/256 = 0.3008) and kept
    values are scaled by 1 / (1 − that p): the output's expectation is exactly the input. A step
    of the de-en model trained 5% faster than with 16 bits per element (AMD EPYC).
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        n = x.numel()
        dropped = min(round(self.p * 256), 255)  # of 256 byte values, this many drop the element
        # The whole int64 range: random_() without bounds leaves the top bit 0 (values < 2^63),
        # which would make every eighth byte < 128.
        bits = torch.empty((n + 7) // 8, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        # keep = byte ≥ dropped (bytes uniform on [0, 256)), written as 0/1 in x's dtype by the
        # comparison itself: a bool mask costs a cast (10x the comparison) or, multiplied as it is,
        # a promotion inside every multiply, forward and backward (a bf16 training step +10% here).
        keep = torch.ge(bits.view(torch.uint8)[:n].view(x.shape), dropped, out=torch.empty_like(x))
        scale = 256.0 / (256 - dropped)
        if x.dtype == torch.float32:  # the scale into the mask: one multiply each way, same values
            return x * keep.mul_(scale)
        return x * keep * scale  # bf16 (fp16): a mask in x's dtype would round the scale; x · scale rounds once


class TokenEmbedding(nn.Module):
    """Embedding lookup scaled by sqrt(d_model) (paper §3.4)."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, L) → (B, L, D)
        return self.embedding(tokens) * self.scale


def sinusoidal_table(max_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)). (L, D)"""
    position = torch.arange(max_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds position information (sinusoidal table or learned embedding), then dropout."""

    def __init__(self, d_model: int, max_positions: int, dropout: float, learned: bool = False):
        super().__init__()
        self.learned = learned
        if learned:
            self.table = nn.Parameter(torch.randn(max_positions, d_model) * d_model**-0.5)
        else:
            self.register_buffer("table", sinusoidal_table(max_positions, d_model), persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:  # (B, L, D)
        length = x.size(1)
        self._check_positions(offset + length)
        return self.dropout(x + self.table[offset : offset + length])

    def step(self, x: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """forward at inference for one position of every row, in place: x (B, D) → x + PE(position);
        `position` is one for all rows, or (B,) one per row (continuous batching)."""
        if isinstance(position, int):
            self._check_positions(position + 1)
            return x.add_(self.table[position])
        return x.add_(self.table.index_select(0, position))  # (an index past the table raises)

    def _check_positions(self, count: int) -> None:
        if count > self.table.size(0):
            raise ValueError(f"sequence of {count} positions exceeds max_positions={self.table.size(0)}")


@dataclass
class AttentionCache:
    """Keys/values kept between decoding steps. (B, H, L, Dh) each."""

    key: torch.Tensor
    value: torch.Tensor


class KVCache:
    """Self-attention keys and values of the decoded prefix, (B, H, t, Dh) each, in buffers with
    room for more positions: a step writes its own in place instead of torch.cat copying the whole
    prefix again at every step (greedy decoding +10% sentences/s). A reorder (beam search, rows
    leaving the batch) copies the prefix once, into buffers with room for just the next step:
    beam search (fp32, or on a GPU) reorders before every step, and copying empty room would cost
    more (measured). When full, the buffers double. bf16 beam search on CPU uses BeamKVCache.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.keys, self.values, self.length = keys, values, length  # (B, H, capacity, Dh) each

    @classmethod
    def empty(cls, rows: int, heads: int, d_head: int, capacity: int, like: torch.Tensor,
              dtype: torch.dtype) -> KVCache:
        shape = (rows, heads, max(capacity, 1), d_head)
        return cls(like.new_empty(shape, dtype=dtype), like.new_empty(shape, dtype=dtype), 0)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Store one step's (B, H, 1, Dh) key and value → the keys and values of every step so far
        (and no mask: every row attends to all of them).

        At the first step of a beam search the key and value may hold one row per sentence (B/G,
        its beams are all the same then): each is stored in its sentence's G rows and the step
        attends with the B/G rows it came with."""
        t = self.length
        if key.size(0) != self.keys.size(0):
            if t != 0 or self.keys.size(0) % key.size(0):
                raise ValueError(f"KV cache: {key.size(0)} rows at step {t} of a {self.keys.size(0)}-row cache")
            beams = self.keys.size(0) // key.size(0)
            self.keys[:, :, 0] = key[:, :, 0].repeat_interleave(beams, dim=0)
            self.values[:, :, 0] = value[:, :, 0].repeat_interleave(beams, dim=0)
            self.length = 1
            return key, value, None
        if t == self.keys.size(2):
            self.keys, self.values = (self._copy_prefix(b, None, 2 * t) for b in (self.keys, self.values))
        self.keys[:, :, t] = key[:, :, 0]  # cast to the cache dtype by the copy
        self.values[:, :, t] = value[:, :, 0]
        self.length = t + 1
        return self.keys[:, :, : t + 1], self.values[:, :, : t + 1], None

    def index_select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> KVCache:
        """A cache whose row i is this cache's row rows[i] (rows may repeat; `sentences` is not needed)."""
        t = self.length
        return KVCache(*(self._copy_prefix(b, rows, t + 1) for b in (self.keys, self.values)), t)

    def drop_front(self, positions: int) -> None:
        """Forget the first `positions` cached positions of every row (no row attends to them any more)."""
        self.keys, self.values = (self._copy_prefix(b, None, self.keys.size(2), positions) for b in (self.keys, self.values))
        self.length -= positions

    def _copy_prefix(self, buffer: torch.Tensor, rows: torch.Tensor | None, capacity: int,
                     skip: int = 0) -> torch.Tensor:
        t = self.length
        new = buffer.new_empty((buffer.size(0) if rows is None else len(rows), buffer.size(1), capacity, buffer.size(3)))
        if rows is None:
            new[:, :, : t - skip] = buffer[:, :, skip:t]
        else:
            torch.index_select(buffer[:, :, :t], 0, rows, out=new[:, :, :t])
        return new


class BeamKVCache:
    """Self-attention keys and values for beam search on CPU, kept where they were written.

    A sentence's K beams own K slots; at step t beam b writes its key and value into slot b,
    position t, and nothing is ever copied when beams pick new parents. Instead each row keeps an
    additive mask over its sentence's K × capacity keys: 0 where its own prefix lies (position j of
    its ancestry is in the slot of the beam that held it at step j), −inf elsewhere, and a reorder
    copies only that mask. The K beams of a sentence then attend as one block of K queries over
    the sentence's K · capacity keys (as they do in cross-attention): K times the multiply-adds of
    one query per row over its own t keys, but in one matmul per sentence and head, which on CPU
    in bf16 cost less than the per-row matmuls plus the per-step copy of every row's prefix
    (AMD EPYC: 164 vs 285 µs a layer at 15 positions, 32 sentences × 5 beams).
    Capacity grows by `GROW` positions at a time (unused positions hold zeros: finite, and masked).

    keys/values (N, H, K · capacity, Dh), laid out as (N, H, K, capacity, Dh);
    mask (N · K, K · capacity) fp32, row = sentence · K + beam.
    """

    GROW = 8

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, length: int, beams: int):
        self.keys, self.values, self.mask, self.length, self.beams = keys, values, mask, length, beams

    @classmethod
    def empty(cls, sentences: int, beams: int, heads: int, d_head: int, like: torch.Tensor,
              dtype: torch.dtype) -> BeamKVCache:
        shape = (sentences, heads, beams * cls.GROW, d_head)
        mask = like.new_full((sentences * beams, beams * cls.GROW), float("-inf"), dtype=torch.float32)
        return cls(like.new_zeros(shape, dtype=dtype), like.new_zeros(shape, dtype=dtype), mask, 0, beams)

    @property
    def capacity(self) -> int:
        return self.keys.size(2) // self.beams

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one step's (N·K, H, 1, Dh) keys and values → all keys and values (N, H, K·cap, Dh)
        and each row's additive mask over them, (N, 1, K, K·cap).

        At the first step the keys and values may hold one row per sentence (N: its beams are all
        the same then): they go to slot 0, every beam's ancestry starts there, and the mask
        returned is (N, 1, 1, K·cap) for those N query rows."""
        t, k = self.length, self.beams
        if t == self.capacity:
            self._grow(t + self.GROW)
        n, heads, _, d_head = self.keys.shape
        slots = (n, heads, k, self.capacity, d_head)
        if key.size(0) != n * k:
            if t != 0 or key.size(0) != n:
                raise ValueError(f"beam search cache: {key.size(0)} rows at step {t} of {n} sentences × {k} beams")
            self.keys.view(slots)[:, :, 0, 0] = key[:, :, 0]  # (N, H, Dh)
            self.values.view(slots)[:, :, 0, 0] = value[:, :, 0]
            self.mask.view(n, k, k, self.capacity)[:, :, 0, 0] = 0.0
            self.length = 1
            return self.keys, self.values, self.mask.view(n, 1, k, -1)[:, :, :1]
        self.keys.view(slots)[:, :, :, t] = key.view(n, k, heads, d_head).transpose(1, 2)  # (N, H, K, Dh)
        self.values.view(slots)[:, :, :, t] = value.view(n, k, heads, d_head).transpose(1, 2)
        # Row (s, b) attends to what it just wrote: slot b, position t.
        self.mask.view(n, k, k, self.capacity).diagonal(dim1=1, dim2=2)[:, t] = 0.0
        self.length = t + 1
        return self.keys, self.values, self.mask.view(n, 1, k, -1)

    @staticmethod
    def check_rows(rows: torch.Tensor, beams: int, sentences: torch.Tensor | None = None) -> None:
        """Raise unless new row i's source row rows[i] lies in its sentence: new sentence j is old
        sentence sentences[j] (None: the same sentences). Beams only move within their sentence."""
        expected = (torch.arange(len(rows), device=rows.device) // beams if sentences is None
                    else sentences.repeat_interleave(beams))
        if not bool((rows // beams == expected).all()):
            raise ValueError("beam search cache: a row's new parent must be a beam of the same sentence")

    def index_select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None,
                     checked: bool = False) -> BeamKVCache:
        """A cache whose row i continues this cache's row rows[i] (see `check_rows`, which runs
        unless the caller has `checked` them)."""
        k = self.beams
        if not checked:
            self.check_rows(rows, k, sentences)
        keys, values = self.keys, self.values
        if sentences is not None:
            keys, values = keys.index_select(0, sentences), values.index_select(0, sentences)
        return BeamKVCache(keys, values, self.mask.index_select(0, rows), self.length, k)

    def _grow(self, capacity: int) -> None:
        n, heads, _, d_head = self.keys.shape
        k, old = self.beams, self.capacity

        def grown(buffer: torch.Tensor) -> torch.Tensor:
            new = buffer.new_zeros((n, heads, k, capacity, d_head))
            new[:, :, :, :old] = buffer.view(n, heads, k, old, d_head)
            return new.view(n, heads, k * capacity, d_head)

        self.keys, self.values = grown(self.keys), grown(self.values)
        mask = self.mask.new_full((n * k, k, capacity), float("-inf"))
        mask[:, :, :old] = self.mask.view(n * k, k, old)
        self.mask = mask.view(n * k, k * capacity)


def attention_softmax(scores: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim of attention scores; may overwrite `scores` (if fp32).

    torch's CPU softmax vectorises along the last dim only from 16 elements up; below that it
    calls a scalar exp per element: 640 rows of 15 keys cost 112 µs, of 16 keys 9 µs (AMD EPYC).
    Decoding attends over fewer than 16 keys all the time (the first target steps; Multi30k
    sources), so there the softmax is written as whole-tensor vectorised ops instead: four ops
    (~6 µs) that beat the scalar loop from ~500 scores up (640 × 15 scores: 27 µs).
    """
    if scores.device.type != "cpu" or scores.size(-1) >= 16 or scores.numel() < 512 or torch.is_grad_enabled():
        return scores.softmax(dim=-1, dtype=torch.float32)
    x = scores.float()  # a copy for bf16; fp32 scores are overwritten
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    return x.div_(x.sum(dim=-1, keepdim=True))


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, prescaled: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √Dh) v for one query per row (incremental decoding), as two batched matmuls.

    q (B, H, 1, Dh); k/v (B/G, H, Tk, Dh): G consecutive query rows share one set of keys and
    values (the G beams of a sentence: in cross-attention, and in self-attention over a
    BeamKVCache); mask: boolean (True = attend) broadcastable to (B/G, H, 1, Tk), or fp32 additive
    (0 / −inf) broadcastable to (B/G, H, G, Tk), or None → (B, H, 1, Dh).
    torch's fused CPU attention kernel works in blocks of queries; with a single query it costs
    1.5x (fp32) to 6x (bf16 without AMX) more than this (scripts/profile_step.py --what beam).
    The matmuls are torch.bmm over (B/G · H) blocks: k and v (also a cache's prefix, sliced from
    its buffer) fold their first two dims into one without a copy, and a 4-D `@` would add an
    expand and two reshapes around each (decoding runs these 12 times a step for 3 layers).
    The softmax is taken in fp32, as the fused kernel does. `prescaled`: q is already q / √Dh.
    """
    rows, heads, _, d_head = q.shape
    sentences, keys = k.size(0), k.size(2)
    groups = rows // sentences
    out_dtype = q.dtype
    if q.dtype != k.dtype:  # (a same-dtype .to is still a dispatched op: 18 a step)
        q = q.to(k.dtype)
    if not prescaled:
        q = q * d_head**-0.5
    # (B, H, 1, Dh) → (B/G · H, G, Dh): a sentence's beams become its query block (a view for G = 1)
    q = q.reshape(sentences, groups, heads, d_head).transpose(1, 2).reshape(sentences * heads, groups, d_head)
    scores = torch.bmm(q, k.reshape(sentences * heads, keys, d_head).transpose(1, 2))  # (B/G · H, G, Tk)
    scores = scores.view(sentences, heads, groups, keys)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:  # additive, fp32: bf16 scores + fp32 mask is a new fp32 tensor (one pass)
        scores = scores + mask if scores.dtype != torch.float32 else scores.add_(mask)
    weights = attention_softmax(scores)
    if weights.dtype != v.dtype:
        weights = weights.to(v.dtype)
    weights = weights.view(sentences * heads, groups, keys)
    out = torch.bmm(weights, v.reshape(sentences * heads, keys, d_head))  # (B/G · H, G, Dh)
    # → (B, H, 1, Dh): row s·G + g is query g of sentence s
    out = out.view(sentences, heads, groups, d_head).transpose(1, 2).reshape(rows, heads, 1, d_head)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     is_causal: bool, dropout: float = 0.0, prescaled: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √Dh) v as two batched matmuls in q's dtype, the softmax in fp32.

    q (B, H, Tq, Dh), k/v (B, H, Tk, Dh), mask broadcastable to (B, H, Tq, Tk) (True = attend)
    or None; `is_causal`: position t attends to keys ≤ t → (B, H, Tq, Dh).
    For bf16 training on CPU: torch's fused kernel is slow in bf16 there, and running it in fp32
    costs the casts of q, k, v and of the output, forward and backward. This way a de-en training
    step ran 12% faster (AMD EPYC, AVX512_BF16 without AMX; alternating blocks of identical batches).
    """
    scores = (q if prescaled else q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    if is_causal:
        mask = causal_mask(q.size(2), q.device) if mask is None else mask & causal_mask(q.size(2), q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # at least fp32
    if dropout > 0.0:
        weights = F.dropout(weights, dropout, training=True)
    return weights.to(v.dtype) @ v


def decoding_cache_dtype(memory: torch.Tensor, beams: int) -> torch.dtype:
    """Keys/values cached for greedy decoding on CPU: fp32; otherwise the model's dtype.

    One query per row makes the attention matmuls tiny (1 × Tk per head); torch's bf16 CPU batched
    matmul costs 2.5x its fp32 one there (10 vs 28 µs for 128 heads × 20 keys, AMD EPYC), so greedy
    decoding with a bf16 model attends over fp32 caches (+7% sentences/s); its linear layers stay
    bf16. Beam search keeps the model's dtype: its per-step reorders of fp32 caches cost more than
    the faster matmuls gained (−25% all caches, −5.5% self-attention only), and in bf16 on CPU its
    BeamKVCache no longer copies at all.
    """
    on_cpu = memory.device.type == "cpu" and memory.is_floating_point()
    return torch.float32 if on_cpu and beams == 1 else memory.dtype


class MultiHeadAttention(nn.Module):
    """Q, K, V projections → H heads of scaled dot-product attention → concat → output projection.

    Self-attention (queries, keys and values all from one sequence) projects Q, K and V with one
    fused (D → 3D) matmul; cross-attention projects Q from the decoder and K, V (fused, D → 2D)
    from the encoder output, which incremental decoding computes once per sentence.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, self_attention: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # rows: Q, then K, then V
        else:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)  # rows: K, then V
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.queries_prescaled = False  # see fold_query_scale

    def fold_query_scale(self) -> bool:
        """Scale the query projection by 1/√Dh once, for inference, so that no attention call scales
        its queries again (one elementwise op fewer per attention call and decoding step). Done only
        where 1/√Dh is a power of two (Dh = 4, 16, 64, 256, …): then every weight is scaled exactly
        and outputs stay bit-identical. Changes the weights: for a model that is not trained again.
        """
        scale = self.d_head**-0.5
        if self.queries_prescaled or math.frexp(scale)[0] != 0.5:
            return False
        projection = self.qkv_proj if self.self_attention else self.q_proj  # Q rows come first in both
        d_model = self.n_heads * self.d_head
        with torch.no_grad():
            projection.weight[:d_model].mul_(scale)
            if projection.bias is not None:
                projection.bias[:d_model].mul_(scale)
        self.queries_prescaled = True
        return True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before Q, K, V were fused for self-attention hold q_proj + kv_proj.
        if self.self_attention and prefix + "q_proj.weight" in state_dict:
            for kind in ("weight", "bias"):
                q, kv = state_dict.pop(f"{prefix}q_proj.{kind}"), state_dict.pop(f"{prefix}kv_proj.{kind}")
                state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([q, kv])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D) → (B, H, L, Dh)
        return x.view(x.size(0), x.size(1), self.n_heads, self.d_head).transpose(1, 2)

    def project_kv(self, memory: torch.Tensor) -> AttentionCache:
        """Keys and values of `memory` (B, L, D), e.g. the encoder output, computed once."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return AttentionCache(self._split_heads(k), self._split_heads(v))

    def step(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | BeamKVCache | None = None,
             static_kv: AttentionCache | None = None) -> torch.Tensor:
        """Incremental decoding (inference only): one new position per row, x (B, D) → (B, D).
        Self-attention appends the new key/value to `cache` (`mask`: None, or additive over its
        slots; a BeamKVCache brings its own); cross-attention attends to `static_kv` under `mask`.
        What `forward` computes for a (B, 1, D) query, in a few ops and calls fewer: run once per
        layer and step, the decoder's per-op overhead matters as much as its arithmetic."""
        rows = x.size(0)
        if self.self_attention:
            q, k, v = self.qkv_proj(x).view(rows, 3, self.n_heads, 1, self.d_head).unbind(1)  # (B, H, 1, Dh) each
            k, v, cache_mask = cache.append(k, v)
            mask = mask if cache_mask is None else cache_mask
        else:
            q = self.q_proj(x).view(rows, self.n_heads, 1, self.d_head)
            k, v = static_kv.key, static_kv.value
        out = single_query_attention(q, k, v, mask, self.queries_prescaled)  # (B, H, 1, Dh)
        return self.out_proj(out.reshape(rows, -1))  # heads concatenated, as in forward

    def forward(
        self,
        query: torch.Tensor,  # (B, Tq, D)
        key_value: torch.Tensor,  # (B, Tk, D); unused by self-attention
        mask: torch.Tensor | str | None,  # broadcastable to (B, H, Tq, Tk), True = attend; or CAUSAL
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole sequences (training, teacher forcing, attention maps); incremental decoding uses `step`."""
        if self.self_attention:  # key_value is query itself
            q, k, v = (self._split_heads(t) for t in self.qkv_proj(query).chunk(3, dim=-1))  # (B, H, T, Dh)
        else:
            q = self._split_heads(self.q_proj(query))  # (B, H, Tq, Dh)
            kv = self.project_kv(key_value)
            k, v = kv.key, kv.value
        dropout = self.dropout if self.training else 0.0
        scale = 1.0 if self.queries_prescaled else None  # None: SDPA's own 1/√Dh
        weights = None
        is_causal = isinstance(mask, str)  # CAUSAL: SDPA builds the mask itself
        if is_causal:
            mask = causal_mask(q.size(2), q.device) if need_weights else None
        if need_weights:
            # Explicit softmax(QKᵀ/√Dh)V so the weights can be returned (e.g. for plots).
            scores = q @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
            if not self.queries_prescaled:
                scores = scores / math.sqrt(self.d_head)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            out = F.dropout(weights, dropout, self.training) @ v
        elif q.size(2) == 1 and not self.training:  # one target position (the step path's attention)
            out = single_query_attention(q, k, v, mask, self.queries_prescaled)
        elif q.device.type == "cpu" and q.dtype == torch.bfloat16 and self.training:
            out = matmul_attention(q, k, v, mask, is_causal, dropout, self.queries_prescaled)
        elif q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(2) > 1:
            # On CPU, torch's fused attention kernel is ~3x slower in bf16 than in fp32 for short
            # multi-query blocks: attend in fp32 there (the encoder at inference).
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                     dropout_p=dropout, is_causal=is_causal, scale=scale).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                                 scale=scale)
        out = out.transpose(1, 2).reshape(query.size(0), query.size(1), -1)  # (B, Tq, D)
        return self.out_proj(out), weights


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = W2 · act(W1 x + b1) + b2, applied to every position."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu"):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D)
        return self.w2(self.dropout(self.activation(self.w1(x))))

    def step(self, x: torch.Tensor) -> torch.Tensor:  # forward at inference (no dropout)
        return self.w2(self.activation(self.w1(x)))


class AddNorm(nn.Module):
    """Residual connection + LayerNorm around a sub-layer ("Add & Norm").

    post-norm (paper): LayerNorm(x + Dropout(sublayer(x)))
    pre-norm:          x + Dropout(sublayer(LayerNorm(x)))
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))

    def step(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        """forward at inference (no dropout), with LayerNorm called as a function."""
        norm = self.norm
        if self.pre_norm:
            return x + sublayer(F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps))
        return F.layer_norm(x + sublayer(x), norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        pre = cfg.norm_position == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=True)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation)
        self.attn_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.ffn_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.last_self_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor, need_weights: bool = False) -> torch.Tensor:
        def attend(h: torch.Tensor) -> torch.Tensor:  # (B, S, D)
            out, weights = self.self_attn(h, h, src_mask, need_weights=need_weights)
            self.last_self_weights = weights
            return out

        x = self.attn_add_norm(x, attend)
        return self.ffn_add_norm(x, self.ffn)


@dataclass
class LayerState:
    """Per decoder layer at inference: growing self-attention cache + fixed cross-attention K/V."""

    self_attn: KVCache | BeamKVCache
    cross_attn: AttentionCache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        pre = cfg.norm_position == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation)
        self.self_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.cross_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.ffn_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.last_cross_weights: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # (B, T, D)
        memory: torch.Tensor,  # (B, S, D)
        self_mask: torch.Tensor | str | None,
        src_mask: torch.Tensor,
        need_weights: bool = False,
    ) -> torch.Tensor:
        x = self.self_add_norm(x, lambda h: self.self_attn(h, h, self_mask)[0])

        def cross(h: torch.Tensor) -> torch.Tensor:
            out, weights = self.cross_attn(h, memory, src_mask, need_weights=need_weights)
            self.last_cross_weights = weights
            return out

        x = self.cross_add_norm(x, cross)
        return self.ffn_add_norm(x, self.ffn)

    def step(self, x: torch.Tensor, state: LayerState, src_mask: torch.Tensor,
             self_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding step at inference: x (B, D), the newest position of each row → (B, D).
        `self_mask` (B, 1, 1, t) additive, where rows do not attend to every cached position."""
        x = self.self_add_norm.step(x, lambda h: self.self_attn.step(h, self_mask, cache=state.self_attn))
        x = self.cross_add_norm.step(x, lambda h: self.cross_attn.step(h, src_mask, static_kv=state.cross_attn))
        return self.ffn_add_norm.step(x, self.ffn.step)


@dataclass
class DecoderState:
    """Everything incremental decoding carries from step to step."""

    layers: list[LayerState]
    src_mask: torch.Tensor  # (B/G, 1, 1, S) fp32, 0 where the key is a real token, −inf at padding: one row per sentence
    length: int = 0  # target positions decoded so far (cache slots written)
    extras: dict = field(default_factory=dict)
    # Continuous batching (greedy): rows that joined later sit at other target positions than
    # `length`, and attend only to the cache slots written since they joined.
    positions: torch.Tensor | None = None  # (B,) long: each row's next target position; None: all at `length`
    self_mask: torch.Tensor | None = None  # (B, capacity ≥ length) fp32 additive over cache slots; None: all 0

    def self_attention_mask(self) -> torch.Tensor | None:
        """The (B, 1, 1, length + 1) additive mask of this step's self-attention (None: attend to all)."""
        if self.self_mask is None:
            return None
        if self.self_mask.size(1) <= self.length:  # room for this step's slot, doubled
            grown = self.self_mask.new_zeros((self.self_mask.size(0), 2 * (self.length + 1)))
            grown[:, : self.self_mask.size(1)] = self.self_mask
            self.self_mask = grown
        return self.self_mask[:, None, None, : self.length + 1]

    def admit(self, rows: torch.Tensor, joining: DecoderState, sentences: torch.Tensor) -> None:
        """Continuous batching, greedy (one row per sentence): rows `rows` (whose sentences are done)
        start the sentences `sentences` of `joining`, a fresh state from `init_state`. They take over
        its cross-attention keys/values and source mask (padded to the wider source of the two), start
        at target position 0 and attend only to the cache slots from this step on. In place."""
        if self.positions is None:
            self.positions = torch.full((self.src_mask.size(0),), self.length, dtype=torch.long, device=rows.device)
        if self.self_mask is None:
            self.self_mask = self.src_mask.new_zeros((self.src_mask.size(0), self.length + 8))
        width = max(self.src_mask.size(-1), joining.src_mask.size(-1))
        if self.src_mask.size(-1) < width:
            self._pad_sources(width)

        def padded(t: torch.Tensor, value: float) -> torch.Tensor:  # (N, ..., S) → (N, ..., width)
            t = t.index_select(0, sentences)
            return t if t.size(-1) == width else F.pad(t, (0, width - t.size(-1)), value=value)

        for mine, theirs in zip(self.layers, joining.layers):
            # keys/values (B, H, S, Dh): pad the source dim (the one before last)
            for have, new in ((mine.cross_attn.key, theirs.cross_attn.key), (mine.cross_attn.value, theirs.cross_attn.value)):
                new = new.index_select(0, sentences)
                if new.size(2) != width:
                    new = F.pad(new, (0, 0, 0, width - new.size(2)))
                have.index_copy_(0, rows, new)
        self.src_mask.index_copy_(0, rows, padded(joining.src_mask, float("-inf")))
        self.positions.index_fill_(0, rows, 0)
        mask = self.self_mask.index_select(0, rows).fill_(0.0)
        mask[:, : self.length] = float("-inf")  # the slots written before they joined
        self.self_mask.index_copy_(0, rows, mask)

    def _pad_sources(self, width: int) -> None:
        """Widen every row's source (cross-attention keys/values, source mask) to `width` positions."""
        extra = width - self.src_mask.size(-1)
        for layer in self.layers:
            c = layer.cross_attn
            layer.cross_attn = AttentionCache(F.pad(c.key, (0, 0, 0, extra)), F.pad(c.value, (0, 0, 0, extra)))
        self.src_mask = F.pad(self.src_mask, (0, extra), value=float("-inf"))

    def drop_front(self, slots: int) -> None:
        """Forget the first `slots` self-attention cache slots, which no row attends to any more
        (every row joined after they were written). In place."""
        for layer in self.layers:
            layer.self_attn.drop_front(slots)
        if self.self_mask is not None:
            self.self_mask = self.self_mask[:, slots:].clone()
        self.length -= slots

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> DecoderState:
        """Keep/duplicate decoding rows (beam search): self-attention caches are indexed by `rows`
        along dim 0. The per-sentence cross-attention K/V and source mask are indexed by
        `sentences` (None: unchanged, i.e. beams moved only within their own sentence).
        """

        def pick(c: AttentionCache, index: torch.Tensor) -> AttentionCache:
            return AttentionCache(c.key.index_select(0, index), c.value.index_select(0, index))

        caches = [s.self_attn for s in self.layers]
        if isinstance(caches[0], BeamKVCache):  # the same rows for every layer: checked once
            BeamKVCache.check_rows(rows, caches[0].beams, sentences)
            caches = [c.index_select(rows, sentences, checked=True) for c in caches]
        else:
            caches = [c.index_select(rows, sentences) for c in caches]
        layers = [LayerState(c, s.cross_attn if sentences is None else pick(s.cross_attn, sentences))
                  for c, s in zip(caches, self.layers)]
        src_mask = self.src_mask if sentences is None else self.src_mask.index_select(0, sentences)
        positions = None if self.positions is None else self.positions.index_select(0, rows)
        self_mask = None if self.self_mask is None else self.self_mask.index_select(0, rows)
        return DecoderState(layers, src_mask, self.length, positions=positions, self_mask=self_mask)


# --------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.share_embeddings and cfg.src_vocab_size != cfg.tgt_vocab_size:
            raise ValueError("share_embeddings needs a joint vocabulary (equal source/target vocab sizes)")
        self.src_embed = TokenEmbedding(cfg.src_vocab_size, cfg.d_model, cfg.pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else TokenEmbedding(
            cfg.tgt_vocab_size, cfg.d_model, cfg.pad_id)
        learned = cfg.positional == "learned"
        self.src_pos = PositionalEncoding(cfg.d_model, cfg.max_positions, cfg.dropout, learned)
        self.tgt_pos = PositionalEncoding(cfg.d_model, cfg.max_positions, cfg.dropout, learned)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-norm leaves the residual stream un-normalised, so each stack ends with a LayerNorm.
        pre = cfg.norm_position == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.output_proj = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_output:
            self.output_proj.weight = self.tgt_embed.embedding.weight

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name and "pos.table" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        # Fused self-attention Q|K|V: initialised as the separate Q (D×D) and K|V (2D×D) matrices were.
        for module in self.modules():
            if isinstance(module, MultiHeadAttention) and module.self_attention:
                q, kv = module.qkv_proj.weight.detach().split([self.cfg.d_model, 2 * self.cfg.d_model])
                nn.init.xavier_uniform_(q)
                nn.init.xavier_uniform_(kv)
        # Embeddings ~ N(0, D^-1/2) so that after the sqrt(D) scaling they have unit variance.
        for emb in {id(m): m for m in (self.src_embed, self.tgt_embed)}.values():
            nn.init.normal_(emb.embedding.weight, 0.0, self.cfg.d_model**-0.5)
            with torch.no_grad():
                emb.embedding.weight[self.cfg.pad_id].zero_()

    def num_parameters(self, trainable_only: bool = True) -> int:
        """Distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # -- training / full forward

    def encode(self, src: torch.Tensor, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids → memory (B, S, D) and source padding mask (B, 1, 1, S)."""
        src_mask = padding_mask(src, self.cfg.pad_id)
        x = self.src_pos(self.src_embed(src))
        for layer in self.encoder_layers:
            x = layer(x, src_mask, need_weights=need_weights)
        return self.encoder_norm(x), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               need_weights: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced decoder: (B, T) ids → logits (B, T, V), or (N, V) for the flat
        positions `rows` of B·T only (training skips the vocabulary projection of padding)."""
        # With right padding, a real position never sees a pad key through the causal mask
        # (pads only follow it), so causal alone equals causal + padding for every real
        # position; SDPA's is_causal path then skips the masked half of the work.
        self_mask = decoder_self_attention_mask(tgt_in, self.cfg.pad_id) if need_weights else CAUSAL
        x = self.tgt_pos(self.tgt_embed(tgt_in))
        for layer in self.decoder_layers:
            x = layer(x, memory, self_mask, src_mask, need_weights=need_weights)
        x = self.decoder_norm(x)
        if rows is not None:
            x = x.reshape(-1, x.size(-1)).index_select(0, rows)  # (N, D)
        return self.output_proj(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask, rows=rows)

    def encoder_attention_weights(self) -> list[torch.Tensor | None]:
        """Per encoder layer (B, H, S, S) self-attention weights of the last `encode(..., need_weights=True)`."""
        return [layer.last_self_weights for layer in self.encoder_layers]

    def cross_attention_weights(self) -> list[torch.Tensor | None]:
        """Per decoder layer (B, H, T, S) weights of the last `decode(..., need_weights=True)`."""
        return [layer.last_cross_weights for layer in self.decoder_layers]

    # -- incremental inference

    def init_state(self, memory: torch.Tensor, src_mask: torch.Tensor, beams: int = 1,
                   max_len: int = 32) -> DecoderState:
        """Precompute each layer's cross-attention K/V once per sentence; self-attention caches
        start empty with `beams` rows per sentence (row = sentence * beams + beam) and room for
        `max_len` steps (more if decoding goes on)."""
        dtype = decoding_cache_dtype(memory, beams)
        rows, d_head = memory.size(0) * beams, self.cfg.d_model // self.cfg.n_heads
        bf16_cpu_beams = beams > 1 and memory.device.type == "cpu" and dtype == torch.bfloat16 and not self.training
        layers = []
        for layer in self.decoder_layers:
            cross = layer.cross_attn.project_kv(memory)
            # Contiguous: as strided views of the fused K|V projection, every step's matmuls would
            # copy them again (as costly as the attention itself at one query per row).
            cross = AttentionCache(*(t.to(dtype, copy=True, memory_format=torch.contiguous_format)  # one copy
                                     for t in (cross.key, cross.value)))
            # bf16 only: in fp32 the per-row matmuls are fast and the grouped ones are not (−3%).
            if bf16_cpu_beams:
                cache = BeamKVCache.empty(memory.size(0), beams, self.cfg.n_heads, d_head, memory, dtype)
            else:
                cache = KVCache.empty(rows, self.cfg.n_heads, d_head, max_len, memory, dtype)
            layers.append(LayerState(cache, cross))
        # Additive (0 / −inf), made once: every step then adds it to its fp32 scores in place (bf16
        # scores take it in the one fp32 pass they need anyway) instead of inverting a boolean mask
        # and filling a copy of the scores, per layer and step.
        src_mask = torch.zeros(src_mask.shape, device=src_mask.device).masked_fill_(~src_mask, float("-inf"))
        return DecoderState(layers, src_mask)

    def decode_step(self, tokens: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Next-token logits for the last tokens (B,) given the cached prefix → (B, V); inference
        (no dropout), one new position per row through each layer's `step`.

        The new token attends to every cached position (no mask needed: the prefix has no
        padding and nothing lies in its future), except, with continuous batching, the positions
        cached before its row's sentence joined (`state.self_mask`); `state` is extended in place.
        """
        position = state.length if state.positions is None else state.positions
        x = self.tgt_pos.step(self.tgt_embed(tokens), position)  # (B, D)
        self_mask = state.self_attention_mask()
        for layer, layer_state in zip(self.decoder_layers, state.layers):
            x = layer.step(x, layer_state, state.src_mask, self_mask)
        state.length += 1
        if state.positions is not None:
            state.positions += 1
        return self.output_proj(self.decoder_norm(x))
