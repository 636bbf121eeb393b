"""What a run trains, built from its config: the Transformer and its optimizer (used by the loop in
train.py and by the shape probe in shape_choice.py)."""

from __future__ import annotations

import torch

from ..experiment.config import ExperimentConfig, TrainConfig
from ..model.special_tokens import PAD_ID
from ..model.transformer import Transformer, TransformerConfig


def build_model(config: ExperimentConfig, src_vocab_size: int, tgt_vocab_size: int,
                shared_ids: bool = False) -> Transformer:
    """The config's Transformer. Embeddings are shared where both sides have one id space: a joint
    vocabulary, or two sentencepiece models over one id map (`shared_ids`: imported Marian models)."""
    share = config.model.share_embeddings and (config.vocab.joint or shared_ids)
    model_cfg = TransformerConfig(
        src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
        **{**config.model.model_dump(exclude={"size"}), "share_embeddings": share}, pad_id=PAD_ID,
    )
    return Transformer(model_cfg)


def adam(model: Transformer, train_cfg: TrainConfig) -> torch.optim.Adam:
    # fused: one kernel for all parameters, and it reads a non-finite gradient as `found_inf`
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
                            fused=True, weight_decay=train_cfg.weight_decay)
