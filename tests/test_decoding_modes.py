"""Production decoding: ensembles, sampling and word alignments, on a model that really learned
the reverse task (source words in reverse order), decoded in fp32 (exact batch invariance)."""

from __future__ import annotations

import json

import pytest
import sacrebleu
import torch

from tests.conftest import fp32_translator, tfm_in_process
from transformer_cli.decoding.alignment import pharaoh, word_numbers
from transformer_cli.decoding.ensemble import Ensemble
from transformer_cli.decoding.search import Sampling, draw, sampling_distribution
from transformer_cli.decoding.terms import LineTerms
from transformer_cli.runtime.files import read_lines


@pytest.fixture(scope="module")
def checkpoint(reverse_model):
    return reverse_model[1].best_checkpoint


@pytest.fixture(scope="module")
def held_out(reverse_model):
    config, _ = reverse_model
    return read_lines(f"{config.data.test}.src.gz")[:80], read_lines(f"{config.data.test}.tgt.gz")[:80]


engine = fp32_translator


# --------------------------------------------------------------------------- ensembles


@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_of_a_model_with_itself_is_the_model(checkpoint, held_out, beam):
    src, _ = held_out
    alone = engine(checkpoint, beam=beam, nbest=min(beam, 2)).translate(src)
    twice = engine(checkpoint, checkpoint)
    assert isinstance(twice.model, Ensemble) and len(twice.model.members) == 2
    together = twice.translate(src, decode=twice.settings(beam=beam, nbest=min(beam, 2)))
    assert [[t.text for t in ts] for ts in together] == [[t.text for t in ts] for ts in alone]
    for ts_alone, ts_together in zip(alone, together):
        for a, b in zip(ts_alone, ts_together):
            assert b.score == pytest.approx(a.score, abs=1e-4)


@pytest.mark.slow
def test_an_ensemble_of_two_networks_scores_at_least_their_mean(layout_runs):
    """Two networks of one vocabulary (pre- and post-norm, each 300 steps of a tiny model): each far
    from perfect on its own, together at least as good as their mean."""
    from transformer_cli.experiment.config import load_config
    from transformer_cli.experiment.rundir import RunDirectory

    configs = [load_config(layout_runs(layout)) for layout in ("pre-norm, joint", "post-norm, joint")]
    paths = [RunDirectory(config.run_path).default_checkpoint() for config in configs]
    src, ref = (read_lines(f"{configs[0].data.test}.{side}.gz") for side in ("src", "tgt"))
    bleu = {}
    for name, members in (("a", paths[:1]), ("b", paths[1:]), ("ab", paths)):
        hyps = [t[0].text for t in engine(*members, beam=4).translate(src)]
        bleu[name] = sacrebleu.corpus_bleu(hyps, [ref]).score
    assert bleu["a"] < 90 and bleu["b"] < 90, bleu  # weak members, so the comparison means something
    assert bleu["ab"] >= (bleu["a"] + bleu["b"]) / 2, bleu


def test_translate_and_evaluate_take_an_ensemble(checkpoint, reverse_model, tmp_path):
    config, _ = reverse_model
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--checkpoint", checkpoint,
                            "--set", "decode.precision=fp32", "--beam", "2", input="wa wb wc\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "wc wb wa\n"
    run_config = tmp_path / "c.yaml"
    raw = json.loads(config.model_dump_json())
    raw["decode"]["checkpoints"] = [str(checkpoint), str(checkpoint)]
    run_config.write_text(json.dumps(raw))
    result = tfm_in_process("evaluate", "--config", run_config, "--json", "--beam", "1")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["checkpoint"] == f"{checkpoint} + {checkpoint}" and report["scores"]["bleu"]["score"] > 90


# --------------------------------------------------------------------------- sampling


def test_sampling_distribution_cuts_exactly():
    logprobs = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    assert sampling_distribution(logprobs, Sampling()).tolist()[0] == pytest.approx([0.5, 0.25, 0.15, 0.1])
    assert sampling_distribution(logprobs, Sampling(top_k=2))[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    # nucleus 0.7: 0.5 alone is short of it, 0.5 + 0.25 reaches it; the rest is cut
    assert sampling_distribution(logprobs, Sampling(top_p=0.7))[0].tolist() == pytest.approx([0.5, 0.25, 0, 0])
    assert sampling_distribution(logprobs, Sampling(top_p=0.1))[0].tolist() == pytest.approx([0.5, 0, 0, 0])
    hot = sampling_distribution(logprobs, Sampling(temperature=2.0))[0]
    cold = sampling_distribution(logprobs, Sampling(temperature=0.5))[0]
    assert hot[0] < 0.5 < cold[0]  # temperature flattens or sharpens


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2]).repeat(4000, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(len(probs))]
    counts = torch.bincount(draw(probs, generators), minlength=4).float() / len(probs)
    assert counts[2] == 0
    assert counts.tolist() == pytest.approx([0.5, 0.3, 0.0, 0.2], abs=0.03)


def samples(translator, lines, **settings):
    return [[t.text for t in ts] for ts in translator.translate(lines, translator.settings(**settings))]


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(checkpoint, held_out):
    src, _ = held_out
    hot = dict(sample=True, temperature=3.0)
    first = samples(engine(checkpoint, seed=7, **hot), src, nbest=3)
    # the same seed in other batches (7 sentences a batch, another order) gives the same samples
    other_batches = engine(checkpoint, seed=7, batch_size=7, **hot)
    assert samples(other_batches, src[::-1], nbest=3) == first[::-1]
    assert all(len(ts) == 3 for ts in first)
    assert sum(len(set(ts)) > 1 for ts in first) > len(src) / 2  # three samples, mostly not all alike
    assert samples(engine(checkpoint, seed=8, **hot), src, nbest=3) != first


def test_sampling_from_the_top_token_only_is_greedy(checkpoint, held_out):
    src, _ = held_out
    greedy = samples(engine(checkpoint), src, beam=1)
    assert samples(engine(checkpoint, sample=True, top_k=1, seed=3), src) == greedy


def test_translate_samples_from_the_command_line(checkpoint):
    args = ["translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", "--sample",
            "--temperature", "3", "--top-p", "0.95", "--nbest", "4"]
    first = tfm_in_process(*args, "--seed", "1", input="wa wb wc wd\n")
    assert first.exit_code == 0, first.stderr
    rows = [line.split("\t") for line in first.stdout.splitlines()]
    assert [r[:2] for r in rows] == [["0", "1"], ["0", "2"], ["0", "3"], ["0", "4"]]
    assert tfm_in_process(*args, "--seed", "1", input="wa wb wc wd\n").stdout == first.stdout


# --------------------------------------------------------------------------- alignments


def test_word_numbers_follow_the_word_start_mark():
    assert word_numbers(["▁a", "b", "▁c", "▁", "d", "."]) == [0, 0, 1, 2, 2, 2]
    assert word_numbers(["x", "▁y"]) == [0, 1]  # a first piece without the mark is still word 0


def test_pharaoh_links_each_target_subword_to_its_strongest_source_subword():
    weights = torch.tensor([[0.1, 0.7, 0.1, 0.1],   # target piece 0 → source piece 1
                            [0.6, 0.2, 0.1, 0.1],   # 1 → 0
                            [0.1, 0.1, 0.1, 0.7]])  # 2 → 3 (<eos> column 3 is outside the 3 pieces) → 0 or 2
    src_words, tgt_words = [0, 1, 1], [0, 1, 1]
    assert pharaoh(weights, src_words, tgt_words, 2, 2) == "0-1 1-0 1-1" or pharaoh(
        weights, src_words, tgt_words, 2, 2) == "0-1 1-0"
    assert pharaoh(weights, [], tgt_words, 1, 2) == ""


@pytest.mark.parametrize("beam", [1, 4])
def test_alignments_of_the_reverse_task_run_against_the_diagonal(checkpoint, held_out, beam):
    src, _ = held_out
    translations = engine(checkpoint, alignment=True, beam=beam, nbest=min(beam, 2)).translate(src)
    links = reversed_links = 0
    for line, ts in zip(src, translations):
        for rank, t in enumerate(ts):
            n_src, n_tgt = len(line.split()), len(t.text.split())
            pairs = [tuple(map(int, p.split("-"))) for p in t.alignment.split()]
            assert pairs == sorted(set(pairs))
            assert all(0 <= i < n_src and 0 <= j < n_tgt for i, j in pairs), (line, t)
            assert {j for _, j in pairs} == set(range(n_tgt))  # every target word is linked
            if rank == 0:  # the best translation is the reversed source: its links run anti-diagonally
                links += len(pairs)
                reversed_links += sum(j == n_src - 1 - i for i, j in pairs)
    # The reverse model's links ran anti-diagonally 0.80–0.81 of the time (Zen 4: bf16, fp32, and fp32 with every
    # library capped to AVX2, where 0.7996 failed a bound of 0.8); random or diagonal links would match
    # about once per sentence, ~1 / its length.
    assert reversed_links / links >= 0.7, reversed_links / links


def test_translate_prints_alignments_after_a_tab(checkpoint):
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", "--alignment",
                            input="wa wb wc\n\nwd we\n")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[1] == "\t"
    for line in (lines[0], lines[2]):
        text, alignment = line.split("\t")
        assert alignment and all(len(p.split("-")) == 2 for p in alignment.split())
    nbest = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", "--alignment",
                           "--beam", "3", "--nbest", "2", input="wa wb wc\n")
    assert [len(row.split("\t")) for row in nbest.stdout.splitlines()] == [5, 5]


def test_sampling_is_the_greedy_loop_with_a_draw_and_keeps_each_sentences_samples(checkpoint, held_out):
    """Sampling picks by drawing inside the greedy loop (`SamplingPick`): decoding several batches at
    once with continuous batching, rows changing sentences as they finish, draws for every sentence
    what it draws alone; and a draw whose distribution keeps only the best token is the greedy pick."""
    from transformer_cli.data.batches import pad_batch
    from transformer_cli.decoding.search import (
        SamplingPick,
        greedy_search_continuous,
        sample_search,
        sampling_generators,
    )
    from transformer_cli.model.special_tokens import BOS_ID, EOS_ID

    model = engine(checkpoint).model
    ids = [engine(checkpoint).src_sp.encode(line) + [EOS_ID] for line in held_out[0][:12]]
    sampling = Sampling(temperature=1.5, seed=3)
    alone = [sample_search(model, pad_batch([row]), BOS_ID, EOS_ID, sampling, 2, 1.0, 5)[0] for row in ids]
    rows = [row for row in ids for _ in range(2)]  # two samples per sentence, as sample_search lays them out
    batches = [pad_batch(rows[i : i + 6]) for i in range(0, len(rows), 6)]
    generators = sampling_generators(pad_batch(ids), model.cfg.pad_id, sampling.seed, 2)
    together = [h for batch in greedy_search_continuous(model, batches, BOS_ID, EOS_ID, 1.0, 5,
                                                        pick=SamplingPick(sampling, generators)) for h in batch]
    assert [h.tokens for h in together] == [h.tokens for pair in alone for h in pair]
    cold = sample_search(model, pad_batch(ids), BOS_ID, EOS_ID, Sampling(top_k=1), 1, 1.0, 5)
    greedy = greedy_search_continuous(model, [pad_batch(ids)], BOS_ID, EOS_ID, 1.0, 5)[0]
    assert [h[0].tokens for h in cold] == [h.tokens for h in greedy]
    assert len({tuple(h.tokens) for pair in alone for h in pair}) > len(ids) // 2  # it does draw



@pytest.mark.parametrize("beam, nbest, sample", [(1, 1, False), (4, 1, False), (4, 3, False), (1, 2, True)])
def test_a_prefix_starts_every_hypothesis_of_its_own_line(checkpoint, held_out, beam, nbest, sample):
    """Lines with a prefix (the reference's first words, or a word the model would not choose) and
    lines without, in one batch: each hypothesis of a prefixed line starts with its prefix; the
    others are what they are without any prefix in the batch (fp32: batch-invariant)."""
    src, ref = held_out
    lines = src[:16]
    prefixes = ["" if i % 2 else (" ".join(ref[i].split()[:2]) if i % 4 == 0 else "wp wp") for i in range(len(lines))]
    settings = {"sample": True, "seed": 5} if sample else {}
    translator = engine(checkpoint, **settings)
    plain = translator.translate(lines, decode=translator.settings(beam=beam, nbest=nbest))
    forced = translator.translate(lines, decode=translator.settings(beam=beam, nbest=nbest), terms=[LineTerms(prefix=p) for p in prefixes])
    for i, hyps in enumerate(forced):
        assert len(hyps) == nbest
        if prefixes[i]:
            assert all(h.text.startswith(prefixes[i]) for h in hyps), (prefixes[i], [h.text for h in hyps])
        else:
            assert [h.text for h in hyps] == [h.text for h in plain[i]]
    unlikely = [i for i in range(2, len(lines), 4) if not plain[i][0].text.startswith("wp wp")]
    assert unlikely and all(forced[i][0].text != plain[i][0].text for i in unlikely)  # the prefix steered them


def test_translate_prefix_from_the_command_line(checkpoint, held_out):
    src, _ = held_out
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--prefix", "wp wo", "--beam", "2",
                            input="\n".join(src[:5]) + "\n\n")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("wp wo") for line in lines[:5]) and lines[5] == ""
    bad = tfm_in_process("translate", "--checkpoint", checkpoint, "--prefix", " ", input="wa\n")
    assert bad.exit_code == 2 and "--prefix: give one line of text" in bad.stderr
    unknown = tfm_in_process("translate", "--checkpoint", checkpoint, "--prefix", "wz", input="wa\n")
    assert unknown.exit_code == 2 and "prefix 'wz': the model's target vocabulary cannot spell" in unknown.stderr
