"""A command never writes over a file it reads: the cases a sweep found (the config as `--dropped`, the
CTranslate2 reference script's input as its output) and their neighbours (a link to the input)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow
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
    from transformer_cli.decoding.distill import check_distill_output
    from transformer_cli.experiment.config import config_from_dict
    from transformer_cli.runtime.errors import TfmError

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / corpus_file).write_text("x\n")
    config = config_from_dict(tiny_reverse_config(folder, tmp_path / "run", ))
    with pytest.raises(TfmError, match=f"distill.output {folder} holds {corpus_file}, which tfm did not write"):
        check_distill_output(folder, config)
    assert sorted(p.name for p in folder.iterdir()) == [corpus_file]
    (folder / "teacher.json").write_text("{}")  # a distillation's own folder: resumed, not refused
    check_distill_output(folder, config)
    with pytest.raises(TfmError, match="this command's input \\(the run directory\\)"):
        check_distill_output(tmp_path / "run", config)


# --------------------------------------------------------------------------- the rule itself (runtime.files.check_output)

def test_the_output_rule_refuses_every_kind_of_overwrite_and_allows_its_own(tmp_path, monkeypatch):
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.runtime.files import check_output

    monkeypatch.chdir(tmp_path)
    text = tmp_path / "in.txt"
    text.write_text("keep\n")
    (tmp_path / "link.txt").symlink_to(text)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "prepare.json").write_text("{}")
    refused = [  # (target, how it is checked, what the one line says)
        (text, {}, "is also this command's input (-i)"),
        (tmp_path / "link.txt", {}, "is also this command's input (-i)"),  # the input through a link
        (folder, {}, "is a directory: give the file to write"),
        (run / "config.yaml", {}, "one of the run directory"),
        (text, {"directory": True}, "exists and is not a directory"),
        (Path("."), {"directory": True}, "the working directory or one of its parents"),
        (tmp_path.parent, {"directory": True}, "the working directory or one of its parents"),
        (folder, {"directory": True}, "holds files tfm did not write there"),  # replaced whole: must be empty
        (tmp_path / "sub", {"directory": True, "extra": tmp_path / "sub" / "x"}, "this command's input"),
        (run / "checkpoints", {"directory": True}, "one of the run directory"),
        (folder, {"directory": True, "names": ["notes.txt.gz"]}, "holds notes.txt, which tfm did not write"),
        (folder, {"directory": True, "names": ["notes.txt"]}, "holds notes.txt, which tfm did not write"),
    ]
    for target, how, message in refused:
        how = dict(how)
        extra = how.pop("extra", None)
        with pytest.raises(TfmError, match=message.replace("(", "\\(").replace(")", "\\)")):
            check_output(target, {"-i": [text, extra]}, **how)
    assert text.read_text() == "keep\n" and (folder / "notes.txt").read_text() == "mine\n"
    allowed = [(tmp_path / "new.txt", {}), (None, {}), ("-", {}), (tmp_path / "new", {"directory": True}),
               (folder, {"directory": True, "names": ["train.de"]}),  # its other files are left alone
               (folder, {"directory": True, "ours": lambda d: (d / "notes.txt").is_file()})]  # its own earlier output
    for target, how in allowed:
        check_output(target, {"-i": [text]}, **how)


def test_a_scripts_workdir_is_its_own_or_new(tmp_path):
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.runtime.files import SCRATCH_MARK, scratch_directory

    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work\n")
    with pytest.raises(TfmError, match="--workdir .* holds files tfm did not write there"):
        scratch_directory(users)
    assert sorted(p.name for p in users.iterdir()) == ["thesis.tex"]
    made = scratch_directory(tmp_path / "scratch")
    (made / "result.txt").write_text("from last time\n")
    assert scratch_directory(made) == made and (made / SCRATCH_MARK).is_file()  # its own: used again


# --------------------------------------------------------------------------- every command and script

@pytest.fixture
def written_inputs(tmp_path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("A dog.\n", encoding="utf-8")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


# Each command that writes, given one of its own inputs as its output (or a directory that holds it).
COMMANDS = {
    "translate": lambda d, ck: ["translate", "--checkpoint", ck, "-i", d / "in.de", "-o", d / "in.de"],
    "glossary": lambda d, ck: ["glossary", "--checkpoint", ck, "--src", d / "in.de", "--ref", d / "ref.en",
                               "-o", d / "ref.en"],
    "sample-constraints": lambda d, ck: ["sample-constraints", "--src", d / "in.de", "--ref", d / "ref.en",
                                         "-o", d / "in.de"],
    "average": lambda d, ck: ["average", ck, ck, "-o", ck],
    "attention": lambda d, ck: ["attention", "--checkpoint", ck, "--src", "wa", "-o", ck],
    "export": lambda d, ck: ["export", "--checkpoint", ck, "-o", Path(ck).parent],
    "import": lambda d, ck: ["import", d / "model", "-o", d / "model"],
    "api-key": lambda d, ck: ["api-key", "--api-keys", Path(ck).parent],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_command_writes_over_what_it_reads(command, written_inputs, reverse_model):
    checkpoint = reverse_model[1].best_checkpoint
    before = {p: p.read_bytes() for p in [*written_inputs.rglob("*"), Path(checkpoint)] if p.is_file()}
    result = tfm_in_process(*COMMANDS[command](written_inputs, checkpoint))
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert any(words in result.stderr for words in ("this command's input", "is a directory", "run directory")), \
        result.stderr
    assert {p: p.read_bytes() for p in before} == before


WRITES_WHERE_TOLD = re.compile(r"add_argument\([^)]*[\"'](?:-o|--output|--out|--workdir|--run-dir|output)[\"']")


def test_every_script_that_writes_where_it_is_told_checks_the_output_rule():
    """A script that takes a path to write (a file, a folder, a working directory) checks it with the
    one output rule (check_output, or scratch_directory for a working directory) before writing."""
    writers = [p for p in sorted((ROOT / "scripts").glob("*.py")) if WRITES_WHERE_TOLD.search(p.read_text())]
    assert len(writers) >= 8, [p.name for p in writers]  # the pattern still finds them
    unchecked = [p.name for p in writers if not re.search(r"\b(check_output|scratch_directory)\(", p.read_text())]
    assert unchecked == []


@pytest.mark.parametrize("script, args", [
    ("make_noisy.py", lambda d: ["--data", d, "-o", d]),
    ("make_documents.py", lambda d: ["--src", d / "in.de", "--ref", d / "ref.en", "--out", d]),
    ("ct2_reference.py", lambda d: [d / "model", d / "in.de", d / "link.de"]),
])
def test_scripts_never_write_over_their_inputs(script, args, written_inputs):
    (written_inputs / "train.de.gz").write_bytes(gzip.compress(b"Ein Hund.\n"))
    (written_inputs / "train.en.gz").write_bytes(gzip.compress(b"A dog.\n"))
    (written_inputs / "lines.src").write_text("a user's file of the same name\n")
    (written_inputs / "model" / "model.bin").write_bytes(b"")
    (written_inputs / "link.de").symlink_to(written_inputs / "in.de")
    before = {p: p.read_bytes() for p in written_inputs.rglob("*") if p.is_file()}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args(written_inputs))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and ("input" in done.stderr or "did not write" in done.stderr)
    assert {p: p.read_bytes() for p in written_inputs.rglob("*") if p.is_file()} == before


def test_prepare_reports_a_plain_corpus_beside_its_gz_instead_of_choosing(tiny_config, tmp_path):
    """`train.src` beside `train.src.gz` (an unpacked copy, another command's output): which one is the
    corpus is the user's to say; nothing is prepared from either."""
    data = tmp_path / "data"
    (data / "train.src").write_bytes(gzip.decompress((data / "train.src.gz").read_bytes())[:200])
    result = tfm_in_process("prepare", "--config", str(tiny_config))
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert f"{data / 'train.src'} and {data / 'train.src.gz'} both exist" in result.stderr
    assert not (tmp_path / "run").exists()
    (data / "train.src").unlink()
    assert tfm_in_process("prepare", "--config", str(tiny_config)).exit_code == 0
