"""A run directory: everything one experiment writes, and the one place that knows where it is.

    config.yaml      the resolved config of the last prepare/train
    prepare.json     prepare's manifest: inputs, settings, counts
    spm.model        the joint sentencepiece model (or spm.src.model + spm.tgt.model)
    data/            <split>.<side>.tokens.npy / .offsets.npy: the encoded splits
    metrics.jsonl    one JSON record per log interval and evaluation (train appends, plot reads)
    checkpoints/     step_<N>.pt of the last `keep_last` evaluations, checkpoint_last.pt (resume),
                     checkpoint_best.pt, checkpoint_avg.pt, checkpoint_ema.pt, scores.json
    eval/            what `tfm evaluate --config` translated, and its scores

Files inside a run name each other relative to the run, so a run directory can be moved or
copied: its own config.yaml means the directory it is in (config.load_config). Only the process
holding the run's lock (`tfm prepare`, `tfm train`) writes the run's own files (files.refuse_run_files).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.errors import TfmError
from ..runtime.files import CONFIG_NAME, MANIFEST_NAME, atomic_write_text, run_owning
from .runlock import RunLock

if TYPE_CHECKING:
    from .config import ExperimentConfig

LAST, BEST, AVERAGE, EMA = "checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_avg.pt", "checkpoint_ema.pt"
SCORES = "scores.json"
SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")


def step_of(checkpoint: Path) -> int:
    """step_1200.pt → 1200."""
    return int(checkpoint.stem.split("_")[1])


class RunDirectory:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.metrics = self.root / "metrics.jsonl"
        self.config_file = self.root / CONFIG_NAME
        self.manifest_file = self.root / MANIFEST_NAME
        self.eval_dir = self.root / "eval"

    # -- what prepare writes

    def vocab_files(self, joint: bool) -> dict[str, Path]:
        if joint:
            return {"src": self.root / "spm.model", "tgt": self.root / "spm.model"}
        return {"src": self.root / "spm.src.model", "tgt": self.root / "spm.tgt.model"}

    def binary_stem(self, split: str, side: str) -> Path:
        return self.root / "data" / f"{split}.{side}"

    def load_manifest(self) -> dict:
        if not self.manifest_file.is_file():
            raise TfmError(f"{self.manifest_file} not found: run `tfm prepare --config ...` first")
        return json.loads(self.manifest_file.read_text(encoding="utf-8"))

    def vocab_file(self, manifest: dict, side: str) -> Path:
        """The sentencepiece model of `side` in this run (manifests name it by its file name; older
        ones by a path, of which only the name counts, so a moved run still finds its own)."""
        return self.root / Path(manifest["vocab"][side]).name

    # -- what train writes

    def step_checkpoints(self) -> list[Path]:
        """step_<N>.pt, in step order."""
        return sorted(self.checkpoints.glob("step_*.pt"), key=step_of)

    def save(self, name: str, payload: dict[str, Any]) -> Path:
        path = self.checkpoints / name
        _save_checkpoint(path, payload)
        return path

    def prune_step_checkpoints(self, keep_last: int) -> None:
        steps = self.step_checkpoints()
        for old in steps[: max(len(steps) - keep_last, 0)]:
            old.unlink()

    def write_scores(self, metric: str, scores: dict[str, float | None]) -> None:
        """scores.json: each final checkpoint's validation score (higher is better), which
        `default_checkpoint` chooses by; without a choice to make, none (an older run's would mislead)."""
        scored = {name: score for name, score in scores.items() if score is not None}
        if len(scored) > 1:
            atomic_write_text(self.checkpoints / SCORES, json.dumps({"metric": metric, **scored}, indent=1))
        else:
            (self.checkpoints / SCORES).unlink(missing_ok=True)

    def forget_score(self, name: str) -> None:
        """Drop `name`'s validation score from scores.json: the file was replaced by another model."""
        try:
            scores = json.loads((self.checkpoints / SCORES).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(scores, dict) and scores.pop(name, None) is not None:
            atomic_write_text(self.checkpoints / SCORES, json.dumps(scores, indent=1))

    def has_checkpoints(self) -> bool:
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("*.pt"))

    def discard_training(self) -> Path:
        """Move what training wrote (checkpoints/, metrics.jsonl, tensorboard/) into a new
        discarded-<UTC time>/ of the run; returns it. Nothing is deleted: remove it when sure."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.root / f"discarded-{stamp}"
        number = 1
        while aside.exists():
            number += 1
            aside = self.root / f"discarded-{stamp}-{number}"
        aside.mkdir()
        for name in (self.checkpoints.name, self.metrics.name, "tensorboard"):
            if (self.root / name).exists():
                (self.root / name).rename(aside / name)
        return aside

    def remove_training(self) -> None:
        """Delete what training wrote (checkpoints/, metrics.jsonl, tensorboard/): a run that starts
        afresh under its own plan check, within its first minute."""
        for name in (self.checkpoints.name, "tensorboard"):
            shutil.rmtree(self.root / name, ignore_errors=True)
        self.metrics.unlink(missing_ok=True)

    def default_checkpoint(self) -> Path:
        """The model `--config` means: of checkpoint_avg.pt, checkpoint_ema.pt and checkpoint_best.pt
        the one that validated best (scores.json; ties in that order); without scores, the average,
        then the best, then checkpoint_last.pt."""
        order = [AVERAGE, EMA, BEST]
        try:
            scores = json.loads((self.checkpoints / SCORES).read_text(encoding="utf-8"))
            scored = [n for n in order if isinstance(scores.get(n), (int, float)) and (self.checkpoints / n).is_file()]
            if scored:
                return self.checkpoints / max(scored, key=lambda name: (scores[name], -order.index(name)))
        except (OSError, ValueError, AttributeError):
            pass
        for name in (AVERAGE, BEST, LAST):
            if (self.checkpoints / name).is_file():
                return self.checkpoints / name
        raise TfmError(f"no checkpoint in {self.checkpoints}: train first or pass --checkpoint")


class MetricsLog:
    """metrics.jsonl, the run's record: one JSON object a line, appended (readers skip a torn line)."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def end_torn_line(self) -> None:
        """A kill during an append can leave a half line: end it, so the next record starts on a
        line of its own."""
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")


def save_checkpoint_file(output: Path, make_payload: Callable[[], dict[str, Any]], force: bool, command: str) -> None:
    """Save the checkpoint that `make_payload()` returns (a command's, not training's: `tfm average
    -o`) at `output`. A run's checkpoints/ takes it only with `force`, under the run's lock (never
    while the run trains), and never over what training keeps there for itself: checkpoint_last.pt
    (what --resume continues), step_<N>.pt (pruned and averaged by training), scores.json. A
    replaced checkpoint's validation score is dropped from scores.json. Every other file of a run
    (its data, vocabulary, settings) is refused."""
    root = run_owning(output)
    if root is None:
        _save_checkpoint(output, make_payload())
        return
    run = RunDirectory(root)
    if run.checkpoints.resolve() not in output.resolve().parents:
        raise TfmError(f"-o {output} is one of the run directory {root}'s own files (its data, vocabulary or "
                       "settings): choose another output path")
    if output.parent.resolve() == run.checkpoints.resolve() and (
            output.name in (LAST, SCORES) or output.name.startswith("step_")):
        raise TfmError(f"-o {output}: {output.name} in a run's checkpoints/ is training's own (checkpoint_last.pt "
                       "is what --resume continues; step_<N>.pt are pruned and averaged by training): "
                       "choose another name")
    if not force:
        raise TfmError(f"-o {output} is in the run directory {root}'s checkpoints/: pass --force to write it "
                       "there (the run's --config then may translate with it), or choose another output path")
    with RunLock(root, command):
        _save_checkpoint(output, make_payload())
        run.forget_score(output.name)


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    from .checkpoint import save_checkpoint  # torch: this module also serves commands that never load it

    save_checkpoint(path, payload)


def vocab_mismatch(config: ExperimentConfig, manifest: dict) -> str:
    """How `config`'s vocab settings differ from those its run_dir was prepared with, as a
    sentence naming the key ("" when they agree)."""
    prepared = manifest.get("vocab_size", {})
    if any(size != config.vocab.size for size in prepared.values()):
        return (f"key 'vocab.size': {config.vocab.size} in the config, but {config.run_dir} was prepared with "
                f"{sorted(set(prepared.values()))[0]}")
    joint = manifest["vocab"]["src"] == manifest["vocab"]["tgt"]
    if joint != config.vocab.joint:
        return f"key 'vocab.joint': {config.vocab.joint} in the config, but {config.run_dir} was prepared with joint={joint}"
    return ""
