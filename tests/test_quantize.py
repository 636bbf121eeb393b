import subprocess
import sys

import pytest
import sacrebleu
import torch

from transformer_cli.cpu_inference import PackedLinear
from transformer_cli.files import read_lines
from transformer_cli.translate import Translator

TFM = [sys.executable, "-m", "transformer_cli.cli"]


@pytest.mark.parametrize("beam", [1, 4])
def test_int8_decoding_keeps_quality(reverse_model, beam):
    config, summary = reverse_model
    int8 = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", precision="int8")
    assert int8.decode.precision == "int8"
    linears = [m for m in int8.model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in int8.model.modules() if "DynamicQuantizedLinear" in type(m).__name__
                 or type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")]
    assert not linears and quantized  # every Linear layer was replaced
    src, ref = read_lines(f"{config.data.test}.src.gz"), read_lines(f"{config.data.test}.tgt.gz")
    hyps = [t[0].text for t in int8.translate(src, beam=beam)]
    assert sacrebleu.corpus_bleu(hyps, [ref]).score >= 90


@pytest.mark.slow
def test_int8_is_off_by_default_and_reachable_from_the_cli(reverse_model):
    _, summary = reverse_model
    default = Translator.from_checkpoint(summary.best_checkpoint, device="cpu")
    assert default.decode.precision != "int8"
    # Not quantized: Linear layers stay floating point (pre-packed for oneDNN on CPU).
    assert not any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in default.model.modules())
    assert any(isinstance(m, (torch.nn.Linear, PackedLinear)) for m in default.model.modules())
    base = [*TFM, "translate", "--checkpoint", str(summary.best_checkpoint), "--beam", "2"]
    for extra in (["--quantize", "int8"], ["--set", "decode.precision=int8"]):
        proc = subprocess.run([*base, *extra], input="wa wb wc\n\nwd we\n", capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.split("\n")
        assert len(lines) == 4 and lines[1] == "" and lines[3] == "" and lines[0] and lines[2]
    proc = subprocess.run([*base, "--quantize", "int4"], input="wa\n", capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --quantize int4")
