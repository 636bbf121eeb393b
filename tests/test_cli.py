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


BAD_SETTINGS = [
    ("model.d_model=0", "key 'model.d_model': Input should be greater than or equal to 1"),
    ("model.d_model=-8", "key 'model.d_model'"),
    ("model.n_heads=3", "d_model 64 is not divisible by n_heads 3"),
    ("model.dropout=1.5", "key 'model.dropout': Input should be less than 1"),
    ("train.label_smoothing=-0.1", "key 'train.label_smoothing'"),
    ("decode.beam=0", "key 'decode.beam'"),
    ("train.max_tokens=0", "key 'train.max_tokens'"),
    ("vocab.size=5", "key 'vocab.size'"),
]


def test_out_of_range_settings_are_refused_at_validation(tmp_path):
    """Caught when the config is read: one line naming the key, exit 2, before any work."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    for setting, message in BAD_SETTINGS:
        proc = run("train", "--config", str(config), "--set", setting, "--set", f"run_dir={tmp_path}")
        assert proc.returncode == 2, setting
        assert message in proc.stderr and "Traceback" not in proc.stderr, (setting, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bad_device_and_missing_eval_files_are_one_line_errors(reverse_model, tmp_path):
    _, summary = reverse_model
    proc = run("translate", "--checkpoint", str(summary.best_checkpoint), "--device", "gpu", input="wa wb wc\n")
    assert proc.returncode == 2 and "'gpu' is not a device" in proc.stderr and "Traceback" not in proc.stderr
    ref = tmp_path / "ref.txt"
    ref.write_text("a b c\n")
    proc = run("evaluate", "--hyp", str(tmp_path / "missing.txt"), "--ref", str(ref))
    assert proc.returncode == 2 and "file not found" in proc.stderr and "Traceback" not in proc.stderr


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
    assert passing.returncode == 0 and passing.stderr.count("PASS") == 2, passing.stderr
    failing = run("evaluate", "--hyp", str(good), "--hyp", str(bad), "--ref", str(ref), "--min-bleu", "90")
    assert failing.returncode == 1 and f"FAIL: {bad}" in failing.stderr, failing.stderr
    refused = run("evaluate", "--hyp", str(good), "--hyp", str(bad), "--ref", str(ref), "--json")
    assert refused.returncode == 2 and "paired mode" in refused.stderr
