"""What incremental decoding carries from step to step: key/value caches and the decoder state.

The model (model/transformer.py) encodes a batch once, then decodes one position per row at a time; each
decoder layer keeps the keys and values of the positions decoded so far (self-attention) and of
the source (cross-attention, computed once per sentence). Beam search reorders rows between steps,
and continuous batching (greedy) lets new sentences take the rows of finished ones: both are
operations on this state, not on the model. Why each cache is laid out as it is: docs/performance.md.

Shapes: B rows (sentences × beams), H heads, t positions decoded, S source length, Dh head size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionCache:
    """Keys/values kept between decoding steps. (B, H, L, Dh) each."""

    key: torch.Tensor
    value: torch.Tensor


class KVCache:
    """Self-attention keys and values of the decoded prefix, (B, H, t, Dh) each, in buffers with
    room for more positions: a step writes its own in place instead of torch.cat copying the whole
    prefix again at every step. A reorder (beam search, rows leaving the batch) copies the prefix
    once, into buffers with room for just the next step: beam search (fp32, or on a GPU) reorders
    before every step, and copying empty room would cost more. When full, the buffers double.
    bf16 beam search on CPU uses BeamKVCache.
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
        return KVCache(self._copy_prefix(self.keys, rows, t + 1), self._copy_prefix(self.values, rows, t + 1), t)

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
    in bf16 cost less than the per-row matmuls plus the per-step copy of every row's prefix.
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


@dataclass
class LayerState:
    """Per decoder layer at inference: growing self-attention cache + fixed cross-attention K/V."""

    self_attn: KVCache | BeamKVCache
    cross_attn: AttentionCache


@dataclass
class DecoderState:
    """Everything incremental decoding carries from step to step."""

    layers: list[LayerState]
    src_mask: torch.Tensor  # (B/G, 1, 1, S) fp32, 0 where the key is a real token, −inf at padding: one row per sentence
    length: int = 0  # target positions decoded so far (cache slots written)
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
        width = max(self.source_width, joining.source_width)
        if self.source_width < width:
            self._pad_sources(width)

        def padded(t: torch.Tensor, value: float) -> torch.Tensor:  # (N, ..., S) → (N, ..., width)
            t = t.index_select(0, sentences)
            return t if t.size(-1) == width else F.pad(t, (0, width - t.size(-1)), value=value)

        for layer, joining_layer in zip(self.layers, joining.layers):
            # keys/values (B, H, S, Dh): pad the source dim (the one before last)
            for have, new in ((layer.cross_attn.key, joining_layer.cross_attn.key),
                              (layer.cross_attn.value, joining_layer.cross_attn.value)):
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
        extra = width - self.source_width
        for layer in self.layers:
            c = layer.cross_attn
            layer.cross_attn = AttentionCache(F.pad(c.key, (0, 0, 0, extra)), F.pad(c.value, (0, 0, 0, extra)))
        self.src_mask = F.pad(self.src_mask, (0, extra), value=float("-inf"))

    @property
    def source_width(self) -> int:
        """Source positions the cross-attention attends over (the widest source among the rows)."""
        return self.src_mask.size(-1)

    def narrow_sources(self, width: int) -> None:
        """Keep the first `width` source positions only (cross-attention keys/values and source mask),
        where every row's source fits: the positions beyond are padding in every row. In place.
        The keys/values are copied, once per narrowing: attending over strided views of the wider
        ones measured no faster than over all of them."""
        for layer in self.layers:
            c = layer.cross_attn
            layer.cross_attn = AttentionCache(c.key[:, :, :width].contiguous(), c.value[:, :, :width].contiguous())
        self.src_mask = self.src_mask[..., :width]

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
            caches = [c.index_select(rows, sentences, checked=True) for c in caches]  # type: ignore[call-arg]
        else:
            caches = [c.index_select(rows, sentences) for c in caches]
        layers = [LayerState(c, s.cross_attn if sentences is None else pick(s.cross_attn, sentences))
                  for c, s in zip(caches, self.layers)]
        src_mask = self.src_mask if sentences is None else self.src_mask.index_select(0, sentences)
        positions = None if self.positions is None else self.positions.index_select(0, rows)
        self_mask = None if self.self_mask is None else self.self_mask.index_select(0, rows)
        return DecoderState(layers, src_mask, self.length, positions=positions, self_mask=self_mask)


def decoding_cache_dtype(memory: torch.Tensor, beams: int) -> torch.dtype:
    """Keys/values cached for greedy decoding on CPU: fp32; otherwise the model's dtype.

    One query per row makes the attention matmuls tiny, and torch's bf16 CPU batched matmul is
    slower than its fp32 one at that size, so greedy decoding with a bf16 model attends over fp32
    caches (its linear layers stay bf16). Beam search keeps the model's dtype: its per-step
    reorders of fp32 caches cost more than the faster matmuls gained, and in bf16 on CPU its
    BeamKVCache no longer copies at all.
    """
    on_cpu = memory.device.type == "cpu" and memory.is_floating_point()
    return torch.float32 if on_cpu and beams == 1 else memory.dtype


def initial_decoder_state(memory: torch.Tensor, src_mask: torch.Tensor, cross_attention: Iterable[AttentionCache],
                          n_heads: int, beams: int, max_len: int, training: bool) -> DecoderState:
    """The state before the first decoding step: per decoder layer its cross-attention keys/values
    (`cross_attention`, one row per sentence) and an empty self-attention cache with `beams` rows per
    sentence (row = sentence * beams + beam) and room for `max_len` steps (more if decoding goes on).
    memory (N, S, D); src_mask (N, 1, 1, S) boolean, True = real token."""
    dtype = decoding_cache_dtype(memory, beams)
    rows, d_head = memory.size(0) * beams, memory.size(-1) // n_heads
    # bf16 only: in fp32 the per-row matmuls are fast and the grouped ones are not.
    bf16_cpu_beams = beams > 1 and memory.device.type == "cpu" and dtype == torch.bfloat16 and not training
    layers = []
    for kv in cross_attention:
        # Contiguous: as strided views of the fused K|V projection, every step's matmuls would
        # copy them again (as costly as the attention itself at one query per row).
        cross = AttentionCache(*(t.to(dtype, copy=True, memory_format=torch.contiguous_format)  # one copy
                                 for t in (kv.key, kv.value)))
        if bf16_cpu_beams:
            cache = BeamKVCache.empty(memory.size(0), beams, n_heads, d_head, memory, dtype)
        else:
            cache = KVCache.empty(rows, n_heads, d_head, max_len, memory, dtype)
        layers.append(LayerState(cache, cross))
    # Additive (0 / −inf), made once: every step adds it to its fp32 scores in place instead of
    # inverting a boolean mask and filling a copy of the scores, per layer and step.
    additive = torch.zeros(src_mask.shape, device=src_mask.device).masked_fill_(~src_mask, float("-inf"))
    return DecoderState(layers, additive)


class SearchState(Protocol):
    """What a search does with a decoder state: a `DecoderState`, or an ensemble's
    (`ensemble.EnsembleState`), which applies each operation to every member's."""

    @property
    def length(self) -> int: ...

    positions: torch.Tensor | None

    @property
    def self_mask(self) -> torch.Tensor | None: ...

    @property
    def source_width(self) -> int: ...

    def admit(self, rows: torch.Tensor, joining: Any, sentences: torch.Tensor) -> None: ...

    def narrow_sources(self, width: int) -> None: ...

    def drop_front(self, slots: int) -> None: ...

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> SearchState: ...


class SearchModel(Protocol):
    """What a search calls: a `model.Transformer`, or an `ensemble.Ensemble` of them."""

    @property
    def cfg(self) -> Any: ...  # pad_id, max_positions

    def encode(self, src: torch.Tensor) -> tuple[Any, torch.Tensor]: ...

    def init_state(self, memory: Any, src_mask: torch.Tensor, beams: int = 1, max_len: int = 32) -> SearchState: ...

    def decode_step(self, tokens: torch.Tensor, state: Any) -> torch.Tensor: ...
