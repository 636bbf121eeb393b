"""Word alignments from the encoder–decoder attention (Pharaoh format: "i-j", source word i ~
target word j, both 0-based over whitespace-separated words).

After the search, each translation is teacher-forced through the decoder once more, and the
encoder–decoder attention, averaged over heads and decoder layers, links every target subword to
the source subword it attends to most while the decoder predicts it. Which single layer aligns
best depends on the model (Garg et al., 2019 found the penultimate of six; a Multi30k model's
first of three, a reverse-task model's last of two), while the mean over layers measured as good
as the best layer on both, so it is the default; `decode.alignment_layer` picks one layer.
Measured against a statistical aligner: docs/translation.md.
Subwords map to words by sentencepiece's word-start mark; each pair of words linked by a subword
pair is printed once. An ensemble averages its members' attention.
"""

from __future__ import annotations

import torch

from ..data.batches import pad_batch
from ..model.lengths import source_token_limit
from ..model.special_tokens import BOS_ID, EOS_ID
from ..model.transformer import Transformer
from ..runtime.errors import TfmError
from .ensemble import Ensemble
from .hypothesis import Hypothesis

WORD_START = "\u2581"  # sentencepiece's mark for "a new word starts here" (▁)


def word_numbers(pieces: list[str]) -> list[int]:
    """The word (0-based) each sentencepiece piece belongs to: a piece with the word-start mark
    begins the next word, any other continues the current one."""
    numbers, word = [], -1
    for piece in pieces:
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        numbers.append(word)
    return numbers


def decoder_layers(model: Transformer, setting: int | None) -> list[int]:
    """The 0-based decoder layers alignments read: decode.alignment_layer (1-based), else all."""
    layers = model.cfg.dec_layers
    if setting is not None and setting > layers:
        raise TfmError(f"decode.alignment_layer={setting}: the model has {layers} decoder layer(s)")
    return [setting - 1] if setting is not None else list(range(layers))


@torch.inference_mode()
def cross_attention(model: Transformer | Ensemble, src: torch.Tensor, tgt: torch.Tensor,
                    setting: int | None) -> torch.Tensor:
    """src (B, S) ending in <eos>, tgt (B, T) ending in <eos>, both right-padded → (B, T, S) fp32:
    row t is where the chosen layers' heads (mean) look while predicting tgt[:, t]."""
    members = list(model.members) if isinstance(model, Ensemble) else [model]
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS_ID), tgt[:, :-1]], dim=1)  # (B, T)
    total = None
    for member in members:
        memory, src_mask = member.encode(src)
        member.decode(tgt_in, memory, src_mask, need_weights=True, project=False)  # the weights, not the logits
        maps = member.cross_attention_weights()
        weights = torch.stack([maps[i].float().mean(dim=1) for i in decoder_layers(member, setting)]).mean(dim=0)
        total = weights if total is None else total + weights
    return total / len(members)


def pharaoh(weights: torch.Tensor, src_words: list[int], tgt_words: list[int], n_src_words: int,
            n_tgt_words: int) -> str:
    """One sentence: weights (≥ len(tgt_words), ≥ len(src_words)) between subwords → "i-j …" over
    words, each target subword linked to the source subword it attends to most (<eos> and padding
    excluded), word numbers kept within the words of the text."""
    if not tgt_words or not src_words:
        return ""
    best = weights[: len(tgt_words), : len(src_words)].argmax(dim=1).tolist()
    pairs = {(min(src_words[i], n_src_words - 1), min(tgt_words[j], n_tgt_words - 1)) for j, i in enumerate(best)}
    return " ".join(f"{i}-{j}" for i, j in sorted(pairs))


def word_alignments(model: Transformer | Ensemble, lines: list[str], sources: list[list[int]],
                    hyps: list[list[Hypothesis]], src_sp, tgt_sp, decode, device: torch.device) -> list[list[str]]:
    """Per sentence, per hypothesis its Pharaoh alignment; `sources` are the lines' ids (no <eos>),
    cut as the search cut them."""
    limit = source_token_limit(model.cfg.max_positions)  # source tokens the search kept
    # Batches of similar lengths (the longest pairs first): padding costs the forced pass as real tokens do.
    pairs = sorted(((s, h) for s, sentence_hyps in enumerate(hyps) for h in range(len(sentence_hyps))),
                   key=lambda pair: -(min(len(sources[pair[0]]), limit) + len(hyps[pair[0]][pair[1]].tokens)))
    found: dict[tuple[int, int], str] = {}
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(pairs), decode.batch_size):
            batch = pairs[start : start + decode.batch_size]
            src_ids = [sources[s][:limit] for s, _ in batch]
            tgt_ids = [hyps[s][h].tokens for s, h in batch]
            weights = cross_attention(model, pad_batch(src_ids, suffix=EOS_ID).to(device),
                                      pad_batch(tgt_ids, suffix=EOS_ID).to(device), decode.alignment_layer)
            for row, ((s, h), src, tgt) in enumerate(zip(batch, src_ids, tgt_ids)):
                text = tgt_sp.decode(tgt)
                found[s, h] = pharaoh(weights[row].cpu(), word_numbers([src_sp.id_to_piece(t) for t in src]),
                                      word_numbers([tgt_sp.id_to_piece(t) for t in tgt]),
                                      max(len(lines[s].split()), 1), max(len(text.split()), 1))
    finally:
        model.train(was_training)
    return [[found[s, h] for h in range(len(sentence_hyps))] for s, sentence_hyps in enumerate(hyps)]
