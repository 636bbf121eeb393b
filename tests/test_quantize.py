
import pytest
import sacrebleu
import torch

from tests.conftest import tfm_in_process
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.runtime.files import read_lines


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
    hyps = [t[0].text for t in int8.translate(src, decode=int8.settings(beam=beam))]
    assert sacrebleu.corpus_bleu(hyps, [ref]).score >= 90


def quantized_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__module__.startswith("torch.ao.nn.quantized")]


@pytest.mark.parametrize("bf16_speedup, env, expected", [
    (0.02, None, "int8"),  # an AVX2-only CPU (bf16 emulated: 100x slower there)
    (2.3, None, "bf16"),  # an AVX512_BF16 CPU
    (1.2, None, "int8"),  # bf16 not fast enough to pick
    (0.02, "fp32", "fp32"),  # TFM_PRECISION means what it says
    (0.02, "bf16", "bf16"),
])
def test_auto_decodes_in_int8_where_bf16_is_slow(reverse_model, monkeypatch, bf16_speedup, env, expected):
    from transformer_cli.runtime import precision

    _, summary = reverse_model
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *shape: bf16_speedup)
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    if env is None:
        monkeypatch.delenv(precision.PRECISION_ENV, raising=False)
    else:
        monkeypatch.setenv(precision.PRECISION_ENV, env)
    auto = Translator.from_checkpoint(summary.best_checkpoint, device="cpu")
    assert auto.decode.precision == "auto" and auto.precision.name == expected
    assert bool(quantized_modules(auto.model)) == (expected == "int8")
    assert auto.precision.describe().startswith({"int8": "int8 dynamic quantization (auto: bf16 matmuls",
                                                 "bf16": "bf16 autocast", "fp32": "fp32"}[expected])
    explicit = Translator.from_checkpoint(summary.best_checkpoint, device="cpu", precision="fp32")
    assert explicit.precision.name == "fp32" and not quantized_modules(explicit.model)


def test_auto_falls_back_to_fp32_where_torch_cannot_quantize(monkeypatch):
    from transformer_cli.model import cpu_inference
    from transformer_cli.runtime import precision

    assert cpu_inference.int8_quantization_works()  # this torch can (the probe agrees with nn.Linear)
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda *shape: 0.02)
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.delenv(precision.PRECISION_ENV, raising=False)
    monkeypatch.setattr(cpu_inference, "int8_quantization_works", lambda: False)
    choice = precision.choose_decoding_precision("auto", torch.device("cpu"))
    assert choice.name == "fp32" and "int8 quantization unavailable" in choice.reason


@pytest.mark.slow
def test_int8_is_reachable_from_the_cli(reverse_model):
    _, summary = reverse_model
    base = ["translate", "--checkpoint", summary.best_checkpoint, "--beam", "2"]  # the command line, in this process
    for extra in (["--quantize", "int8"], ["--set", "decode.precision=int8"]):
        result = tfm_in_process(*base, *extra, input="wa wb wc\n\nwd we\n")
        assert result.exit_code == 0, result.stderr
        lines = result.stdout.split("\n")
        assert len(lines) == 4 and lines[1] == "" and lines[3] == "" and lines[0] and lines[2]
    result = tfm_in_process(*base, "--quantize", "int4", input="wa\n")
    assert result.exit_code == 2 and result.stderr.startswith("error: --quantize int4")
