"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), one file, top to bottom.

Each component is a module named as in the paper. Each layer has `forward` (whole sequences:
training, teacher forcing) and, beside it, `forward_incremental` (one new position per row at
inference, with cached keys/values); tests hold the two to the same numbers. How attention is
computed on each device lives in model/kernels.py, the decoding caches in model/decoder_state.py.

Shapes: B batch, S source length, T target length, H heads, D d_model, Dh = D / H, V vocab.
Masks are boolean with True = "may attend", the convention of F.scaled_dot_product_attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .decoder_state import AttentionCache, BeamKVCache, DecoderState, KVCache, LayerState, initial_decoder_state
from .kernels import Dropout, attend, causal_mask
from .shape import Shape


@dataclass(frozen=True, kw_only=True)
class TransformerConfig(Shape):
    src_vocab_size: int
    tgt_vocab_size: int
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float | None = None  # on the FFN's hidden activations; None: `dropout`
    activation: str = "relu"  # relu | gelu | swish
    norm_position: str = "post"  # post (paper) | pre
    # sinusoidal (paper: sin/cos interleaved) | sinusoidal_split (sin half, then cos half: Marian) | learned
    positional: str = "sinusoidal"
    max_positions: int = 1024
    share_embeddings: bool = True
    tie_output: bool = True
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias)
    pad_id: int = 0


# --------------------------------------------------------------------------- masks


CAUSAL = "causal"  # mask argument meaning "position t attends to positions ≤ t" (SDPA is_causal)


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) ids → (B, 1, 1, L): True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def decoder_self_attention_mask(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, T, T): causal AND key is not padding."""
    return causal_mask(tgt_in.size(1), tgt_in.device) & padding_mask(tgt_in, pad_id)


# --------------------------------------------------------------------------- components


class TokenEmbedding(nn.Module):
    """Embedding lookup scaled by sqrt(d_model) (paper §3.4)."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, L) → (B, L, D)
        return self.embedding(tokens) * self.scale


def sinusoidal_table(max_positions: int, d_model: int, split: bool = False) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)). (L, D)
    `split`: the same values with every sin first and every cos after them (Marian's layout)."""
    position = torch.arange(max_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    sin, cos = torch.sin(position * inv_freq), torch.cos(position * inv_freq[: d_model // 2])
    if split:
        return torch.cat([sin, cos], dim=1).float()
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = sin, cos
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds position information (sinusoidal table or learned embedding), then dropout."""

    def __init__(self, d_model: int, max_positions: int, dropout: float, kind: str = "sinusoidal"):
        super().__init__()
        self.learned = kind == "learned"
        if self.learned:
            self.table = nn.Parameter(torch.randn(max_positions, d_model) * d_model**-0.5)
        else:
            table = sinusoidal_table(max_positions, d_model, split=kind == "sinusoidal_split")
            self.register_buffer("table", table, persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:  # (B, L, D)
        length = x.size(1)
        self._check_positions(offset + length)
        return self.dropout(x + self.table[offset : offset + length])

    def forward_incremental(self, x: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """forward at inference for one position of every row, in place: x (B, D) → x + PE(position);
        `position` is one for all rows, or (B,) one per row (continuous batching)."""
        if isinstance(position, int):
            self._check_positions(position + 1)
            return x.add_(self.table[position])
        return x.add_(self.table.index_select(0, position))  # (an index past the table raises)

    def _check_positions(self, count: int) -> None:
        if count > self.table.size(0):
            raise ValueError(f"sequence of {count} positions exceeds max_positions={self.table.size(0)}")


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
        self.queries_prescaled = False  # the query projection already holds 1/√Dh (cpu_inference)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D) → (B, H, L, Dh)
        return x.view(x.size(0), x.size(1), self.n_heads, self.d_head).transpose(1, 2)

    def project_kv(self, memory: torch.Tensor) -> AttentionCache:
        """Keys and values of `memory` (B, L, D), e.g. the encoder output, computed once."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return AttentionCache(self._split_heads(k), self._split_heads(v))

    def forward(
        self,
        query: torch.Tensor,  # (B, Tq, D)
        key_value: torch.Tensor,  # (B, Tk, D); unused by self-attention
        mask: torch.Tensor | str | None,  # broadcastable to (B, H, Tq, Tk), True = attend; or CAUSAL
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole sequences (training, teacher forcing, attention maps); incremental decoding uses
        `forward_incremental`."""
        if self.self_attention:  # key_value is query itself
            q, k, v = (self._split_heads(t) for t in self.qkv_proj(query).chunk(3, dim=-1))  # (B, H, T, Dh)
        else:
            q = self._split_heads(self.q_proj(query))  # (B, H, Tq, Dh)
            kv = self.project_kv(key_value)
            k, v = kv.key, kv.value
        is_causal = isinstance(mask, str)  # CAUSAL: the kernel builds the mask itself
        out, weights = attend(q, k, v, None if is_causal else mask, is_causal=is_causal,
                              dropout=self.dropout if self.training else 0.0, training=self.training,
                              need_weights=need_weights, prescaled=self.queries_prescaled)
        out = out.transpose(1, 2).reshape(query.size(0), query.size(1), -1)  # (B, Tq, D)
        return self.out_proj(out), weights

    def forward_incremental(self, x: torch.Tensor, mask: torch.Tensor | None,
                            cache: KVCache | BeamKVCache | None = None,
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
        out, _ = attend(q, k, v, mask, prescaled=self.queries_prescaled)  # (B, H, 1, Dh): one query per row
        return self.out_proj(out.reshape(rows, -1))  # heads concatenated, as in forward


class Dropouts(Protocol):  # TransformerConfig, or the config file's model section (config.ModelConfig)
    dropout: float
    activation_dropout: float | None


def ffn_dropout(cfg: Dropouts) -> float:
    """Dropout inside the FFN, on act(W1 x + b1): `activation_dropout`, else `dropout`."""
    return cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = W2 · act(W1 x + b1) + b2, applied to every position."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu"):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D)
        return self.w2(self.dropout(self.activation(self.w1(x))))

    def forward_incremental(self, x: torch.Tensor) -> torch.Tensor:  # forward at inference (no dropout)
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

    def forward_incremental(self, x: torch.Tensor, sublayer) -> torch.Tensor:
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
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, ffn_dropout(cfg), cfg.activation)
        self.attn_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.ffn_add_norm = AddNorm(cfg.d_model, cfg.dropout, pre)
        self.last_self_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor, need_weights: bool = False) -> torch.Tensor:
        def self_attention(h: torch.Tensor) -> torch.Tensor:  # (B, S, D)
            out, weights = self.self_attn(h, h, src_mask, need_weights=need_weights)
            self.last_self_weights = weights
            return out

        x = self.attn_add_norm(x, self_attention)
        return self.ffn_add_norm(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        pre = cfg.norm_position == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, self_attention=True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, ffn_dropout(cfg), cfg.activation)
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

    def forward_incremental(self, x: torch.Tensor, state: LayerState, src_mask: torch.Tensor,
                            self_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding step at inference: x (B, D), the newest position of each row → (B, D).
        `self_mask` (B, 1, 1, t) additive, where rows do not attend to every cached position."""
        x = self.self_add_norm.forward_incremental(
            x, lambda h: self.self_attn.forward_incremental(h, self_mask, cache=state.self_attn))
        x = self.cross_add_norm.forward_incremental(
            x, lambda h: self.cross_attn.forward_incremental(h, src_mask, static_kv=state.cross_attn))
        return self.ffn_add_norm.forward_incremental(x, self.ffn.forward_incremental)


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
        self.src_pos = PositionalEncoding(cfg.d_model, cfg.max_positions, cfg.dropout, cfg.positional)
        self.tgt_pos = PositionalEncoding(cfg.d_model, cfg.max_positions, cfg.dropout, cfg.positional)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-norm leaves the residual stream un-normalised, so each stack ends with a LayerNorm.
        pre = cfg.norm_position == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.output_proj = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
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
               need_weights: bool = False, rows: torch.Tensor | None = None, project: bool = True) -> torch.Tensor:
        """Teacher-forced decoder: (B, T) ids → logits (B, T, V), or (N, V) for the flat
        positions `rows` of B·T only (training skips the vocabulary projection of padding).
        `project=False` stops before the vocabulary projection: the states (…, D) that the
        training loss projects itself, a chunk at a time (training/loss.py)."""
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
        return self.output_proj(x) if project else x

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, rows: torch.Tensor | None = None,
                project: bool = True) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask, rows=rows, project=project)

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
        cross_attention = (layer.cross_attn.project_kv(memory) for layer in self.decoder_layers)
        return initial_decoder_state(memory, src_mask, cross_attention, self.cfg.n_heads, beams, max_len,
                                     self.training)

    def decode_step(self, tokens: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Next-token logits for the last tokens (B,) given the cached prefix → (B, V); inference
        (no dropout), one new position per row through each layer's `forward_incremental`.

        The new token attends to every cached position (no mask needed: the prefix has no
        padding and nothing lies in its future), except, with continuous batching, the positions
        cached before its row's sentence joined (`state.self_mask`); `state` is extended in place.
        """
        position = state.length if state.positions is None else state.positions
        x = self.tgt_pos.forward_incremental(self.tgt_embed(tokens), position)  # (B, D)
        self_mask = state.self_attention_mask()
        for layer, layer_state in zip(self.decoder_layers, state.layers):
            x = layer.forward_incremental(x, layer_state, state.src_mask, self_mask)
        state.length += 1
        if state.positions is not None:
            state.positions += 1
        return self.output_proj(self.decoder_norm(x))
