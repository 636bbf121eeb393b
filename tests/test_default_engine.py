"""decode.engine auto: CTranslate2 by default where it applies, its conversion cached beside the
checkpoint; tfm's own engine, with the reason, where it does not.

The tiny model is trained here for a few steps: the tests compare engines and files with each other,
never with fixed strings, so they hold whichever CPU trained it.
"""

import gzip
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import sentencepiece as spm

ctranslate2 = pytest.importorskip("ctranslate2")

from transformer_cli.experiment.checkpoint import bytes_to_tensor, load_checkpoint, save_checkpoint  # noqa: E402
from transformer_cli.experiment.config import load_config  # noqa: E402
from transformer_cli.interop.ct2_cache import CACHE_NAME, cached_conversion  # noqa: E402
from transformer_cli.training.train import train  # noqa: E402

from .conftest import TFM, tfm_in_process, tiny_run  # noqa: E402

LINES = "a b c d\nd c b a\n\nb b a c d\nc\n"


@pytest.fixture(scope="module")
def trained(tiny_prepared, tmp_path_factory):
    """(config file, checkpoint) of a tiny run trained for a few steps."""
    root = tmp_path_factory.mktemp("engine")
    config = tiny_run(tiny_prepared, root, max_steps=20, eval_every=20)
    train(load_config(config), progress_bar=False)
    return config, root / "run/checkpoints/checkpoint_last.pt"


@pytest.fixture
def checkpoint(trained, tmp_path):
    """A private copy of the checkpoint (its cache starts empty)."""
    own = tmp_path / "checkpoints" / "model.pt"
    own.parent.mkdir()
    shutil.copy(trained[1], own)
    return own


def conversions(checkpoint: Path) -> list[str]:
    cache = checkpoint.parent / CACHE_NAME
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@pytest.mark.slow
def test_auto_translates_through_ctranslate2_as_the_exported_directory_does(checkpoint, tmp_path):
    auto = tfm_in_process("translate", "--checkpoint", checkpoint, input=LINES)
    assert auto.exit_code == 0, auto.stderr
    assert "CTranslate2 int8 on cpu" in auto.stderr.splitlines()[-1]
    assert "engine: torch" not in auto.stderr
    [conversion] = conversions(checkpoint)
    assert tfm_in_process("export", "--checkpoint", checkpoint, "-o", tmp_path / "exported").exit_code == 0
    exported = tfm_in_process("translate", "--engine", "ctranslate2", "--model", tmp_path / "exported", input=LINES)
    assert exported.exit_code == 0, exported.stderr
    assert auto.stdout == exported.stdout and len(auto.stdout.splitlines()) == 5
    greedy = [tfm_in_process("translate", *args, "--beam", "1", input=LINES).stdout for args in
              (["--checkpoint", checkpoint], ["--engine", "ctranslate2", "--model", tmp_path / "exported"])]
    assert greedy[0] == greedy[1]
    assert conversions(checkpoint) == [conversion]  # reused, not converted again


def test_the_cache_is_reused_and_follows_the_checkpoints_content(checkpoint, trained, tmp_path):
    first = cached_conversion(checkpoint)
    assert first.converted and first.directory.parent == checkpoint.parent / CACHE_NAME
    again = cached_conversion(checkpoint)
    assert not again.converted and again.directory == first.directory
    os.utime(checkpoint, ns=(1, 1))  # same content, another identity: hashed, found, remembered
    assert cached_conversion(checkpoint).directory == first.directory
    assert len(json.loads((first.directory / "tfm_source.json").read_text())["identities"]) == 2
    # A new checkpoint replaces the old by a rename, as training writes one: a new conversion, the old one gone.
    payload = load_checkpoint(checkpoint)
    payload["model"] = {name: tensor * 1.5 if name.endswith("weight") else tensor
                        for name, tensor in payload["model"].items()}
    save_checkpoint(tmp_path / "new.pt", payload)
    os.replace(tmp_path / "new.pt", checkpoint)
    changed = cached_conversion(checkpoint)
    assert changed.converted and changed.directory != first.directory
    assert conversions(checkpoint) == [changed.directory.name]


@pytest.mark.slow
def test_a_kill_mid_conversion_leaves_no_half_model(checkpoint):
    cache = checkpoint.parent / CACHE_NAME

    def writing() -> bool:  # the first file of the conversion is in its staging directory
        staging = [p for p in (cache.iterdir() if cache.exists() else []) if p.name.endswith(".staging")]
        return any(any(s.iterdir()) for s in staging)

    # The tiny model's conversion writes for milliseconds: on a busy machine this test may not look, or
    # kill, in that window. A conversion that ended by itself is removed and made again, up to 5 times.
    for _attempt in range(5):
        converting = subprocess.Popen([sys.executable, "-c", "import sys; from transformer_cli.interop.ct2_cache import "
                                       "cached_conversion; cached_conversion(sys.argv[1])", str(checkpoint)])
        deadline = time.monotonic() + 60
        while not writing() and converting.poll() is None:
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.001)
        converting.send_signal(signal.SIGKILL)
        if converting.wait() == -signal.SIGKILL:
            break
        assert converting.returncode == 0
        shutil.rmtree(cache)
    else:
        pytest.fail("5 conversions ended before one could be killed while writing")
    assert not [n for n in conversions(checkpoint) if not n.startswith(".")], "a half conversion took the name"
    done = cached_conversion(checkpoint)
    assert done.converted and conversions(checkpoint) == [done.directory.name]  # the dead writer's staging removed
    result = tfm_in_process("translate", "--checkpoint", checkpoint, input=LINES)
    assert result.exit_code == 0 and "CTranslate2" in result.stderr


@pytest.mark.slow
def test_two_first_uses_at_once_end_with_one_good_conversion(checkpoint, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text(LINES * 20)
    runs = [subprocess.Popen([*TFM, "translate", "--checkpoint", str(checkpoint), "-i", str(source), "-o",
                              str(tmp_path / f"out{i}")], stderr=subprocess.PIPE, text=True) for i in range(2)]
    errors = [run.communicate()[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    assert all("CTranslate2 int8" in e for e in errors), errors
    assert (tmp_path / "out0").read_text() == (tmp_path / "out1").read_text()
    assert len(conversions(checkpoint)) == 1  # one conversion, no staging directory left


@pytest.mark.slow
def test_an_unwritable_checkpoint_directory_converts_into_a_temporary_one(checkpoint):
    (checkpoint.parent / CACHE_NAME).write_text("not a directory")  # the cache cannot be made there
    proc = subprocess.run([*TFM, "translate", "--checkpoint", str(checkpoint)], input=LINES, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "cannot be written" in proc.stderr and "CTranslate2 int8" in proc.stderr
    temporary = next(w for w in proc.stderr.split() if "tfm-ctranslate2-" in w)
    assert not Path(temporary.rstrip(",:")).exists()  # removed at exit
    assert (checkpoint.parent / CACHE_NAME).read_text() == "not a directory"


@pytest.mark.parametrize("args, reason", [
    (["--checkpoint", "{ckpt}", "--checkpoint", "{ckpt}"], "engine: torch (ensembles are tfm's own)"),
    (["--checkpoint", "{ckpt}", "--sample", "--nbest", "2"], "engine: torch (sampling is tfm's own"),
    (["--checkpoint", "{ckpt}", "--quantize", "int8"], "engine: torch (--quantize is tfm's own int8"),
    (["--checkpoint", "{ckpt}", "--set", "decode.precision=fp32"], "engine: torch (decode.precision fp32"),
])
@pytest.mark.slow
def test_settings_only_tfm_has_fall_back_to_its_engine_and_say_why(checkpoint, args, reason):
    args = [a.replace("{ckpt}", str(checkpoint)) for a in args]
    result = tfm_in_process("translate", *args, input=LINES)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count(reason) == 1, result.stderr
    assert "tfm's engine (torch)" in result.stderr.splitlines()[-1]
    explicit = tfm_in_process("translate", "--engine", "ctranslate2", *args, input=LINES)
    assert explicit.exit_code == 2 and f"--engine ctranslate2: {reason.split('(', 1)[1].rstrip(')')}" in explicit.stderr


def test_alignments_under_auto_are_tfm_engines_on_ctranslate2s_translations(checkpoint, tmp_path):
    """CTranslate2 searches and tfm's engine aligns its output (one forced pass); a bare exported
    directory has no weights to align with."""
    from transformer_cli.decoding.engine import open_engine
    from transformer_cli.decoding.hypothesis import Hypothesis
    from transformer_cli.decoding.torch_engine import Translator

    lines = [f"{a} {b} {c}" for a in "abcd" for b in "dcba" for c in "bd"]
    auto = tfm_in_process("translate", "--checkpoint", checkpoint, "--alignment", input="\n".join(lines) + "\n")
    assert auto.exit_code == 0, auto.stderr
    assert "engine: torch" not in auto.stderr
    assert "CTranslate2" in auto.stderr.splitlines()[-1] and "word alignments by tfm's engine" in auto.stderr
    for line, out in zip(lines, auto.stdout.splitlines(), strict=True):
        text, links = out.split("\t")
        assert all(int(i) < len(line.split()) and int(j) < len(text.split())
                   for i, j in (x.split("-") for x in links.split()))
    engine = open_engine(None, None, [checkpoint], alignment=True)
    own = Translator.from_checkpoint(checkpoint, device="cpu")
    try:
        assert engine.name == "ctranslate2" and engine.aligner is not None
        pieces = engine.tokenize(lines)
        found = engine.search(pieces)
        source_ids = [[own.src_sp.piece_to_id(p) for p in sentence] for sentence in pieces]
        output_ids = [[Hypothesis([own.tgt_sp.piece_to_id(p) for p in h.tokens], h.score) for h in sentence]
                      for sentence in found]
        expected = own.align(lines, source_ids, output_ids, engine.decode)
        assert [[t.alignment for t in sentence] for sentence in engine.translate(lines)] == expected
    finally:
        engine.close()
        own.close()
    assert tfm_in_process("export", "--checkpoint", checkpoint, "-o", tmp_path / "exported").exit_code == 0
    bare = tfm_in_process("translate", "--model", tmp_path / "exported", "--alignment", input="a b\n")
    assert bare.exit_code == 2 and "come from tfm's own engine run on the model's checkpoint" in bare.stderr
    assert "not --model DIR" in bare.stderr and len(bare.stderr.strip().splitlines()) == 1


def test_ctranslate2_searches_a_chunk_over_max_work_a_part_at_a_time_in_order(checkpoint):
    from transformer_cli.decoding.budget import decoding_shape, decoding_work
    from transformer_cli.decoding.engine import open_engine

    lines = [f"{a} {b} {c}" for a in "abcd" for b in "dcba" for c in "bd"] + ["", "c"]
    engine = open_engine(None, ["decode.batch_size=1"], [checkpoint])  # one line a batch, split or not
    try:
        assert engine.name == "ctranslate2"
        whole = [t[0].text for t in engine.translate(lines)]
        sizes = engine.member_configs
        longest = max(map(len, engine.tokenize(lines)))
        one_line = decoding_work(sizes, decoding_shape(sizes[0], engine.decode, 1, longest))
        engine.decode = engine.decode.model_copy(update={"max_work": 3.5 * one_line})
        searches = []
        search_later = engine.search_later
        engine.search_later = lambda sources, *args, **kwargs: (searches.append(len(sources)),
                                                                search_later(sources, *args, **kwargs))[1]
        assert [t[0].text for t in engine.translate(lines)] == whole
        assert searches[0] == 3 and len(searches) > 5 and sum(searches) == len(lines) - 1  # the longest first
    finally:
        engine.close()


def test_without_ctranslate2_tfm_translates_with_its_engine_and_says_how_to_get_it(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    result = tfm_in_process("translate", "--checkpoint", checkpoint, input=LINES)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("engine: torch (CTranslate2 is not installed: pip install ctranslate2") == 1
    assert not conversions(checkpoint)
    explicit = tfm_in_process("translate", "--engine", "ctranslate2", "--checkpoint", checkpoint, input=LINES)
    assert explicit.exit_code == 2 and "not installed" in explicit.stderr


def test_a_model_ctranslate2_cannot_express_falls_back(checkpoint, tiny_prepared, tmp_path):
    """A vocabulary whose special pieces sit at other ids (CTranslate2 finds them by their text)."""
    payload = load_checkpoint(checkpoint)
    size = payload["model_config"]["tgt_vocab_size"]
    text = tmp_path / "text.txt"
    text.write_text(gzip.decompress((tiny_prepared[0] / "train.src.gz").read_bytes()).decode())
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(input=str(text), model_writer=model, vocab_size=size, model_type="bpe",
                                   pad_id=3, unk_id=1, bos_id=2, eos_id=0, minloglevel=2)
    assert spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size() == size
    payload["spm_src"] = payload["spm_tgt"] = bytes_to_tensor(model.getvalue())
    save_checkpoint(checkpoint, payload)
    result = tfm_in_process("translate", "--checkpoint", checkpoint, input=LINES)
    assert result.exit_code == 0, result.stderr
    assert "engine: torch (CTranslate2 cannot express this model: source vocabulary id 3 is '<pad>'" in result.stderr
    assert not [n for n in conversions(checkpoint) if not n.startswith(".")]


def test_evaluate_uses_the_same_engine(trained, tmp_path):
    config, _ = trained
    result = tfm_in_process("evaluate", "--config", config, "--split", "test", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"].startswith("CTranslate2 int8")
    torch_run = json.loads(tfm_in_process("evaluate", "--config", config, "--split", "test", "--json",
                                          "--engine", "torch").stdout)
    assert torch_run["engine"].startswith("tfm's engine (torch)")


def test_settings_and_options_of_the_engine_are_checked():
    bad = tfm_in_process("translate", "--engine", "onnx", "--checkpoint", "x.pt", input="a\n")
    assert bad.exit_code == 2 and "--engine onnx: choose auto, torch, ctranslate2" in bad.stderr


def test_without_quantize_dynamic_the_torch_fallback_ends_in_fp32_with_a_message(monkeypatch):
    """torch.ao.quantization is deprecated: its removal must leave tfm working (fp32, saying why)."""
    import torch.ao.quantization

    from transformer_cli.model import cpu_inference
    from transformer_cli.runtime import precision

    monkeypatch.delattr(torch.ao.quantization, "quantize_dynamic")
    cpu_inference.int8_quantization_works.cache_clear()
    monkeypatch.setattr(precision, "choose_precision",  # a CPU where auto would pick int8 (no fast bf16)
                        lambda *a, **k: precision.PrecisionChoice(False, "no fast bf16 on this CPU"))
    monkeypatch.delenv(precision.PRECISION_ENV, raising=False)
    try:
        choice = precision.choose_decoding_precision("auto", torch.device("cpu"))
        assert not choice.int8 and not choice.bf16 and "int8 quantization unavailable" in choice.reason
    finally:
        cpu_inference.int8_quantization_works.cache_clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_serve_decodes_through_ctranslate2_as_translate_does(checkpoint):
    """The same answers as `tfm translate`, where the length limit is the same for every line (CTranslate2
    takes one limit per batch, and the server batches lines otherwise than translate does)."""
    lines = [line for line in LINES.splitlines()]
    fixed_limit = ["--set", "decode.max_len_a=0", "--set", "decode.max_len_b=12"]
    expected = tfm_in_process("translate", "--checkpoint", checkpoint, *fixed_limit, input=LINES).stdout.splitlines()
    port = free_port()
    server = subprocess.Popen([*TFM, "serve", "--checkpoint", str(checkpoint), "--port", str(port), *fixed_limit],
                              stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stderr.readline()
        assert "CTranslate2 int8" in banner, banner
        for _ in range(100):
            try:
                status, body = post(port, {"text": lines})
                break
            except (ConnectionError, urllib.error.URLError):
                time.sleep(0.1)
        assert status == 200 and body["translations"] == expected
        status, body = post(port, {"text": lines[:1], "sample": True})
        assert status == 422 and "sampling" in body["error"] and "CTranslate2" in body["error"]
        # constraints and avoided terms go to tfm's engine, made at the first such request
        status, body = post(port, {"text": lines[:2], "constraints": [["b d"], []], "avoid": [[], ["n"]]})
        assert status == 200 and "b d" in body["translations"][0] and body["unmet"] == [[], []], body
        assert "n" not in body["translations"][1], body
        assert post(port, {"text": lines[:2]})[1]["translations"] == expected[:2]  # the server goes on
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert "requests with constraints or avoided terms decode with tfm's engine" in server.stderr.read()


def test_a_prefix_through_ctranslate2_is_tfms_prefix(checkpoint):
    """--prefix becomes CTranslate2's target_prefix: in float32 greedy the same tokens as tfm's fp32
    search forced through the prefix; in the default int8 every line starts with it."""
    same = ["--beam", "1", "--prefix", "wa wb", "--set", "decode.max_len_a=0", "--set", "decode.max_len_b=12"]
    ct2 = tfm_in_process("translate", "--checkpoint", checkpoint, "--compute-type", "float32", *same, input=LINES)
    ours = tfm_in_process("translate", "--checkpoint", checkpoint, "--engine", "torch", "--set",
                          "decode.precision=fp32", *same, input=LINES)
    assert ct2.exit_code == ours.exit_code == 0, ct2.stderr + ours.stderr
    assert "CTranslate2 float32" in ct2.stderr and ct2.stdout == ours.stdout
    default = tfm_in_process("translate", "--checkpoint", checkpoint, "--prefix", "wa wb", "--nbest", "2",
                             input=LINES)
    assert default.exit_code == 0 and "CTranslate2 int8" in default.stderr
    texts = [line.split("\t")[3] for line in default.stdout.splitlines()]
    assert len(texts) == 10 and all(t.startswith("wa wb") or t == "" for t in texts) and texts.count("") == 2


def test_device_cuda_without_a_gpu_is_one_line(checkpoint):
    from transformer_cli.decoding.engine import gpu_present

    if gpu_present():
        pytest.skip("this machine has a GPU")
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--device", "cuda", input=LINES)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "CUDA" in result.stderr, result.stderr


class BrokenOnTheGpu:
    """A real CTranslate2 translator (on the CPU) that fails as PyPI's CUDA 12 build does on a CUDA 13
    machine: the model loads, translating raises. `after`: calls that still work first."""

    def __init__(self, translator, after: int):
        self.translator, self.after = translator, after

    def translate_batch(self, *args, asynchronous: bool = False, **kwargs):
        results = self.translator.translate_batch(*args, asynchronous=asynchronous, **kwargs)
        self.after -= 1
        if self.after >= 0:
            return results
        if not asynchronous:
            raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")
        return [Failing() for _ in results]  # as CTranslate2's threads report it: from the result


class Failing:
    def result(self):
        raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")


@pytest.mark.parametrize("works_first", [0, 1])
def test_a_ctranslate2_that_cannot_translate_on_the_gpu_gives_way_or_one_line(checkpoint, monkeypatch, works_first):
    """A GPU that CTranslate2 sees but cannot translate on (a missing cuBLAS, found only at the first
    translation; no GPU here, so its device count and the failure are simulated around the real
    library). auto checks with one token at open and translates with tfm's engine instead, saying why;
    --engine ctranslate2 stops with that line; a failure after the check is one line, not a traceback."""
    real = ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)
    supported = ctranslate2.get_supported_compute_types
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types",
                        lambda device: {"float32", "float16"} if device == "cuda" else supported(device))
    monkeypatch.setattr(ctranslate2, "Translator", lambda path, device, compute_type, **kw: BrokenOnTheGpu(
        real(path, device="cpu", compute_type="float32", **kw), works_first))
    result = tfm_in_process("translate", "--checkpoint", checkpoint, input=LINES)
    if works_first:  # the check passed; the translation itself fails
        assert result.exit_code == 2 and "Traceback" not in result.stderr
        assert "error: CTranslate2 failed on cuda: Library libcublas.so.12 is not found" in result.stderr
        return
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("\n") == LINES.count("\n")
    assert ("engine: torch (CTranslate2 cannot translate on cuda here (Library libcublas.so.12 is not found or "
            "cannot be loaded))") in result.stderr
    explicit = tfm_in_process("translate", "--engine", "ctranslate2", "--checkpoint", checkpoint, input=LINES)
    assert explicit.exit_code == 2 and "--engine ctranslate2: CTranslate2 cannot translate on cuda" in explicit.stderr
    assert "Traceback" not in explicit.stderr


def _damage(directory: Path, how: str) -> None:
    if how == "model.bin deleted":
        (directory / "model.bin").unlink()
    elif how == "model.bin truncated":
        os.truncate(directory / "model.bin", 100)
    elif how == "config.json replaced":
        (directory / "config.json").write_text('{"add_source_eos": false}')
    elif how == "tfm_decode.json deleted":
        (directory / "tfm_decode.json").unlink()
    elif how == "model.bin garbled, size and time kept":  # past what the record can see: CTranslate2's reading catches it
        path = directory / "model.bin"
        status = path.stat()
        path.write_bytes(b"\0" * status.st_size)
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    elif how == "its record deleted":
        (directory / "tfm_source.json").unlink()


@pytest.mark.parametrize("how", ["model.bin deleted", "model.bin truncated", "config.json replaced",
                                 "tfm_decode.json deleted", "model.bin garbled, size and time kept",
                                 "its record deleted"])
@pytest.mark.slow
def test_a_damaged_conversion_is_made_again_with_one_line_and_the_checkpoints_settings(checkpoint, how):
    """tfm's own cache heals: whatever was damaged, the next command converts again (one warning
    line, no temporary directory, no 'export it again'), and translates as before, with the decode
    settings of the checkpoint (beam included), never a default."""
    first = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.beam=3", input=LINES)
    assert first.exit_code == 0, first.stderr
    [conversion] = conversions(checkpoint)
    _damage(checkpoint.parent / CACHE_NAME / conversion, how)
    healed = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.beam=3", input=LINES)
    assert healed.exit_code == 0, healed.stderr
    assert healed.stdout == first.stdout
    warnings = [line for line in healed.stderr.splitlines() if line.startswith("warning:")]
    if how != "its record deleted":  # (without its record it is no conversion at all: simply made)
        assert len(warnings) == 1 and "made it again" in warnings[0], healed.stderr
    assert "temporary" not in healed.stderr and "export it again" not in healed.stderr
    [again] = conversions(checkpoint)
    record = json.loads((checkpoint.parent / CACHE_NAME / again / "tfm_source.json").read_text())
    assert set(record["files"]) >= {"model.bin", "config.json", "tfm_decode.json"}
    settings = json.loads((checkpoint.parent / CACHE_NAME / again / "tfm_decode.json").read_text())
    assert settings["decode"] == load_checkpoint(checkpoint)["config"]["decode"]
    quiet = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.beam=3", input=LINES)
    assert quiet.stdout == first.stdout and "warning" not in quiet.stderr  # healed for good


@pytest.mark.slow
def test_a_checkpoint_replaced_under_a_server_is_reported_not_half_used(checkpoint, tmp_path):
    """One snapshot behind a server: after the checkpoint is replaced, the requests that need tfm's
    engine (made at the first one) are refused with 503 naming the file, instead of loading the new
    model beside the CTranslate2 one that answers the others, which keeps answering."""
    port = free_port()
    server = subprocess.Popen([*TFM, "serve", "--checkpoint", str(checkpoint), "--port", str(port)],
                              stderr=subprocess.PIPE, text=True)
    try:
        assert "CTranslate2" in server.stderr.readline()
        for _ in range(100):
            try:
                status, plain = post(port, {"text": ["a b c d"]})
                break
            except (ConnectionError, urllib.error.URLError):
                time.sleep(0.1)
        assert status == 200
        payload = load_checkpoint(checkpoint)
        payload["model"] = {name: tensor * 1.5 if name.endswith("weight") else tensor
                            for name, tensor in payload["model"].items()}
        save_checkpoint(tmp_path / "new.pt", payload)
        os.replace(tmp_path / "new.pt", checkpoint)  # as training writes a checkpoint
        status, body = post(port, {"text": ["a b c d"], "constraints": [["b d"]]})
        assert status == 503 and "replaced after the server started" in body["error"], body
        status, body = post(port, {"text": "<p>a <b>b</b> c d</p>", "format": "html"})  # alignments: tfm's engine too
        assert status == 503 and "word alignments and documents with markup" in body["error"], body
        assert post(port, {"text": ["a b c d"]}) == (200, plain)  # the model it started with
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in stderr, stderr


def test_a_compute_type_that_cannot_apply_is_refused_with_the_reason(checkpoint):
    """--compute-type is CTranslate2's: where tfm's engine decodes (sampling, here) it was silently ignored."""
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--sample", "--compute-type", "int8", input=LINES)
    assert result.exit_code == 2 and "--compute-type int8 is CTranslate2's" in result.stderr, result.stderr
    assert "sampling" in result.stderr and not result.stdout
