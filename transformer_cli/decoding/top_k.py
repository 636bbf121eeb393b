"""The k largest values of each row, faster than torch.topk on CPU for the small k a search takes:
shared by beam search (decoding/search.py) and the constrained beam's candidates (decoding/constraints.py)."""

from __future__ import annotations

import torch


def top_k(scores: torch.Tensor, k: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of `scores` (R, N) and their column indices, largest first:
    torch.topk's result (up to the order of equal values), computed faster on CPU for small k.

    torch.topk (and max with indices) walk each row with scalar code, while amax is vectorised:
    per beam step, topk over all candidates costs as much as decoder layers do. Every one of a row's k largest values lies in a chunk whose maximum is among
    the k largest chunk maxima, so only those k chunks need a real top-k.
    """
    rows, n = scores.shape
    if scores.device.type != "cpu" or n < 8 * k * chunk:
        return scores.topk(k, dim=1)
    pad = -n % chunk
    if pad:  # a ragged end: fill the last chunk with -inf, which never outranks a real value
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    best_chunks = scores.view(rows, -1, chunk).amax(dim=2).topk(k, dim=1).indices  # (R, k) of C chunks
    return top_k_in_chunks(scores, best_chunks, k, chunk)


def top_k_in_chunks(scores: torch.Tensor, best_chunks: torch.Tensor, k: int, chunk: int,
                    added: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the values of each row of `scores` (R, C·chunk) that lie in its chunks
    `best_chunks` (R, k), plus `added` (R, k) per chunk if given → values and columns (R, k)."""
    rows = scores.size(0)
    columns = (best_chunks[:, :, None] * chunk + torch.arange(chunk, device=scores.device)).view(rows, -1)
    values = scores.gather(1, columns)  # (R, k·chunk)
    if added is not None:
        values.add_(added.repeat_interleave(chunk, dim=1))
    values, picked = values.topk(k, dim=1)
    return values, columns.gather(1, picked)
