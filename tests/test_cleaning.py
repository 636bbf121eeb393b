"""Corpus cleaning, measured on injected noise: the noise benchmark (scripts/make_noisy.py) writes
what it promises, labelled, seeded, and never over its input."""

from __future__ import annotations

import collections
import gzip
import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from transformer_cli.runtime.files import read_lines


def make_noisy_module():
    spec = importlib.util.spec_from_file_location("make_noisy", ROOT / "scripts" / "make_noisy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def noisy(multi30k_2k, tmp_path_factory):
    out = tmp_path_factory.mktemp("noisy")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_noisy.py"), "--data", str(multi30k_2k),
                          "--noise", "0.7", "--seed", "3", "-o", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return multi30k_2k, out


def test_the_noisy_corpus_is_the_clean_one_plus_each_kind_of_noise_labelled(noisy):
    data, out = noisy
    sources, targets = read_lines(data / "train.de.gz"), read_lines(data / "train.en.gz")
    others = {line for lang in ("fr", "cs") for line in read_lines(data / f"train.{lang}.gz")}
    rows = list(zip(read_lines(out / "train.de.gz"), read_lines(out / "train.en.gz"),
                    (out / "train.labels").read_text().splitlines()))
    kinds = collections.Counter(label for _, _, label in rows)
    assert kinds["clean"] == len(sources) and len(rows) == len(sources) + round(0.7 * len(sources))
    assert set(kinds) == {"clean", *make_noisy_module().KINDS}
    assert max(kinds[k] for k in kinds if k != "clean") - min(kinds[k] for k in kinds if k != "clean") <= 1
    pairs = set(zip(sources, targets))
    assert collections.Counter((s, t) for s, t, label in rows if label == "clean") == collections.Counter(
        zip(sources, targets))  # every clean pair once, unchanged
    longest = max(max(map(len, sources)), max(map(len, targets)))
    for s, t, label in rows:
        if label == "duplicate":
            assert (s, t) in pairs
        elif label == "copy":
            assert s == t
        elif label == "misaligned":
            assert (s, t) not in pairs and s in set(sources) and t in set(targets)
        elif label == "wrong_language":
            assert (s in others) != (t in others)
        elif label == "overlong":
            assert len(s) > longest or len(t) > longest
        elif label == "fragment":
            assert len(s.split()) <= 2 and len(t.split()) <= 2
        elif label == "garbage":
            assert (s, t) not in pairs and s not in set(sources)


def test_the_noise_is_seeded_and_the_input_is_never_written(noisy, tmp_path):
    data, out = noisy
    module = make_noisy_module()
    sources, targets = read_lines(data / "train.de.gz")[:300], read_lines(data / "train.en.gz")[:300]
    assert module.make_noisy(sources, targets, [], 0.5, 1) == module.make_noisy(sources, targets, [], 0.5, 1)
    assert module.make_noisy(sources, targets, [], 0.5, 1) != module.make_noisy(sources, targets, [], 0.5, 2)
    before = (data / "train.de.gz").read_bytes()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_noisy.py"), "--data", str(data),
                          "-o", str(data)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("error: -o") and "Traceback" not in run.stderr
    assert (data / "train.de.gz").read_bytes() == before
    assert gzip.decompress((out / "train.de.gz").read_bytes())  # a real gzip file
