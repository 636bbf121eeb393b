"""The command line as a user meets it: help, version, usage and config errors, the evaluate gate.

Run in this process (tfm_in_process: the same app, parsing and exit codes); one test starts the
installed entry point for real."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tfm_in_process


def run(*args, input=None):
    return tfm_in_process(*args, input=input)


def test_the_tfm_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "transformer_cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("tfm ") and not proc.stderr


@pytest.mark.slow
def test_reading_the_command_line_and_the_config_does_not_import_torch():
    # tfm train starts itself again on mimalloc after reading its config: importing torch first
    # would cost every run a second torch import (~1 s on these CPUs)
    config = Path(__file__).parents[1] / "configs/de-en.yaml"
    code = ("import sys, transformer_cli.cli; from transformer_cli.experiment.config import load_config; "
            f"load_config({str(config)!r}, []); print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_help_and_version():
    top = run("--help")
    assert top.exit_code == 0
    for command in ("prepare", "train", "translate", "evaluate", "average"):
        assert command in top.stdout
        sub = run(command, "--help")
        assert sub.exit_code == 0 and "--" in sub.stdout
    version = run("--version")
    assert version.exit_code == 0 and version.stdout.startswith("tfm ")


def test_config_errors_are_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_modle: 3\n")
    for args in (["train", "--config", str(bad)], ["prepare", "--config", str(tmp_path / "missing.yaml")],
                 ["prepare", "--config", str(bad), "--set", "model.d_model"]):
        proc = run(*args)
        assert proc.exit_code == 2, args
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "did you mean 'model.d_model'" in run("train", "--config", str(bad)).stderr


def test_usage_errors_are_one_line_exit_2():
    # click would print the usage, a hint and a boxed message; tfm prints one line naming the command
    for args, command, says in [(["train", "--no-such-flag"], "train", "No such option: --no-such-flag"),
                                (["no-such-command"], "", "No such command 'no-such-command'"),
                                (["evaluate", "--beam", "x"], "evaluate", "Invalid value for '--beam'"),
                                (["translate", "--set"], "translate", "Option '--set' requires an argument")]:
        proc = run(*args)
        assert proc.exit_code == 2 and not proc.stdout, args
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
        assert says in proc.stderr and f"{command} --help" in proc.stderr, proc.stderr


def test_bad_device_and_missing_eval_files_are_one_line_errors(reverse_model, tmp_path):
    _, summary = reverse_model
    proc = run("translate", "--checkpoint", str(summary.best_checkpoint), "--device", "gpu", input="wa wb wc\n")
    assert proc.exit_code == 2 and "'gpu' is not a device" in proc.stderr and "Traceback" not in proc.stderr
    ref = tmp_path / "ref.txt"
    ref.write_text("a b c\n")
    proc = run("evaluate", "--hyp", str(tmp_path / "missing.txt"), "--ref", str(ref))
    assert proc.exit_code == 2 and "file not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_paired_mode_gates_every_system(tmp_path):
    ref = tmp_path / "ref.txt"
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    lines = [f"the cat number {i} sat on the mat today" for i in range(30)]
    ref.write_text("\n".join(lines) + "\n")
    good.write_text("\n".join(lines) + "\n")
    also_good = tmp_path / "also_good.txt"
    also_good.write_text("\n".join(lines) + "\n")
    bad.write_text("\n".join(line.replace("cat", "dog").replace("mat", "rug") for line in lines) + "\n")
    passing = run("evaluate", "--hyp", str(good), "--hyp", str(also_good), "--ref", str(ref), "--min-bleu", "90")
    assert passing.exit_code == 0 and passing.stderr.count("PASS") == 2, passing.stderr
    failing = run("evaluate", "--hyp", str(good), "--hyp", str(bad), "--ref", str(ref), "--min-bleu", "90")
    assert failing.exit_code == 1 and f"FAIL: {bad}" in failing.stderr, failing.stderr
    as_json = run("evaluate", "--hyp", str(good), "--hyp", str(bad), "--ref", str(ref), "--json", "--min-bleu", "90")
    assert as_json.exit_code == 1, as_json.stderr  # --json does not switch the gate off
    report = json.loads(as_json.stdout)
    assert report["baseline"] == str(good) and round(report["systems"][str(good)]["bleu"]["score"], 6) == 100
    assert report["systems"][str(bad)]["bleu"]["p_value"] < 0.05
    with_ci = run("evaluate", "--hyp", str(good), "--hyp", str(bad), "--ref", str(ref), "--confidence")
    assert with_ci.exit_code == 0 and "95% CI" in with_ci.stdout and "paired bootstrap" in with_ci.stdout
