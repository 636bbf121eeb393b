"""`tfm distill`: sequence-level knowledge distillation (Kim & Rush 2016), the first half.

A teacher (the run's checkpoint, another checkpoint of the same vocabulary, or an ensemble)
translates the run's prepared training source with beam search through the default engine; its
output becomes the targets a small student is prepared and trained on (`vocab.from_run` keeps the
teacher's vocabulary; `data.train` lists the distilled corpus, and the original one beside it to mix
them). As Bergamot's pipeline does, the pairs whose teacher output scores worst can be left out
(`distill.drop_worst`).

Streaming and resumable: the training source is read from the run's memory-mapped token arrays
chunk by chunk (`distill.chunk_lines`), and each translated chunk is appended to
`<output>/teacher.tsv` (score, tab, translation) and synced before the next begins. A run killed at
any point goes on from the last whole chunk, with the same chunks as an uninterrupted run, so the
corpus is the same and no line is translated into it twice. `teacher.json` records what the
teacher's output was made with: another teacher, beam or source is refused rather than mixed in.
When every line is translated, the corpus is written from it (atomically); teacher.tsv stays, so a
later call with another `drop_worst` writes the corpus again without translating anything.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.batches import TokenArray
from ..data.prepare import load_sentencepiece
from ..experiment.config import DecodeConfig, ExperimentConfig
from ..experiment.rundir import Manifest, RunDirectory
from ..experiment.runlock import RunLock
from ..runtime.errors import TfmError
from ..runtime.files import AtomicStream, atomic_write_text, check_output
from .translation import CHUNK_LINES, TranslationEngine

PARTIAL = "teacher.tsv"
PARTIAL_INFO = "teacher.json"
REPORT = "distill.json"


@dataclass
class DistillResult:
    output: Path  # the corpus prefix: <output>/train, with .<src_lang> and .<tgt_lang>
    lines: int  # training source lines
    kept: int  # pairs written (lines less the dropped)
    resumed_at: int  # lines found translated when this call began
    seconds: float  # this call's translating
    threshold: float | None  # the score below which pairs were dropped
    report: dict


def output_dir(config: ExperimentConfig) -> Path:
    return Path(config.distill.output) if config.distill.output else config.run.distilled


def _pieces(sp) -> list[str]:
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def check_teacher_vocabulary(engine: TranslationEngine, run: RunDirectory, manifest: Manifest, teacher: str) -> None:
    """The teacher must speak the run's pieces: the student is prepared with the run's vocabulary."""
    for side, name in (("src", "source"), ("tgt", "target")):
        ours = load_sentencepiece(run.vocab_file(manifest, side))
        theirs = engine.src_sp if side == "src" else engine.tgt_sp
        if _pieces(theirs) != _pieces(ours):
            raise TfmError(f"{teacher}: the teacher was trained with another {name} vocabulary than {run.root} "
                           "holds: distil with a model of this run's vocabulary (or prepare the run with "
                           "vocab.from_run set to the teacher's run directory)")


def _identity(config: ExperimentConfig, manifest: Manifest, teachers: list[Path], decode: DecodeConfig) -> dict:
    """What a partial output depends on: resuming with anything else would mix two corpora."""
    files = []
    for path in teachers:
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, int(stat.st_mtime)])
    settings = config.distill
    return {"teachers": files, "beam": decode.beam, "length_penalty": decode.length_penalty,
            "data_digest": manifest.data_digest, "chunk_lines": settings.chunk_lines, "score": settings.score}


def teacher_settings(engine: TranslationEngine, config: ExperimentConfig) -> DecodeConfig:
    """The teacher's decode settings: its engine's with distill.beam (None: decode.beam's), one
    hypothesis a line, its score kept (drop_worst ranks by it)."""
    return engine.decode.updated(scores=True, beam=config.distill.beam or config.decode.beam, nbest=1)


def _check_identity(partial: Path, info: Path, identity: dict) -> None:
    """A partial output goes on only with what began it; a new one records what begins it."""
    if partial.exists():
        try:
            recorded = json.loads(info.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = None
        if recorded != identity:
            raise TfmError(f"{partial} was begun with another teacher, beam or training data than this call's "
                           f"(or {info.name} is missing): add --restart to translate from the start")
    else:
        atomic_write_text(info, json.dumps(identity, indent=2))


def _read_partial(path: Path, lines: int, chunk: int) -> int:
    """Whole chunks in the partial output; what follows them (a torn chunk) is cut off. A line
    that is not `score<TAB>text` is a corrupt partial output, an error naming the line."""
    if not path.exists():
        return 0
    good_bytes, good_lines, offset = 0, 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            offset += len(raw)
            if not raw.endswith(b"\n"):
                break  # torn by a kill: the chunk it belongs to is translated again
            score, tab, text = raw.partition(b"\t")
            try:
                float(score.decode("ascii"))
                text.decode("utf-8")
            except (UnicodeDecodeError, ValueError):
                tab = b""
            if not tab:
                raise TfmError(f"{path} line {number}: not 'score<TAB>translation' (a corrupt partial output): "
                               f"remove {path} to translate from the start")
            if number % chunk == 0 or number == lines:
                good_bytes, good_lines = offset, number
    if good_lines > lines:
        raise TfmError(f"{path}: {good_lines} lines for {lines} training sources (a corrupt partial output): "
                       f"remove {path} to translate from the start")
    with open(path, "r+b") as f:
        f.truncate(good_bytes)
    return good_lines


def _source_texts(tokens: TokenArray, sp, start: int, end: int) -> list[str]:
    return [sp.decode(tokens[i].tolist()) for i in range(start, end)]


def _clean(text: str) -> str:
    return " ".join(text.split())  # a line stays one line, a field one field


def _scores(translations, references: list[str] | None) -> list[float]:
    if references is None:
        return [t[0].score if t else -math.inf for t in translations]
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    return [chrf.sentence_score(t[0].text if t else "", [ref]).score for t, ref in zip(translations, references)]


def translate_corpus(engine: TranslationEngine, config: ExperimentConfig, run: RunDirectory, manifest: Manifest,
                     partial: Path, done: int, decode: DecodeConfig, progress: Callable[[int], None]) -> int:
    """Append the teacher's translations (under `decode`: `teacher_settings`) of training lines
    done… to `partial`, a synced chunk at a time."""
    src = TokenArray.load(run.binary_stem("train", "src"))
    tgt = TokenArray.load(run.binary_stem("train", "tgt")) if config.distill.score == "chrf" else None
    src_sp = load_sentencepiece(run.vocab_file(manifest, "src"))
    tgt_sp = load_sentencepiece(run.vocab_file(manifest, "tgt")) if tgt is not None else None
    chunk = config.distill.chunk_lines
    with open(partial, "ab") as out:
        for start in range(done, len(src), chunk):
            end = min(start + chunk, len(src))
            sources = _source_texts(src, src_sp, start, end)
            # Started together (CTranslate2 keeps its threads busy across them), each within the work
            # budget of a `tfm translate` chunk.
            pending = [engine.translate_later(sources[i:i + CHUNK_LINES], decode,
                                              first_line=start + i + 1, warn_long=False)
                       for i in range(0, len(sources), CHUNK_LINES)]
            translations = [t for collect in pending for t in collect()]
            refs = _source_texts(tgt, tgt_sp, start, end) if tgt is not None else None
            rows = (f"{score!r}\t{_clean(t[0].text) if t else ''}\n" for score, t in zip(_scores(translations, refs),
                                                                                      translations))
            out.write("".join(rows).encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
            progress(end - start)
            done = end
    return done


def _partial_rows(path: Path) -> Iterator[tuple[float, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            score, _, text = line.rstrip("\n").partition("\t")
            yield float(score), text


def keep_mask(scores: np.ndarray, drop_worst: float) -> tuple[np.ndarray, float | None]:
    """Which pairs stay: all but the `drop_worst` percent with the lowest scores (ties broken by
    line order, so exactly that many go) and the score at which they stop."""
    keep = np.ones(len(scores), dtype=bool)
    n_drop = int(len(scores) * drop_worst / 100)
    threshold = None
    if n_drop:
        order = np.argsort(np.nan_to_num(scores, nan=-np.inf), kind="stable")
        keep[order[:n_drop]] = False
        threshold = float(scores[order[n_drop - 1]])
    return keep, threshold


def write_corpus(config: ExperimentConfig, run: RunDirectory, manifest: Manifest, directory: Path, partial: Path,
                 lines: int) -> tuple[int, float | None]:
    """The distilled corpus from the teacher's output: train.<src_lang> (the training source, as the
    teacher read it) and train.<tgt_lang> (its translations), the dropped pairs and the pairs with an
    empty side left out."""
    scores = np.fromiter((s for s, _ in _partial_rows(partial)), dtype=np.float64, count=lines)
    keep, threshold = keep_mask(scores, config.distill.drop_worst)
    src = TokenArray.load(run.binary_stem("train", "src"))
    src_sp = load_sentencepiece(run.vocab_file(manifest, "src"))
    writers = [AtomicStream(directory / f"train.{lang}", "w", "utf-8")
               for lang in (config.data.src_lang, config.data.tgt_lang)]
    kept = 0
    try:
        for i, (_, text) in enumerate(_partial_rows(partial)):
            source = _clean(src_sp.decode(src[i].tolist()))
            if keep[i] and text and source:
                writers[0].write(source + "\n")
                writers[1].write(text + "\n")
                kept += 1
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.close()
    return kept, threshold


def check_distill_output(directory: Path, config: ExperimentConfig) -> None:
    """The distilled corpus is written as <output>/train.<lang>: the output rule (files.check_output)
    refuses the run directory itself and a directory that already holds such files (plain or gzipped)
    that no `tfm distill` wrote (it leaves teacher.json beside them): a corpus, e.g. the run's own
    training data, which the output would replace, or shadow for every later `tfm prepare` (a plain
    file beside its .gz). Checked before the teacher is loaded."""
    check_output(directory, {"the run directory": [config.run_path]}, flag="distill.output", directory=True,
                 names=[f"train.{config.data.src_lang}", f"train.{config.data.tgt_lang}"],
                 ours=lambda folder: (folder / PARTIAL_INFO).is_file())


def distill(config: ExperimentConfig, open_teacher: Callable[[], tuple[TranslationEngine, list[Path]]],
            restart: bool = False, progress: Callable[[int, int], None] | None = None) -> DistillResult:
    """Translate the prepared training source of `config`'s run with the teacher `open_teacher`
    returns (engine, its model files), resuming a partial output; write the distilled corpus."""
    run = config.run
    manifest = run.load_manifest()
    if manifest.tagged:
        raise TfmError(f"{config.run_path}: a multilingual run (tagged sources): tfm distill takes a bilingual run")
    lines = len(TokenArray.load(run.binary_stem("train", "src")))
    directory = output_dir(config)
    check_distill_output(directory, config)
    engine, teachers = open_teacher()
    try:
        check_teacher_vocabulary(engine, run, manifest, ", ".join(map(str, teachers)))
        decode = teacher_settings(engine, config)
        identity = _identity(config, manifest, teachers, decode)
        directory.mkdir(parents=True, exist_ok=True)
        partial, info = directory / PARTIAL, directory / PARTIAL_INFO
        with RunLock(directory, "tfm distill"):  # one writer: two appending to teacher.tsv would interleave
            if restart:
                partial.unlink(missing_ok=True)
                info.unlink(missing_ok=True)
            _check_identity(partial, info, identity)
            done = _read_partial(partial, lines, config.distill.chunk_lines)
            started = time.perf_counter()
            translate_corpus(engine, config, run, manifest, partial, done, decode,
                             lambda n: progress(n, lines) if progress else None)
            seconds = time.perf_counter() - started
            describe = engine.describe()
            engine.close()
            kept, threshold = write_corpus(config, run, manifest, directory, partial, lines)
    finally:
        engine.close()
    report = {"lines": lines, "kept": kept, "dropped": lines - kept, "resumed_at": done,
              "drop_worst": config.distill.drop_worst, "score": config.distill.score, "threshold": threshold,
              "teachers": [str(t) for t in teachers], "beam": decode.beam, "engine": describe,
              "seconds": round(seconds, 2),
              "sentences_per_second": round((lines - done) / seconds, 1) if seconds > 0 and lines > done else None}
    atomic_write_text(directory / REPORT, json.dumps(report, indent=2))
    return DistillResult(directory / "train", lines, kept, done, seconds, threshold, report)
