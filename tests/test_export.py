"""CTranslate2 export: the exported model must decode exactly as tfm does (fp32, same search settings).

tfm and CTranslate2 are compared with each other, never with fixed strings, so the tests do not
depend on the CPU that trained the fixtures.
"""

import resource
import subprocess
import sys

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")

from tests.warm_processes import preexec
from transformer_cli.data.prepare import prepare  # noqa: E402
from transformer_cli.decoding.ct2_engine import CT2Translator
from transformer_cli.decoding.torch_engine import Translator, decode_in_batches  # noqa: E402
from transformer_cli.experiment.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from transformer_cli.experiment.config import config_from_dict  # noqa: E402
from transformer_cli.interop.ct2 import check_convertible, export_ctranslate2  # noqa: E402
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID  # noqa: E402
from transformer_cli.model.transformer import Transformer, TransformerConfig  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402
from transformer_cli.training.train import train  # noqa: E402

from .conftest import multi30k_config, tfm_in_process  # noqa: E402

TFM = [sys.executable, "-m", "transformer_cli.cli"]
# Same search on both sides: no length penalty (tfm's GNMT ((5+len)/6)^a and CTranslate2's len^a
# agree only at a = 0) and a fixed length limit (CTranslate2 takes one limit per batch).
SAME_SEARCH = ["decode.precision=fp32", "decode.length_penalty=0", "decode.max_len_a=0", "decode.max_len_b=30"]


def compare(checkpoint, sources, tmp_path, beam):
    """Token ids of tfm's and CTranslate2's best hypothesis for each source line."""
    out = tmp_path / "ct2"
    if not out.exists():
        export_ctranslate2(checkpoint, out)
    tfm = Translator.from_checkpoint(checkpoint, device="cpu", overrides=SAME_SEARCH)
    ct2 = CT2Translator(out, decode=tfm.decode, compute_type="float32")
    ids = tfm.src_sp.encode(sources, out_type=int)
    ours = [h[0].tokens for h in decode_in_batches(tfm.model, ids, tfm.decode.updated(beam=beam), tfm.device)]
    pieces = [[tfm.src_sp.id_to_piece(i) for i in s] for s in ids]
    theirs = [[tfm.tgt_sp.piece_to_id(p) for p in h[0].tokens] for h in ct2.search(pieces, ct2.decode.updated(beam=beam))]
    return ours, theirs


@pytest.fixture(scope="module")
def multi30k_model(multi30k_2k, tmp_path_factory):
    """A tiny de→en model, 100 steps of the real prepare + train (post-norm here, unlike the
    pre-norm reverse model, so both layouts are checked on trained weights)."""
    run = tmp_path_factory.mktemp("m30k_ct2")
    config = config_from_dict(multi30k_config(multi30k_2k, run / "run", model={"norm_position": "post"},
                                              train={"eval_every": 100, "eval_bleu_sentences": 10}))
    prepare(config, progress=False)
    summary = train(config, progress_bar=False)
    return config, summary


def test_reverse_model_greedy_and_beam_match_tfm(reverse_model, tmp_path):
    config, summary = reverse_model
    src = read_lines(f"{config.data.test}.src.gz")[:100]
    torch.set_num_threads(2)
    ours, theirs = compare(summary.best_checkpoint, src, tmp_path, beam=1)
    assert ours == theirs  # token for token, all 100 sentences
    # CTranslate2 (here with 2 workers of 1 thread) set the thread count that torch shares to 1,
    # and in-process training after it no longer matched a run in its own process.
    assert torch.get_num_threads() == 2
    ours, theirs = compare(summary.best_checkpoint, src, tmp_path, beam=4)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.9 * len(src)


@pytest.mark.slow
def test_multi30k_model_greedy_and_beam_match_tfm(multi30k_model, tmp_path):
    config, summary = multi30k_model
    src = read_lines(f"{config.data.test}.de.gz")[:60]
    ours, theirs = compare(summary.best_checkpoint, src, tmp_path, beam=1)
    assert ours == theirs
    ours, theirs = compare(summary.best_checkpoint, src, tmp_path, beam=4)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.9 * len(src)


@pytest.mark.parametrize("variant", [
    {"norm_position": "post", "activation": "gelu", "positional": "learned", "share_embeddings": False,
     "tie_output": False},
    {"norm_position": "pre", "activation": "gelu", "positional": "sinusoidal", "share_embeddings": True,
     "tie_output": False},
])
def test_other_architectures_score_identically(reverse_model, tmp_path, variant):
    """Random weights in other layouts: CTranslate2's log-probabilities of a target equal tfm's."""
    _, summary = reverse_model
    payload = load_checkpoint(summary.best_checkpoint)
    payload.pop("format")
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**payload["model_config"], **variant})
    model = Transformer(cfg).eval()
    payload["model_config"] = {**payload["model_config"], **variant}
    payload["model"] = model.state_dict()
    save_checkpoint(tmp_path / "variant.pt", payload)
    export_ctranslate2(tmp_path / "variant.pt", tmp_path / "ct2")
    ct2 = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type="float32")
    sp = Translator.from_checkpoint(tmp_path / "variant.pt", device="cpu").src_sp
    src = ["wa wb wc wd", "wp wo", "wa wa wb wc wd we wf wg wh"]
    tgt = ["wd wc wb wa", "wo wp", "wh wg wf we wd wc wb wa wa"]
    scores = ct2.score_batch([sp.encode(s, out_type=str) for s in src], [sp.encode(t, out_type=str) for t in tgt])
    for s, t, result in zip(src, tgt, scores):
        src_ids = torch.tensor([sp.encode(s) + [EOS_ID]])
        tgt_ids = sp.encode(t) + [EOS_ID]
        with torch.no_grad():
            logits = model(src_ids, torch.tensor([[BOS_ID] + tgt_ids[:-1]]))  # (1, T, V)
        ours = logits.log_softmax(-1)[0, torch.arange(len(tgt_ids)), tgt_ids]
        assert torch.allclose(ours, torch.tensor(result.log_probs), atol=1e-4)


def test_unrepresentable_models_are_refused(reverse_model):
    _, summary = reverse_model
    tr = Translator.from_checkpoint(summary.best_checkpoint, device="cpu")
    cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, activation="tanh")
    with pytest.raises(TfmError, match="cannot export to CTranslate2: activation 'tanh'"):
        check_convertible(cfg, tr.src_sp, tr.tgt_sp)


@pytest.mark.slow
def test_cli_export_and_translate_stream(reverse_model, tmp_path):
    config, summary = reverse_model
    out = tmp_path / "model"
    proc = subprocess.run([*TFM, "export", "--checkpoint", str(summary.best_checkpoint), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert {"model.bin", "source.spm.model", "target.spm.model"} <= {p.name for p in out.iterdir()}
    again = tfm_in_process("export", "--checkpoint", summary.best_checkpoint, "-o", out)
    assert again.exit_code == 2 and "--force" in again.stderr
    # --force on a full disk (a file-size limit here): one line naming the directory; the export that
    # was there stays whole and no staging directory is left.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    full = subprocess.run([*TFM, "export", "--checkpoint", str(summary.best_checkpoint), "-o", str(out), "--force"],
                          capture_output=True, text=True, preexec_fn=preexec(limits=((resource.RLIMIT_FSIZE, 20_000),)))
    assert full.returncode == 2 and full.stderr.strip().splitlines()[-1] == f"error: {out}: File too large (EFBIG)"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    src = read_lines(f"{config.data.test}.src.gz")[:30]
    text = "\n".join(src[:20] + ["", "   "] + src[20:]) + "\n"
    # the command line in this process (tfm translate --engine ctranslate2 as a process: test_default_engine.py)
    torch_out = tfm_in_process("translate", "--checkpoint", summary.best_checkpoint, "--beam", "1",
                               "--set", "decode.precision=fp32", input=text)
    for compute_type in ("float32", "int8"):
        proc = tfm_in_process("translate", "--engine", "ctranslate2", "--model", out, "--beam", "1",
                              "--compute-type", compute_type, "--batch-size", "7", input=text)
        assert proc.exit_code == 0, proc.stderr
        lines = proc.stdout.split("\n")[:-1]
        assert len(lines) == 32 and lines[20] == "" and lines[21] == ""
        if compute_type == "float32":
            assert proc.stdout == torch_out.stdout  # same order, same empty lines, same words
    for args, message in ((["--model", str(tmp_path / "nothing")], "not a CTranslate2 model directory"),
                          (["--model", str(out), "--compute-type", "float8"], "--compute-type float8"),
                          ([], "give --checkpoint, or --config")):
        result = tfm_in_process("translate", "--engine", "ctranslate2", *args, input="wa\n")
        assert result.exit_code == 2 and message in result.stderr


def test_force_replaces_only_a_previous_export_and_never_deletes_anything_else(reverse_model, tmp_path,
                                                                              monkeypatch):
    """`--force` once deleted the working directory (`-o .`), a whole run (`-o RUN`) or its
    checkpoints (`-o RUN/checkpoints`). It may replace only a directory that tfm export wrote."""
    _, summary = reverse_model
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint = run / "checkpoints" / "checkpoint_best.pt"
    checkpoint.write_bytes(summary.best_checkpoint.read_bytes())
    (run / "metrics.jsonl").write_text("{}\n")
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    (work / "notes" / "todo.txt").write_text("keep me\n")
    (work / "a_file").write_text("not a directory\n")
    monkeypatch.chdir(work)

    def files() -> dict:
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = files()
    for output, message in ((".", "working directory"), ("..", "working directory"), (run, "this command's input (--checkpoint)"),
                            (run / "checkpoints", "this command's input (--checkpoint)"),
                            ("notes", "holds files tfm did not write there"),
                            ("a_file", "is not a directory")):
        result = tfm_in_process("export", "--checkpoint", checkpoint, "-o", output, "--force")
        assert result.exit_code == 2 and message in result.stderr, (output, result.stderr)
        assert files() == before, output
    assert tfm_in_process("export", "--checkpoint", checkpoint, "-o", "ct2").exit_code == 0
    first = (work / "ct2" / "model.bin").stat().st_ino
    replaced = tfm_in_process("export", "--checkpoint", checkpoint, "-o", "ct2", "--force")
    assert replaced.exit_code == 0, replaced.stderr
    assert (work / "ct2" / "model.bin").stat().st_ino != first  # a new export took the old one's place
    assert sorted(p.name for p in work.iterdir()) == ["a_file", "ct2", "notes"]  # no staging left
