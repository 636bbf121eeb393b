import gc
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest
import sacrebleu
import torch

from tests.conftest import tfm_in_process
from tests.warm_processes import preexec, tfm_in_scripts
from transformer_cli.decoding.search import beam_search, beam_top_k, greedy_search, log_probs, logits_buffer, top_k
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.decoding.translation import balanced_batches, format_nbest, length_sorted_batches
from transformer_cli.decoding.workers import resolve_workers
from transformer_cli.model.cpu_inference import PackedLinear
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID
from transformer_cli.model.transformer import MultiHeadAttention, TransformerConfig
from transformer_cli.runtime.cpu import denormals_flushed_to_zero, usable_cores
from transformer_cli.runtime.errors import TfmError
from transformer_cli.runtime.files import read_lines

TFM = [sys.executable, "-m", "transformer_cli.cli"]


@pytest.fixture(scope="module")
def translator(reverse_model):
    config, summary = reverse_model
    # fp32 whatever the CPU: exact batch invariance and beam-1 == greedy are fp32 guarantees.
    return Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=["decode.precision=fp32"])


@pytest.fixture(scope="module")
def held_out_pairs(reverse_model):
    config, _ = reverse_model
    return read_lines(f"{config.data.test}.src.gz"), read_lines(f"{config.data.test}.tgt.gz")


@pytest.mark.parametrize("beam", [1, 4])
def test_reverse_model_translates_held_out_sentences(translator, held_out_pairs, beam):
    src, ref = held_out_pairs
    hyps = [t[0].text for t in translator.translate(src, decode=translator.settings(beam=beam))]
    bleu = sacrebleu.corpus_bleu(hyps, [ref]).score
    assert bleu >= 90, f"beam {beam}: BLEU {bleu:.1f}"


@pytest.mark.parametrize("beam", [1, 4])
def test_bf16_decoding_keeps_quality(reverse_model, held_out_pairs, beam):
    _, summary = reverse_model
    bf16 = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=["decode.precision=bf16"])
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    src, ref = held_out_pairs
    hyps = [t[0].text for t in bf16.translate(src, decode=bf16.settings(beam=beam))]
    assert sacrebleu.corpus_bleu(hyps, [ref]).score >= 90


def test_beam_one_equals_greedy_token_for_token(translator, held_out_pairs):
    src_lines, _ = held_out_pairs
    model = translator.model
    ids = [translator.src_sp.encode(line) + [EOS_ID] for line in src_lines[:48]]
    src = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
    for i, s in enumerate(ids):
        src[i, : len(s)] = torch.tensor(s)
    greedy = greedy_search(model, src, BOS_ID, EOS_ID, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, BOS_ID, EOS_ID, beam=1, max_len_a=1.0, max_len_b=5)
    assert [g.tokens for g in greedy] == [b[0].tokens for b in beam]
    # Also when the length limit, not <eos>, ends the hypotheses.
    greedy = greedy_search(model, src, BOS_ID, EOS_ID, max_len_a=0.0, max_len_b=3)
    beam = beam_search(model, src, BOS_ID, EOS_ID, beam=1, max_len_a=0.0, max_len_b=3)
    assert [g.tokens for g in greedy] == [b[0].tokens for b in beam]
    assert all(len(g.tokens) <= 3 for g in greedy)


class ConfidentToyModel:
    """The incremental decoding API over fixed step-wise scores: at step t every row puts almost all
    mass on token 5 + t, a little on <eos> (log-prob ~ -3), nothing elsewhere, and from step 3 on <eos>
    is the likely token. The best output is [5, 6, 7] (log-prob ~ -0.15); each step's <eos> candidate
    also ranks in the top K, so after two steps K = 2 improbable hypotheses have already finished."""

    cfg = TransformerConfig(src_vocab_size=16, tgt_vocab_size=16)

    class State:
        step = 0
        positions = None  # (B,) per-row target positions, which the searches may set (as DecoderState)

        def reorder(self, rows, sentences=None):
            return self

    def encode(self, src):
        return src, None

    def init_state(self, memory, src_mask, beams=1, max_len=32):
        return self.State()

    def decode_step(self, tokens, state):
        logits = torch.full((tokens.size(0), 16), -20.0)
        logits[:, EOS_ID] = -3.0
        if state.step < 3:
            logits[:, 5 + state.step] = 0.0
        else:
            logits[:, EOS_ID] = 0.0
        state.step += 1
        if state.positions is not None:
            state.positions += 1
        return logits


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_keeps_going_while_a_live_beam_can_win(alpha):
    """Stopping once K hypotheses have finished would return an early <eos> here: the search must
    continue while the best live beam still beats every finished one."""
    src = torch.tensor([[7, 8, 9, EOS_ID]])
    hyps = beam_search(ConfidentToyModel(), src, BOS_ID, EOS_ID, beam=2, alpha=alpha, max_len_b=20, nbest=2)[0]
    assert hyps[0].tokens == [5, 6, 7]
    assert hyps[0].score > hyps[1].score
    assert greedy_search(ConfidentToyModel(), src, BOS_ID, EOS_ID, max_len_b=20)[0].tokens == [5, 6, 7]


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_invariance_and_order(translator, held_out_pairs, beam):
    src, _ = held_out_pairs
    lines = src[:40]
    together = [t[0].text for t in translator.translate(lines, decode=translator.settings(beam=beam))]
    alone = [translator.translate([line], decode=translator.settings(beam=beam))[0][0].text for line in lines[:12]]
    assert together[:12] == alone
    shuffled = list(reversed(lines))
    assert [t[0].text for t in translator.translate(shuffled, decode=translator.settings(beam=beam))] == list(reversed(together))


# Inputs whose text a test checks come from the task's training distribution (3–9 words): a
# length the model never saw would make the output depend on which CPU/precision trained it.
IN_DOMAIN = ["wa wb wc", "wc wd we wf", "wp wo wn wm wl", "wb wb wa wh"]


@pytest.mark.parametrize("beam", [1, 3])
def test_a_long_line_does_not_shorten_the_other_translations_in_its_batch(translator, beam):
    """Each row's length limit is its own a · src_len + b (capped by the position table): a
    700-token line beside short ones once cut their translations short (the limit of the widest
    row was taken for every row of the batch)."""
    long_line = " ".join(["wa"] * 700)  # one piece per word: 700 tokens, under max_positions
    translator.decode.max_len_a, translator.decode.max_len_b = 1.5, 5
    try:
        alone = [t[0].text for t in translator.translate(IN_DOMAIN, decode=translator.settings(beam=beam))]
        together = [t[0].text for t in translator.translate([long_line, *IN_DOMAIN], decode=translator.settings(beam=beam))]
    finally:
        translator.decode.max_len_a, translator.decode.max_len_b = 1.0, 5
    assert together[1:] == alone
    assert all(len(text.split()) >= 3 for text in alone)


def own_translation(translator, line: str, beam: int) -> str:
    """The fixture model's translation of one line alone (fp32), the reference for plumbing tests."""
    return translator.translate([line], decode=translator.settings(beam=beam))[0][0].text


def test_empty_lines_stay_empty(translator):
    out = translator.translate([IN_DOMAIN[0], "", "   ", IN_DOMAIN[1]], decode=translator.settings(beam=3))
    texts = [t[0].text for t in out]
    assert texts[1] == "" and texts[2] == ""
    # Empty lines neither shift nor change the translations around them.
    assert texts[0] == own_translation(translator, IN_DOMAIN[0], 3)
    assert texts[3] == own_translation(translator, IN_DOMAIN[1], 3)
    assert texts[0] != "" and texts[3] != ""


def test_nbest_is_sorted_and_formatted(translator):
    out = translator.translate([IN_DOMAIN[0]], decode=translator.settings(beam=4, nbest=3))[0]
    assert len(out) == 3
    assert [t.score for t in out] == sorted((t.score for t in out), reverse=True)
    lines = format_nbest(7, out)
    fields = lines[0].split("\t")
    assert fields[0] == "7" and fields[1] == "1" and float(fields[2]) == pytest.approx(out[0].score, abs=1e-4)
    assert fields[3] == out[0].text == own_translation(translator, IN_DOMAIN[0], 4)
    assert len({line.split("\t")[3] for line in lines}) == 3  # distinct hypotheses


def test_length_sorted_batches_cover_all():
    lengths = [5, 1, 9, 3, 7, 2]
    batches = length_sorted_batches(lengths, batch_size=2, batch_tokens=None)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) <= 2 for b in batches)
    assert batches[0] == [2, 4]  # longest first
    capped = length_sorted_batches(lengths, batch_size=10, batch_tokens=10)
    assert all(max(lengths[i] for i in b) * len(b) <= 10 or len(b) == 1 for b in capped)


def test_balanced_batches_deal_every_length_to_every_batch():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    by_length = length_sorted_batches(lengths, batch_size=4, batch_tokens=None)
    assert by_length == [[2, 6, 4, 0], [7, 3, 5, 1]]  # 9 8 7 5 | 4 3 2 1
    dealt = balanced_batches(by_length, None, lengths)
    assert dealt == [[2, 4, 7, 5], [6, 0, 3, 1]]  # 9 7 4 2 | 8 5 3 1: each longest first
    assert sorted(i for b in dealt for i in b) == list(range(8))
    # where dealing would break the token cap (3 sentences beside a 9-token one > 20 tokens), the batches stay
    lengths = [9, 9, 1, 1, 1, 1]
    capped = length_sorted_batches(lengths, batch_size=4, batch_tokens=20)
    assert capped == [[0, 1], [2, 3, 4, 5]]
    assert balanced_batches(capped, 20, lengths) == capped
    assert balanced_batches(capped, None, lengths) == [[0, 2, 4], [1, 3, 5]]


def test_balanced_batching_decodes_the_same_sentences_side_by_side(reverse_model, held_out_pairs):
    """decode.batching=balanced (what `tfm serve` uses with several processes): one task per
    batch, each with long and short sentences, every sentence translated as in length batches (fp32)."""
    _, summary = reverse_model
    src, _ = held_out_pairs
    settings = ["decode.precision=fp32", "decode.batch_size=8", "decode.workers=2"]
    by_length = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=settings)
    balanced = Translator.from_checkpoint(summary.best_checkpoint, device="cpu",
                                          overrides=[*settings, "decode.batching=balanced"])
    try:
        for beam in (1, 3):
            expected = [t[0].text for t in by_length.translate(src[:16], decode=by_length.settings(beam=beam))]
            assert [t[0].text for t in balanced.translate(src[:16], decode=balanced.settings(beam=beam))] == expected
        assert balanced.decoding_processes == 2  # two batches of 8 went to the two processes
    finally:
        by_length.close()
        balanced.close()


@pytest.mark.slow
def test_cli_streams_stdin_to_stdout(reverse_model, held_out_pairs):
    config, summary = reverse_model
    src, ref = held_out_pairs
    text = "\n".join(src[:30] + ["", src[30]]) + "\n"
    proc = subprocess.run([*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--beam", "2"],
                          input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split("\n")[:-1]
    assert len(out) == 32 and out[30] == ""
    assert sacrebleu.corpus_bleu(out[:30] + [out[31]], [ref[:30] + [ref[30]]]).score >= 90
    assert "sentences/s" in proc.stderr


# The command line in this process (Typer's runner: the same parsing, error wrapper and exit codes);
# test_cli_streams_stdin_to_stdout above runs it as a real process.


@pytest.mark.slow
def test_cli_nbest_output_and_invalid_utf8(reverse_model):
    _, summary = reverse_model
    data = b"wa wb wc\n\xff\xfe wc wd\nwd we wf\n"
    result = tfm_in_process("translate", "--checkpoint", summary.best_checkpoint, "--beam", "3", "--nbest", "2",
                            input=data)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 6 and [line.split("\t")[0] for line in lines] == ["0", "0", "1", "1", "2", "2"]
    assert "line 2 is not valid UTF-8" in result.stderr


@pytest.mark.slow
def test_cli_set_without_config_edits_the_checkpoint_settings(reverse_model):
    _, summary = reverse_model
    base = ["translate", "--checkpoint", summary.best_checkpoint]
    result = tfm_in_process(*base, "--set", "decode.beem=3", input="wa\n")
    assert result.exit_code == 2 and "decode.beem" in result.stderr and "beam" in result.stderr
    result = tfm_in_process(*base, "--set", "decode.beam=1", "--nbest", "2", input="wa\n")
    assert result.exit_code == 2 and "--nbest 2 (key 'decode.nbest'): 2 hypotheses need a beam" in result.stderr


@pytest.mark.slow
def test_cli_bad_checkpoint_is_one_line_exit_2(tmp_path, reverse_model):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    for args in (["--checkpoint", bad], ["--checkpoint", tmp_path / "missing.pt"]):
        result = tfm_in_process("translate", *args, input="wa\n")
        assert result.exit_code == 2
        assert "Traceback" not in result.stderr and result.stderr.startswith("error: ")
        assert len(result.stderr.strip().splitlines()) == 1


def test_vocab_mismatch_is_detected(reverse_model, tmp_path):
    from transformer_cli.experiment.checkpoint import bytes_to_tensor, load_checkpoint, save_checkpoint

    _, summary = reverse_model
    payload = load_checkpoint(summary.best_checkpoint)
    payload.pop("format")
    import sentencepiece as spm

    other = tmp_path / "other"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["abc def ghi jkl"] * 50 + ["mno pqr stu"] * 50),
                                   model_prefix=str(other), vocab_size=27, pad_id=0, unk_id=1, bos_id=2,
                                   eos_id=3, minloglevel=2)
    payload["spm_tgt"] = bytes_to_tensor((tmp_path / "other.model").read_bytes())
    save_checkpoint(tmp_path / "mismatch.pt", payload)
    with pytest.raises(TfmError, match="target vocabulary has 27 pieces but the model expects 40"):
        Translator.from_checkpoint(tmp_path / "mismatch.pt")


@pytest.mark.slow
def test_streaming_writes_before_input_ends(reverse_model, translator):
    """The first batch is written while stdin is still open (an endless pipe works)."""
    _, summary = reverse_model
    proc = subprocess.Popen([*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--beam", "1",
                             "--batch-size", "2", "--set", "decode.precision=fp32"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with proc:  # closes the pipes at the end, whatever happens
        proc.stdin.write(f"{IN_DOMAIN[0]}\n{IN_DOMAIN[1]}\n")
        proc.stdin.flush()
        first = proc.stdout.readline()  # blocks until tfm flushes the first batch; stdin is still open
        assert first.strip() == own_translation(translator, IN_DOMAIN[0], 1)
        proc.stdin.close()
        proc.wait(timeout=60)
        assert proc.returncode == 0


@pytest.mark.slow
def test_closed_pipe_downstream_exits_quietly(reverse_model, translator, tmp_path):
    """`cat big.txt | tfm translate | head -n 1`: no traceback, no error status."""
    _, summary = reverse_model
    big = tmp_path / "big.txt"
    big.write_text(f"{IN_DOMAIN[0]}\n" * 3000)
    cmd = f"tfm translate --checkpoint {summary.best_checkpoint} --beam 1 --set decode.precision=fp32 < {big} | head -n 1"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120,
                          env=tfm_in_scripts(tmp_path / "bin"))
    assert proc.stdout == own_translation(translator, IN_DOMAIN[0], 1) + "\n"
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("rows,n,k", [(4, 40000, 10), (3, 8000, 1), (5, 12345, 4), (2, 300, 3)])
def test_top_k_equals_torch_topk(rows, n, k):
    torch.manual_seed(n)
    scores = torch.randn(rows, n)
    scores[0, :] = float("-inf")  # a dead beam row: -inf everywhere
    scores[0, 7] = 1.0
    scores[1, n - 1] = 100.0  # the best value in the ragged last chunk
    values, indices = top_k(scores, k)
    expected = scores.topk(k, dim=1)
    assert torch.equal(values, expected.values)
    assert torch.equal(scores.gather(1, indices), values)  # indices point at those values
    assert int(indices[1, 0]) == n - 1


def test_log_probs_widen_bf16_logits_into_the_search_buffer():
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 5).to(torch.bfloat16)
    buffer = logits_buffer(8, logits)  # room for 8 rows; the search passes fewer as sentences finish
    assert buffer.dtype == torch.float32 and buffer.numel() == 8 * 300
    for rows in (6, 4):
        got = log_probs(logits[:rows], buffer)
        assert got.dtype == torch.float32 and got.data_ptr() == buffer.data_ptr()  # no new tensor
        assert torch.allclose(got, torch.log_softmax(logits[:rows].float(), dim=-1), atol=1e-6)
    assert logits_buffer(8, logits.float()) is None  # fp32 logits are normalised in place


def test_packed_linear_layers_decode_exactly_like_nn_linear(reverse_model, held_out_pairs, monkeypatch):
    """fp32 Translator on CPU packs its Linear layers for oneDNN: same numbers, same tokens."""
    _, summary = reverse_model
    packed = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=["decode.precision=fp32"])
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules()), "no layer was packed on this CPU"
    monkeypatch.setattr("transformer_cli.decoding.torch_engine.pack_linear_layers", lambda model: False)
    plain = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=["decode.precision=fp32"])
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    x = torch.randn(6, 1, plain.model.cfg.d_model)
    layer = plain.model.decoder_layers[0].ffn.w1
    assert torch.allclose(PackedLinear(layer)(x), layer(x), atol=1e-5)
    # The FFN's ReLU runs inside its first matmul (oneDNN post-op) and the FFN no longer applies it.
    ffn = packed.model.decoder_layers[0].ffn
    assert ffn.w1.activation == "relu" and ffn.activation(-x).min() < 0  # identity now
    assert torch.allclose(ffn(x), plain.model.decoder_layers[0].ffn(x), atol=1e-5)
    # Dh = 16 here: 1/√Dh = 1/4 moves into every query projection, exactly.
    attentions = [m for m in packed.model.modules() if isinstance(m, MultiHeadAttention)]
    assert attentions and all(m.queries_prescaled for m in attentions)
    src = held_out_pairs[0][:60]
    for beam in (1, 4):
        assert ([t[0].text for t in packed.translate(src, decode=packed.settings(beam=beam))]
                == [t[0].text for t in plain.translate(src, decode=plain.settings(beam=beam))])


@pytest.mark.parametrize("vocab", [8000, 8001, 640])  # chunked path; ragged vocabulary and few chunks: fallback
def test_beam_top_k_equals_top_k_over_the_summed_candidates(vocab):
    torch.manual_seed(vocab)
    n, beams, k = 6, 5, 10
    logprobs = torch.log_softmax(torch.randn(n * beams, vocab) * 4, dim=-1)
    beam_scores = -torch.rand(n, beams) * 10
    beam_scores[0, 1:] = float("-inf")  # a sentence with one live beam
    logprobs[7, 123] = 50.0  # one candidate far ahead of the rest
    expected = top_k((logprobs + beam_scores.view(-1, 1)).view(n, beams * vocab), k)
    values, indices = beam_top_k(logprobs.clone(), beam_scores, k)
    assert torch.equal(values, expected[0])
    assert torch.equal(indices, expected[1])
    assert int(indices[1, 0]) == 2 * vocab + 123  # row 7 = sentence 1, beam 2
    assert bool(torch.isfinite(values[0]).all())  # beam 0 alone fills the first sentence's k


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_packed_linear_fuses_the_activation(activation):
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64)
    x = torch.randn(5, 3, 32)
    fused = PackedLinear(layer, activation=activation)(x)
    expected = getattr(torch.nn.functional, activation)(layer(x))
    assert (expected == 0).any() if activation == "relu" else (expected < 0).any()  # the activation mattered
    assert torch.allclose(fused, expected, atol=1e-5)


def test_denormals_are_flushed_only_inside_the_decoding_block():
    tiny = torch.tensor([1e-39])  # a float32 denormal
    with denormals_flushed_to_zero():
        inside = float(tiny * 1.0)
    assert float(tiny * 1.0) > 0.0  # IEEE behaviour is back afterwards
    if torch.set_flush_denormal(False):  # True where the CPU supports the switch (x86 with SSE3)
        assert inside == 0.0



def test_searches_pause_the_cyclic_gc_and_restore_it(translator, held_out_pairs, monkeypatch):
    """Inside a search the collector is off (a decoding step sees gc disabled); afterwards it is
    back as it was, also when the search raised, and left off where the caller had turned it off."""
    model = translator.model
    seen = []
    real_step = model.decode_step

    def step(tokens, state):
        seen.append(gc.isenabled())
        return real_step(tokens, state)

    monkeypatch.setattr(model, "decode_step", step)
    src = torch.tensor([translator.src_sp.encode(held_out_pairs[0][0]) + [EOS_ID]])
    assert gc.isenabled()
    greedy_search(model, src, BOS_ID, EOS_ID)
    beam_search(model, src, BOS_ID, EOS_ID, beam=3)
    assert seen and not any(seen) and gc.isenabled()

    def failing_step(tokens, state):
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "decode_step", failing_step)
    with pytest.raises(RuntimeError):
        greedy_search(model, src, BOS_ID, EOS_ID)
    assert gc.isenabled()
    gc.disable()
    try:
        monkeypatch.setattr(model, "decode_step", step)
        greedy_search(model, src, BOS_ID, EOS_ID)
        assert not gc.isenabled()
    finally:
        gc.enable()


# --------------------------------------------------------------------------- decoding workers


def test_decoding_workers_translate_exactly_like_one_process(reverse_model, held_out_pairs):
    """Batches decoded by two forked worker processes come back complete, in input order, and
    equal (text and score) to decoding in this process with the workers' one thread."""
    _, summary = reverse_model
    settings = ["decode.precision=fp32", "decode.batch_size=16"]
    one = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=[*settings, "decode.workers=1"])
    two = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=[*settings, "decode.workers=2"])
    src, _ = held_out_pairs
    torch.set_num_threads(1)  # what each worker runs: the same arithmetic
    try:
        for beam in (1, 4):
            in_process = one.translate(src, decode=one.settings(beam=beam))
            assert two.translate(src, decode=two.settings(beam=beam)) == in_process
        workers = two.workers.pids
        assert len(workers) == 2 and os.getpid() not in workers
    finally:
        torch.set_num_threads(2)
        two.close()
    assert one.workers.processes == 1 and not one.workers.started  # workers=1 never forks


def test_workers_setting_resolves_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_workers("auto", cpu) == usable_cores() >= 1
    assert resolve_workers(3, cpu) == 3
    assert resolve_workers("auto", cuda) == resolve_workers(4, cuda) == 1


@pytest.mark.slow
def test_cli_with_workers_streams_in_order_and_stops_cleanly_on_ctrl_c(reverse_model, held_out_pairs, translator):
    """`tfm translate --workers 2` writes what one process writes; Ctrl-C (SIGINT to the whole
    process group, as a terminal sends it) ends it with 130, no traceback and no worker left."""
    _, summary = reverse_model
    src, _ = held_out_pairs
    args = [*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--set", "decode.precision=fp32",
            "--batch-size", "8", "--workers", "2"]
    proc = subprocess.run(args, input="\n".join(src) + "\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "2 decoding processes" in proc.stderr
    torch.set_num_threads(1)
    try:
        expected = [t[0].text for t in translator.translate(src)]
    finally:
        torch.set_num_threads(2)
    assert proc.stdout.splitlines() == expected

    # A terminal job gets Ctrl-C even where this test runs with SIGINT ignored (`pytest &` from a
    # non-interactive shell ignores it, and a child keeps an ignored signal through exec, so Python
    # would install no handler): start tfm with SIGINT back at its default, as a terminal has it.
    with_sigint = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])", *args[1:]]
    endless = subprocess.Popen(with_sigint, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # its own process group, like a terminal job
    feeder = threading.Thread(target=lambda: feed_forever(endless.stdin, src), daemon=True)
    feeder.start()
    assert endless.stdout.readline()  # the first chunk is out: the second one's batches go to the workers
    time.sleep(1.0)
    os.killpg(endless.pid, signal.SIGINT)
    _, stderr = endless.communicate(timeout=60)
    assert endless.returncode == 130 and "Traceback" not in stderr, stderr
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(endless.pid, 0)  # nobody left in its process group


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_or_hangup_while_writing_output_leaves_no_file_and_no_worker(reverse_model, held_out_pairs, tmp_path,
                                                                              signum, code):
    """`tfm translate -o out.txt` stopped by a scheduler (SIGTERM to tfm alone) or a hang-up: exit
    143/129 with one line and no traceback, no `out.txt` (it was never complete) and no temporary
    file next to it, and no decoding worker left running (they would print tracebacks later)."""
    _, summary = reverse_model
    src, _ = held_out_pairs
    out = tmp_path / "out" / "out.txt"
    args = [*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--set", "decode.precision=fp32",
            "--batch-size", "8", "--workers", "2", "--output", str(out)]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec(default_signals=(signum,)))
    threading.Thread(target=lambda: feed_forever(proc.stdin, src), daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(f.stat().st_size for f in out.parent.glob(".out.txt.*")):
        time.sleep(0.05)  # the first chunk is written: the next ones' batches go to the workers
    time.sleep(1.0)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in stderr, stderr
    if signum == signal.SIGTERM:  # (after a hang-up stderr, a pipe here, goes to /dev/null)
        assert stderr.strip().splitlines()[-1] == "SIGTERM: stopped", stderr
    assert list(out.parent.iterdir()) == []
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nobody left in its process group


@pytest.mark.slow
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_full_disk_under_stdout_or_output_is_one_line_exit_2(reverse_model, held_out_pairs, tmp_path, unbuffered):
    """A file-size limit 5 bytes short of the translation (a disk that fills up during the last
    write) under `tfm translate > file` and under `--output`: exit 2 and one line naming standard
    output / the file. Before: "error: File too large" naming nothing, a second error from Python
    retrying the write at exit (status 120), and with PYTHONUNBUFFERED=1 (set in many container
    images), whose text stream drops the rest of a short write silently, exit 0 with the last
    line cut short."""
    _, summary = reverse_model
    src, _ = held_out_pairs
    text = ("\n".join(src) + "\n").encode()
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    args = [*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--beam", "1", "--workers", "1",
            "--engine", "torch", "--set", "decode.precision=fp32"]
    full = subprocess.run(args, input=text, capture_output=True, env=env)
    assert full.returncode == 0, full.stderr.decode()
    limit = len(full.stdout) - 5
    assert limit > 1000
    limited = preexec(limits=((resource.RLIMIT_FSIZE, limit),))
    with open(tmp_path / "stdout.txt", "w") as stdout:
        proc = subprocess.run(args, input=text, stdout=stdout, stderr=subprocess.PIPE, env=env, preexec_fn=limited)
    assert (proc.returncode, proc.stderr.decode()) == (2, "error: standard output: File too large (EFBIG)\n")
    assert (tmp_path / "stdout.txt").read_bytes() == full.stdout[:limit]
    out = tmp_path / "out" / "out.txt"
    proc = subprocess.run([*args, "--output", str(out)], input=text, capture_output=True, env=env,
                          preexec_fn=limited)
    assert (proc.returncode, proc.stderr.decode()) == (2, f"error: {out}: File too large (EFBIG)\n")
    assert list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_warnings_into_a_full_disk_do_not_stop_translation(reverse_model, held_out_pairs):
    """`tfm translate … 2> log` with the log's disk full (/dev/full) and an input line that needs a
    warning (invalid UTF-8): the translation is still complete, exit 0. Before: exit 2 and no output,
    since the warning that could not be written ended the run."""
    _, summary = reverse_model
    src, _ = held_out_pairs
    text = ("\n".join(src[:40]) + "\n").encode() + b"wa \xff wb\n"
    args = [*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--beam", "1", "--workers", "1",
            "--set", "decode.precision=fp32"]
    shown = subprocess.run(args, input=text, capture_output=True)
    assert shown.returncode == 0 and b"line 41 is not valid UTF-8" in shown.stderr, shown.stderr
    with open("/dev/full", "w") as full:
        proc = subprocess.run(args, input=text, stdout=subprocess.PIPE, stderr=full)
    assert proc.returncode == 0
    assert proc.stdout == shown.stdout and len(proc.stdout.splitlines()) == 41


def feed_forever(stream, lines: list[str]) -> None:
    try:
        while True:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass  # the translator has exited


def padded_batches(translator, lines: list[str], size: int) -> list[torch.Tensor]:
    """Source id batches of `size` sentences, longest first, as decode_in_batches makes them."""
    ids = [translator.src_sp.encode(line) + [EOS_ID] for line in lines]
    batches = []
    for batch in length_sorted_batches([len(s) for s in ids], size, None):
        src = torch.zeros(len(batch), max(len(ids[i]) for i in batch), dtype=torch.long)
        for row, i in enumerate(batch):
            src[row, : len(ids[i])] = torch.tensor(ids[i])
        batches.append(src)
    return batches


@pytest.mark.parametrize("limits", [dict(max_len_a=1.0, max_len_b=5), dict(max_len_a=0.0, max_len_b=4),
                                    dict(max_len_a=0.0, max_len_b=12, min_len=12)])
def test_continuous_greedy_equals_greedy_batch_by_batch(translator, held_out_pairs, limits, monkeypatch):
    """Rows refilled with the next batches' sentences decode what each batch decodes alone: the
    same tokens, scores up to rounding (joined rows attend over masked-out older cache slots). With
    12 batches of 4 the run outlives its first cache slots, which are dropped, and the shorter
    sentences joining rows that held long ones narrow the sources again (both counted)."""
    from transformer_cli.decoding.search import greedy_search_continuous
    from transformer_cli.model.transformer import DecoderState

    dropped, narrowed = [], []
    drop_front, narrow_sources = DecoderState.drop_front, DecoderState.narrow_sources
    monkeypatch.setattr(DecoderState, "drop_front", lambda self, n: (dropped.append(n), drop_front(self, n)))

    def narrow(self, width):
        narrowed.append((self.src_mask.size(-1), width))
        narrow_sources(self, width)
        assert self.src_mask.size(-1) == width and self.layers[0].cross_attn.key.size(2) == width

    monkeypatch.setattr(DecoderState, "narrow_sources", narrow)
    src_lines, _ = held_out_pairs
    batches = padded_batches(translator, src_lines[:48], 4)
    model = translator.model
    alone = [greedy_search(model, b, BOS_ID, EOS_ID, **limits) for b in batches]
    together = greedy_search_continuous(model, batches, BOS_ID, EOS_ID, **limits)
    assert [[h.tokens for h in hyps] for hyps in together] == [[h.tokens for h in hyps] for hyps in alone]
    for hyps_a, hyps_b in zip(alone, together):
        assert [h.score for h in hyps_b] == pytest.approx([h.score for h in hyps_a], abs=1e-4)
    assert dropped and all(n >= 16 for n in dropped)
    assert narrowed and all(width <= 3 * before // 4 for before, width in narrowed)
    # A longer source joining later widens every row's source (unsorted input): still the same.
    shuffled = [batches[3], batches[0], batches[7]]
    assert [[h.tokens for h in hyps] for hyps in greedy_search_continuous(model, shuffled, BOS_ID, EOS_ID, **limits)] \
        == [[h.tokens for h in greedy_search(model, b, BOS_ID, EOS_ID, **limits)] for b in shuffled]


def test_joining_rows_attend_only_to_their_own_cache_slots(translator, held_out_pairs):
    """DecoderState.admit: the joined rows start at position 0 with −inf over every slot written before
    them and 0 from their first slot on; other rows keep theirs; sources are padded with −inf."""
    model = translator.model
    src_lines, _ = held_out_pairs
    long, short = padded_batches(translator, src_lines[:8], 4)[:2]
    with torch.inference_mode():
        state = model.init_state(*model.encode(long), max_len=4)
        state.positions = torch.zeros(4, dtype=torch.long)
        for _ in range(3):
            model.decode_step(torch.full((4,), BOS_ID), state)
        joining = model.init_state(*model.encode(short), max_len=1)
        state.admit(torch.tensor([1, 3]), joining, torch.tensor([2, 0]))
        assert state.positions.tolist() == [3, 0, 3, 0]
        mask = state.self_attention_mask()[:, 0, 0]  # (4, length + 1): this step's slots
        assert mask.shape == (4, 4)
        assert torch.equal(mask[[0, 2]], torch.zeros(2, 4))
        assert torch.equal(mask[[1, 3], :3], torch.full((2, 3), float("-inf"))) and torch.equal(mask[[1, 3], 3], torch.zeros(2))
        width = (short[[2, 0]] != 0).sum(1)  # the joined sentences' own source lengths
        for row, n in zip((1, 3), width.tolist()):
            assert torch.equal(state.src_mask[row, 0, 0, :n], torch.zeros(n))
            assert bool((state.src_mask[row, 0, 0, n:] == float("-inf")).all())
        expected_key = joining.layers[0].cross_attn.key[2]
        assert torch.equal(state.layers[0].cross_attn.key[1, :, : expected_key.size(1)], expected_key)
        # The step after: the joined rows decode their first position like a fresh state would.
        logits = model.decode_step(torch.full((4,), BOS_ID), state)
        fresh = model.decode_step(torch.full((4,), BOS_ID), model.init_state(*model.encode(short), max_len=1))
        torch.testing.assert_close(logits[[1, 3]], fresh[[2, 0]], atol=1e-4, rtol=1e-4)


def test_continuous_greedy_out_of_memory_falls_back_to_batch_by_batch(translator, held_out_pairs, monkeypatch):
    """A task of several batches that runs out of memory when decoded together is decoded one batch
    at a time instead (each batch still halved if need be): the same translations."""
    import transformer_cli.decoding.torch_engine as translate_module

    src, _ = held_out_pairs
    lines = src[:40]
    before, translator.decode.batch_size = translator.decode.batch_size, 8
    try:
        expected = [t[0].text for t in translator.translate(lines, decode=translator.settings(beam=1))]
        real = translate_module.greedy_search_continuous
        calls = []

        def tight_memory(model, batches, *args, **kwargs):
            calls.append(len(batches))
            if len(batches) > 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(model, batches, *args, **kwargs)

        monkeypatch.setattr(translate_module, "greedy_search_continuous", tight_memory)
        assert [t[0].text for t in translator.translate(lines, decode=translator.settings(beam=1))] == expected
        assert calls == [5]  # 40 sentences: one task of 5 batches, which fell back
    finally:
        translator.decode.batch_size = before
