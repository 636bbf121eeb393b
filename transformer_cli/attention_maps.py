"""`tfm attention`: the model's own attention weights (its `need_weights` path) as heatmaps.

Encoder–decoder attention is read by teacher-forcing the target through the decoder: either the
model's own greedy translation or a target the user gives. `--self` shows encoder self-attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data.batches import pad_batch
from .decoding.search import greedy_search
from .decoding.translation import warn_long_lines
from .experiment.checkpoint import TrainedModel
from .model.lengths import source_token_limit
from .model.special_tokens import BOS_ID, EOS_ID
from .model.transformer import Transformer
from .runtime.errors import TfmError


@torch.inference_mode()
def attention_weights(model: Transformer, src: torch.Tensor, tgt: torch.Tensor | None = None,
                      encoder_self: bool = False) -> torch.Tensor:
    """Attention probabilities of every layer and head, straight from the model's `need_weights` path.

    src: (B, S) source ids ending in <eos>, right-padded. tgt: (B, T) target ids without <bos>,
    ending in <eos>, right-padded (needed unless `encoder_self`).
    Returns (layers, B, H, T, S) encoder–decoder weights: row t is where the decoder looks while
    predicting tgt[:, t]; or with `encoder_self` (layers, B, H, S, S). Padded keys get weight 0.
    """
    was_training = model.training
    model.eval()  # no dropout on the weights
    try:
        memory, src_mask = model.encode(src, need_weights=encoder_self)
        if encoder_self:
            layers = model.encoder_attention_weights()
        else:
            if tgt is None:
                raise ValueError("encoder-decoder attention needs a target")
            bos = torch.full((tgt.size(0), 1), BOS_ID, dtype=torch.long, device=tgt.device)
            tgt_in = torch.cat([bos, tgt[:, :-1]], dim=1)  # (B, T): <bos> y1 … y_{T-1}
            model.decode(tgt_in, memory, src_mask, need_weights=True)
            layers = model.cross_attention_weights()
    finally:
        model.train(was_training)
    return torch.stack([w.float() for w in layers])  # type: ignore[union-attr]


@dataclass
class AttentionMaps:
    """What `tfm attention` draws: weights (layers, H, rows, S) with their axis labels."""

    weights: np.ndarray  # (L, H, rows, S); rows = target positions, or source positions with encoder_self
    src_tokens: list[str]  # x axis: source subwords + "</s>"
    row_tokens: list[str]  # y axis: target subwords + "</s>" (or the source again with encoder_self)
    encoder_self: bool
    translation: str  # the target that was teacher-forced, as text

    def layer_average(self) -> np.ndarray:
        """(L, rows, S) head average of every layer."""
        return self.weights.mean(axis=1)


def attention_maps(trained: TrainedModel, src: str, tgt: str | None = None,
                   encoder_self: bool = False) -> AttentionMaps:
    """The maps `tfm attention` draws for one sentence: encoder–decoder attention while the model
    translates it (its own greedy translation, or `tgt` teacher-forced), or encoder self-attention.
    A source longer than the model's positions is cut, with a warning."""
    if not src.strip():
        raise TfmError("--src is empty: give a sentence to translate")
    if tgt is not None and encoder_self:
        raise TfmError("--tgt has no effect with --self (encoder self-attention sees only the source): "
                       "leave one of them out")
    if tgt is not None and not tgt.strip():
        raise TfmError("--tgt is empty: leave it out to use the model's own translation")
    model, decode = trained.model.float().eval(), trained.config.decode
    keep = source_token_limit(model.cfg.max_positions)  # the target too: <bos> or </s> takes a position
    src_ids = trained.src_sp.encode(src, out_type=int)
    warn_long_lines([0], [src_ids], keep, 1)
    src_ids = src_ids[:keep] + [EOS_ID]
    src_tokens = [trained.src_sp.id_to_piece(i) for i in src_ids[:-1]] + ["</s>"]
    src_batch = pad_batch([src_ids])
    if encoder_self:
        weights = attention_weights(model, src_batch, encoder_self=True)
        return AttentionMaps(weights[:, 0].numpy(), src_tokens, src_tokens, True, "")
    if tgt is None:
        # The model's own translation: greedy, as the weights then show what it attended to
        # while choosing each token.
        tgt_ids = greedy_search(model, src_batch, BOS_ID, EOS_ID, decode.max_len_a, decode.max_len_b)[0].tokens
    else:
        tgt_ids = trained.tgt_sp.encode(tgt, out_type=int)
    tgt_ids = tgt_ids[:keep] + [EOS_ID]
    row_tokens = [trained.tgt_sp.id_to_piece(i) for i in tgt_ids[:-1]] + ["</s>"]
    weights = attention_weights(model, src_batch, pad_batch([tgt_ids]))
    return AttentionMaps(weights[:, 0].numpy(), src_tokens, row_tokens, False, trained.tgt_sp.decode(tgt_ids[:-1]))


def check_layer(layer: int | None, n_layers: int, what: str) -> int:
    """1-based `--layer` (default: the last) → 0-based index, or a TfmError."""
    if layer is None:
        return n_layers - 1
    if not 1 <= layer <= n_layers:
        raise TfmError(f"--layer {layer}: the {what} has {n_layers} layers (choose 1 to {n_layers})")
    return layer - 1


MAX_PIXELS = 6_000  # per side of the picture: a long sentence gets smaller cells and fewer labels


def plot_attention(maps: AttentionMaps, layer: int | None, output: Path, dpi: int = 100) -> Path:
    """One heatmap per head of `layer` (1-based, default last) on the first row, the head average
    of every layer on the second; columns = source subwords, rows = target subwords. The format is
    the one `output`'s suffix names (PNG, SVG, PDF, …)."""
    from .plot import figure_format, import_pyplot, save_figure

    figure_format(output)  # before drawing
    n_layers, n_heads = maps.weights.shape[:2]
    index = check_layer(layer, n_layers, "encoder" if maps.encoder_self else "decoder")
    plt = import_pyplot()
    n_cols = max(n_heads, n_layers)
    n_rows_tok, n_src = len(maps.row_tokens), len(maps.src_tokens)
    # Cell size grows with the sentence so that every subword label stays readable, up to a bound
    # on the picture's size; past it, cells shrink and only every k-th subword is labelled.
    cell_w = min(max(2.2, 0.28 * n_src + 1.0), MAX_PIXELS / dpi / n_cols)
    cell_h = min(max(2.0, 0.28 * n_rows_tok + 1.0), (MAX_PIXELS / dpi - 0.6) / 2)
    x_every = max(1, math.ceil(0.28 * n_src / max(cell_w - 1.0, 0.28)))
    y_every = max(1, math.ceil(0.28 * n_rows_tok / max(cell_h - 1.0, 0.28)))
    fig, axes = plt.subplots(2, n_cols, figsize=(cell_w * n_cols, cell_h * 2 + 0.6), dpi=dpi,
                             layout="constrained", squeeze=False)
    panels = [(axes[0, h], maps.weights[index, h], f"layer {index + 1}, head {h + 1}") for h in range(n_heads)]
    panels += [(axes[1, i], avg, f"layer {i + 1}, head average") for i, avg in enumerate(maps.layer_average())]
    used = {id(ax) for ax, _, _ in panels}
    for ax in axes.flat:
        if id(ax) not in used:
            ax.axis("off")
    image = None
    for ax, grid, title in panels:
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(title, fontsize="small")
        ax.set_xticks(range(0, n_src, x_every), maps.src_tokens[::x_every], rotation=90, fontsize="x-small")
        ax.set_yticks(range(0, n_rows_tok, y_every), maps.row_tokens[::y_every], fontsize="x-small")
    kind = "encoder self-attention" if maps.encoder_self else "encoder–decoder attention"
    title = "".join(maps.src_tokens[:-1]).replace("▁", " ").strip()
    title = title if len(title) <= 200 else title[:200] + " …"
    fig.suptitle(f"{kind}: {title}" + (f" → {maps.translation[:200]}" if maps.translation else ""), fontsize="small")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    save_figure(fig, output, dpi)
    plt.close(fig)
    return output
