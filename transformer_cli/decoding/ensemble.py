"""Ensembles: several trained models decoding as one.

An `Ensemble` offers the incremental API the searches use (`encode`, `init_state`, `decode_step`,
`cfg`), so greedy, beam and sampling search decode an ensemble exactly as they decode one model.
Each member keeps its own encoder output and key/value caches (`EnsembleState`); at every step
the members' log-probabilities are averaged, and the search normalises that average again (a
normalised geometric mean of the members' distributions, as Marian and OpenNMT combine them).
An ensemble of one model with itself therefore decodes as the model alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..experiment.checkpoint import TrainedModel, check_same_vocabulary, load_trained_model
from ..model.decoder_state import DecoderState
from ..model.transformer import Transformer


class EnsembleState:
    """The members' decoder states, moved together: every search operation on a state (reorder,
    admitting sentences, dropping cache slots, narrowing sources) is applied to each member's. A
    `decoder_state.SearchState`, as each member's `DecoderState` is."""

    def __init__(self, members: list[DecoderState]):
        self.members = members

    @property
    def length(self) -> int:
        return self.members[0].length

    @property
    def positions(self) -> torch.Tensor | None:
        return self.members[0].positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        for member in self.members:  # each its own copy: decode_step advances it in place
            member.positions = None if value is None else value.clone()

    @property
    def self_mask(self) -> torch.Tensor | None:
        return self.members[0].self_mask

    def admit(self, rows: torch.Tensor, joining: EnsembleState, sentences: torch.Tensor) -> None:
        for member, new in zip(self.members, joining.members):
            member.admit(rows, new, sentences)

    @property
    def source_width(self) -> int:
        return self.members[0].source_width

    def narrow_sources(self, width: int) -> None:
        for member in self.members:
            member.narrow_sources(width)

    def drop_front(self, slots: int) -> None:
        for member in self.members:
            member.drop_front(slots)

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None) -> EnsembleState:
        return EnsembleState([member.reorder(rows, sentences) for member in self.members])


class Ensemble(nn.Module):
    """Models sharing one vocabulary, decoding together: a `decoder_state.SearchModel`, as each
    member is. `cfg` is the first member's, with the position table of the shortest: the searches
    read `pad_id` and `max_positions` from it."""

    def __init__(self, members: list[Transformer]):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        self.members = nn.ModuleList(members)
        self.cfg = dataclasses.replace(members[0].cfg, max_positions=min(m.cfg.max_positions for m in members))

    def encode(self, src: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(B, S) ids → each member's memory (B, S, D_m) and the source padding mask (B, 1, 1, S)."""
        encoded = [member.encode(src) for member in self.members]
        return [memory for memory, _ in encoded], encoded[0][1]

    def init_state(self, memory: list[torch.Tensor], src_mask: torch.Tensor, beams: int = 1,
                   max_len: int = 32) -> EnsembleState:
        return EnsembleState([member.init_state(m, src_mask, beams, max_len)
                              for member, m in zip(self.members, memory)])

    def decode_step(self, tokens: torch.Tensor, state: EnsembleState) -> torch.Tensor:
        """The mean of the members' next-token log-probabilities (B, V), fp32."""
        total = None
        for member, member_state in zip(self.members, state.members):
            logprobs = torch.log_softmax(member.decode_step(tokens, member_state).float(), dim=-1)
            total = logprobs if total is None else total.add_(logprobs)
        return total.div_(len(self.members))


def load_ensemble(paths: list[str | Path]) -> TrainedModel:
    """Several checkpoints as one TrainedModel whose model is their Ensemble (the first one's
    config and sentencepiece models); a checkpoint with another vocabulary is a one-line error."""
    members = [load_trained_model(path) for path in paths]
    first = members[0]
    for other in members[1:]:
        check_same_vocabulary(first.path, first.spm_files, other.path, other.spm_files,
                              "the models of an ensemble must share one vocabulary: prepare with vocab.from_run")
    return dataclasses.replace(first, model=Ensemble([m.model for m in members]).eval())
