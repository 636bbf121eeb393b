"""A run directory: everything one experiment writes, and the one place that knows where it is.

    config.yaml         the resolved config of the last prepare/train
    prepare.json        prepare's manifest: inputs, settings, counts (read back as a `Manifest`)
    prepare_report.json what the training-pair filters dropped (data/cleaning.py)
    spm.model           the joint sentencepiece model (or spm.src.model + spm.tgt.model)
    data/               <split>.<side>.tokens.npy / .offsets.npy: the encoded splits
    filter_models/      the model filter's own runs, half<k>/<src>-<tgt>/, and halves.json
    shape_choice.json   what `model.size: auto` timed and chose, and the in-run check of that plan
    metrics.jsonl       one JSON record per log interval and evaluation (train appends, plot reads)
    tensorboard/        the same records for TensorBoard (train.tensorboard)
    checkpoints/        step_<N>.pt of the last `keep_last` evaluations, checkpoint_last.pt (resume),
                        checkpoint_best.pt, checkpoint_avg.pt, checkpoint_ema.pt, scores.json
    eval/               what `tfm evaluate --config` translated, and its scores
    shortlist.txt       `tfm shortlist`'s vocabulary shortlist
    distilled/          `tfm distill`'s corpus (unless distill.output names another place)

No module outside experiment/ names one of these files (tests/test_layout.py): it asks the
run's `RunDirectory`, built once by the command (`ExperimentConfig.run`).

Files inside a run name each other relative to the run, so a run directory can be moved or
copied: its own config.yaml means the directory it is in (config.load_config). Only the process
holding the run's lock (`tfm prepare`, `tfm train`) writes the run's own files (files.refuse_run_files).
"""

from __future__ import annotations

import functools
import io
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from ..runtime.errors import TfmError
from ..runtime.files import (
    CONFIG_NAME,
    MANIFEST_NAME,
    atomic_write_bytes,
    atomic_write_text,
    run_owning,
)
from .runlock import RunLock

LAST, BEST, AVERAGE, EMA = "checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_avg.pt", "checkpoint_ema.pt"
SCORES = "scores.json"
_SCORE_FILE = re.compile(r"^test\.(?P<checkpoints>[^.]+)\.beam(?P<beam>\d+)(?:\.directions)?\.json$")
CHECKPOINT_FORMAT = "tfm-checkpoint-1"  # every checkpoint's "format": what load_checkpoint checks first
SHORTLIST_FILE = "shortlist.txt"  # `tfm shortlist`'s, which translating with the run's checkpoints takes
SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")
R = TypeVar("R")  # a record type read back from a run file


def step_of(checkpoint: Path) -> int:
    """step_1200.pt → 1200."""
    return int(checkpoint.stem.split("_")[1])


def step_name(step: int) -> str:
    """1200 → step_1200.pt: the checkpoint of that step's evaluation."""
    return f"step_{step}.pt"


@dataclass(frozen=True)
class Manifest:
    """prepare.json as it is read back (`tfm prepare` writes it; an older run's, or an imported one's,
    lacks some keys: they default here; a key of the wrong type is refused)."""

    vocab: dict[str, str]  # side → its sentencepiece model's file name in the run
    vocab_size: dict[str, int]
    fingerprint: str | None = None  # of everything prepare read: a re-run with the same reuses the run
    src_lang: str = ""
    tgt_lang: str = ""
    vocab_from: str | None = None  # vocab.from_run's run, resolved
    shared_ids: bool = False  # two sentencepiece models over one id map (an imported Marian model's)
    special_ids: dict[str, int] = field(default_factory=dict)
    directions: list[dict] = field(default_factory=list)  # each direction's [start, end) of each split
    tagged: bool = False  # a multilingual run's sources begin with their target language's tag
    files: dict[str, list[str]] = field(default_factory=dict)  # split → source, target, … of each direction
    train_pairs_read: int = 0
    train_pairs_dropped: dict[str, int] = field(default_factory=dict)  # reason → pairs
    truncated: dict[str, dict] = field(default_factory=dict)  # valid/test pairs cut to the model's positions
    vocab_sample_pairs: int = 0
    workers: int = 1
    stats: dict = field(default_factory=dict)  # per split and side: lines, tokens, unk rate
    data_digest: str | None = None  # of the encoded data: checkpoints carry it, --resume checks it
    seconds: float = 0.0
    seconds_vocab: float = 0.0  # sampling pass + sentencepiece training
    imported_from: dict | None = None

    @classmethod
    def from_json(cls, record: dict, path: Path) -> Manifest:
        if not isinstance(record, dict) or not isinstance(record.get("vocab"), dict) or not isinstance(
                record.get("vocab_size"), dict):
            raise TfmError(f"{path}: not a manifest tfm prepare wrote (no vocab): run `tfm prepare --force` again")
        try:
            return typed(cls, {**record, "shared_ids": bool(record.get("shared_ids")), "tagged": bool(record.get("tagged"))})
        except ValueError as exc:
            raise TfmError(f"{path}: not a manifest tfm prepare wrote ({exc}): run `tfm prepare --force` again") from None

    @property
    def joint(self) -> bool:
        return self.vocab["src"] == self.vocab["tgt"]

    def references(self, split: str) -> list[str]:
        """The target files of `split`, one per direction (files lists source, target, source, …)."""
        return self.files.get(split, [])[1::2]


@dataclass(frozen=True)
class ShapeChoice:
    """shape_choice.json (training/shape_choice.py writes it): what `model.size: auto` timed and chose,
    and for what budget; a re-plan's says why and keeps the first plan's record; `check`: the in-run
    check of the plan. Keys an older run's lacks default."""

    chosen: str  # the named shape trained
    max_tokens: int = 0
    lr: float | None = None
    dropout: float | None = None
    probe_seconds: float = 0.0
    busy: float = 0.0  # the share of the CPUs other work took while the shapes were timed
    budget_seconds: float | None = None  # train.max_time, or None: a budget of updates...
    max_steps: int | None = None  # ... train.max_steps
    device: str = "cpu"
    shapes: list[dict] = field(default_factory=list)  # each shape's timing, batch, predicted updates and BLEU
    replanned: dict | None = None  # why, after how many seconds, and the first plan ("first")
    check: dict | None = None  # the plan check: after how many seconds, the speed trained at, the verdict

    @classmethod
    def from_json(cls, record: Any) -> ShapeChoice:
        if not isinstance(record, dict) or not isinstance(record.get("chosen"), str):
            raise ValueError("not a record of tfm train's (no chosen shape)")
        return typed(cls, record)

    def to_json(self) -> dict:
        return {name: value for name, value in asdict(self).items()
                if value is not None or name not in ("replanned", "check")}


@dataclass(frozen=True)
class CleaningTotals:
    """prepare_report.json's totals, as the model card reads them back (data/cleaning.py
    `CleaningReport.to_json` writes the whole report: each direction's counts, examples, settings)."""

    pairs_read: int = 0
    pairs_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # pairs per reason, all directions

    @classmethod
    def from_json(cls, record: Any) -> CleaningTotals:
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        return typed(cls, record)


@functools.cache
def _adapter(record_type: type) -> TypeAdapter:
    return TypeAdapter(record_type)


def typed(record_type: type[R], record: dict) -> R:
    """`record_type` from the keys of `record` it has, each one's type checked (`"shapes": 5` is a
    ValueError naming the key, not a record that fails later where it is read); other keys are passed over."""
    try:
        known = {name: record[name] for name in record_type.__dataclass_fields__ if name in record}  # type: ignore[attr-defined]
        return _adapter(record_type).validate_python(known)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ValueError(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None


def _read_record(path: Path, from_json: Callable[[Any], R], writer: str, strict: bool) -> R | None:
    """The record in `path`: None where there is none, or where it is torn (with `strict`, a one-line
    TfmError naming it and `writer`, the command that writes it)."""
    try:
        return from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        if strict:
            raise TfmError(f"{path}: torn or not written by {writer} ({exc}): run {writer} again, or remove it") from None
        return None


class RunDirectory:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.last_checkpoint = self.checkpoints / LAST
        self.metrics = self.root / "metrics.jsonl"
        self.tensorboard = self.root / "tensorboard"
        self.config_file = self.root / CONFIG_NAME
        self.manifest_file = self.root / MANIFEST_NAME
        self.cleaning_report = self.root / "prepare_report.json"
        self.shape_choice_file = self.root / "shape_choice.json"
        self.filter_models = self.root / "filter_models"
        self.halves_file = self.filter_models / "halves.json"  # what the model filter's halves were written from
        self.data_dir = self.root / "data"
        self.eval_dir = self.root / "eval"
        self.shortlist_file = self.root / SHORTLIST_FILE
        self.distilled = self.root / "distilled"  # `tfm distill`'s corpus, unless distill.output names another

    def filter_model_half(self, fold: int) -> Path:
        """Where the model filter's models trained on fold `fold` live (run directories), with its pairs."""
        return self.filter_models / f"half{fold + 1}"

    # -- what prepare writes

    def vocab_files(self, joint: bool) -> dict[str, Path]:
        if joint:
            return {"src": self.root / "spm.model", "tgt": self.root / "spm.model"}
        return {"src": self.root / "spm.src.model", "tgt": self.root / "spm.tgt.model"}

    def binary_stem(self, split: str, side: str) -> Path:
        return self.data_dir / f"{split}.{side}"

    def load_manifest(self) -> Manifest:
        if not self.manifest_file.is_file():
            raise TfmError(f"{self.manifest_file} not found: run `tfm prepare --config ...` first")
        try:
            record = json.loads(self.manifest_file.read_text(encoding="utf-8"))
        except ValueError:
            raise TfmError(f"{self.manifest_file}: torn or not JSON: run `tfm prepare --force` again") from None
        return Manifest.from_json(record, self.manifest_file)

    def vocab_file(self, manifest: Manifest, side: str) -> Path:
        """The sentencepiece model of `side` in this run (manifests name it by its file name; older
        ones by a path, of which only the name counts, so a moved run still finds its own)."""
        return self.root / Path(manifest.vocab[side]).name

    def cleaning_totals(self) -> CleaningTotals | None:
        """prepare_report.json's totals: None where the run has none; a one-line TfmError where it is torn."""
        return _read_record(self.cleaning_report, CleaningTotals.from_json, "tfm prepare", strict=True)

    # -- what train writes

    def shape_choice(self, strict: bool = False) -> ShapeChoice | None:
        """What `model.size: auto` timed and chose: None where the run has no shape_choice.json, or where
        it is torn (with `strict`, a one-line TfmError naming it)."""
        return _read_record(self.shape_choice_file, ShapeChoice.from_json, "tfm train", strict)

    def write_shape_choice(self, choice: ShapeChoice) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.shape_choice_file, json.dumps(choice.to_json(), indent=1) + "\n")

    def step_checkpoints(self) -> list[Path]:
        """step_<N>.pt, in step order."""
        return sorted(self.checkpoints.glob("step_*.pt"), key=step_of)

    def save(self, name: str, payload: dict[str, Any]) -> Path:
        path = self.checkpoints / name
        save_checkpoint(path, payload)
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

    # -- what evaluate writes

    def eval_stem(self, split: str, checkpoints: list[Path], beam: int, tail: str = "") -> Path:
        """eval/<split>.<checkpoints' stems>.beam<N><tail>: `tfm evaluate`'s translations (.hyp) and scores (.json)."""
        return self.eval_dir / f"{split}.{'+'.join(p.stem for p in checkpoints)}.beam{beam}{tail}"

    def test_score_files(self, checkpoint: Path) -> list[tuple[Path, int]]:
        """eval/'s test-set score files of `checkpoint` alone (each direction's, a multilingual run's) and the beam
        of each (constrained runs and ensembles left out)."""
        found = ((path, _SCORE_FILE.match(path.name)) for path in sorted(self.eval_dir.glob("test.*.json")))
        return [(path, int(match["beam"])) for path, match in found if match and match["checkpoints"] == checkpoint.stem]

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
        for name in (self.checkpoints.name, self.metrics.name, self.tensorboard.name):
            if (self.root / name).exists():
                (self.root / name).rename(aside / name)
        return aside

    def remove_training(self) -> None:
        """Delete what training wrote (checkpoints/, metrics.jsonl, tensorboard/): a run that starts
        afresh under its own plan check, within its first minute."""
        for folder in (self.checkpoints, self.tensorboard):
            shutil.rmtree(folder, ignore_errors=True)
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
    run = run_of(output)
    if run is None:
        save_checkpoint(output, make_payload())
        return
    root = run.root
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
        save_checkpoint(output, make_payload())
        run.forget_score(output.name)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically and durably: a crash mid-write never leaves a truncated checkpoint behind.

    Serialised in memory first, then written by Python: a failed write (disk full, file-size
    limit, permissions) is then a plain OSError naming the cause, which torch's own file writer
    turns into an opaque "enforce fail" message.
    """
    import torch  # here: this module also serves commands that never load it

    buffer = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **payload}, buffer)
    atomic_write_bytes(path, buffer.getbuffer())


def checkpoint_at(path: str | Path) -> Path:
    """A checkpoint file as given, or a run directory's default checkpoint (the one its --config means)."""
    path = Path(path)
    return RunDirectory(path).default_checkpoint() if path.is_dir() else path


def metrics_of(path: Path) -> Path:
    """A run directory's metrics.jsonl (or that file itself, given)."""
    return path if path.is_file() else RunDirectory(path).metrics


def run_of(path: Path) -> RunDirectory | None:
    """The run directory `path` (a checkpoint, an export of one, …) lies in, if any."""
    root = run_owning(path)
    return None if root is None else RunDirectory(root)
