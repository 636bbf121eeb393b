"""Every bad input of docs/reliability.md, fed to the real command line: exit code, message, no traceback.

One row per case. A row's `setup(case_dir, data, run)` writes whatever the case needs and returns
the arguments of `tfm` (and optionally its stdin); `check` looks at the finished process.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from tests.conftest import TFM, tiny_reverse_config, tiny_run, write_reverse_task

# --------------------------------------------------------------------------- corpus helpers


def corpus(case: Path, **edits: Callable[[list[bytes]], list[bytes] | bytes | None]) -> Path:
    """A small reverse-task corpus in case/data as plain files, with `edits[split_side](lines)` applied.

    An edit returns new lines, raw bytes for the whole file, or None to delete the file.
    Returns the config file that prepares it (vocab 40, tiny model).
    """
    data = case / "data"
    write_reverse_task(data, n_train=300, n_test=20)
    for gz in data.glob("*.gz"):
        with gzip.open(gz, "rb") as f:
            lines = f.read().splitlines(keepends=True)
        plain = gz.with_suffix("")
        key = plain.name.replace(".", "_")  # train_src …
        gz.unlink()
        result = edits[key](lines) if key in edits else lines
        if result is None:
            continue
        plain.write_bytes(result if isinstance(result, bytes) else b"".join(result))
    config = case / "c.yaml"
    config.write_text(json.dumps(tiny_reverse_config(data, case / "run")))
    return config


def prepare_case(**edits):
    return lambda case, data, run: (["prepare", "--config", corpus(case, **edits)], None)


def with_line(number: int, raw: bytes):
    def edit(lines: list[bytes]) -> list[bytes]:
        return lines[: number - 1] + [raw] + lines[number:]
    return edit


def directory_instead(case: Path, data, run):
    config = corpus(case, train_src=lambda lines: None)
    (case / "data/train.src").mkdir()
    return ["prepare", "--config", config], None


def truncated_gzip(case: Path, data, run):
    config = corpus(case)
    plain = case / "data/train.src"
    packed = gzip.compress(plain.read_bytes() * 50)
    plain.unlink()
    (case / "data/train.src.gz").write_bytes(packed[: len(packed) // 2])
    return ["prepare", "--config", config], None


def vocab_pieces(case: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(case / "run/spm.model"))
    return [sp.id_to_piece(i) for i in range(sp.vocab_size())]


# --------------------------------------------------------------------------- config helpers


def config_text(text: str):
    def setup(case: Path, data, run):
        path = case / "c.yaml"
        path.write_text(text.replace("MARKER", str(case / "MARKER")))
        return ["train", "--config", path], None
    return setup


def with_settings(*settings: str, command: str = "train"):
    def setup(case: Path, data, run):
        config = tiny_run((data, run), case)
        return [command, "--config", config, *[a for s in settings for a in ("--set", s)]], None
    return setup


# --------------------------------------------------------------------------- translate / checkpoint helpers


def translate_input(text: bytes, *extra: str):
    def setup(case: Path, data, run, checkpoint: Path):
        return ["translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", *extra], text
    return setup


def checkpoint_file(make: Callable[[Path, Path], None]):
    def setup(case: Path, data, run, checkpoint: Path):
        path = case / "bad.pt"
        make(path, checkpoint)
        return ["translate", "--checkpoint", path], b"wa wb wc\n"
    return setup


def crafted_pickle(path: Path, good: Path) -> None:
    """A checkpoint whose unpickling would run `touch MARKER` (if anyone loaded it unsafely)."""
    marker = path.parent / "MARKER"
    code = ("import os, torch\n"
            "class Evil:\n"
            f"    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
            f"torch.save({{'format': 'tfm-checkpoint-1', 'model': Evil()}}, {str(path)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def other_vocabulary(path: Path, good: Path) -> None:
    payload = torch.load(good, weights_only=True)
    sentences = [f"{a}{b} {b}{a}" for a in "abcdefghij" for b in "klmnopqrst"]
    model = path.parent / "other"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(model), vocab_size=30,
                                   minloglevel=2)
    payload["spm_src"] = torch.frombuffer(bytearray((model.parent / "other.model").read_bytes()), dtype=torch.uint8)
    torch.save(payload, path)


def average_different_shapes(case: Path, data, run, checkpoint: Path):
    small = case / "small"
    config = tiny_run((data, run), small, max_steps=2)
    raw = json.loads(config.read_text())
    raw["model"]["d_ff"] = 48
    config.write_text(json.dumps(raw))
    assert subprocess.run([*TFM, "train", "--config", str(config)], capture_output=True).returncode == 0
    return ["average", checkpoint, small / "run/checkpoints/checkpoint_last.pt", "-o", case / "avg.pt"], None


def evaluate_files(hyp: str, ref: str, *extra: str):
    def setup(case: Path, data, run):
        (case / "hyp.txt").write_text(hyp)
        (case / "ref.txt").write_text(ref)
        return ["evaluate", "--hyp", case / "hyp.txt", "--ref", case / "ref.txt", *extra], None
    return setup


# --------------------------------------------------------------------------- the table


@dataclass
class Case:
    name: str
    setup: Callable
    code: int
    message: str  # must appear in stderr ("" = no requirement)
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None
    needs_checkpoint: bool = False


def no_marker(case: Path, proc) -> None:
    assert not (case / "MARKER").exists(), "the crafted pickle ran code"


GARBAGE = bytes(range(256)) * 4 + b"\n\xff\xfe\x00\n"  # every byte value, NULs, invalid UTF-8

CASES = [
    # corpus (prepare)
    Case("corpus: missing file", prepare_case(train_src=lambda lines: None), 2, "corpus file not found"),
    Case("corpus: a directory", directory_instead, 2, "is a directory"),
    Case("corpus: empty file", prepare_case(valid_tgt=lambda lines: b""), 2, "valid.tgt is empty (data.valid)"),
    Case("corpus: line counts differ", prepare_case(train_tgt=lambda lines: lines[:-1]), 2,
         "line counts differ"),
    Case("corpus: invalid UTF-8", prepare_case(train_src=with_line(7, b"wa \xff\xfe wb\n")), 2,
         "train.src: line 7 is not valid UTF-8"),
    Case("corpus: NUL byte", prepare_case(train_tgt=with_line(5, b"wa\x00wb\n")), 2,
         "train.tgt: line 5 contains a NUL byte"),
    Case("corpus: UTF-8 BOM is stripped", prepare_case(train_src=lambda lines: [b"\xef\xbb\xbf" + lines[0], *lines[1:]]),
         0, "", lambda case, proc: assert_no_piece(case, "\ufeff")),
    Case("corpus: CRLF line ends", prepare_case(**{k: (lambda lines: [x.rstrip(b"\n") + b"\r\n" for x in lines])
                                                  for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")}),
         0, "", lambda case, proc: assert_no_piece(case, "\r")),
    Case("corpus: 1M-character train line is dropped", prepare_case(
        train_src=with_line(3, b"wa " * 333_334 + b"\n")), 0, "", lambda case, proc: assert_dropped(proc)),
    Case("corpus: 1M-character valid line is truncated", prepare_case(
        valid_src=with_line(3, b"wa " * 333_334 + b"\n")), 0,
         "warning: data.valid: 1 pair(s) longer than 1022 tokens (model.max_positions - 2) kept but truncated; line(s) 3"),
    Case("corpus: vocab larger than the data supports", lambda case, d, r: (
        ["prepare", "--config", corpus(case), "--set", "vocab.size=5000"], None), 2,
         "key 'vocab.size': 5000 pieces is more than this training data supports"),
    Case("corpus: truncated gzip", truncated_gzip, 2, "truncated or corrupt file"),
    # config
    Case("config: not a mapping", config_text("- a\n- b\n"), 2, "top level must be a mapping"),
    Case("config: unknown key", config_text("model:\n  d_modle: 3\n"), 2, "did you mean 'model.d_model'"),
    Case("config: wrong type", config_text("model:\n  d_model: large\n"), 2, "key 'model.d_model'"),
    Case("config: python object tag", config_text("model: !!python/object/apply:os.system ['touch MARKER']\n"), 2,
         "could not determine a constructor", no_marker),
    Case("config: d_model=0", with_settings("model.d_model=0"), 2, "key 'model.d_model'"),
    Case("config: n_heads=0", with_settings("model.n_heads=0"), 2, "key 'model.n_heads'"),
    Case("config: enc_layers=0", with_settings("model.enc_layers=0"), 2, "key 'model.enc_layers'"),
    Case("config: d_ff=-1", with_settings("model.d_ff=-1"), 2, "key 'model.d_ff'"),
    Case("config: dropout=1.5", with_settings("model.dropout=1.5"), 2, "key 'model.dropout'"),
    Case("config: label_smoothing=-0.1", with_settings("train.label_smoothing=-0.1"), 2, "key 'train.label_smoothing'"),
    Case("config: beam=0", with_settings("decode.beam=0"), 2, "key 'decode.beam'"),
    Case("config: d_model not divisible by n_heads", with_settings("model.n_heads=3"), 2,
         "d_model 32 is not divisible by n_heads 3"),
    Case("config: max_tokens=0", with_settings("train.max_tokens=0"), 2, "key 'train.max_tokens'"),
    Case("config: vocab.size=5", with_settings("vocab.size=5"), 2, "key 'vocab.size'"),
    Case("config: vocab.size differs from the prepared data", with_settings("vocab.size=50"), 2,
         "key 'vocab.size': 50 in the config, but"),
    Case("config: unknown device", with_settings("train.device=gpu"), 2, "'gpu' is not a device"),
    # translate input
    Case("translate: empty stdin", translate_input(b""), 0, "translated 0 sentences",
         lambda case, proc: assert_stdout_lines(proc, 0), needs_checkpoint=True),
    Case("translate: line longer than the positions", translate_input(b"wa wb\n" + b"wc " * 1500 + b"\nwd we\n"), 0,
         "warning: input line 2 has", lambda case, proc: assert_stdout_lines(proc, 3), needs_checkpoint=True),
    Case("translate: binary garbage", translate_input(GARBAGE), 0, "is not valid UTF-8",
         lambda case, proc: assert_stdout_lines(proc, GARBAGE.count(b"\n")), needs_checkpoint=True),
    Case("translate: beam 0", translate_input(b"wa\n", "--beam", "0"), 2, "", needs_checkpoint=True),
    # checkpoints
    Case("checkpoint: zero bytes", checkpoint_file(lambda p, good: p.write_bytes(b"")), 2, "empty file (0 bytes)",
         needs_checkpoint=True),
    Case("checkpoint: truncated", checkpoint_file(lambda p, good: p.write_bytes(good.read_bytes()[:5000])), 2,
         "truncated/corrupt", needs_checkpoint=True),
    Case("checkpoint: a text file", checkpoint_file(lambda p, good: p.write_text("not a model\n")), 2,
         "not a checkpoint file", needs_checkpoint=True),
    Case("checkpoint: another format", checkpoint_file(lambda p, good: torch.save({"weights": torch.ones(3)}, p)), 2,
         "missing format marker", needs_checkpoint=True),
    Case("checkpoint: vocabulary does not match", checkpoint_file(other_vocabulary), 2,
         "source vocabulary has 30 pieces but the model expects 40", needs_checkpoint=True),
    Case("checkpoint: crafted pickle", checkpoint_file(crafted_pickle), 2,
         "refused: it contains Python objects or code", no_marker, needs_checkpoint=True),
    Case("checkpoint: missing", checkpoint_file(lambda p, good: None), 2, "checkpoint not found",
         needs_checkpoint=True),
    Case("average: different shapes", average_different_shapes, 2, "cannot average", needs_checkpoint=True),
    # evaluate
    Case("evaluate: empty hyp and ref", evaluate_files("", ""), 2, "is empty: there is nothing to score"),
    Case("evaluate: line counts differ", evaluate_files("a\nb\n", "a\n"), 2, "line counts differ"),
    Case("evaluate: missing --ref", lambda case, d, r: (["evaluate", "--hyp", case / "h.txt"], None), 2,
         "--hyp needs --ref"),
    Case("evaluate: --beam 0", lambda case, d, r: (["evaluate", "--beam", "0", "--config", "x.yaml"], None), 2, ""),
]


def assert_no_piece(case: Path, char: str) -> None:
    assert not any(char in piece for piece in vocab_pieces(case))


def assert_dropped(proc) -> None:
    assert "too_long: 1" in proc.stdout, proc.stdout


def assert_stdout_lines(proc, n: int) -> None:
    assert proc.stdout.count("\n") == n, proc.stdout


@pytest.fixture(scope="module")
def good_checkpoint(tiny_prepared, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good")
    config = tiny_run(tiny_prepared, root, max_steps=5)
    proc = subprocess.run([*TFM, "train", "--config", str(config)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return root / "run/checkpoints/checkpoint_last.pt"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tiny_prepared, tmp_path, request):
    data, run = tiny_prepared
    extra = (request.getfixturevalue("good_checkpoint"),) if case.needs_checkpoint else ()
    args, stdin = case.setup(tmp_path, data, run, *extra)
    proc = subprocess.run([*TFM, *map(str, args)], capture_output=True, input=stdin if stdin is not None else b"",
                          cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == case.code, proc.stderr
    assert case.message in proc.stderr, proc.stderr
    if case.code == 2 and case.message:
        assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1, proc.stderr
    if case.check is not None:
        case.check(tmp_path, proc)


def test_closed_stdout_pipe_exits_quietly(good_checkpoint, tmp_path):
    lines = "\n".join("wa wb wc wd" for _ in range(3000)) + "\n"
    (tmp_path / "in.txt").write_text(lines)
    cmd = (f"set -o pipefail; {sys.executable} -m transformer_cli.cli translate "
           f"--checkpoint {good_checkpoint} < {tmp_path / 'in.txt'} | head -1")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
