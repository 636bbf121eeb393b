"""Numbers mean what they say, and every decoding call has a bounded cost.

Every float setting is finite and in a stated range, and the ends of a range behave as their
meaning says (a vanishing temperature or top_p samples greedily; a huge length factor is the
model's position cap); settings that do nothing in the chosen mode are refused; and a decoding
call whose memory bound is over the limit is refused before it starts, naming the setting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TFM, tfm_in_process, tiny_run
from transformer_cli.decoding.budget import (
    DeadlinePassed,
    check_decoding_budget,
    check_decoding_work,
    decoding_bytes,
    decoding_shape,
    decoding_work,
    parts_within_work,
)
from transformer_cli.decoding.search import (
    Sampling,
    greedy_search,
    max_output_lengths,
    sample_search,
    sampling_distribution,
)
from transformer_cli.experiment.config import DecodeConfig, load_config
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID
from transformer_cli.model.transformer import Transformer, TransformerConfig
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train


@pytest.fixture(scope="module")
def checkpoint(tiny_prepared, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("numbers")
    train(load_config(tiny_run(tiny_prepared, root, max_steps=5)), progress_bar=False)
    return root / "run/checkpoints/checkpoint_last.pt"


# --------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("setting,key", [
    ("decode.length_penalty=1.0e+308", "decode.length_penalty"),  # overflowed ((5 + len) / 6) ** alpha
    ("decode.length_penalty=10.5", "decode.length_penalty"),
    ("train.max_time='" + "9" * 400 + "s'", "train.max_time"),  # a duration of infinite seconds
    ("decode.max_memory=0", "decode.max_memory"),
    ("decode.max_memory=lots", "decode.max_memory"),
])
def test_out_of_range_numbers_are_refused_naming_the_key(setting, key):
    with pytest.raises(TfmError, match=f"key '{key}'"):
        load_config(None, [setting])


def test_the_ends_of_the_ranges_are_accepted():
    config = load_config(None, ["decode.length_penalty=10", "decode.max_len_a=1.0e+308", f"decode.max_len_b={10**30}",
                                "decode.max_memory=512MB", "decode.sample=true", "decode.temperature=1.0e-300",
                                "decode.top_p=1.0e-300"])
    assert config.decode.max_memory == "512MB"


def test_a_huge_length_factor_is_the_position_cap():
    src = torch.tensor([[5, 6, 7, EOS_ID], [5, EOS_ID, 0, 0]])
    assert max_output_lengths(src, 0, 1e308, 0, 0, 64).tolist() == [63, 63]  # a · len overflowed int64
    assert max_output_lengths(src, 0, 0.0, 10**30, 0, 64).tolist() == [63, 63]  # b overflowed int64
    assert max_output_lengths(src, 0, 1.5, 10, 0, 64).tolist() == [16, 13]  # ordinary values as before


# --------------------------------------------------------------------------- sampling at its limits


def random_model() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=2, enc_layers=1, dec_layers=1,
                            d_ff=64, dropout=0.0, max_positions=64)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("sampling", [Sampling(temperature=1e-300), Sampling(top_p=1e-300)],
                         ids=["temperature", "top_p"])
def test_a_vanishing_temperature_or_top_p_samples_greedily(sampling):
    """1e-300 is 0 in fp32: it divided 0 by 0 (temperature) or cut every token (top_p), and the
    draw then took the last token of the vocabulary."""
    logprobs = torch.tensor([[0.1, 0.6, 0.2, 0.1]]).log()
    assert (sampling_distribution(logprobs, sampling)[0] > 0).tolist() == [False, True, False, False]
    model = random_model()
    src = torch.randint(4, 50, (6, 9))
    greedy = [h.tokens for h in greedy_search(model, src, BOS_ID, EOS_ID, 1.0, 5)]
    drawn = [hs[0].tokens for hs in sample_search(model, src, BOS_ID, EOS_ID, sampling, 1, 1.0, 5)]
    assert drawn == greedy


# --------------------------------------------------------------------------- settings that do nothing


@pytest.mark.parametrize("key,value", [("top_k", 3), ("top_p", 0.9), ("temperature", 0.7), ("seed", 4)])
def test_sampling_settings_without_sampling_are_refused(key, value):
    with pytest.raises(TfmError, match=f"key 'decode.{key}': {value} does nothing without sampling"):
        load_config(None, [f"decode.{key}={value}"])
    assert getattr(load_config(None, [f"decode.{key}={value}", "decode.sample=true"]).decode, key) == value


@pytest.mark.parametrize("options,message", [
    (["--top-k", "3"], "--top-k 3 (key 'decode.top_k'): 3 does nothing without sampling: add --sample"),
    (["--seed", "7"], "--seed 7 (key 'decode.seed'): 7 does nothing without sampling"),
    (["--sample", "--beam", "4"], "--beam 4 does nothing with --sample"),
])
def test_translate_refuses_options_that_do_nothing(checkpoint, options, message):
    result = tfm_in_process("translate", "--checkpoint", checkpoint, *options, input="wa wb\n")
    assert result.exit_code == 2 and message in result.stderr, result.stderr


# --------------------------------------------------------------------------- the decoding budget


@pytest.mark.slow
def test_a_million_beams_are_refused_before_any_input_is_read(checkpoint):
    """It grew until the kernel killed it (exit 137, no message). Standard input stays open and
    empty here: a command that read it first would wait forever."""
    proc = subprocess.Popen([*TFM, "translate", "--checkpoint", str(checkpoint), "--beam", "1000000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=120)  # never written; closed only once it has answered
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert "error: decoding 1 line(s)" in stderr and "lower --beam (decode.beam, now 1000000)" in stderr
    assert "more than the limit of" in stderr and len(stderr.strip().splitlines()) == 1


def test_input_over_the_budget_is_refused_before_it_is_decoded(checkpoint, tmp_path):
    """One line of one token fits 64 MB (so the command starts), 32 lines of 1,000 tokens with 4
    beams do not: refused, nothing written."""
    out = tmp_path / "out.txt"
    lines = "\n".join(["wa wb wc"] + ["wa " * 1000] * 40) + "\n"
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.max_memory=64MB", "--beam", "4",
                            "-o", out, input=lines)
    assert result.exit_code == 2, result.stderr
    assert "decoding 32 line(s) of up to 1000 token(s)" in result.stderr
    assert "more than the limit of 64.0 MB (decode.max_memory" in result.stderr
    assert not out.exists()


def test_the_setting_that_raises_the_cost_is_named():
    """The serve request that took 11 GB: 32 lines × 10,000 characters, 64 samples each."""
    model = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, n_heads=4, enc_layers=2,
                              dec_layers=2, d_ff=256)
    sampling = DecodeConfig(sample=True, nbest=64)
    with pytest.raises(TfmError, match=r"lower --nbest \(samples per line, now 64\), or raise decode.max_memory"):
        check_decoding_budget(model, sampling, 32, 3000, 8 * 2**30)
    check_decoding_budget(model, sampling, 32, 20, 8 * 2**30)  # 64 samples of short lines fit
    with pytest.raises(TfmError, match=r"translate shorter lines"):
        check_decoding_budget(model, DecodeConfig(beam=1, batch_size=1), 1, 1000, 33 * 2**20)


MEASURE = """
import json, sys
from pathlib import Path
import torch
from transformer_cli.decoding.budget import decoding_bytes, decoding_shape
from transformer_cli.experiment.config import DecodeConfig
from transformer_cli.decoding.torch_engine import Translator, decode_in_batches

def resident():  # (current, peak) resident bytes
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return [int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")]

lines, tokens, beam = 32, 600, 4
decode = DecodeConfig(beam=beam, batch_size=lines, workers=1, precision="fp32", max_len_a=0.0, max_len_b=tokens + 1)
translator = Translator.from_checkpoint(sys.argv[1], decode=decode, device="cpu")
sources = [[4 + (i + j) % 16 for j in range(tokens)] for i in range(lines)]
decode_in_batches(translator.model, sources[:1], decode, translator.device, min_len=4, max_len=4)  # warm-up
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
before, _ = resident()
# every hypothesis runs to the length limit, as the bound assumes
decode_in_batches(translator.model, sources, decode, translator.device, min_len=tokens + 1, max_len=tokens + 1)
_, peak = resident()
shape = decoding_shape(translator.model.cfg, decode, lines, tokens)
print(json.dumps({"estimate": decoding_bytes(translator.model.cfg, shape), "used": peak - before}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures peak memory the Linux way")
def test_the_bound_holds_a_real_decode_within_a_small_factor(checkpoint):
    """Peak resident memory of a real beam search (fp32, 32 lines × 600 tokens, 4 beams, every
    hypothesis to its length limit), measured in a process of its own, against the bound."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["used"] <= found["estimate"] <= 4 * found["used"], found



def test_a_long_target_prefix_raises_the_bound():
    """A prefix forces the output through its tokens: a 1-token source with a 500-token prefix may
    decode 501 tokens, not a · 2 + b; the bound (and so the refusal) follows."""
    from transformer_cli.experiment.config import DecodeConfig
    from transformer_cli.model.transformer import TransformerConfig

    cfg = TransformerConfig(src_vocab_size=8000, tgt_vocab_size=8000, max_positions=1024)
    decode = DecodeConfig(beam=4)
    plain = decoding_shape(cfg, decode, 1, 1)
    forced = decoding_shape(cfg, decode, 1, 1, longest_prefix=500)
    assert plain.output < 20 and forced.output == 501
    assert decoding_bytes([cfg], forced) > 4 * decoding_bytes([cfg], plain)  # (32 MB of it is fixed workspace)
    limit = 2 * decoding_bytes([cfg], plain)
    check_decoding_budget(cfg, decode, 1, 1, limit)  # fits without the prefix
    with pytest.raises(TfmError, match="up to 501 output tokens"):
        check_decoding_budget(cfg, decode, 1, 1, limit, longest_prefix=500)


# --------------------------------------------------------------------------- time


def test_the_work_of_a_call_grows_with_each_setting_and_over_max_work_is_refused_naming_it():
    """Time is budgeted like memory: the estimated work multiplies lines, beams, output length,
    the decoder's size and the constrained beam's banks, and a call over decode.max_work is refused."""
    cfg = TransformerConfig(src_vocab_size=8000, tgt_vocab_size=8000)  # the paper's base shape
    decode = DecodeConfig()
    work = {}
    for name, (lines, beam, constraints) in {"one": (1, 4, 0), "lines": (256, 4, 0), "beam": (1, 64, 0),
                                             "terms": (1, 4, 8)}.items():
        shape = decoding_shape(cfg, decode.updated(beam=beam), lines, 20, constraints=(constraints, 5))
        work[name] = decoding_work([cfg], shape)
    assert work["lines"] == pytest.approx(256 * work["one"], rel=0.01)
    assert work["beam"] == pytest.approx(16 * work["one"], rel=0.01)
    assert work["terms"] == pytest.approx(9 * work["one"], rel=0.2)
    check_decoding_work(cfg, decode.updated(beam=5), 256, 20)  # a full request of a normal size passes
    heavy_terms = (32, 10)  # 256 lines, beam 64, nbest 64, 32 five-word constraints a line
    with pytest.raises(TfmError, match=r"256 line\(s\).*beam 64.*32 constraint\(s\) a line.*decode.max_work"):
        check_decoding_work(cfg, decode.updated(beam=64, nbest=64), 256, 20, longest_prefix=160, constraints=heavy_terms)
    check_decoding_work(cfg, decode.updated(max_work=1e17, beam=64, nbest=64), 256, 20,
                        longest_prefix=160, constraints=heavy_terms)  # raised: let in


def test_translate_refuses_work_over_the_budget_before_decoding(checkpoint):
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--engine", "torch", "--beam", "64",
                            "--set", "decode.max_work=1e6", input="wa wb wc\n")
    assert result.exit_code == 2 and "decode.max_work" in result.stderr and not result.stdout, result.stderr


def test_lines_over_max_work_together_are_split_into_parts_each_within_it():
    """A file's chunk of a base-size model at beam 5 (a test set's 1,000 lines) is over the default
    budget together; its parts, longest lines first, each pass the check and hold every line once."""
    cfg = TransformerConfig(src_vocab_size=10000, tgt_vocab_size=10000)
    decode = DecodeConfig(beam=5)
    lengths = [5 + (i * 37) % 40 for i in range(1000)]
    with pytest.raises(TfmError, match="decode.max_work"):
        check_decoding_work(cfg, decode, len(lengths), max(lengths))
    parts = parts_within_work(cfg, decode, lengths)
    assert len(parts) > 1 and sorted(i for part in parts for i in part) == list(range(len(lengths)))
    for part in parts:
        check_decoding_work(cfg, decode, len(part), max(lengths[i] for i in part))
    tops = [max(lengths[i] for i in part) for part in parts]
    assert tops == sorted(tops, reverse=True)
    # Within the budget: one part, the lines in their order; a line over it alone: a part of its own.
    assert parts_within_work(cfg, decode, lengths[:10]) == [list(range(10))]
    tight = decode.model_copy(update={"max_work": 1.0})
    assert parts_within_work(cfg, tight, [3, 9, 4]) == [[1], [2], [0]]


def test_translate_searches_a_chunk_over_max_work_a_part_at_a_time_with_the_same_translations(checkpoint):
    from transformer_cli.decoding.torch_engine import Translator

    overrides = ["decode.precision=fp32", "decode.workers=1", "decode.batch_size=1"]  # one line a batch either way
    lines = ["wa wb wc", "wd we", "wf wg wh wi", "wj wk", "", "wl wm wn"]
    whole = Translator.from_checkpoint(checkpoint, device="cpu", overrides=overrides)
    sources = whole.tokenize([line for line in lines if line])
    one_line = decoding_work(whole.member_configs, decoding_shape(whole.member_configs[0], whole.decode.updated(beam=4),
                                                                  1, max(map(len, sources))))
    split = Translator.from_checkpoint(checkpoint, device="cpu",
                                       overrides=[*overrides, f"decode.max_work={2.5 * one_line}"])
    searches = []
    search_later = split.search_later
    split.search_later = lambda sources, *args, **kwargs: (searches.append(len(sources)),
                                                           search_later(sources, *args, **kwargs))[1]
    try:
        with pytest.raises(TfmError, match="decode.max_work"):
            split.check_search_budget(sources, split.settings(beam=4))  # together: over the budget
        beam_4 = [t[0].text for t in split.translate(lines, decode=split.settings(beam=4))]
        assert beam_4 == [t[0].text for t in whole.translate(lines, decode=whole.settings(beam=4))]
        assert len(searches) > 1 and sum(searches) == len(sources) and max(searches) <= 2
    finally:
        whole.close()
        split.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_search_past_its_deadline_stops_between_steps(checkpoint, workers):
    from transformer_cli.decoding.torch_engine import Translator

    translator = Translator.from_checkpoint(checkpoint, device="cpu",
                                            overrides=["decode.precision=fp32", f"decode.workers={workers}",
                                                       "decode.batch_size=2"])
    lines = ["wa wb wc", "wd we", "wf wg wh wi", "wj wk"]
    try:
        with pytest.raises(DeadlinePassed):
            translator.translate_later(lines, decode=translator.settings(beam=4), deadline=time.monotonic() - 1)()
        in_time = translator.translate_later(lines, decode=translator.settings(beam=4), deadline=time.monotonic() + 600)()
        assert [t[0].text for t in in_time] == [t[0].text for t in translator.translate(lines, decode=translator.settings(beam=4))]
    finally:
        translator.close()


def test_an_avoided_term_of_thousands_of_characters_is_refused_at_once(checkpoint, tmp_path):
    avoid = tmp_path / "avoid.txt"
    avoid.write_text("w" * 200_000 + "\n")
    started = time.monotonic()
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--avoid", avoid, input="wa wb\n")
    assert result.exit_code == 2 and "200000 characters, more than 256" in result.stderr, result.stderr
    assert time.monotonic() - started < 30  # (it never finished)
