"""Shared fixtures: Multi30k slices fetched through scripts/get_data.sh, and a synthetic task.

Corpus data is never read from a hard-coded path: the same script users run finds it
(data/, then ../shared/data/, then the public download) and fails loudly if it cannot.
"""

from __future__ import annotations

import fcntl
import gc
import gzip
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests import warm_processes

# torch and tfm's training are imported where a fixture needs them, not here: pytest's controlling
# process (it only hands tests to the workers) reads this file too, and torch takes seconds to import.

ROOT = Path(__file__).resolve().parents[1]

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE): without it every
# test process rewrites every test module's asserts again and every `tfm` process a test starts compiles
# tfm's modules again, ~10 s a test process on a slow CPU. The caches are __pycache__/ folders (ignored by git).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# torch.compile's tests: inductor takes the vector instructions the CPU reports (AVX-512, AVX2) as
# usable instead of first compiling and loading a probe for each with its compiler (~6 s of CPU a run,
# once per cache folder: a new machine, CI). A compiler that cannot build them fails those tests.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# `python -m transformer_cli ...` started by a test forks from a process that has imported torch and
# tfm already (tests/warm_processes.py says what differs from a cold start, and when it starts cold).
warm_processes.install()


def xdist_workers() -> int:
    """Test processes of this run (pytest-xdist's -n; 1 without it)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def threads_per_test_process() -> int:
    """The cores shared among the run's test processes: each one's share (1 or 2)."""
    return max(1, min(2, (os.cpu_count() or 1) // xdist_workers()))


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # The cores shared among the run's test processes: two processes of two threads each on two
    # cores take turns on them (a step's threads wait for each other), slower than one thread each.
    # The processes a test starts take as many (OMP_NUM_THREADS sets torch's default), so that a run
    # in a subprocess and one in the test itself sum in the same order: resumed = uninterrupted.
    threads = threads_per_test_process()
    import torch

    torch.set_num_threads(threads)
    if xdist_workers() > 1:
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(autouse=True)
def _torch_threads_kept(_torch_threads):
    """Every test starts and ends at this process's share of the cores, whatever a test or a fixture
    set torch's thread count to (to match a worker process's arithmetic, or to see that CTranslate2
    gives it back): left at 2 beside the other test process's threads, OpenMP's threads outnumber the
    cores and wait on each other (every later test in that process ran ~2.5x slower on a 2-core Zen
    3). A module's fixture that set it once (the Marian directory's) left every later test of its
    process at 2: the model filter's self-trained test took 117 CPU-s there, 23 at one thread."""
    import torch

    threads = threads_per_test_process()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


T = TypeVar("T")


def run_folder(tmp_path_factory) -> Path:
    """The test run's temporary folder: above each xdist worker's own, shared by the run's processes."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)` once per test run, its result shared by the run's test processes (pytest-xdist
    workers): the first to ask builds it in a folder beside theirs (a lock keeps the others waiting)
    and leaves it pickled; the others read it. Without xdist: built here, as a session fixture is.
    Whatever uses the result must not change what is in its folder (copy it first)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    shared = run_folder(tmp_path_factory)
    result = shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if `build` fails
        if not result.exists():
            value = build(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=shared)))  # a failed try leaves its own
            staged = result.with_suffix(".partial")
            staged.write_bytes(pickle.dumps(value))
            staged.replace(result)
            return value
    return pickle.loads(result.read_bytes())


# Fixtures that train a model for more than a few steps, or run a corpus through a script: seconds to
# a minute each on a 2-core CPU. A test that needs one (directly or through another fixture) belongs
# to the full suite, not to the fast tier's minute (`-m "not slow"`, docs/testing.md).
TRAINED_FIXTURES = {"reverse_model", "shift_model", "multi30k_model", "marian", "marian_dir", "copy_model",
                    "straight_30_steps", "layout_runs", "noisy", "multi30k_8k"}


# What the run's test processes build once and share (`built_once`): while one builds it, another that
# needs it waits.
SHARED_FIXTURES = {"reverse_model", "shift_model", "layout_runs", "multi30k_2k"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The tests that need a shared fixture first, the others after (each group in file order). pytest-xdist
    # hands each test process a contiguous part of this order and a free one takes from the end of
    # another's: one process meets the shared fixtures and builds them while the other runs tests that
    # need none, instead of waiting for a fixture the first is building (~10 s of a core, ~20 on a Zen 3).
    items.sort(key=lambda item: not SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())))


def pytest_collection_finish(session):
    # The test modules and what they imported (torch, tfm, hypothesis) live for the whole run: in the
    # permanent generation, the run's garbage collections skip them.
    gc.freeze()
    if not any(item.get_closest_marker("slow") for item in session.items):
        warm_processes.cold_for_a_fast_run()  # the fast tier's few commands are cheaper cold


@pytest.fixture(scope="session", autouse=True)
def _private_measurement_cache(tmp_path_factory):
    """The bf16 speed measurement (precision.measure_bf16_speedup) is cached here, not in ~/.cache:
    one folder for the run's test processes and the processes they start (measured once a run)."""
    shared = run_folder(tmp_path_factory)
    (shared / "tfm_cache").mkdir(exist_ok=True)
    os.environ.setdefault("TFM_CACHE", str(shared / "tfm_cache"))


def prepare_and_train(raw: dict, train_it: bool = True):
    """The real `prepare` (and `train`) of a raw config: (config, training summary or None)."""
    from transformer_cli.data.prepare import prepare
    from transformer_cli.experiment.config import config_from_dict
    from transformer_cli.training.train import train

    config = config_from_dict(raw)
    prepare(config, progress=False)
    return config, train(config, progress_bar=False) if train_it else None


def get_corpus_slice(dest: Path, lines: int) -> Path:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get_data.sh"), "multi30k", "--dest", str(dest), "--lines", str(lines)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, f"scripts/get_data.sh failed (corpus unavailable?): {result.stderr}"
    return dest


@pytest.fixture(scope="session")
def multi30k_2k(tmp_path_factory) -> Path:
    """First 2,000 lines of every Multi30k file (train, val, test), gzipped like the originals."""
    return built_once(tmp_path_factory, "multi30k_2k", lambda folder: get_corpus_slice(folder, 2000))


def multi30k_config(data_dir: Path, run_dir: Path, **sections) -> dict:
    raw = {
        "run_dir": str(run_dir),
        "data": {"src_lang": "de", "tgt_lang": "en", "train": str(data_dir / "train"),
                 "valid": str(data_dir / "val"), "test": str(data_dir / "test_2016_flickr"), "max_len": 64},
        "vocab": {"size": 1000},
        "model": {"d_model": 64, "n_heads": 2, "enc_layers": 2, "dec_layers": 2, "d_ff": 128, "dropout": 0.1,
                  "norm_position": "pre"},
        "train": {"max_tokens": 1024, "lr_schedule": "inverse_sqrt", "lr": 0.003, "warmup": 50,
                  "max_steps": 100, "eval_every": 50, "eval_bleu_sentences": 20, "log_every": 10},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values) if isinstance(values, dict) else raw.update({section: values})
    return raw


# --------------------------------------------------------------------------- synthetic reverse task

WORDS = [f"w{c}" for c in "abcdefghijklmnop"]


def write_reverse_task(folder: Path, n_train: int = 6000, n_test: int = 200, seed: int = 0) -> None:
    """Source: 3–9 random words; target: the same words in reverse order."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_test), ("test", n_test)):
        src_lines, tgt_lines = [], []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
            src_lines.append(" ".join(words))
            tgt_lines.append(" ".join(reversed(words)))
        for lang, lines in (("src", src_lines), ("tgt", tgt_lines)):
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")


# Synthetic tasks are not language: a reversed line has the source's words (a "copy"), random words
# repeat and short random lines recur, and "src"/"tgt" name no language. The corpus filters that judge
# that are off for them.
SYNTHETIC_FILTERS = {"copies": {"enabled": False}, "repeats": {"enabled": False}, "duplicates": {"enabled": False},
                     "language": {"enabled": False}}


def reverse_task_config(data_dir: Path, run_dir: Path, **train_overrides) -> dict:
    return {
        "run_dir": str(run_dir),
        "data": {"src_lang": "src", "tgt_lang": "tgt", "train": str(data_dir / "train"),
                 "valid": str(data_dir / "valid"), "test": str(data_dir / "test"), "filters": SYNTHETIC_FILTERS},
        # Vocabulary: 16 words + the characters, so every word becomes one piece.
        "vocab": {"size": 40},
        "model": {"d_model": 64, "n_heads": 4, "enc_layers": 2, "dec_layers": 2, "d_ff": 256, "dropout": 0.0,
                  "norm_position": "pre"},
        "train": {"seed": 1, "max_tokens": 1500, "lr_schedule": "inverse_sqrt", "lr": 0.003, "warmup": 100,
                  "max_steps": 700, "eval_every": 700, "eval_bleu_sentences": 100, "log_every": 100,
                  "label_smoothing": 0.0, "clip_norm": 1.0, **train_overrides},
        "decode": {"beam": 4, "batch_size": 32, "max_len_a": 1.0, "max_len_b": 5},
    }


@pytest.fixture(scope="session")
def reverse_model(tmp_path_factory):
    """A tiny model trained by the real `prepare` + `train` on the reverse task (~25 s on 2 cores).

    400 steps of the budget schedule (decay to 0 at the last step) end at valid BLEU 98.8–99.6 over
    seeds 1–3 in fp32 and 99.0 in bf16; 700 steps of inverse_sqrt took 1.7x as long for 98.6."""
    def build(root: Path):
        write_reverse_task(root / "data")
        raw = reverse_task_config(root / "data", root / "run", max_steps=400, eval_every=400, lr_schedule="budget")
        return prepare_and_train(raw)

    return built_once(tmp_path_factory, "reverse", build)


# --------------------------------------------------------------------------- synthetic multilingual task

SHIFT = {"up": 1, "dn": -1}


def shifted(words: list[str], language: str) -> list[str]:
    return [WORDS[(WORDS.index(w) + SHIFT[language]) % len(WORDS)] for w in words]


def write_shift_task(folder: Path, n_train: int = 3000, n_test: int = 100, seed: int = 0) -> None:
    """Files train/valid/test.{src,up,dn}, line-aligned: 3–8 random words and their two shifts."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_test), ("test", n_test)):
        lines = [[rng.choice(WORDS) for _ in range(rng.randint(3, 8))] for _ in range(n)]
        for language in ("src", "up", "dn"):
            text = [" ".join(words if language == "src" else shifted(words, language)) for words in lines]
            with gzip.open(folder / f"{split}.{language}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(text) + "\n")


def shift_config(data: Path, run: Path, **train) -> dict:
    return {
        "run_dir": str(run),
        "data": {"directions": ["src-up", "src-dn"], "train": str(data / "train"), "valid": str(data / "valid"),
                 "test": str(data / "test"), "filters": SYNTHETIC_FILTERS},
        "vocab": {"size": 42},  # 16 words, their characters and the two tags: every word one piece
        "model": {"d_model": 64, "n_heads": 4, "enc_layers": 2, "dec_layers": 2, "d_ff": 256, "dropout": 0.0,
                  "norm_position": "pre"},
        "train": {"seed": 1, "max_tokens": 1500, "lr_schedule": "budget", "lr": 0.003, "warmup": 60,
                  "max_steps": 300, "eval_every": 300, "eval_bleu_sentences": 50, "log_every": 50,
                  "label_smoothing": 0.0, "clip_norm": 1.0, "precision": "fp32", **train},
        "decode": {"beam": 2, "batch_size": 32, "max_len_a": 1.0, "max_len_b": 5, "precision": "fp32"},
    }


@pytest.fixture(scope="session")
def shift_model(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, config file) of the tiny multilingual model, trained by prepare + train (~15 s),
    once per test run (the Hugging Face export's tests read it too); copy the run before changing it."""
    def build(root: Path) -> tuple[Path, Path]:
        write_shift_task(root / "data")
        raw = shift_config(root / "data", root / "run")
        (root / "shift.yaml").write_text(json.dumps(raw))
        prepare_and_train(raw)
        return root / "data", root / "shift.yaml"

    return built_once(tmp_path_factory, "shift", build)


# --------------------------------------------------------------------------- a tiny prepared run (CLI tests)

TFM = [sys.executable, "-m", "transformer_cli.cli"]


def tfm(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run the real `tfm` command line in a subprocess (text mode, output captured)."""
    return subprocess.run([*TFM, *map(str, args)], capture_output=True, text=True, **kwargs)


def tfm_in_process(*args: str, input: str | None = None):
    """The real `tfm` app run in this process by Typer's CliRunner: parsing, the error wrapper and the
    exit code as on the command line, without a subprocess's start-up (~3 s importing torch on a slow
    CPU). For the variants of a command whose first case runs as a real process. Returns click's
    Result (exit_code, stdout, stderr); an exception other than the exit is a failure (a traceback)."""
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def tiny_reverse_config(data_dir: Path, run_dir: Path, **train_overrides) -> dict:
    """The reverse task with a 23k-parameter model: a step takes milliseconds (fault-injection tests)."""
    settings = {"max_steps": 30, "eval_every": 10, "log_every": 5, "eval_bleu_sentences": 10, "precision": "fp32"}
    raw = reverse_task_config(data_dir, run_dir, **{**settings, **train_overrides})
    raw["model"].update(d_model=32, d_ff=64, n_heads=2, enc_layers=1, dec_layers=1)
    return raw


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, prepared run folder) of the tiny reverse task; copy the run before changing it."""
    def build(root: Path) -> tuple[Path, Path]:
        write_reverse_task(root / "data", n_train=2000, n_test=50)
        prepare_and_train(tiny_reverse_config(root / "data", root / "run"), train_it=False)
        return root / "data", root / "run"

    return built_once(tmp_path_factory, "tiny", build)


# The tiny reverse task in each layout the exports map differently: name → (the model section's
# changes, the vocab section's). Each is trained once per run (`layout_runs`) and shared: the Hugging
# Face export and import tests take every one, the ensemble test two (one vocabulary, two networks).
TINY_LAYOUTS = {
    "pre-norm, joint": ({"norm_position": "pre"}, {}),
    "post-norm, joint": ({"norm_position": "post"}, {}),
    "post-norm, separate vocabularies, split sinusoids, output bias": (
        {"norm_position": "post", "share_embeddings": False, "positional": "sinusoidal_split", "output_bias": True,
         "tie_output": False}, {"joint": False}),
}


def trained_layout(root: Path, model: dict, vocab: dict) -> Path:
    """A tiny reverse-task model (d_model 32, 2+2 layers) trained for 300 steps and scored on its test
    set (the score goes into an export's model card); its config file."""
    from transformer_cli.data.prepare import prepare
    from transformer_cli.experiment.config import config_from_dict
    from transformer_cli.training.train import train

    write_reverse_task(root / "data", n_train=2000, n_test=40)
    if vocab.get("joint") is False:  # target words in capitals: two vocabularies that differ
        for split in ("train", "valid", "test"):
            target = root / "data" / f"{split}.tgt.gz"
            target.write_bytes(gzip.compress(gzip.decompress(target.read_bytes()).upper()))
    raw = tiny_reverse_config(root / "data", root / "run", max_steps=300, eval_every=300, lr_schedule="budget")
    raw["model"].update(d_model=32, d_ff=64, n_heads=2, enc_layers=2, dec_layers=2, **model)
    raw["vocab"].update(vocab)
    raw["decode"].update(precision="fp32", engine="torch")
    (root / "c.yaml").write_text(json.dumps(raw))
    config = config_from_dict(raw)
    prepare(config, progress=False)
    train(config, progress_bar=False)
    scored = tfm_in_process("evaluate", "--config", root / "c.yaml", "--split", "test")
    assert scored.exit_code == 0, scored.stderr
    return root / "c.yaml"


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory) -> Callable[[str], Path]:
    """The config file of a layout's trained run (TINY_LAYOUTS), built when a test first asks for
    it, by whichever test process asks first (the layouts train side by side in a parallel run)."""
    import functools

    @functools.cache
    def run_of(layout: str) -> Path:
        model, vocab = TINY_LAYOUTS[layout]
        name = f"layout-{list(TINY_LAYOUTS).index(layout)}"
        return built_once(tmp_path_factory, name, lambda root: trained_layout(root, model, vocab))

    return run_of


def tiny_run(tiny_prepared, dest: Path, **train_overrides) -> Path:
    """A private copy of the prepared tiny run at `dest` and its config file; returns the config path."""
    data, run = tiny_prepared
    shutil.copytree(run, dest / "run")
    config = dest / "tiny.yaml"
    config.write_text(json.dumps(tiny_reverse_config(data, dest / "run", **train_overrides)))
    return config


def wait_until_training(run_dir: Path, records: int = 5, meanwhile=lambda: time.sleep(0.05),
                        timeout: float = 120.0) -> None:
    """Return once a `tfm train` subprocess has logged `records` lines to <run_dir>/metrics.jsonl
    (it is past start-up and training), or after `timeout`; `meanwhile` runs between looks."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < records):
        meanwhile()


def assert_same_final_weights(a_path: Path, b_path: Path, step: int) -> None:
    """Two runs' checkpoint_last.pt are at `step` with bit-identical weights."""
    import torch

    from transformer_cli.experiment.checkpoint import load_checkpoint

    a, b = load_checkpoint(a_path), load_checkpoint(b_path)
    assert a["progress"]["step"] == b["progress"]["step"] == step
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


FP32 = ["decode.precision=fp32"]  # batch-invariant results: a line's output does not depend on its neighbours


def fp32_translator(*checkpoints, **decode):
    """tfm's engine on `checkpoints` (several: an ensemble) in fp32, with `decode` settings."""
    from transformer_cli.decoding.torch_engine import Translator

    overrides = FP32 + [f"decode.{k}={json.dumps(v)}" for k, v in decode.items()]
    return Translator.from_checkpoint(list(checkpoints), device="cpu", overrides=overrides)
