"""Hypothesis scoring (experiment/scoring.py): the rules every engine's search and settings read.
The beam search's reported scores are checked against a teacher-forced forward pass of the same
model, so the rule written in scoring.py is the one the search applies."""

import math

import pytest
import torch

from transformer_cli.decoding.search import beam_search, greedy_search
from transformer_cli.experiment.scoring import (
    finished_needed,
    gnmt_length_penalty,
    length_penalty,
    normalised_score,
    search_alpha,
    total_log_prob,
)
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID
from transformer_cli.model.transformer import Transformer, TransformerConfig


def teacher_forced_total(model: Transformer, src: torch.Tensor, tokens: list[int], eos: bool = True) -> float:
    """The sum of log-probabilities of `tokens` (then </s>) for one source row (1, S)."""
    target = torch.tensor([tokens + [EOS_ID] * eos])
    tgt_in = torch.cat([torch.tensor([[BOS_ID]]), target[:, :-1]], dim=1)
    logprobs = torch.log_softmax(model(src, tgt_in).float(), dim=-1)  # (1, T, V)
    return float(logprobs.gather(2, target[:, :, None]).sum())


LIMIT = 6 * 1.0 + 4  # max_len_a · source length + max_len_b


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_beam_and_greedy_scores_follow_the_rule(alpha):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=24, tgt_vocab_size=24, d_model=32, n_heads=4,
                                          enc_layers=1, dec_layers=1, d_ff=64, dropout=0.0)).eval()
    src = torch.randint(4, 24, (3, 6))
    with torch.no_grad():
        for row, hyps in enumerate(beam_search(model, src, BOS_ID, EOS_ID, beam=3, alpha=alpha, nbest=3,
                                               max_len_a=1.0, max_len_b=4)):
            assert hyps
            for hyp in hyps:
                ended = len(hyp.tokens) < LIMIT  # by </s>, which counts; else cut at the length limit
                total = teacher_forced_total(model, src[row : row + 1], hyp.tokens, eos=ended)
                length = len(hyp.tokens) + ended
                assert hyp.score == pytest.approx(normalised_score(total, length, alpha, 3), abs=1e-4)
        for row, hyp in enumerate(greedy_search(model, src, BOS_ID, EOS_ID, max_len_a=1.0, max_len_b=4)):
            total = teacher_forced_total(model, src[row : row + 1], hyp.tokens, eos=len(hyp.tokens) < LIMIT)
            assert hyp.score == pytest.approx(total, abs=1e-4)  # the plain total, whatever alpha


def test_normalisation_is_undone_exactly_and_greedy_is_never_normalised():
    for convention in ("gnmt", "length"):
        for length in (1, 7, 250):
            score = normalised_score(-12.5, length, 0.6, beam=4, convention=convention)
            assert total_log_prob(score, length, 0.6, beam=4, convention=convention) == pytest.approx(-12.5)
            assert normalised_score(-12.5, length, 0.6, beam=1, convention=convention) == -12.5
    assert gnmt_length_penalty(1, 0.6) == 1.0 and length_penalty(1, 0.6, "length") == 1.0
    assert length_penalty(10, 1.0, "gnmt") == pytest.approx(15 / 6) and length_penalty(10, 1.0, "length") == 10.0
    assert gnmt_length_penalty(torch.tensor([1.0, 7.0]), 2.0).tolist() == pytest.approx([1.0, 4.0])
    assert search_alpha(0.6, 1) == 0.0 and search_alpha(0.6, 2) == 0.6
    assert math.isfinite(normalised_score(-1.0, 1000, 10.0, beam=5))


def test_stopping_rule_waits_for_the_beam_only_with_a_length_penalty_and_no_constraints():
    assert finished_needed([False, True], nbest=2, beam=5, alpha=0.0) == [2, 2]
    assert finished_needed([False, True], nbest=2, beam=5, alpha=0.6) == [5, 2]
    assert finished_needed([False], nbest=6, beam=5, alpha=0.6) == [6]
