"""`tfm plot`: learning curves from one or more runs' metrics.jsonl, drawn into one PNG.

matplotlib is an optional extra (`pip install -e '.[plot]'`): training and translating never
need it, and it is a large install for a server that only decodes.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .experiment.rundir import metrics_of
from .runtime.errors import TfmError
from .runtime.files import atomic_write_bytes

INSTALL_HINT = "matplotlib is not installed: pip install -e '.[plot]' (or pip install matplotlib)"


def import_pyplot() -> Any:
    """pyplot on the Agg backend (no display needed), or a TfmError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise TfmError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # headless: never try to open a window (servers, CI)
    import matplotlib.pyplot as plt

    return plt


@dataclass
class RunMetrics:
    name: str
    train: list[dict] = field(default_factory=list)  # kind "train": step, lr, loss, tokens_per_s, elapsed
    valid: list[dict] = field(default_factory=list)  # kind "valid": step, loss, bleu, elapsed (may lack elapsed)


def _by_step(rows: list[dict]) -> list[dict]:
    # After `train --resume` the steps between the last checkpoint and the crash are logged
    # twice: keep the later record of each step, in step order.
    latest = {row["step"]: row for row in rows}
    return [latest[step] for step in sorted(latest)]


MAX_PIXELS = 20_000  # a side; a picture's memory grows with width x height


def read_metrics(run: Path, name: str | None = None) -> RunMetrics:
    """Train and valid rows of one run; a run without any is a TfmError."""
    path = metrics_of(run)
    if not path.is_file():
        raise TfmError(f"{run}: no metrics.jsonl (is this a run directory? train writes it)")
    train, valid = [], []
    with open(path, encoding="utf-8", errors="replace") as f:  # a line that is not text is skipped below
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a crash can leave the last line half written
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                continue
            if row.get("kind") == "train" and "loss" in row:
                train.append(row)
            elif row.get("kind") == "valid" and "loss" in row:
                valid.append(row)
    if not train and not valid:
        raise TfmError(f"{path}: no train or valid metrics in it yet")
    return RunMetrics(name or run_name(run), _by_step(train), _by_step(valid))


def run_name(run: Path) -> str:
    run = run.resolve()
    return (run.parent if run.is_file() else run).name


def unique_names(runs: list[Path]) -> list[str]:
    """Legend labels: the directory names, with their parents added while two runs share one."""
    parts = [list((r.resolve().parent if r.is_file() else r.resolve()).parts) for r in runs]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


def plot_runs(runs: list[Path], output: Path, width: int = 1200, height: int = 800, dpi: int = 100) -> Path:
    """Draw train/valid loss, valid BLEU (against step and minutes) and the learning rate of
    every run (overlaid, one colour per run) into a `width`×`height` pixel picture (PNG, or the
    format `output`'s suffix names)."""
    if not runs:
        raise TfmError("give at least one run directory")
    if width < 200 or height < 150:
        raise TfmError(f"--width/--height {width}x{height}: too small to draw (at least 200x150)")
    if width > MAX_PIXELS or height > MAX_PIXELS:
        raise TfmError(f"--width/--height {width}x{height}: larger than {MAX_PIXELS} pixels a side")
    figure_format(output)  # before any work
    data = [read_metrics(run, name) for run, name in zip(runs, unique_names(runs))]
    plt = import_pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    ax_loss, ax_bleu, ax_lr, ax_bleu_time = axes.flat
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(data):
        color = colors[i % len(colors)]
        if run.train:
            dots = "." if len(run.train) < 20 else None  # a short run's few points stay visible
            ax_loss.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], color=color,
                         marker=dots, label=f"{run.name} train")
            lr_rows = [r for r in run.train if "lr" in r]
            ax_lr.plot([r["step"] for r in lr_rows], [r["lr"] for r in lr_rows], color=color, marker=dots,
                       label=run.name)
        if run.valid:
            ax_loss.plot([r["step"] for r in run.valid], [r["loss"] for r in run.valid], color=color,
                         linestyle="--", marker="o", markersize=3, label=f"{run.name} valid")
            bleu = [r for r in run.valid if "bleu" in r]
            ax_bleu.plot([r["step"] for r in bleu], [r["bleu"] for r in bleu], color=color, marker="o",
                         markersize=3, label=run.name)
            timed = [r for r in bleu if "elapsed" in r]  # the final max_epochs evaluation has no time
            ax_bleu_time.plot([r["elapsed"] / 60 for r in timed], [r["bleu"] for r in timed], color=color,
                              marker="o", markersize=3, label=run.name)
    titles = (("loss (solid: train, dashed: valid)", "step", "loss"), ("valid BLEU", "step", "BLEU"),
              ("learning rate", "step", "lr"), ("valid BLEU against time", "wall-clock minutes", "BLEU"))
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no validation rows yet", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax_loss.legend(fontsize="small")
    if len(data) > 1:
        ax_bleu.legend(fontsize="small")
    save_figure(fig, output, dpi)
    plt.close(fig)
    return output


def figure_format(output: Path) -> str:
    """The file format `output`'s suffix names (png, svg, pdf, …: whatever matplotlib writes), or a
    TfmError: a picture is never written in a format its name does not say."""
    plt = import_pyplot()
    supported = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = output.suffix.lower().lstrip(".")
    if suffix not in supported:
        raise TfmError(f"{output}: cannot tell the picture format from {output.suffix or 'a name without a suffix'!r}; "
                       f"end the name in one of {', '.join('.' + s for s in sorted(supported))}")
    return suffix


def save_figure(fig: Any, output: Path, dpi: int) -> None:
    """Write atomically, in the format the suffix names; no bbox_inches="tight", so a PNG keeps
    exactly the figure's pixel size."""
    fmt = figure_format(output)
    picture = io.BytesIO()  # drawn first: a FIFO or a device cannot be seeked in, as savefig does
    fig.savefig(picture, dpi=dpi, format=fmt)
    atomic_write_bytes(output, picture.getvalue())
