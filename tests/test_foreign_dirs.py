"""Model directories that tfm did not write, damaged in every way derived from a good one.

Two kinds: a Hugging Face Marian directory (`tfm import --format marian`, built here by
transformers itself) and a CTranslate2 model directory (`tfm translate --engine ctranslate2 --model
DIR`, made by `tfm export`). The damages are not a list of cases but derived from the good
directory: every file in it deleted, emptied, cut to half, replaced by random bytes or by a
directory (CTranslate2: or by the other export's file of that name), and every top-level key of
its config.json (and tfm_decode.json) deleted, given the wrong type, made negative, huge (1e308), or
another value of its type (one less, the other truth value). Each command either works as on the
good directory (the same translations) or ends with one `error:` line and exit 2: no traceback,
and no output directory left behind.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import tiny_reverse_config
from tests.test_marian import read_gz, save_hf_marian, tfm_decode
from transformer_cli.cli import app
from transformer_cli.experiment.checkpoint import load_trained_model
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.training.train import train

LINES = 8
MAX_LEN = 20
DELETE, SKIP = object(), object()

FILE_DAMAGES: dict[str, Callable[[Path], None]] = {
    "deleted": lambda path: path.unlink(),
    "emptied": lambda path: path.write_bytes(b""),
    "truncated to half": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "random bytes": lambda path: path.write_bytes(random.Random(path.name).randbytes(max(path.stat().st_size, 64))),
    "a directory": lambda path: (path.unlink(), path.mkdir()),
}


def another_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    return value - 1 if isinstance(value, int) else SKIP  # one layer, one id less…


KEY_DAMAGES: dict[str, Callable[[Any], Any]] = {
    "deleted": lambda value: DELETE,
    "wrong type": lambda value: 1 if isinstance(value, str) else "x",
    "negative": lambda value: -1,
    "huge": lambda value: 1e308,
    "another value": another_value,
}


def run_tfm(*args: Any, input: str | None = None):
    """The `tfm` command line in this process; unlike tests.conftest.tfm_in_process it returns a
    crash too (as result.exception), so that one sweep reports every failing case."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def outcome_problem(result, translations: Any, good: Any) -> str | None:
    """What is wrong with a command's outcome on a damaged directory, or None: exit 0 with the good
    directory's translations, or exit 2 with one `error:` line."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"crashed (a traceback on the command line): {type(result.exception).__name__}: {result.exception}"
    if result.exit_code == 0:
        return None if translations == good else "exit 0, but the translations differ from the good directory's"
    lines = result.stderr.strip().splitlines()
    if result.exit_code != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
        return f"exit {result.exit_code}, stderr {result.stderr!r}"
    return None


def damaged_copies(good: Path, tmp: Path, damage: str) -> list[tuple[str, Path]]:
    """(case, a copy of `good` with the damage applied) for every file of `good`."""
    cases = []
    for i, file in enumerate(sorted(p.name for p in good.iterdir())):
        copy = tmp / f"case{i}" / good.name
        shutil.copytree(good, copy)
        FILE_DAMAGES[damage](copy / file)
        cases.append((f"{file} {damage}", copy))
    return cases


def config_copies(good: Path, tmp: Path, damage: str, config_names: tuple[str, ...],
                  every: int = 1) -> list[tuple[str, Path]]:
    """(case, a copy of `good` with one key of one JSON file damaged) for every top-level key; with
    `every` n, for every n-th key, starting one further along from one damage to the next (so that
    every key is still damaged in some way by the damages together)."""
    cases = []
    offset = list(KEY_DAMAGES).index(damage)
    for config_name in config_names:
        settings = json.loads((good / config_name).read_text())
        for index, (key, value) in enumerate(settings.items()):
            if (index + offset) % every:
                continue
            new = KEY_DAMAGES[damage](value)
            if new is SKIP:
                continue
            copy = tmp / f"case{len(cases)}" / good.name
            shutil.copytree(good, copy)
            changed = {k: v for k, v in settings.items() if k != key or new is not DELETE}
            if new is not DELETE:
                changed[key] = new
            (copy / config_name).write_text(json.dumps(changed))
            shown = "deleted" if new is DELETE else json.dumps(new)
            cases.append((f"{config_name} {key} {damage} ({json.dumps(value)} → {shown})", copy))
    return cases


def assert_no_problems(problems: dict[str, str], cases: int, at_least: int) -> None:
    assert cases >= at_least, f"only {cases} cases derived from the good directory"
    assert not problems, "\n".join(f"{case}: {why}" for case, why in problems.items())


# --------------------------------------------------------------------------- tfm import --format marian


@pytest.fixture(scope="module")
def marian_dir(multi30k_2k, tmp_path_factory) -> tuple[Path, list[str], list[list[int]]]:
    """(a good Marian directory, source lines, the greedy translations of its import)."""
    root = tmp_path_factory.mktemp("foreign_marian")
    de, en = read_gz(multi30k_2k / "train.de.gz", 2000), read_gz(multi30k_2k / "train.en.gz", 2000)
    save_hf_marian(root / "hf", de, en)
    lines = de[:LINES]
    result = run_tfm("import", "--format", "marian", root / "hf", "-o", root / "run")
    assert result.exit_code == 0, result.output
    good = marian_translations(root / "run", lines)
    assert len({tuple(t) for t in good}) > LINES // 2  # translations that depend on the input
    return root / "hf", lines, good


def marian_translations(run: Path, lines: list[str]) -> list[list[int]]:
    """Greedy ids of an imported run, always on 2 threads (the good and the damaged runs' decoding
    sum in the same order); the thread count is given back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return tfm_decode(load_trained_model(run / "checkpoints/checkpoint_best.pt"), lines, 1, MAX_LEN)
    finally:
        torch.set_num_threads(threads)


def sweep_marian(cases: list[tuple[str, Path]], lines: list[str], good: list[list[int]]) -> dict[str, str]:
    problems = {}
    for case, hf in cases:
        run = hf.parent / "out" / "run"
        result = run_tfm("import", "--format", "marian", hf, "-o", run)
        translations = marian_translations(run, lines) if result.exit_code == 0 else None
        problem = outcome_problem(result, translations, good)
        if problem is None and result.exit_code != 0 and run.parent.exists() and any(run.parent.iterdir()):
            problem = f"exit 2, but it left {sorted(p.name for p in run.parent.iterdir())} behind"
        if problem:
            problems[case] = problem
    return problems


@pytest.mark.parametrize("damage", FILE_DAMAGES)
def test_every_file_of_a_marian_directory_damaged(marian_dir, tmp_path, damage):
    hf, lines, good = marian_dir
    cases = damaged_copies(hf, tmp_path, damage)
    assert_no_problems(sweep_marian(cases, lines, good), len(cases), at_least=7)


# Every run damages every third key of the Marian config in each way (each key in some way); -m sweep
# every key in every way. (~40 keys, one import each: 30 s of CPU for them all.)
@pytest.mark.parametrize("every", [3, pytest.param(1, marks=pytest.mark.sweep)], ids=["a third", "every key"])
@pytest.mark.parametrize("damage", KEY_DAMAGES)
def test_every_key_of_a_marian_config_damaged(marian_dir, tmp_path, damage, every):
    hf, lines, good = marian_dir
    cases = config_copies(hf, tmp_path, damage, ("config.json",), every)
    assert_no_problems(sweep_marian(cases, lines, good), len(cases), at_least=10 // every)


def test_a_third_of_the_keys_in_every_way_damages_every_key_in_some_way(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps({f"key{i}": i + 1 for i in range(10)}))
    damaged = set()
    for damage in KEY_DAMAGES:
        damaged |= {case.split()[1] for case, _ in config_copies(good, tmp_path / damage, damage, ("config.json",), 3)}
    assert damaged == {f"key{i}" for i in range(10)}


# --------------------------------------------------------------------------- tfm translate --engine ctranslate2


# Lines for both exports: the tiny model's words, and German for the Marian model's vocabulary.
CT2_INPUT = ("wa wb wc wd\nwp wo\nwa wa wb wc wd we wf wg wh\nEin Mann fährt Fahrrad .\n"
             "Zwei Hunde spielen im Schnee .\neine Frau\n")


def ct2_translate(model_dir: Path):
    return run_tfm("translate", "--engine", "ctranslate2", "--model", model_dir, "--beam", "1", "--set",
                   "decode.max_len_a=0", "--set", f"decode.max_len_b={MAX_LEN}", input=CT2_INPUT)


@pytest.fixture(scope="module")
def ct2_exports(marian_dir, tiny_prepared, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Two good CTranslate2 directories, {name: (directory, its translations of CT2_INPUT)}: the
    imported Marian model's (source and target vocabularies) and a tiny tfm model's (one shared
    vocabulary)."""
    pytest.importorskip("ctranslate2")
    root = tmp_path_factory.mktemp("foreign_ct2")
    assert run_tfm("import", "--format", "marian", marian_dir[0], "-o", root / "marian").exit_code == 0
    data, _ = tiny_prepared
    shutil.copytree(tiny_prepared[1], root / "tiny")
    train(config_from_dict(tiny_reverse_config(data, root / "tiny", max_steps=30, eval_every=30)), progress_bar=False)
    exports = {}
    for name in ("marian", "tiny"):
        out = root / f"{name}_ct2"
        result = run_tfm("export", "--checkpoint", root / name / "checkpoints/checkpoint_best.pt", "-o", out)
        assert result.exit_code == 0, result.output
        good = ct2_translate(out)
        assert good.exit_code == 0 and len(good.stdout.splitlines()) == CT2_INPUT.count("\n"), good.output
        exports[name] = out, good.stdout
    assert (exports["tiny"][0] / "shared_vocabulary.json").is_file()
    assert (exports["marian"][0] / "source_vocabulary.json").is_file()
    return exports


def sweep_ct2(cases: list[tuple[str, Path]], good: str) -> dict[str, str]:
    problems = {}
    for case, model_dir in cases:
        result = ct2_translate(model_dir)
        problem = outcome_problem(result, result.stdout, good)
        if problem:
            problems[case] = problem
    return problems


@pytest.mark.parametrize("damage", [*FILE_DAMAGES, "the other export's"])
@pytest.mark.parametrize("export", ["marian", "tiny"])
def test_every_file_of_a_ctranslate2_directory_damaged(ct2_exports, tmp_path, export, damage):
    good, translations = ct2_exports[export]
    if damage == "the other export's":  # a vocabulary, sentencepiece model or model.bin of another model
        other = ct2_exports["tiny" if export == "marian" else "marian"][0]
        cases = []
        for file in sorted(p.name for p in good.iterdir() if (other / p.name).is_file()):
            copy = tmp_path / file / good.name
            shutil.copytree(good, copy)
            shutil.copyfile(other / file, copy / file)
            cases.append((f"{file} from the other export", copy))
    else:
        cases = damaged_copies(good, tmp_path, damage)
    assert_no_problems(sweep_ct2(cases, translations), len(cases), at_least=5)


@pytest.mark.parametrize("damage", KEY_DAMAGES)
@pytest.mark.parametrize("export", ["marian", "tiny"])
def test_every_key_of_a_ctranslate2_config_damaged(ct2_exports, tmp_path, export, damage):
    good, translations = ct2_exports[export]
    cases = config_copies(good, tmp_path, damage, ("config.json", "tfm_decode.json"))
    assert_no_problems(sweep_ct2(cases, translations), len(cases), at_least=3)


def test_a_file_instead_of_a_ctranslate2_directory(tmp_path):
    pytest.importorskip("ctranslate2")
    (tmp_path / "model").write_text("not a directory\n")
    result = run_tfm("translate", "--engine", "ctranslate2", "--model", tmp_path / "model", input="wa\n")
    assert result.exit_code == 2 and "not a CTranslate2 model directory (it is not a directory" in result.stderr
