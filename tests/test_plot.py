import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (matplotlib depends on pillow)

from transformer_cli.plot import plot_runs, read_metrics  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

TFM = [sys.executable, "-m", "transformer_cli.cli"]


def write_run(folder, valid=True, steps=10):
    folder.mkdir(parents=True)
    rows = [{"kind": "train", "step": s * 10, "epoch": 0, "lr": 1e-3 * s, "loss": 5.0 / s, "ppl": 1.0,
             "tokens_per_s": 1000.0, "padding": 0.1, "elapsed": 6.0 * s} for s in range(1, steps + 1)]
    if valid:
        rows += [{"kind": "valid", "step": s * 50, "epoch": 0, "elapsed": 30.0 * s, "loss": 3.0 / s, "ppl": 2.0,
                  "bleu": 10.0 * s} for s in (1, 2)]
    text = "\n".join(json.dumps(r) for r in rows) + "\n" + '{"kind": "train", "st'  # crash mid-line
    (folder / "metrics.jsonl").write_text(text)
    return folder


@pytest.mark.slow
def test_png_has_the_requested_size_and_overlays_runs(tmp_path):
    a, b = write_run(tmp_path / "base"), write_run(tmp_path / "big")
    out = plot_runs([a, b], tmp_path / "curves.png", width=640, height=480)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (640, 480)


def test_run_without_valid_rows_still_plots_train_curves(tmp_path):
    run = write_run(tmp_path / "early", valid=False)
    metrics = read_metrics(run)
    assert len(metrics.train) == 10 and metrics.valid == []
    with Image.open(plot_runs([run], tmp_path / "c.png", 500, 400)) as image:
        assert image.size == (500, 400)


def test_resumed_run_keeps_one_row_per_step(tmp_path):
    run = write_run(tmp_path / "r")
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"kind": "train", "step": 20, "lr": 1.0, "loss": 9.0, "elapsed": 1.0}) + "\n")
    rows = read_metrics(run).train
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    assert next(r for r in rows if r["step"] == 20)["loss"] == 9.0


@pytest.mark.slow
def test_cli_plots_and_reports_a_run_without_metrics(tmp_path):
    run = write_run(tmp_path / "run")
    proc = subprocess.run([*TFM, "plot", str(run), "-o", str(tmp_path / "x.png"), "--width", "800",
                           "--height", "600"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with Image.open(tmp_path / "x.png") as image:
        assert image.size == (800, 600)
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([*TFM, "plot", str(tmp_path / "empty"), "-o", str(tmp_path / "y.png")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "metrics.jsonl" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "y.png").exists()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(TfmError, match="no train or valid metrics"):
        read_metrics(tmp_path / "empty")


def test_a_picture_written_to_a_fifo_reaches_its_reader(tmp_path):
    """`tfm plot -o FIFO`: "[Errno None] None" (savefig seeks in what it writes)."""
    import os
    import threading

    run = write_run(tmp_path / "run")
    fifo = tmp_path / "curves.png"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    plot_runs([run], fifo)
    reader.join(timeout=30)
    assert fifo.exists() and received and received[0].startswith(b"\x89PNG")
