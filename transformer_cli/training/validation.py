"""Validation during training: loss and perplexity over the valid split, and greedy BLEU of its
first sentences against the raw references (what `train.best_metric` picks the best checkpoint by)."""

from __future__ import annotations

import math

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch

from ..data.batches import ParallelData
from ..decoding.torch_engine import decode_in_batches
from ..experiment.config import ExperimentConfig
from ..experiment.rundir import Manifest, RunDirectory
from ..model.transformer import Transformer
from ..runtime.files import read_lines
from .loss import batch_loss


@torch.no_grad()
def evaluate_loss(model: Transformer, data: ParallelData, config: ExperimentConfig,
                  device: torch.device) -> dict[str, float]:
    model.eval()
    loss_sum = nll_sum = tokens = 0.0
    for batch in data.iterate(config.train.max_tokens, seed=0):
        batch = batch.to(device)
        loss, nll = batch_loss(model, batch, config.train.label_smoothing)
        loss_sum, nll_sum, tokens = loss_sum + float(loss), nll_sum + float(nll), tokens + batch.n_tgt_tokens
    return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50))}


def validation_bleu(model: Transformer, data: ParallelData, references: list[str], tgt_sp: spm.SentencePieceProcessor,
                    config: ExperimentConfig, device: torch.device) -> float:
    """Greedy-decode the first N valid sentences (a multilingual run: the first N / directions of
    each direction's) and score them against the raw references."""
    chosen = bleu_sentences(data, min(config.train.eval_bleu_sentences, len(data), len(references)))
    src = [np.asarray(data.src[i]).tolist() for i in chosen]
    hyps = decode_in_batches(model, src, config.decode.updated(beam=1, nbest=1), device)
    texts = [tgt_sp.decode(h[0].tokens) for h in hyps]
    return sacrebleu.corpus_bleu(texts, [[references[i] for i in chosen]]).score


def bleu_sentences(data: ParallelData, n: int) -> list[int]:
    """Which n valid sentences validation BLEU decodes: the first n, or an equal share of each
    direction's (the first direction alone would choose a multilingual run's best checkpoint)."""
    if len(data.directions) <= 1:
        return list(range(n))
    share = -(-n // len(data.directions))
    return [i for r in data.directions for i in range(r.start, min(r.end, r.start + share))][:n]


class Validation:
    """A run's validation set, loaded once: `validation(model)` → its metrics (loss, nll, ppl,
    bleu), with the model left in eval mode; `score(metrics)`: higher is better, whichever
    train.best_metric."""

    def __init__(self, run_dir: RunDirectory, manifest: Manifest, config: ExperimentConfig, device: torch.device):
        self.config, self.device = config, device
        self.data = ParallelData(run_dir, "valid")
        self.references = [line for path in manifest.references("valid") for line in read_lines(path)]
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(run_dir.vocab_file(manifest, "tgt")))

    def __call__(self, model: Transformer) -> dict[str, float]:
        metrics = evaluate_loss(model, self.data, self.config, self.device)
        metrics["bleu"] = validation_bleu(model, self.data, self.references, self.tgt_sp, self.config, self.device)
        return metrics

    def score(self, metrics: dict[str, float]) -> float:
        return metrics["bleu"] if self.config.train.best_metric == "bleu" else -metrics["loss"]
