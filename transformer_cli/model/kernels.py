"""How attention and dropout are computed: one `attend()` that picks the kernel, and a CPU dropout.

model/transformer.py says *what* the Transformer computes; this module says *how*, per device and dtype.
Every kernel computes softmax(q kᵀ / √Dh) v with the softmax in fp32; the tests hold each one
to F.scaled_dot_product_attention. Why each exists, with measurements: docs/performance.md.

Shapes: B batch, H heads, Tq queries, Tk keys, Dh = d_model / H. Boolean masks: True = attend.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn


def causal_mask(length: int, device: torch.device | None = None) -> torch.Tensor:
    """(1, 1, T, T): position t may attend to positions ≤ t."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def keep_compiled_kernels_per_isa_cap() -> None:
    """Before torch.compile: a process whose kernels are capped to a lower instruction set
    (`ATEN_CPU_CAPABILITY`, as on a CPU of a lower class) keeps inductor's on-disk kernels in a folder
    of its own. With one folder for both, a kernel built in a capped run and loaded in an uncapped
    one (or the other way round) computed wrong values or freed memory twice (torch 2.13, a Zen 4:
    the compiled output loss 1,503 where eager gave 1,176). A `TORCHINDUCTOR_CACHE_DIR` the user
    set is left alone."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not cap or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    except ImportError:  # another torch: a folder of tfm's in the temporary one
        import tempfile

        base = os.path.join(tempfile.gettempdir(), "torchinductor_tfm")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"aten-{cap}")


def compile_for_training(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """`train.compile: true`: each encoder and decoder layer through torch.compile, in place
    ("regional compilation"), with dynamic shapes from the start; returns `model` (DDP's wrapper
    or the Transformer), whose parameter names and checkpoints stay as they are.

    The layers of a stack run the same code on their own weights, so dynamo captures one graph per
    layer kind, not one per layer: a 6+6-layer model compiles an encoder layer and a decoder layer
    (on a 2-core CPU, 3+3 layers of d_model 256: 19 s against 33 s for the whole model; whole-model
    graphs grow with depth). Training batches never share one shape; torch.compile's default
    would first specialise on the first batch's shapes and compile again, dynamic, at the second.
    The model remembers the backend (`compile_backend`): loss.batch_loss compiles the chunked
    output loss's chunks with it, fused instead of one elementwise step at a time through memory.
    The embeddings and the final norms stay eager."""
    keep_compiled_kernels_per_isa_cap()
    transformer = getattr(model, "module", model)  # inside DDP's wrapper
    for layer in (*transformer.encoder_layers, *transformer.decoder_layers):
        layer.compile(dynamic=True, backend=backend)
    transformer.compile_backend = backend
    return model


def leave_out_cudnn_attention(leave_out: bool = True) -> None:
    """On CUDA, let F.scaled_dot_product_attention choose among flash, memory-efficient and math
    attention only (process-wide; `leave_out=False` restores torch's default).

    Recent torch builds try cuDNN's attention first on Hopper GPUs. cuDNN builds (and autotunes)
    an execution graph for every new (B, H, Tq, Tk) and mask kind, hundreds of milliseconds each,
    and its per-call host cost is higher. Translation batches come in dozens of shapes (Multi30k
    at 8k tokens: ~50 per run, x 3 attention kinds x forward and backward): on an H200 the first
    pass over new batch shapes ran at 1/15 of the speed with cuDNN than without it, and a 150 s run
    spent its first 35 s at a seventh of its later speed (`scripts/bench_train.py
    --cudnn-attention` times the first pass both ways).
    Flash attention takes decoder self-attention (`is_causal`), the memory-efficient kernel a
    key-padding mask; neither builds anything per shape.
    """
    torch.backends.cuda.enable_cudnn_sdp(not leave_out)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
           is_causal: bool = False, dropout: float = 0.0, training: bool = False, need_weights: bool = False,
           prescaled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention → (output (B, H, Tq, Dh), weights (B, H, Tq, Tk) or None).

    q (B, H, Tq, Dh), k/v (B, H, Tk, Dh); mask broadcastable to (B, H, Tq, Tk) or None;
    `is_causal`: query t attends to keys ≤ t; `prescaled`: q is already q / √Dh (see
    cpu_inference.fold_query_scale). The kernel:
    - `need_weights` (attention maps): an explicit softmax, whose weights are returned;
    - one query per row at inference (incremental decoding): `single_query_attention`;
    - bf16 training on CPU: `matmul_attention` (torch's fused kernel is slow in bf16 there);
    - bf16 inference with several queries on CPU: the fused kernel in fp32, for the same reason;
    - everything else: F.scaled_dot_product_attention.
    """
    if need_weights:
        mask = causal_mask(q.size(2), q.device) if is_causal else mask
        scores = q @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
        if not prescaled:
            scores = scores / math.sqrt(q.size(-1))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        return F.dropout(weights, dropout, training) @ v, weights
    on_cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    if q.size(2) == 1 and not training:
        return single_query_attention(q, k, v, mask, prescaled), None
    if on_cpu_bf16 and training:
        return matmul_attention(q, k, v, mask, is_causal, dropout, prescaled), None
    scale = 1.0 if prescaled else None  # None: SDPA's own 1/√Dh
    if on_cpu_bf16:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout,
                                                 is_causal=is_causal, scale=scale)
        return out.to(q.dtype), None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale), None


def attention_softmax(scores: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim of attention scores; may overwrite `scores` (if fp32).

    torch's CPU softmax vectorises along the last dim only from 16 elements up and calls a scalar
    exp per element below; decoding attends over fewer than 16 keys all the time, so there it is
    written as four whole-tensor ops, which win from ~500 scores up.
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
    torch's fused CPU kernel works in blocks of queries and costs more with a single one; the
    matmuls are torch.bmm over (B/G · H) blocks, so k and v (also a cache's prefix, sliced from its
    buffer) fold their first two dims without a copy.
    """
    rows, heads, _, d_head = q.shape
    sentences, keys = k.size(0), k.size(2)
    groups = rows // sentences
    out_dtype = q.dtype
    if q.dtype != k.dtype:  # (a same-dtype .to is still a dispatched op)
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
    For bf16 training on CPU, where the fused kernel is slow in bf16 and running it in fp32 costs
    the casts of q, k, v and of the output, forward and backward.
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


class Dropout(nn.Module):
    """nn.Dropout, with a cheaper random mask on CPU.

    On CPU torch draws one 32-bit random number per element from a single-threaded generator (a
    large part of a training step); here one 64-bit number serves eight elements, each byte
    compared with p. So p is resolved to 1/256 (0.1 → 26/256 = 0.1016, 0.3 → 77/256 = 0.3008) and
    kept values are scaled by 1 / (1 − that p): the output's expectation is exactly the input.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        # Under torch.compile the compiler draws and fuses the mask itself (and cannot trace random_).
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return F.dropout(x, self.p, True)
        n = x.numel()
        dropped = min(round(self.p * 256), 255)  # of 256 byte values, this many drop the element
        # The whole int64 range: random_() without bounds leaves the top bit 0 (values < 2^63),
        # which would make every eighth byte < 128.
        bits = torch.empty((n + 7) // 8, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        # keep = byte ≥ dropped, written as 0/1 in x's dtype by the comparison itself: a bool mask
        # would cost a cast, or a promotion inside every multiply, forward and backward.
        keep = torch.ge(bits.view(torch.uint8)[:n].view(x.shape), dropped, out=torch.empty_like(x))
        scale = 256.0 / (256 - dropped)
        if x.dtype == torch.float32:  # the scale into the mask: one multiply each way, same values
            return x * keep.mul_(scale)
        return x * keep * scale  # bf16 (fp16): a mask in x's dtype would round the scale; x · scale rounds once
