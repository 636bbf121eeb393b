"""A fuzzer generated from the command line's own option definitions: every option of every `tfm`
command, read from the Typer app (click introspection and the functions' type hints), is given
hostile values — numbers {0, −1, NaN, inf, 1e308, 2^63}, paths {missing, a directory, a FIFO, an
empty file, a path through a file, a device, the command's own inputs, a run's checkpoints}, words
{"", nonsense} — in an otherwise good invocation of that command. Every case must end with exit 0 or 2
(1 only for an evaluate gate), one `error:` line and no traceback, and a checksum of the working tree
must show nothing changed outside the command's stated outputs. A new option is covered without a
new row; an option whose type the fuzzer does not know fails `test_the_fuzzer_knows_every_option`.

Decode settings given as `--set decode.KEY=VALUE` are fuzzed the same way from the config's own
field definitions (train.* keys, which start training, in the slow tier)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer.main
from pydantic import BaseModel

from tests.conftest import ROOT, tfm_in_process, tiny_reverse_config, write_reverse_task
from transformer_cli.cli import app
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.config import DataConfig, DecodeConfig, TrainConfig, config_from_dict
from transformer_cli.training.train import train

NUMBERS = ["0", "-1", "nan", "inf", "1e308", str(2**63)]
WORDS = ["", "nonsense"]
PATHS = ["missing", "directory", "fifo", "empty", "through a file", "device", "own input", "run checkpoint"]
OUTPUT_OPTIONS = {"output", "dropped", "access_log"}  # what a command writes; every other path is read


@dataclass
class Workspace:
    root: Path
    config: Path
    run: Path
    checkpoint: Path
    other_checkpoint: Path
    src: Path
    ref: Path

    @property
    def out(self) -> Path:
        return self.root / "out"  # stated outputs go here


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    write_reverse_task(root / "data", n_train=600, n_test=20)
    config = root / "tiny.yaml"
    raw = tiny_reverse_config(root / "data", root / "run", max_steps=20, eval_every=10)
    raw["model"]["max_positions"] = 48  # an untrained model decodes to its length cap: keep that short
    config.write_text(json.dumps(raw))
    cfg = config_from_dict(json.loads(config.read_text()))
    prepare(cfg, progress=False)
    train(cfg, progress_bar=False)
    (root / "src.txt").write_text("wa wb wc\nwd we\n")
    (root / "ref.txt").write_text("wc wb wa\nwe wd\n")
    checkpoints = root / "run" / "checkpoints"
    yield Workspace(root, config, root / "run", checkpoints / "checkpoint_best.pt", checkpoints / "step_10.pt",
                    root / "src.txt", root / "ref.txt")


def good_invocations(ws: Workspace) -> dict[str, list[str]]:
    """One good invocation of each command (serve's ends after its checks, at the bind)."""
    ck, out = str(ws.checkpoint), ws.out
    return {
        "prepare": ["prepare", "--config", str(ws.config)],
        "train": ["train", "--config", str(ws.config), "--resume"],
        "translate": ["translate", "--checkpoint", ck, "-i", str(ws.src), "-o", str(out / "t.txt"),
                      "--set", "decode.precision=fp32"],
        # An address of TEST-NET-3 (RFC 5737), which no machine here has: every check runs, then the
        # bind fails (exit 2), whatever --port a case gives (0 would otherwise serve on a free port).
        "serve": ["serve", "--checkpoint", ck, "--host", "203.0.113.1", "--port", "8000", "--workers", "1"],
        "evaluate": ["evaluate", "--hyp", str(ws.ref), "--ref", str(ws.ref)],
        "average": ["average", ck, str(ws.other_checkpoint), "-o", str(out / "avg.pt")],
        "plot": ["plot", str(ws.run), "-o", str(out / "curves.png")],
        "attention": ["attention", "--checkpoint", ck, "--src", "wa wb", "-o", str(out / "att.png")],
        "export": ["export", "--checkpoint", ck, "-o", str(out / "ct2")],
        "import": ["import", str(ws.run), "-o", str(out / "imported")],
        "glossary": ["glossary", "--checkpoint", ck, "--src", str(ws.src), "--ref", str(ws.ref), "--lines", "20",
                     "-o", str(out / "glossary.tsv")],
        "distill": ["distill", "--config", str(ws.config), "--checkpoint", ck, "--set",
                    f"distill.output={out / 'distilled'}"],
        "shortlist": ["shortlist", "--config", str(ws.config)],
        "api-key": ["api-key", "--api-keys", str(out / "keys.txt"), "--name", "fuzz"],
        "sample-constraints": ["sample-constraints", "--src", str(ws.src), "--ref", str(ws.ref),
                               "-o", str(out / "constraints.tsv")],
    }


@functools.cache
def commands() -> dict:
    return typer.main.get_command(app).commands


def kind_of(command: str, param) -> str:
    """number, path, word or flag: from the command function's type hint for the parameter."""
    hints = typing.get_type_hints(inspect.unwrap(commands()[command].callback))
    hint = hints[param.name]
    while typing.get_origin(hint) in (typing.Union, list, getattr(__import__("types"), "UnionType", None)):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if getattr(param, "is_flag", False) or hint is bool:
        return "flag"
    if hint in (int, float):
        return "number"
    if hint is Path:
        return "path"
    if hint is str:
        return "word"
    return f"unknown ({hint})"


def cases() -> list[tuple[str, str, str]]:
    """(command, parameter name, value kind) for every parameter the fuzzer mutates."""
    found = []
    for name, command in commands().items():
        for param in command.params:
            kind = kind_of(name, param)
            if kind == "flag" or param.name == "set_":
                continue  # flags take no value; --set is fuzzed key by key below
            values = {"number": NUMBERS, "path": PATHS, "word": WORDS}.get(kind, [kind])
            found += [(name, param.name, value) for value in values]
    return found


@pytest.mark.slow
def test_the_fuzzer_knows_every_option():
    assert all(value in NUMBERS + PATHS + WORDS for _, _, value in cases()), \
        [c for c in cases() if c[2] not in NUMBERS + PATHS + WORDS]
    every = cases()
    assert {case[:2] for case in sampled(every)} == {case[:2] for case in every}  # the sample misses no option
    assert len(every) / 4 < len(sampled(every)) < len(every) / 2


# --------------------------------------------------------------------------- the tree and its checksum


def snapshot(root: Path, skip: list[Path]) -> dict[str, str]:
    """path → content hash (or the kind of a non-regular file) of everything under root, but `skip`."""
    seen = {}
    for path in sorted(root.rglob("*")):
        if any(path == s or s in path.parents for s in skip):
            continue
        mode = path.lstat().st_mode
        if stat.S_ISREG(mode):
            seen[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif not stat.S_ISDIR(mode):
            seen[str(path.relative_to(root))] = f"mode {stat.S_IFMT(mode):o}"
    return seen


class Fifo:
    """A FIFO with a thread at its other end: a writer of two lines for a path the command reads, a
    reader for one it writes. Opening a FIFO blocks until the other end opens: after the command,
    the thread is released by opening the far end without blocking."""

    def __init__(self, path: Path, command_writes: bool):
        os.mkfifo(path)
        self.path, self.command_writes = path, command_writes
        self.thread = threading.Thread(target=self._other_end, daemon=True)
        self.thread.start()

    def _other_end(self) -> None:
        try:
            if self.command_writes:
                with open(self.path, "rb") as f:
                    f.read()
            else:
                with open(self.path, "wb") as f:
                    f.write(b"wa wb\nwc\n")
        except OSError:
            pass

    def release(self) -> None:
        flags = (os.O_WRONLY if self.command_writes else os.O_RDONLY) | os.O_NONBLOCK
        while self.thread.is_alive():
            try:
                os.close(os.open(self.path, flags))
            except OSError:
                pass
            self.thread.join(timeout=0.1)


def hostile_path(ws: Workspace, case_dir: Path, value: str, inputs: list[str], command_writes: bool):
    """The path for `value`, and the FIFO to release afterwards (or None)."""
    if value == "missing":
        return case_dir / "no" / "such.file", None
    if value == "directory":
        (case_dir / "dir").mkdir()
        return case_dir / "dir", None
    if value == "fifo":
        fifo = Fifo(case_dir / "fifo", command_writes)
        return fifo.path, fifo
    if value == "empty":
        (case_dir / "empty").write_bytes(b"")
        return case_dir / "empty", None
    if value == "through a file":
        return ws.src / "below", None
    if value == "device":
        return Path("/dev/null"), None
    if value == "own input":
        return Path(inputs[0]) if inputs else ws.src, None
    assert value == "run checkpoint"
    return ws.run / "checkpoints" / "checkpoint_last.pt", None


def with_value(args: list[str], opts: list[str], value: str, positional_index: int | None) -> list[str]:
    """`args` with the option (or the positional argument at `positional_index`) set to `value`."""
    args = list(args)
    if positional_index is not None:
        args[positional_index] = value
        return args
    for i, word in enumerate(args):
        if word in opts:
            args[i + 1] = value
            return args
    return [*args, opts[0], value]


def run_case(ws: Workspace, case_dir: Path, args: list[str]) -> None:
    """Run `args` in this process; check the exit code, the message and the tree."""
    # Written by design: outputs, evaluations, caches (the checkpoint's CTranslate2 conversion, interop/ct2_cache.py).
    stated = [ws.out, ws.run / "eval", ws.root / "tfm_cache", ws.run / "checkpoints" / "ctranslate2"] + (
        [ws.run] if args[0] in ("train", "prepare", "shortlist") else [])
    before = snapshot(ws.root, stated + [case_dir])
    result = tfm_in_process(*args)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, (args, output[-2000:])
    allowed = (0, 1, 2) if args[0] == "evaluate" and "--min-bleu" in args else (0, 2)
    assert result.exit_code in allowed, (args, result.exit_code, output[-2000:])
    if result.exit_code == 2:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, (args, result.stderr[-2000:])
    assert snapshot(ws.root, stated + [case_dir]) == before, args


def fuzz_option(ws: Workspace, tmp_path: Path, command: str, name: str, value: str) -> None:
    base = good_invocations(ws)[command]
    param = next(p for p in commands()[command].params if p.name == name)
    positional = None
    if param.param_type_name == "argument":
        positional = 1  # the first positional argument follows the command's name
    kind = kind_of(command, param)
    fifo = None
    if kind == "path":
        inputs = [a for a in base[1:] if Path(a).exists() and ws.root in Path(a).parents]
        path, fifo = hostile_path(ws, tmp_path, value, inputs, command_writes=name in OUTPUT_OPTIONS)
        value = str(path)
    try:
        run_case(ws, tmp_path, with_value(base, param.opts, value, positional))
    finally:
        if fifo is not None:
            fifo.release()
        shutil.rmtree(ws.out, ignore_errors=True)


def sampled(every: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """A fixed third of the cases in which every option has at least one value: each option's values
    every third, starting one further along from one option to the next."""
    options = list(dict.fromkeys((command, name) for command, name, _ in every))
    chosen = []
    for number, option in enumerate(options):
        values = [case for case in every if case[:2] == option]
        chosen += values[number % 3 :: 3] or values[:1]
    return chosen


ALL_CASES = cases()
# Every run takes a fixed sample, the fast tier its first case of each option; -m sweep runs them all.
SAMPLED_CASES = sampled(ALL_CASES)


def first_of_each_option_fast(cases: list[tuple[str, str, str]]) -> list:
    seen: set[tuple[str, str]] = set()
    params = []
    for case in cases:
        params.append(pytest.param(*case, id="-".join(case), marks=[] if case[:2] not in seen else [pytest.mark.slow]))
        seen.add(case[:2])
    return params


@pytest.mark.parametrize("command, name, value", first_of_each_option_fast(SAMPLED_CASES))
def test_every_option_with_a_hostile_value_sampled(ws, tmp_path, command, name, value):
    fuzz_option(ws, tmp_path, command, name, value)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("command, name, value", ALL_CASES, ids=[f"{c}-{n}-{v}" for c, n, v in ALL_CASES])
def test_every_option_with_a_hostile_value(ws, tmp_path, command, name, value):
    fuzz_option(ws, tmp_path, command, name, value)


# --------------------------------------------------------------------------- --set KEY=VALUE from the config


def numeric_keys(section: str, model) -> list[str]:
    """The int and float keys of a config section, and of the sections nested in it (data.filters.…)."""
    keys = []
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += numeric_keys(f"{section}.{key}", field.annotation)
            continue
        text = str(field.annotation)
        if "int" in text or "float" in text:
            keys.append(f"{section}.{key}")
    return keys


DECODE_CASES = [(key, value) for key in numeric_keys("decode", DecodeConfig) for value in NUMBERS]
TRAIN_CASES = [(key, value) for key in numeric_keys("train", TrainConfig) for value in NUMBERS]


@pytest.mark.parametrize("key, value", DECODE_CASES, ids=[f"{k}={v}" for k, v in DECODE_CASES])
def test_every_numeric_decode_setting_with_a_hostile_value(ws, tmp_path, key, value):
    args = [*good_invocations(ws)["translate"], "--set", f"{key}={value}"]
    try:
        run_case(ws, tmp_path, args)
    finally:
        shutil.rmtree(ws.out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("key, value", TRAIN_CASES[::3], ids=[f"{k}={v}" for k, v in TRAIN_CASES[::3]])
def test_every_numeric_train_setting_with_a_hostile_value_sampled(ws, tmp_path, key, value):
    train_with_setting(ws, tmp_path, key, value)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("key, value", TRAIN_CASES, ids=[f"{k}={v}" for k, v in TRAIN_CASES])
def test_every_numeric_train_setting_with_a_hostile_value(ws, tmp_path, key, value):
    train_with_setting(ws, tmp_path, key, value)


def train_with_setting(ws, tmp_path, key, value):
    """On a copy of the run (training writes it), bounded by a 3-second budget."""
    run = tmp_path / "run"
    shutil.copytree(ws.run, run)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**json.loads(ws.config.read_text()), "run_dir": str(run)}))
    args = ["train", "--config", str(config), "--resume", "--set", "train.max_time=3", "--set", f"{key}={value}"]
    before = snapshot(ws.root, [ws.root / "tfm_cache"])
    result = tfm_in_process(*args)
    assert "Traceback" not in result.stdout + result.stderr and result.exit_code in (0, 2, 3), \
        (args, result.exit_code, result.stderr[-2000:])
    assert snapshot(ws.root, [ws.root / "tfm_cache"]) == before


SIZES = ["auto", "d128", "null", "AUTO", "student", "STUDENT", "''", " d192", "d999", "-1", "0", "1e308", "nan", "true", "[auto]",
         "{d_model: 8}", "auto\\n"]


@pytest.mark.parametrize("value", SIZES)
@pytest.mark.slow
def test_model_size_with_a_hostile_value(ws, tmp_path, value):
    """`tfm train --resume --set model.size=…` on a copy of the run: `auto` resumes the run's own
    shape, any other shape is refused as a change of model; never a traceback, nothing else written."""
    run = tmp_path / "run"
    shutil.copytree(ws.run, run)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**json.loads(ws.config.read_text()), "run_dir": str(run)}))
    before = snapshot(ws.root, [ws.root / "tfm_cache"])
    result = tfm_in_process("train", "--config", str(config), "--resume", "--set", "train.max_time=3",
                            "--set", f"model.size={value}")
    output = result.stdout + result.stderr
    assert "Traceback" not in output and result.exit_code in (0, 2), (value, result.exit_code, output[-2000:])
    if result.exit_code == 2:
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, output
    assert snapshot(ws.root, [ws.root / "tfm_cache"]) == before


DIRECTIONS = WORDS + ["-", "src-", "src-tgt-src", "src-src", "[src-tgt, src-tgt]", "{direction: 3}", "[{train: x}]",
                      "src-tgt,tgt-src"]
# The filters' and augmentation's keys (data.filters.…, data.augment.…) are bounded like the rest: three
# values each keep the tier quick.
DATA_CASES = [(key, value) for key in numeric_keys("data", DataConfig)
              for value in (NUMBERS if not key.startswith(("data.filters.", "data.augment."))
                            else ["-1", "nan", "1e308"])] + [
    ("data.augment", value) for value in ("{lower: 0.7, title: 0.4}", "{upper: 1.1}", "[0.1]", "{typo: 0.1}", "{draws: twice}", "{draws: 1}")] + [
    ("data.directions", value) for value in DIRECTIONS] + [
    ("data.filters.model.engine", value) for value in ("", "CT2", "ctranslate2 ", "{torch: 1}")] + [
    ("data.filters.model", value) for value in ("{enabled: true, train_updates: null}", "{train_updates: 1.5}",
                                                "{train_updates: null, train_time: 1m}", "{train_time: null}")]


@pytest.mark.parametrize("key, value", DATA_CASES, ids=[f"{k}={v}" for k, v in DATA_CASES])
def test_every_data_setting_with_a_hostile_value(ws, tmp_path, key, value):
    """`tfm prepare` of a new run with one data setting hostile: one line and exit 2, or a run
    prepared; never a traceback, and nothing outside the new run written."""
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**json.loads(ws.config.read_text()), "run_dir": str(tmp_path / "run")}))
    before = snapshot(ws.root, [ws.root / "tfm_cache"])
    result = tfm_in_process("prepare", "--config", str(config), "--set", f"{key}={value}")
    output = result.stdout + result.stderr
    assert "Traceback" not in output and result.exit_code in (0, 2), (key, value, result.exit_code, output[-2000:])
    if result.exit_code == 2:
        assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, output
    assert snapshot(ws.root, [ws.root / "tfm_cache"]) == before


# --------------------------------------------------------------------------- the scripts users run

SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py")
                 if p.name not in ("bench_common.py", "ct2_reference.py"))  # a module, and a helper run by a benchmark


# One script runs as a real process (the interpreter's start, its imports, its exit status as a shell
# sees it); the others run in this process, through the same `__main__` path, which checks the same
# wrapper without paying for torch's import again (seconds each on a slow CPU).
REAL_PROCESS_SCRIPT = "quickstart_row.py"
BAD_FILES = ["--checkpoint", "missing.pt", "--src", "no.txt", "--ref", "no.txt", "-o", "out.tsv"]


def run_script_in_process(script: str, args: list[str], capfd) -> tuple[int, str, str]:
    """`python scripts/<script> args` in this process: (exit status, stdout, stderr)."""
    import runpy

    import torch

    import transformer_cli.cli

    argv, path, threads = sys.argv, list(sys.path), torch.get_num_threads()
    # A script that is `tfm glossary` (say) runs tfm's main(), which marks the process as the `tfm`
    # program: a later in-process `tfm train` would then start the test process again on mimalloc.
    as_program = transformer_cli.cli._RUN_AS_PROGRAM
    sys.argv, sys.path = [str(ROOT / "scripts" / script), *args], [str(ROOT / "scripts"), *sys.path]
    capfd.readouterr()
    try:
        runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv, sys.path = argv, path
        torch.set_num_threads(threads)  # a benchmark sets its own
        transformer_cli.cli._RUN_AS_PROGRAM = as_program
    out, err = capfd.readouterr()
    return status, out, err


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_ends_like_tfm_one_line_and_exit_2(script, tmp_path, capfd, monkeypatch):
    """Scripts are tfm: the same entry wrapper (runtime/entry.py), so `--help` works, and an unknown
    option or a missing file is one `error:` line with exit 2, never a traceback."""
    monkeypatch.chdir(tmp_path)  # the missing files below are relative: nothing of the checkout is read
    if script == REAL_PROCESS_SCRIPT:
        def run(args: list[str]) -> tuple[int, str, str]:
            done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True,
                                  text=True, timeout=120)
            return done.returncode, done.stdout, done.stderr
    else:
        def run(args: list[str]) -> tuple[int, str, str]:
            return run_script_in_process(script, args, capfd)
    status, out, err = run(["--help"])
    assert status == 0 and out, err
    # Files that are not there: a script that takes these options fails on the first it reads (the
    # wrapper's one line), one that does not refuses the option (ScriptParser's one line).
    status, out, err = run(BAD_FILES)
    assert status == 2, (status, err[-500:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-500:]
    assert err.startswith("error: "), err
