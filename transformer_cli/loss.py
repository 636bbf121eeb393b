"""The training objective: label-smoothed cross-entropy over the real (non-pad) target tokens,
with teacher forcing (the decoder reads the reference shifted right)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batches import Batch
from .special_tokens import PAD_ID

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
                with_grad: bool):  # (N, D), (V, D), (V,) | None, (N,)
        vocab = weight.size(0)
        w, h = weight.to(compute_dtype), hidden.to(compute_dtype)
        fp32 = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        loss = torch.zeros((), dtype=fp32, device=hidden.device)
        nll = torch.zeros((), dtype=fp32, device=hidden.device)
        if with_grad:
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=fp32, device=weight.device)
            grad_bias = None if bias is None else torch.zeros(vocab, dtype=fp32, device=bias.device)
        for start in range(0, h.size(0), chunk_rows):
            h_chunk, t_chunk = h[start:start + chunk_rows], target[start:start + chunk_rows, None]
            logits = h_chunk @ w.t()  # (C, V)
            if bias is not None:
                logits = logits + bias.to(compute_dtype)
            log_probs = F.log_softmax(logits.to(fp32), dim=-1)  # (C, V), fp32 over the vocabulary
            gold = log_probs.gather(1, t_chunk)  # (C, 1)
            gold_sum = gold.sum()
            nll -= gold_sum
            loss -= (1.0 - smoothing) * gold_sum + smoothing * log_probs.sum() / vocab
            if with_grad:
                grad = log_probs.exp_().sub_(smoothing / vocab)  # softmax − ε/V, in place
                grad.scatter_add_(1, t_chunk, torch.full_like(gold, -(1.0 - smoothing)))
                if bias is not None:
                    grad_bias += grad.sum(0)
                grad = grad.to(compute_dtype)
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
        return scale(grad_hidden), scale(grad_weight), scale(grad_bias), None, None, None, None, None


def output_layer_loss(hidden: torch.Tensor, output_proj: torch.nn.Linear, target: torch.Tensor,
                      smoothing: float, chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL of decoder states `hidden` (N, D) whose
    gold tokens are `target` (N,), through the vocabulary projection `output_proj`.

    The smoothed target puts (1 - ε) on the gold token and ε spread uniformly over the whole
    vocabulary: loss = (1 - ε)·(-log p_gold) + ε·mean_v(-log p_v), as torch's cross_entropy.
    Matmuls run in autocast's dtype where autocast is on (as nn.Linear would), the softmax in fp32.
    """
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    weight, bias = output_proj.weight, output_proj.bias
    with_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    rows = chunk_rows or loss_chunk_rows(weight.size(0), device)
    with torch.autocast(device, enabled=False):
        return OutputLayerLoss.apply(hidden, weight, bias, target, smoothing, compute_dtype, rows, with_grad)


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
    """Teacher-forced summed loss and NLL of a batch, over the positions that have a target."""
    rows, targets = (batch.rows, batch.targets) if batch.rows is not None else target_rows(batch.tgt_out)
    hidden = model(batch.src, batch.tgt_in, rows, project=False)  # (N, D)
    return output_layer_loss(hidden, unwrapped(model).output_proj, targets, smoothing)
