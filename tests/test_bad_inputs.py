"""Every bad input of docs/reliability.md, fed to the real command line: exit code, message, no traceback.

One row per case. A row's `setup(case_dir, data, run)` writes whatever the case needs and returns
the arguments of `tfm` (and optionally its stdin); `check` looks at the finished command. The
command runs in this process (Typer's runner: the same parsing, error handling and exit codes as
the `tfm` script, without a new Python and torch import per row); the faults that need a real
process (signals, resource limits, pipes) are in test_reliability.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from tests.conftest import tiny_reverse_config, tiny_run, write_reverse_task
from tests.warm_processes import tfm_in_scripts
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.config import load_config
from transformer_cli.training.train import train

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
    """translate `text` with the good checkpoint (fp32) and `extra` arguments ("{checkpoint}": its path)."""
    def setup(case: Path, data, run, checkpoint: Path):
        more = [checkpoint if a == "{checkpoint}" else a for a in extra]
        return ["translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", *more], text
    return setup


def checkpoint_file(make: Callable[[Path, Path], None]):
    def setup(case: Path, data, run, checkpoint: Path):
        path = case / "bad.pt"
        make(path, checkpoint)
        return ["translate", "--checkpoint", path], b"wa wb wc\n"
    return setup


class RunsACommandWhenLoaded:
    """Pickled as a call of os.system: unpickling it runs `command`."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted_pickle(path: Path, good: Path) -> None:
    """A checkpoint whose unpickling would run `touch MARKER` (if anyone loaded it unsafely)."""
    torch.save({"format": "tfm-checkpoint-1", "model": RunsACommandWhenLoaded(f"touch {path.parent / 'MARKER'}")}, path)


def other_vocabulary(path: Path, good: Path) -> None:
    payload = torch.load(good, weights_only=True)
    sentences = [f"{a}{b} {b}{a}" for a in "abcdefghij" for b in "klmnopqrst"]
    model = path.parent / "other"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(model), vocab_size=30,
                                   minloglevel=2)
    payload["spm_src"] = torch.frombuffer(bytearray((model.parent / "other.model").read_bytes()), dtype=torch.uint8)
    torch.save(payload, path)


def other_vocabulary_same_size(path: Path, good: Path) -> None:
    """The good checkpoint with sentencepiece models of its size (40) trained on other text."""
    payload = torch.load(good, weights_only=True)
    sentences = [f"{a}{b} {b}{a}{a}" for a in "abcdefghijklm" for b in "nopqrstuvwxyz"]
    model = path.parent / "other40"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(model), vocab_size=40,
                                   minloglevel=2, pad_id=0, unk_id=1, bos_id=2, eos_id=3)
    for side in ("src", "tgt"):
        payload[f"spm_{side}"] = torch.frombuffer(bytearray(model.with_suffix(".model").read_bytes()), dtype=torch.uint8)
    torch.save(payload, path)


def ensemble_with(make: Callable[[Path, Path], None]):
    """translate with an ensemble of the good checkpoint and a second one that `make` writes."""
    def setup(case: Path, data, run, checkpoint: Path):
        path = case / "second.pt"
        make(path, checkpoint)
        return ["translate", "--checkpoint", checkpoint, "--checkpoint", path], b"wa wb wc\n"
    return setup


def average_different_shapes(case: Path, data, run, checkpoint: Path):
    small = case / "small"
    config = tiny_run((data, run), small, max_steps=2)
    raw = json.loads(config.read_text())
    raw["model"]["d_ff"] = 48
    config.write_text(json.dumps(raw))
    train(load_config(config), progress_bar=False)
    return ["average", checkpoint, small / "run/checkpoints/checkpoint_last.pt", "-o", case / "avg.pt"], None


def evaluate_files(hyp: str, ref: str, *extra: str):
    def setup(case: Path, data, run):
        (case / "hyp.txt").write_text(hyp)
        (case / "ref.txt").write_text(ref)
        return ["evaluate", "--hyp", case / "hyp.txt", "--ref", case / "ref.txt", *extra], None
    return setup


# --------------------------------------------------------------------------- rows of a fresh sweep


def trained(case: Path, data, run, **settings) -> Path:
    """A finished tiny run in case/run; returns its config."""
    config = tiny_run((data, run), case, **settings)
    train(load_config(config), progress_bar=False)
    return config


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def resume_complete_run(case: Path, data, run):
    config = trained(case, data, run, max_steps=6, eval_every=3)
    (case / "before.json").write_text(json.dumps(sorted(snapshot(case / "run/checkpoints"))))
    (case / "last.bin").write_bytes((case / "run/checkpoints/checkpoint_last.pt").read_bytes())
    return ["train", "--config", config, "--resume"], None


def nothing_changed(case: Path, proc) -> None:
    assert sorted(snapshot(case / "run/checkpoints")) == json.loads((case / "before.json").read_text())
    assert (case / "run/checkpoints/checkpoint_last.pt").read_bytes() == (case / "last.bin").read_bytes()


def resume_moved_run(case: Path, data, run):
    config = corpus(case)  # prepared here, so that nothing outside the run names its files
    raw = json.loads(config.read_text())
    raw["train"]["max_steps"] = 3
    config.write_text(json.dumps(raw))
    prepare(load_config(config), progress=False)
    train(load_config(config), progress_bar=False)
    (case / "run").rename(case / "moved")
    raw = json.loads(config.read_text())
    raw["run_dir"], raw["train"]["max_steps"] = str(case / "moved"), 5
    config.write_text(json.dumps(raw))
    return ["train", "--config", config, "--resume"], None


def picture(suffix: str, command: str = "plot"):
    def setup(case: Path, data, run, checkpoint: Path):
        if command == "plot":
            return ["plot", checkpoint.parent.parent, "-o", case / f"c{suffix}"], None
        return ["attention", "--checkpoint", checkpoint, "--src", "wa wb wc", "-o", case / f"a{suffix}"], None
    return setup


def starts_with(name: str, prefix: bytes):
    def check(case: Path, proc) -> None:
        assert (case / name).read_bytes().startswith(prefix), (case / name).read_bytes()[:20]
    return check


def bounded_picture(case: Path, proc) -> None:
    from PIL import Image

    with Image.open(case / "a.png") as image:
        assert max(image.size) <= 6_000, image.size


def from_a_pipe(case: Path, data, run, checkpoint: Path):
    """`-i <(printf …)`: the input is a pipe, /dev/fd/N."""
    read, write = os.pipe()
    os.write(write, b"wa wb\nwc wd\n")
    os.close(write)
    return ["translate", "--checkpoint", checkpoint, "-i", f"/dev/fd/{read}"], None


def output_is_an_input(command: str):
    """`-o` naming a file the command reads: translate's `-i` source text, average's checkpoint (a
    copy of the good one, and the second named through another path to the same file)."""
    def setup(case: Path, data, run, checkpoint: Path):
        (case / "kept").mkdir()
        if command == "translate":
            (case / "kept/source.txt").write_text("wa wb\nwc wd\n")
            args = ["translate", "--checkpoint", checkpoint, "-i", case / "kept/source.txt", "-o", "kept/source.txt"]
        else:
            shutil.copy(checkpoint, case / "kept/ck.pt")
            args = ["average", checkpoint, case / "kept/ck.pt", "-o", "kept/../kept/ck.pt"]
        (case / "before.json").write_text(json.dumps({k: v.hex() for k, v in snapshot(case / "kept").items()}))
        return args, None
    return setup


def inputs_unchanged(case: Path, proc) -> None:
    before = json.loads((case / "before.json").read_text())
    assert {k: v.hex() for k, v in snapshot(case / "kept").items()} == before


def export_into(output: str):
    def setup(case: Path, data, run, checkpoint: Path):
        (case / "a_file").write_text("keep me\n")
        (case / "notes").mkdir()
        (case / "notes" / "todo.txt").write_text("keep me too\n")
        (case / "before.json").write_text(json.dumps(sorted(snapshot(case))))
        return ["export", "--checkpoint", checkpoint, "-o", output, "--force"], None
    return setup


def nothing_deleted(case: Path, proc) -> None:
    assert set(json.loads((case / "before.json").read_text())) <= set(snapshot(case))


def average_two(case: Path, data, run, checkpoint: Path):
    return ["average", checkpoint, checkpoint, "-o", case / "avg.pt"], None


def shared_weights_stored_once(case: Path, proc) -> None:
    weights = torch.load(case / "avg.pt", weights_only=True)["model"]
    tied = ("src_embed.embedding.weight", "tgt_embed.embedding.weight", "output_proj.weight")
    assert len({weights[name].untyped_storage().data_ptr() for name in tied}) == 1


def stdout_lines(n: int):
    return lambda case, proc: assert_stdout_lines(proc, n)



# --------------------------------------------------------------------------- the table


@dataclass
class Case:
    name: str
    setup: Callable
    code: int
    message: str  # must appear in stderr ("" = no requirement)
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None
    needs_checkpoint: bool = False
    slow: bool = False  # seconds of work: in the full suite only


def child_of(parent: str, *settings: str, command: str = "prepare"):
    """A new reverse-task corpus prepared (or trained) as the child of `parent`: "tiny" is the
    prepared tiny run, "checkpoint" the trained one's checkpoint (train.init_from)."""
    def setup(case: Path, data, run, checkpoint: Path):
        config = corpus(case)
        raw = json.loads(config.read_text())
        raw["vocab"]["from_run"] = str(run)
        config.write_text(json.dumps(raw))
        if command == "train":
            prepare(load_config(config), progress=False)
        named = {"tiny": run, "checkpoint": checkpoint, "nowhere": case / "nowhere", "itself": case / "run"}
        (case / "nowhere").mkdir()
        return [command, "--config", config, *[a for s in settings for a in ("--set", s.format(**named))]], None
    return setup


def own_vocabulary_child(case: Path, data, run, checkpoint: Path):
    """A run with a vocabulary of its own (38 pieces), told to start from the tiny run's checkpoint."""
    config = corpus(case)
    prepare(load_config(config, ["vocab.size=38"]), progress=False)
    return ["train", "--config", config, "--set", "vocab.size=38", "--set", f"train.init_from={checkpoint}"], None


def usage_error(option: str):
    """A usage error naming `option` (in the one 'error:' line), before any work."""
    def check(case: Path, proc) -> None:
        assert f"Invalid value for '{option}'" in proc.stderr and not proc.stdout, proc.stderr
    return check


def given_twice(proc, option: str) -> None:
    assert f"'{option}': given 2 times; it takes one value" in proc.stderr and not proc.stdout, proc.stderr


def no_checkpoint_written(case: Path, proc) -> None:
    assert not (case / "run/checkpoints").exists()


def no_run_written(case: Path, proc) -> None:
    assert not (case / "run").exists()


def no_marker(case: Path, proc) -> None:
    assert not (case / "MARKER").exists(), "the crafted pickle ran code"


def no_dropped_file(case: Path, proc) -> None:
    assert proc.stderr.startswith("error: ") and str(case) in proc.stderr, proc.stderr
    assert not (case / "run" / "prepare.json").exists()


GARBAGE = bytes(range(256)) * 4 + b"\n\xff\xfe\x00\n"  # every byte value, NULs, invalid UTF-8

CASES = [
    # corpus (prepare)
    Case("corpus: missing file", prepare_case(train_src=lambda lines: None), 2, "corpus file not found"),
    Case("corpus: a directory", directory_instead, 2, "is a directory"),
    Case("corpus: empty file", prepare_case(valid_tgt=lambda lines: b""), 2, "valid.tgt is empty (data.valid)"),
    Case("corpus: line counts differ", prepare_case(train_tgt=lambda lines: lines[:-1]), 2,
         "line counts differ"),
    Case("corpus: invalid UTF-8", prepare_case(valid_src=with_line(7, b"wa \xff\xfe wb\n")), 2,
         "valid.src: line 7 is not valid UTF-8"),
    Case("corpus: NUL byte", prepare_case(valid_tgt=with_line(5, b"wa\x00wb\n")), 2,
         "valid.tgt: line 5 contains a NUL byte"),
    Case("corpus: invalid UTF-8 and NUL in train are dropped", prepare_case(
        train_src=with_line(7, b"wa \xff\xfe wb\n"), train_tgt=with_line(5, b"wa\x00wb wc\n")), 0, "",
         lambda case, proc: assert_dropped(proc, "encoding", 2)),
    Case("corpus: every training pair dropped", lambda case, d, r: (
        ["prepare", "--config", corpus(case), "--set", "data.filters.length.min_words=50"], None), 2,
         "every one of src-tgt's 300 training pairs sampled for the vocabulary was dropped (length: 300"),
    Case("config: filter setting out of range", with_settings("data.filters.copies.max_overlap=1.5"), 2,
         "key 'data.filters.copies.max_overlap'"),
    Case("config: unknown filter", with_settings("data.filters.langauge.enabled=false"), 2,
         "did you mean 'data.filters.language'"),
    Case("prepare: --dropped into a directory", lambda case, d, r: (
        ["prepare", "--config", corpus(case), "--dropped", str(case)], None), 2, "", no_dropped_file),
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
    Case("corpus: CR-only line ends", prepare_case(**{k: (lambda lines: b"".join(x.rstrip(b"\n") + b"\r" for x in lines))
                                                     for k in ("train_src", "train_tgt")}), 2,
         "train.src: its lines end in CR alone (old Mac line ends)"),
    Case("corpus: UTF-16", prepare_case(train_tgt=lambda lines: b"".join(lines).decode().encode("utf-16")), 2,
         "train.tgt: it is UTF-16 (convert it: iconv -f UTF-16 -t UTF-8)"),
    Case("corpus: every pair one pair, vocab too large", lambda case, d, r: (
        ["prepare", "--config", corpus(case, train_src=lambda lines: lines[:1] * 300, train_tgt=lambda lines: lines[:1] * 300),
         "--set", "data.filters.duplicates.enabled=true"], None), 2,
         "(the corpus filters left 1 of the 300 pairs sampled; 299 were repeats of another pair: data.filters.duplicates)"),
    Case("corpus: a language the identifier does not know", lambda case, d, r: (
        ["prepare", "--config", corpus(case), "--set", "data.filters.language.enabled=true"], None), 0,
         "warning: data: language 'src' (src-tgt's source) is not one the language identifier knows"),
    # config
    Case("config: not a mapping", config_text("- a\n- b\n"), 2, "top level must be a mapping"),
    Case("config: empty", config_text(""), 2, "no settings in it (empty, or comments only)"),
    Case("config: comments only", config_text("# run_dir: runs/x\n\n"), 2, "no settings in it"),
    Case("config: a YAML merge key is read", config_text("model:\n  <<: {d_modle: 3}\n"), 2,
         "did you mean 'model.d_model'"),
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
         "warning: input line 2 has", lambda case, proc: assert_stdout_lines(proc, 3), needs_checkpoint=True,
         slow=True),
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
    # a fresh sweep: values that make no sense are refused when the config is read, naming the key
    *[Case(f"config: {' '.join(settings)}", with_settings(*settings), 2, f"key '{key}'") for settings, key in (
        (("train.keep_last=-1",), "train.keep_last"),
        (("train.keep_last=0", "train.average_last=3"), "train.keep_last"),
        (("train.keep_last=1", "train.average_last=3"), "train.keep_last"),
        (("train.average_last=-2",), "train.average_last"),
        (("train.eval_bleu_sentences=-5",), "train.eval_bleu_sentences"),
        (("train.eval_bleu_sentences=0",), "train.eval_bleu_sentences"),
        (("train.threads=-2",), "train.threads"),
        (("train.allocator=jemalloc",), "train.allocator"),
        (("train.adam_eps=-1",), "train.adam_eps"),
        (("train.adam_betas=[1.5,0.98]",), "train.adam_betas"),
        (("train.weight_decay=-1",), "train.weight_decay"),
        (("train.max_time=0",), "train.max_time"),
        (("train.seed=-1",), "train.seed"),
        (("train.lr=-0.001",), "train.lr"),
        (("train.lr=0",), "train.lr"),
        (("train.lr=.nan",), "train.lr"),
        (("train.lr_schedule=budget", "train.lr=0.001", "train.lr_min=0.01"), "train.lr_min"),
        (("train.patience=0",), "train.patience"),
        (("train.max_epochs=0",), "train.max_epochs"),
        (("train.max_epochs=-1",), "train.max_epochs"),
        (("data.train_limit=0",), "data.train_limit"),
        (("data.train_limit=-1",), "data.train_limit"),
        (("data.train=[]",), "data.train"),
        (("data.train=[data/train, '']",), "data.train.1"),
        (("decode.max_len_a=0", "decode.max_len_b=-100"), "decode.max_len_b"),
        (("decode.batching=striped",), "decode.batching"),
    )],
    Case("translate: decode.max_len_a=0 max_len_b=0", translate_input(
        b"wa\n", "--set", "decode.max_len_a=0", "--set", "decode.max_len_b=0"), 2, "key 'decode.max_len_b'",
         needs_checkpoint=True),
    Case("translate: --set model.d_model on a trained model", translate_input(b"wa\n", "--set", "model.d_model=128"),
         2, "--set model.d_model: the model was trained with model.d_model=32; a trained model's model.* settings "
         "are fixed by its checkpoint", needs_checkpoint=True),
    Case("translate: --set model.d_model repeating the trained value", translate_input(
        b"wa\n", "--set", "model.d_model=32"), 0, "translated 1 sentences", stdout_lines(1), needs_checkpoint=True),
    Case("translate: UTF-16 input", translate_input(b"\xff\xfe" + "wa wb\n".encode("utf-16-le")), 2,
         "standard input is UTF-16 text", needs_checkpoint=True),
    Case("translate: -i <(…), a pipe", from_a_pipe, 0, "translated 2 sentences", stdout_lines(2),
         needs_checkpoint=True),
    Case("translate: -o the -i file", output_is_an_input("translate"), 2, "is also this command's input (-i)",
         inputs_unchanged, needs_checkpoint=True),
    Case("average: -o one of the checkpoints", output_is_an_input("average"), 2,
         "is also this command's input (a checkpoint to average)", inputs_unchanged, needs_checkpoint=True),
    Case("evaluate: --min-bleu nan", evaluate_files("a b\n", "a b\n", "--min-bleu", "nan"), 2, "--min-bleu nan"),
    # multilingual runs: directions, temperature, per-direction evaluation
    Case("config: data.directions not a direction", with_settings("data.directions=[srctgt]"), 2,
         "key 'data.directions.0.direction': 'srctgt' is not a direction"),
    Case("config: data.directions listed twice", with_settings("data.directions=[src-tgt,src-tgt]"), 2,
         "key 'data.directions': src-tgt is listed twice"),
    Case("config: data.directions against src_lang", with_settings("data.directions=[tgt-src]"), 2,
         "key 'data.src_lang': src differs from the first of data.directions (tgt-src)"),
    Case("config: data.temperature 0", with_settings("data.directions=[src-tgt]", "data.temperature=0"), 2,
         "key 'data.temperature'"),
    Case("config: data.directions with a separate vocabulary", with_settings("data.directions=[src-tgt]",
                                                                          "vocab.joint=false"), 2, "key 'vocab.joint'"),
    Case("prepare: a direction's file missing", with_settings("data.directions=[src-tgt,src-xx]",
                                                              command="prepare"), 2, "corpus file not found"),
    Case("prepare: a direction's own corpus missing", with_settings(
        "data.directions=[{direction: src-tgt, train: nowhere/train}]", command="prepare"), 2,
        "corpus file not found: nowhere/train.src"),
    Case("config: a direction's own corpus with an unknown key", with_settings(
        "data.directions=[{direction: src-tgt, trian: x}]"), 2, "unknown key 'data.directions.0.trian'"),
    Case("evaluate: --directions without --config", evaluate_files("a\n", "a\n", "--directions", "de-en"), 2,
         "--directions goes with --config"),
    Case("evaluate: --directions not a direction", lambda case, d, r: (
        ["evaluate", "--config", "x.yaml", "--directions", "de_en"], None), 2, "--directions: 'de_en' is not a direction"),
    Case("evaluate: --min-bleu of a direction without a score", evaluate_files("a\n", "a\n", "--min-bleu", "en-de=x"),
         2, "--min-bleu en-de=x: give a finite score"),
    Case("evaluate: --min-bleu of a direction with --hyp", evaluate_files("a\n", "a\n", "--min-bleu", "en-de=3"),
         2, "a direction's gate goes with --config"),
    Case("evaluate: --min-bleu =3", evaluate_files("a\n", "a\n", "--min-bleu", "=3"), 2, "--min-bleu =3"),
    Case("resume: a complete run", resume_complete_run, 0, "is complete (max_steps=6): nothing to do",
         nothing_changed),
    Case("resume: a moved run directory", resume_moved_run, 0, "done (max_steps=5)"),
    Case("vocab: too few sampled sentences", lambda case, d, r: (
        ["prepare", "--config", corpus(case), "--set", "vocab.input_sentence_size=4"], None), 2,
         "key 'vocab.input_sentence_size'"),
    Case("plot: -o c.svg", picture(".svg"), 0, "", starts_with("c.svg", b"<?xml"), needs_checkpoint=True, slow=True),
    Case("plot: -o c.pdf", picture(".pdf"), 0, "", starts_with("c.pdf", b"%PDF"), needs_checkpoint=True, slow=True),
    Case("plot: -o c.txt", picture(".txt"), 2, "cannot tell the picture format from '.txt'", needs_checkpoint=True),
    Case("attention: -o a.txt", picture(".txt", "attention"), 2, "cannot tell the picture format",
         needs_checkpoint=True),
    Case("attention: a 3,500-token source", lambda case, d, r, ck: (
        ["attention", "--checkpoint", ck, "--src", "wa " * 3500, "-o", case / "a.png", "--self"], None), 0,
         "warning: input line 1 has 3500 tokens", bounded_picture, needs_checkpoint=True, slow=True),
    Case("export: -o . --force", export_into("."), 2, "the working directory", nothing_deleted,
         needs_checkpoint=True),
    Case("export: -o an existing file --force", export_into("a_file"), 2, "a_file exists and is not a directory",
         nothing_deleted, needs_checkpoint=True),
    Case("average: shared weights stored once", average_two, 0, "", shared_weights_stored_once,
         needs_checkpoint=True),
    # a single-valued option given twice (click kept the last one: translate used model B alone)
    Case("translate: --beam twice", translate_input(b"wa\n", "--beam", "2", "--beam", "3"), 2, "",
         lambda case, proc: given_twice(proc, "--beam"), needs_checkpoint=True),
    # production decoding: ensembles, sampling, alignments, serve
    Case("translate: --checkpoint twice is an ensemble", translate_input(b"wa wb\n", "--checkpoint", "{checkpoint}"),
         0, "translated 1 sentences", stdout_lines(1), needs_checkpoint=True),
    Case("ensemble: another vocabulary", ensemble_with(other_vocabulary_same_size), 2,
         "its source vocabulary differs from", needs_checkpoint=True),
    Case("ensemble: a missing member", ensemble_with(lambda p, good: None), 2, "checkpoint not found",
         needs_checkpoint=True),
    Case("ensemble: an empty decode.checkpoints entry", translate_input(b"wa\n", "--set", 'decode.checkpoints=[""]'),
         2, "key 'decode.checkpoints", needs_checkpoint=True),
    *[Case(f"translate: {' '.join(option)}", translate_input(b"wa\n", "--sample", *option), 2, f"key '{key}'",
           needs_checkpoint=True) for option, key in (
        (("--top-p", "0"), "decode.top_p"), (("--top-p", "1.5"), "decode.top_p"), (("--top-p", "nan"), "decode.top_p"),
        (("--temperature", "0"), "decode.temperature"), (("--temperature", "-1"), "decode.temperature"),
        (("--temperature", "inf"), "decode.temperature"), (("--top-k", "-1"), "decode.top_k"),
        (("--seed", "-1"), "decode.seed"), (("--seed", str(2**63)), "decode.seed"))],
    Case("translate: --top-p abc", translate_input(b"wa\n", "--sample", "--top-p", "abc"), 2, "",
         usage_error("--top-p"), needs_checkpoint=True),
    Case("translate: --nbest 3 without --sample needs a beam", translate_input(b"wa\n", "--beam", "1", "--nbest", "3"),
         2, "--nbest 3 (key 'decode.nbest'): 3 hypotheses need a beam at least as large", needs_checkpoint=True),
    Case("translate: --sample --nbest 3 with beam 1", translate_input(b"wa\n", "--beam", "1", "--nbest", "3",
                                                                     "--sample"), 0, "", stdout_lines(3),
         needs_checkpoint=True),
    Case("translate: decode.alignment_layer=0", translate_input(b"wa\n", "--alignment", "--set",
                                                                "decode.alignment_layer=0"), 2,
         "key 'decode.alignment_layer'", needs_checkpoint=True),
    Case("translate: decode.alignment_layer past the last layer", translate_input(
        b"wa\n", "--alignment", "--set", "decode.alignment_layer=9"), 2,
         "decode.alignment_layer=9: the model has 1 decoder layer(s)", needs_checkpoint=True),
    # the engine (decode.engine auto: CTranslate2 where it applies)
    *[Case(f"translate: {name}", lambda case, d, r, ck, args=args: (
        ["translate", "--checkpoint", ck, *[ck if a == "{again}" else a for a in args]], b"wa\n"),
           2, message, needs_checkpoint=True) for name, args, message in (
        ("decode.engine=onnx", ["--set", "decode.engine=onnx"], "key 'decode.engine'"),
        ("decode.compute_type=int4", ["--set", "decode.compute_type=int4"], "key 'decode.compute_type'"),
        ("--engine onnx", ["--engine", "onnx"], "--engine onnx: choose auto, torch, ctranslate2"),
        ("--compute-type with --engine torch", ["--engine", "torch", "--compute-type", "int8"],
         "--compute-type is CTranslate2's"),
        ("--compute-type float8", ["--compute-type", "float8"], "--compute-type float8 is not supported on this cpu"),
        ("--engine ctranslate2 --sample", ["--engine", "ctranslate2", "--sample"],
         "--engine ctranslate2: sampling is tfm's own"),
        ("--engine ctranslate2 with an ensemble", ["--engine", "ctranslate2", "--checkpoint", "{again}"],
         "--engine ctranslate2: ensembles are tfm's own"),
        ("--model of no directory", ["--model", "nowhere"], "--checkpoint/--quantize are for tfm's engine"),
    )],
    Case("translate: --model with --engine torch", lambda case, d, r, ck: (
        ["translate", "--engine", "torch", "--model", case], b"wa\n"), 2,
         "--model DIR is a CTranslate2 directory", needs_checkpoint=True),
    *[Case(f"serve: {option} {value}", lambda case, d, r, ck, option=option, value=value: (
        ["serve", "--checkpoint", ck, option, value], None), 2, "", usage_error(option), needs_checkpoint=True)
      for option, value in (("--port", "70000"), ("--max-lines", "0"), ("--max-wait-ms", "-1"))],
    Case("evaluate: --beam twice", lambda case, d, r: (["evaluate", "--beam", "2", "--beam=3", "--config", "x"], None),
         2, "", lambda case, proc: given_twice(proc, "--beam")),
    # starting from a model
    Case("vocab.from_run: not a run directory", child_of("tiny", "vocab.from_run={nowhere}"), 2,
         "key 'vocab.from_run': ", no_run_written, needs_checkpoint=True),
    Case("vocab.from_run: its own run directory", lambda case, d, r, ck: (
        ["prepare", "--config", tiny_run((d, r), case), "--set", f"vocab.from_run={case / 'run'}"], None), 2,
         "is this run's own directory", needs_checkpoint=True),
    Case("vocab.from_run: vocab.size contradicts the parent", child_of("tiny", "vocab.size=50"), 2,
         "key 'vocab.size': 50 in the config, but", no_run_written, needs_checkpoint=True),
    Case("vocab.from_run: vocab.joint contradicts the parent", child_of("tiny", "vocab.joint=false"), 2,
         "key 'vocab.joint': False in the config", no_run_written, needs_checkpoint=True),
    Case("train.init_from: mismatching shapes", child_of("tiny", "train.init_from={checkpoint}", "model.d_ff=48",
                                                         command="train"), 2,
         "key 'train.init_from': tensor 'decoder_layers.0.ffn.w1.bias' has shape (64,)", no_checkpoint_written, needs_checkpoint=True),
    Case("train.init_from: n_heads differs", child_of("tiny", "train.init_from={checkpoint}", "model.n_heads=1",
                                                      command="train"), 2,
         "model.n_heads=2, this config 1", no_checkpoint_written, needs_checkpoint=True),
    Case("train.init_from: another vocabulary", own_vocabulary_child, 2,
         "was trained with another source vocabulary than this run's", no_checkpoint_written, needs_checkpoint=True),
    Case("train.init_from: missing checkpoint", child_of("tiny", "train.init_from={nowhere}/c.pt", command="train"),
         2, "checkpoint not found", no_checkpoint_written, needs_checkpoint=True),
]


def assert_no_piece(case: Path, char: str) -> None:
    assert not any(char in piece for piece in vocab_pieces(case))


def assert_dropped(proc, reason: str = "length", count: int = 1) -> None:
    assert re.search(rf"dropped: {reason} +{count} ", proc.stdout), proc.stdout



def assert_stdout_lines(proc, n: int) -> None:
    assert proc.stdout.count("\n") == n, proc.stdout


@pytest.fixture(scope="module")
def good_checkpoint(tiny_prepared, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good")
    train(load_config(tiny_run(tiny_prepared, root, max_steps=5)), progress_bar=False)
    return root / "run/checkpoints/checkpoint_last.pt"


def run_tfm(args: list, stdin: bytes | None, cwd: Path) -> subprocess.CompletedProcess:
    """`tfm ARGS` in this process, in `cwd`: exit code, stdout and stderr as the script gives them.
    Anything but the CLI's own exit (a traceback) fails the test."""
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, [str(a) for a in args], input=stdin if stdin is not None else b"")
    finally:
        os.chdir(here)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES])
def test_bad_input(case: Case, tiny_prepared, tmp_path, request):
    data, run = tiny_prepared
    extra = (request.getfixturevalue("good_checkpoint"),) if case.needs_checkpoint else ()
    args, stdin = case.setup(tmp_path, data, run, *extra)
    proc = run_tfm(args, stdin, tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == case.code, proc.stderr
    assert case.message in proc.stderr, proc.stderr
    if case.code == 2:  # usage errors too: one line, not click's usage text and box
        assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1, proc.stderr
    if case.check is not None:
        case.check(tmp_path, proc)


@pytest.mark.slow
def test_closed_stdout_pipe_exits_quietly(good_checkpoint, tmp_path):
    lines = "\n".join("wa wb wc wd" for _ in range(3000)) + "\n"
    (tmp_path / "in.txt").write_text(lines)
    cmd = f"set -o pipefail; tfm translate --checkpoint {good_checkpoint} < {tmp_path / 'in.txt'} | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=tfm_in_scripts(tmp_path / "bin"))
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
