"""The training objective: label-smoothed cross-entropy over the real (non-pad) target tokens,
with teacher forcing (the decoder reads the reference shifted right)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from ..data.batches import Batch
from ..model.kernels import keep_compiled_kernels_per_isa_cap
from ..model.special_tokens import PAD_ID

# The output projection and the loss run over this many bytes of fp32 log-probabilities at a time
# (1,048 rows for an 8k vocabulary), so their memory stays bounded whatever the batch and the
# vocabulary: whole-batch logits, log-probabilities and gradients of 4,096 tokens × a 32k
# vocabulary would be 0.5 GB each. Same speed as whole-batch on CPU (docs/performance.md).
LOSS_CHUNK_BYTES = 32 * 2**20
# On a GPU each chunk is a handful of kernel launches, and at a 32k vocabulary 32 MB is 262 rows:
# a 16k-token batch would take 60 chunks of small kernels. A GPU has the memory for fewer, bigger
# ones (4,096 rows at a 32k vocabulary), which keep its units busy.
LOSS_CHUNK_BYTES_CUDA = 512 * 2**20


def loss_chunk_rows(vocab_size: int, device_type: str = "cpu") -> int:
    chunk = LOSS_CHUNK_BYTES_CUDA if device_type == "cuda" else LOSS_CHUNK_BYTES
    return max(64, chunk // (4 * vocab_size))


# One chunk's loss: (logits (C, V), bias (V,) | None, targets (C, 1), ε, with_grad) →
# (summed smoothed loss, summed NLL, ∂loss/∂logits in the logits' dtype | None, its column sums | None)
ChunkLoss = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float, bool],
                     "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]"]


def smoothed_chunk_loss(logits: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, smoothing: float,
                        with_grad: bool, in_place: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk of label-smoothed cross-entropy. The gradient with respect to the logits is
    softmax − (1 − ε)·onehot − ε/V: eagerly built in place (`in_place`), so that one fp32 (C, V)
    tensor is all the memory it takes; for torch.compile (`fused_chunk_loss`) built out of place,
    the one-hot term a comparison, which it fuses into the kernels that read the logits."""
    vocab = logits.size(1)
    if bias is not None:
        logits = logits + bias
    fp32 = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    log_probs = F.log_softmax(logits.to(fp32), dim=-1)  # (C, V), fp32 over the vocabulary
    gold = log_probs.gather(1, target)  # (C, 1)
    gold_sum = gold.sum()
    loss = -((1.0 - smoothing) * gold_sum + smoothing * log_probs.sum() / vocab)
    if not with_grad:
        return loss, -gold_sum, None, None
    if in_place:
        grad = log_probs.exp_().sub_(smoothing / vocab)  # softmax − ε/V, in place
        grad.scatter_add_(1, target, torch.full_like(gold, -(1.0 - smoothing)))
    else:
        is_gold = torch.arange(vocab, device=logits.device) == target  # (C, V), broadcast
        grad = log_probs.exp() - smoothing / vocab - (1.0 - smoothing) * is_gold
    return loss, -gold_sum, grad.to(logits.dtype), None if bias is None else grad.sum(0)


def fused_chunk_loss(logits: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, smoothing: float,
                     with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`smoothed_chunk_loss` out of place, for torch.compile: compiled, it reads the logits and
    writes their gradient with no fp32 (C, V) tensor in between. Eagerly the chunk's values go
    through memory ~10 times (cast, softmax, sums, exp, subtract, cast back): ~6 GB per 4,096-row
    chunk of a 32k vocabulary, which on a GPU is what such elementwise steps cost
    (docs/performance.md). Eagerly this version takes more memory than the in-place one."""
    return smoothed_chunk_loss(logits, bias, target, smoothing, with_grad, in_place=False)


@functools.cache
def compiled_chunk_loss(backend: str = "inductor") -> ChunkLoss:
    """`fused_chunk_loss` through torch.compile (`train.compile: true`), dynamic in the chunk's rows
    from the start: the last chunk of each batch has its own number of them."""
    keep_compiled_kernels_per_isa_cap()
    return cast(ChunkLoss, torch.compile(fused_chunk_loss, dynamic=True, backend=backend))


class OutputLayerLoss(torch.autograd.Function):
    """Output projection + summed label-smoothed cross-entropy, a fixed number of rows at a time.

    The loss is a sum, so its gradient is known up to one scalar while the forward runs: each
    chunk's gradient with respect to its logits, softmax − (1 − ε)·onehot − ε/V, is turned into
    gradients of the hidden states, the weight and the bias at once, and backward only scales
    them. No (tokens × vocabulary) tensor ever exists beyond one chunk, and autograd keeps none.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, smoothing: float, compute_dtype: torch.dtype, chunk_rows: int,
                with_grad: bool, chunk_loss: ChunkLoss):  # (N, D), (V, D), (V,) | None, (N,)
        w, h = weight.to(compute_dtype), hidden.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        fp32 = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        loss = torch.zeros((), dtype=fp32, device=hidden.device)
        nll = torch.zeros((), dtype=fp32, device=hidden.device)
        if with_grad:
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=fp32, device=weight.device)
            grad_bias = None if bias is None else torch.zeros(weight.size(0), dtype=fp32, device=bias.device)
        for start in range(0, h.size(0), chunk_rows):
            h_chunk, t_chunk = h[start:start + chunk_rows], target[start:start + chunk_rows, None]
            chunk, chunk_nll, grad, column_sums = chunk_loss(h_chunk @ w.t(), b, t_chunk, smoothing, with_grad)
            loss += chunk
            nll += chunk_nll
            if grad is not None:  # (C, V), compute_dtype
                if column_sums is not None:
                    grad_bias += column_sums
                grad_hidden[start:start + chunk_rows] = grad @ w  # (C, D)
                grad_weight += (grad.t() @ h_chunk).to(fp32)  # (V, D)
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype),
                                  None if grad_bias is None else grad_bias.to(bias.dtype))
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll: torch.Tensor | None):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_loss.to(g.dtype)  # noqa: E731
        return scale(grad_hidden), scale(grad_weight), scale(grad_bias), None, None, None, None, None, None


def output_layer_loss(hidden: torch.Tensor, output_proj: torch.nn.Linear, target: torch.Tensor,
                      smoothing: float, chunk_rows: int | None = None,
                      chunk_loss: ChunkLoss = smoothed_chunk_loss) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL of decoder states `hidden` (N, D) whose
    gold tokens are `target` (N,), through the vocabulary projection `output_proj`.

    The smoothed target puts (1 - ε) on the gold token and ε spread uniformly over the whole
    vocabulary: loss = (1 - ε)·(-log p_gold) + ε·mean_v(-log p_v), as torch's cross_entropy.
    Matmuls run in autocast's dtype where autocast is on (as nn.Linear would), the softmax in fp32.
    `chunk_loss`: how each chunk's loss and gradient are computed (eager, or compiled and fused).
    """
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    weight, bias = output_proj.weight, output_proj.bias
    with_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    rows = chunk_rows or loss_chunk_rows(weight.size(0), device)
    with torch.autocast(device, enabled=False):
        return OutputLayerLoss.apply(hidden, weight, bias, target, smoothing, compute_dtype, rows, with_grad,
                                     chunk_loss)


def target_rows(tgt_out: torch.Tensor, pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of real (non-pad) target tokens and those tokens: (N,), (N,)."""
    flat = tgt_out.reshape(-1)
    rows = (flat != pad_id).nonzero().squeeze(1)
    return rows, flat.index_select(0, rows)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformer inside torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def batch_loss(model: torch.nn.Module, batch: Batch, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced summed loss and NLL of a batch, over the positions that have a target; the
    chunks' loss compiled where the model's layers are (`kernels.compile_for_training`)."""
    rows, targets = (batch.rows, batch.targets) if batch.rows is not None else target_rows(batch.tgt_out)
    hidden = model(batch.src, batch.tgt_in, rows, project=False)  # (N, D)
    transformer = unwrapped(model)
    backend = getattr(transformer, "compile_backend", None)
    return output_layer_loss(hidden, transformer.output_proj, targets, smoothing,
                             chunk_loss=smoothed_chunk_loss if backend is None else compiled_chunk_loss(backend))
