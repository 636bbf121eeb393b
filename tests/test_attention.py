import subprocess
import sys

import pytest
import torch

from tests.conftest import tfm_in_process
from transformer_cli.attention_maps import attention_maps, attention_weights
from transformer_cli.data.batches import pad_batch
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.experiment.checkpoint import load_trained_model
from transformer_cli.model.special_tokens import EOS_ID
from transformer_cli.runtime.errors import TfmError

TFM = [sys.executable, "-m", "transformer_cli.cli"]


@pytest.fixture(scope="module")
def attn_model(reverse_model):
    _, summary = reverse_model
    return load_trained_model(summary.best_checkpoint)


def test_rows_sum_to_one_and_padding_gets_no_weight(attn_model):
    model, sp = attn_model.model, attn_model.src_sp
    # Two sentences of different length in one batch: the shorter one is padded.
    src_ids = [sp.encode("wa wb wc wd we wf wg", out_type=int) + [EOS_ID], sp.encode("wa wb", out_type=int) + [EOS_ID]]
    tgt_ids = [sp.encode("wg wf we wd wc wb wa", out_type=int) + [EOS_ID], sp.encode("wb wa", out_type=int) + [EOS_ID]]
    src, tgt = pad_batch(src_ids), pad_batch(tgt_ids)
    cross = attention_weights(model, src, tgt)  # (L, B, H, T, S)
    assert cross.shape == (2, 2, 4, tgt.size(1), src.size(1))
    short = len(src_ids[1])
    assert torch.allclose(cross.sum(-1), torch.ones_like(cross.sum(-1)), atol=1e-5)
    assert cross[:, 1, :, :, short:].abs().max() == 0  # padded source positions
    self_attn = attention_weights(model, src, encoder_self=True)  # (L, B, H, S, S)
    assert self_attn.shape == (2, 2, 4, src.size(1), src.size(1))
    assert torch.allclose(self_attn.sum(-1), torch.ones_like(self_attn.sum(-1)), atol=1e-5)
    assert self_attn[:, 1, :, :, short:].abs().max() == 0
    # Batched equals alone: padding does not leak into the real positions.
    alone = attention_weights(model, src[1:, :short], tgt[1:, : len(tgt_ids[1])])
    assert torch.allclose(cross[:, 1, :, : len(tgt_ids[1]), :short], alone[:, 0], atol=1e-5)


def test_maps_of_the_models_own_translation(attn_model, reverse_model):
    _, summary = reverse_model
    maps = attention_maps(attn_model, "wa wb wc wd")
    # The plotted target is the model's own greedy translation (compared with tfm's translator,
    # not a fixed string: the fixture's exact outputs depend on the CPU that trained it).
    greedy = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", overrides=["decode.precision=fp32"])
    assert maps.translation == greedy.translate(["wa wb wc wd"], decode=greedy.settings(beam=1))[0][0].text
    layers, heads, rows, cols = maps.weights.shape
    assert (layers, heads) == (2, 4) and rows == len(maps.row_tokens) and cols == len(maps.src_tokens)
    assert maps.src_tokens[-1] == "</s>" and maps.row_tokens[-1] == "</s>"
    assert abs(maps.weights.sum(-1) - 1).max() < 1e-5
    assert abs(maps.layer_average().sum(-1) - 1).max() < 1e-5
    forced = attention_maps(attn_model, "wa wb wc wd", tgt="wa wa")
    assert forced.weights.shape[2] == 3 and forced.translation == "wa wa"
    with pytest.raises(TfmError, match="--src is empty"):
        attention_maps(attn_model, "   ")


@pytest.mark.slow
def test_cli_writes_png_and_refuses_bad_input(reverse_model, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    _, summary = reverse_model
    args = ["attention", "--checkpoint", summary.best_checkpoint, "--src", "wa wb wc"]
    # A real process for the plain case; the variants and the errors in this process (same app).
    proc = subprocess.run([*TFM, *args, "-o", str(tmp_path / "a.png")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for extra in (["--self", "--layer", "1"], ["--tgt", "wc wb wa"]):
        result = tfm_in_process(*args, *extra, "-o", tmp_path / f"a{len(extra)}.png")
        assert result.exit_code == 0, result.stderr
    for name in ("a.png", "a3.png", "a2.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and min(image.size) > 100
    result = tfm_in_process(*args, "--layer", "3", "-o", tmp_path / "x.png")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    assert errors == ["error: --layer 3: the decoder has 2 layers (choose 1 to 2)"], result.stderr
    bad = [(["--layer", "0", "--self"], "the encoder has 2 layers"),
           (["--self", "--tgt", "wc wb wa"], "--tgt has no effect with --self")]
    for extra, message in bad:
        result = tfm_in_process(*args, *extra, "-o", tmp_path / "x.png")
        assert result.exit_code == 2 and message in result.stderr
    for other, message in ((["--checkpoint", tmp_path / "no.pt", "--src", "wa"], "checkpoint not found"),
                           (["--checkpoint", summary.best_checkpoint, "--src", ""], "--src is empty")):
        result = tfm_in_process("attention", *other, "-o", tmp_path / "x.png")
        assert result.exit_code == 2 and result.stderr.startswith("error: ") and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()
