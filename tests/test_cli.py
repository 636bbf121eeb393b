import subprocess
import sys

TFM = [sys.executable, "-m", "transformer_cli.cli"]


def run(*args, **kw):
    return subprocess.run([*TFM, *args], capture_output=True, text=True, **kw)


def test_help_and_version():
    top = run("--help")
    assert top.returncode == 0
    for command in ("prepare", "train", "translate", "evaluate", "average"):
        assert command in top.stdout
        sub = run(command, "--help")
        assert sub.returncode == 0 and "--" in sub.stdout
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("tfm ")


def test_config_errors_are_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_modle: 3\n")
    for args in (["train", "--config", str(bad)], ["prepare", "--config", str(tmp_path / "missing.yaml")],
                 ["prepare", "--config", str(bad), "--set", "model.d_model"]):
        proc = run(*args)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "did you mean 'model.d_model'" in run("train", "--config", str(bad)).stderr


def test_wrong_flag_is_a_usage_error():
    proc = run("train", "--no-such-flag")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
