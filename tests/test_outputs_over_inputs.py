"""A command never writes over a file it reads: the cases a sweep found (the config as `--dropped`, the
CTranslate2 reference script's input as its output) and their neighbours (a link to the input)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tfm_in_process, tiny_reverse_config, write_reverse_task


@pytest.fixture
def tiny_config(tmp_path):
    write_reverse_task(tmp_path / "data", n_train=200, n_test=20)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(tiny_reverse_config(tmp_path / "data", tmp_path / "run")))
    return config


@pytest.mark.parametrize("through_a_link", [False, True])
def test_prepare_never_writes_the_dropped_pairs_over_its_config(tiny_config, tmp_path, through_a_link):
    before = tiny_config.read_bytes()
    target = tiny_config
    if through_a_link:
        target = tmp_path / "link.yaml"
        target.symlink_to(tiny_config)
    result = tfm_in_process("prepare", "--config", str(tiny_config), "--dropped", str(target))
    assert result.exit_code == 2 and result.stderr.startswith("error: --dropped "), result.stderr
    assert "is also this command's input (--config)" in result.stderr and len(result.stderr.splitlines()) == 1
    assert tiny_config.read_bytes() == before and not (tmp_path / "run").exists()


def run_reference(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "ct2_reference.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_the_ct2_reference_script_refuses_to_write_over_its_input_and_names_what_is_missing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    missing = run_reference(str(tmp_path / "nowhere"), str(source), str(tmp_path / "out.en"))
    assert missing.returncode == 2 and "not a CTranslate2 model directory" in missing.stderr
    (model / "model.bin").write_bytes(b"")  # the checks come before the model is loaded
    for output in (str(source), str(tmp_path)):
        refused = run_reference(str(model), str(source), output)
        assert refused.returncode == 2 and refused.stderr.startswith("error: ct2_reference.py: ")
        assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert source.read_text(encoding="utf-8") == "Ein Hund.\n"


@pytest.mark.parametrize("corpus_file", ["train.src", "train.src.gz", "train.tgt"])
def test_distill_never_writes_into_a_folder_that_holds_a_corpus(tmp_path, corpus_file):
    """distill.output naming the corpus folder (its train.src.gz would be shadowed by a plain
    train.src, or train.tgt replaced): refused before any teacher is loaded, nothing written."""
    from transformer_cli.decoding.distill import refuse_foreign_corpus
    from transformer_cli.experiment.config import config_from_dict
    from transformer_cli.runtime.errors import TfmError

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / corpus_file).write_text("x\n")
    config = config_from_dict(tiny_reverse_config(folder, tmp_path / "run", ))
    with pytest.raises(TfmError, match=f"holds {corpus_file}, which tfm distill did not write"):
        refuse_foreign_corpus(folder, config)
    assert sorted(p.name for p in folder.iterdir()) == [corpus_file]
    (folder / "teacher.json").write_text("{}")  # a distillation's own folder: resumed, not refused
    refuse_foreign_corpus(folder, config)
