"""Stage 1, data: sentencepiece vocab and binarised splits (`tfm prepare`); what a batch of them
is, and how training reads them, is data/batches.py.

Layout written into `run_dir`:
    spm.model (joint) or spm.src.model + spm.tgt.model (separate)
    data/<split>.<side>.tokens.npy   int32/uint16 token ids of all sentences, concatenated
    data/<split>.<side>.offsets.npy  int64, sentence i is tokens[offsets[i]:offsets[i+1]]
    prepare.json                     manifest: inputs, settings, counts (re-runs reuse it)
Token ids carry no <bos>/<eos>; batching adds them.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from ..experiment.config import ExperimentConfig, config_to_yaml
from ..experiment.directions import Direction, sampling_rates, tag, tag_piece
from ..experiment.rundir import SIDES, SPLITS, Manifest, RunDirectory, checkpoint_at
from ..experiment.runlock import LOCK_NAME, RunLock
from ..model.lengths import source_token_limit
from ..model.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from ..runtime.cpu import usable_cores
from ..runtime.errors import TfmError
from ..runtime.files import (
    MANIFEST_NAME,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    check_output,
    iter_raw_lines,
    remove_stale_temps,
)
from .augment import CASES, cased_like_training
from .batches import array_path
from .cleaning import Cleaning, CleaningReport, build_filters, clean_result, filter_sample, make_cleaning
from .corpus import (
    Corpus,
    EncodeTask,
    NpyAppender,
    corpora_chunks,
    count_lines,
    encode_chunk,
    init_encoder,
    ordered_map,
    sample_lines,
    sample_pairs,
)
from .filters import DirectionFilters
from .language_tags import known_languages
from .model_filter import SCORES as MODEL_SCORES
from .model_filter import model_identity, self_trained_runs


def corpus_file(prefix: str, lang: str) -> Path:
    """`<prefix>.<lang>` or `<prefix>.<lang>.gz`, whichever exists. Both: an ambiguity, refused (a plain
    file beside the .gz is often another command's output, e.g. a distilled corpus, or a stale unpacked
    copy; reading either silently would train on what the user may not mean)."""
    plain, packed = Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")
    if plain.is_file() and packed.is_file():
        raise TfmError(f"corpus files {plain} and {packed} both exist: tfm cannot tell which is the corpus; "
                       "move or delete the one that is not")
    for candidate in (plain, packed):
        if candidate.is_file():
            return candidate
        if candidate.is_dir():
            raise TfmError(f"corpus file {candidate} is a directory, not a text file")
    raise TfmError(f"corpus file not found: {prefix}.{lang} (nor {prefix}.{lang}.gz)")


def check_corpus_files(config: ExperimentConfig) -> None:
    """Every input exists and has a first line, before minutes of work begin."""
    for split in SPLITS:
        for corpus in split_corpora(config, split):
            for path in corpus:
                if next(iter(iter_raw_lines(path)), None) is None:
                    raise TfmError(f"corpus file {path} is empty (data.{split})")


def split_files(config: ExperimentConfig, split: str, direction: Direction | None = None) -> Corpus:
    """The source and target file of `valid` or `test` (`train` may be several: `split_corpora`) in
    `direction` (None: the run's first)."""
    direction = direction or config.data.pairs[0]
    prefix = config.data.prefixes(direction, split)[0]
    return corpus_file(prefix, direction.src), corpus_file(prefix, direction.tgt)


def direction_corpora(config: ExperimentConfig, split: str, direction: Direction) -> list[Corpus]:
    """The (source, target) files of one direction's split: `data.train` lists one corpus or several."""
    return [(corpus_file(prefix, direction.src), corpus_file(prefix, direction.tgt))
            for prefix in config.data.prefixes(direction, split)]


def language_files(config: ExperimentConfig, language: str) -> list[Path]:
    """The training text of a language: its side of every direction's training corpora."""
    files = [path for d in config.data.pairs for src, tgt in direction_corpora(config, "train", d)
             for lang, path in ((d.src, src), (d.tgt, tgt)) if lang == language]
    return list(dict.fromkeys(files))


def split_corpora(config: ExperimentConfig, split: str) -> list[Corpus]:
    """The (source, target) files of a split, every direction's in turn."""
    return [corpus for direction in config.data.pairs for corpus in direction_corpora(config, split, direction)]


# --------------------------------------------------------------------------- vocabulary


def train_sentencepiece(sentences: list[str], target: Path, config: ExperimentConfig, sampled: bool = False,
                        user_symbols: list[str] = ()) -> None:
    """Train a sentencepiece model on `sentences` (`sampled`: a sample of the training data,
    vocab.input_sentence_size of them) and write it atomically to `target`.

    The trainer hands the model over in memory (`model_writer`) and Python writes it: sentencepiece's
    own file writer does not check its writes, so a full disk or a file-size limit left a truncated
    model that only failed later, when loaded.
    """
    vocab = config.vocab
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(s for s in sentences if s.strip()),
            model_writer=model,
            vocab_size=vocab.size,
            model_type=vocab.model_type,
            character_coverage=vocab.character_coverage,
            input_sentence_size=0,  # `prepare` already sampled (vocab.input_sentence_size)
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            user_defined_symbols=list(user_symbols),  # target-language tags: one piece each, never split
            # prepare.workers is the number of cores prepare may use, in every stage.
            num_threads=config.prepare.workers or usable_cores(),
            minloglevel=2,
        )
    except RuntimeError as exc:  # e.g. vocab size too large for the corpus
        too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(exc))
        if too_high and sampled:
            raise TfmError(f"key 'vocab.input_sentence_size': the {vocab.input_sentence_size:,} sentences sampled "
                           f"for the vocabulary support at most {too_high[2]} pieces, not vocab.size={vocab.size}: "
                           "raise vocab.input_sentence_size (0 = every sentence) or lower vocab.size") from None
        if too_high:
            raise TfmError(f"key 'vocab.size': {vocab.size} pieces is more than this training data supports "
                           f"(at most {too_high[2]}); lower vocab.size") from None
        detail = re.sub(r"^.*?\) \[?", "", str(exc).strip().splitlines()[0])  # drop "INTERNAL: file.cc(123)"
        raise TfmError(f"sentencepiece training failed (vocab.size={vocab.size}): {detail}") from None
    with atomic_path(target) as tmp_target:
        tmp_target.write_bytes(model.getvalue())


def load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise TfmError(f"sentencepiece model not found: {path} (run `tfm prepare` first)")
    return spm.SentencePieceProcessor(model_file=str(path))


# --------------------------------------------------------------------------- prepare

@dataclass
class PrepareResult:
    run_dir: Path
    reused: bool
    summary: str
    manifest: Manifest
    discarded: Path | None = None  # where the run's earlier training went (discard_checkpoints)
    cleaning: CleaningReport | None = None  # what the training-pair filters dropped (None: reused)


def _fingerprint(config: ExperimentConfig, parent: ParentVocab | None) -> str:
    """Hash of everything `prepare` depends on: data/vocab settings and input files' size+mtime."""
    inputs = []
    for split in SPLITS:
        for path in (path for corpus in split_corpora(config, split) for path in corpus):
            stat = path.stat()
            inputs.append([str(path), stat.st_size, int(stat.st_mtime)])
    vocab = config.vocab.model_dump(exclude={"from_run"} if config.vocab.from_run is None else set())
    if parent is not None:  # a parent whose vocabulary changed is a new input
        inputs += [hashlib.sha256(path.read_bytes()).hexdigest() for path in parent.files.values()]
    data = config.data.model_dump()
    augment = data.pop("augment")  # drawn in training, each epoch; the vocabulary's sample sees its casings
    if config.data.augment.enabled:
        data["augment"] = {key: augment[key] for key in CASES}
    scoring = data["filters"].pop("model")  # off: runs prepared before the model filter stay prepared
    if scoring["enabled"]:  # its models are inputs too (what trained them, if tfm did, is in their digests)
        del scoring["train_time"], scoring["train_updates"]
        named = [scoring[key] for key in ("forward", "backward")]
        if named == [None, None] and len(config.data.pairs) == 1:  # those tfm trains itself, on each half
            pair = config.data.pairs[0]
            named = [str(run) for runs in self_trained_runs(config.run, pair.src, pair.tgt) for run in runs]
        scoring["identities"] = [_model_identity(path) for path in named]
        scoring["scores"] = MODEL_SCORES
        data["filters"]["model"] = scoring
    if data["directions"] is None:  # a bilingual run: its fingerprint as before directions existed
        del data["directions"], data["temperature"]
    if len(data["train"]) == 1:
        data["train"] = data["train"][0]  # as before lists were allowed: runs prepared then stay prepared
    payload = json.dumps(
        [data, vocab, config.model.max_positions, inputs], sort_keys=True
    ).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def _model_identity(path: str | None) -> str | None:
    """A scoring model's digest; None for none, or one that cannot be read (prepare says why later)."""
    try:
        return model_identity(checkpoint_at(path)) if path else None
    except (OSError, TfmError):
        return None


def _summary_table(stats: dict) -> str:
    header = f"{'split':<6} {'side':<4} {'lines':>8} {'tokens':>10} {'mean':>6} {'p95':>5} {'unk%':>6}"
    rows = [header, "-" * len(header)]
    for split in SPLITS:
        for side in SIDES:
            s = stats[split][side]
            rows.append(
                f"{split:<6} {side:<4} {s['lines']:>8} {s['tokens']:>10} {s['mean_len']:>6.1f} "
                f"{s['p95_len']:>5} {100 * s['unk_rate']:>6.3f}"
            )
    return "\n".join(rows)


def _side_stats(lengths: np.ndarray, unk: int) -> dict:
    n_tokens = int(lengths.sum())
    return {
        "lines": len(lengths),
        "tokens": n_tokens,
        "mean_len": float(lengths.mean()) if len(lengths) else 0.0,
        "p95_len": int(np.percentile(lengths, 95)) if len(lengths) else 0,
        "unk_rate": unk / max(n_tokens, 1),
    }


def _train_vocab(config: ExperimentConfig, paths: dict[str, Path], seed: int, filters: list[DirectionFilters],
                 workers: int | None) -> tuple[int, int]:
    """Sentencepiece on a uniform sample of the training pairs, less those the filters drop;
    returns (pairs read, pairs sampled)."""
    vocab = config.vocab
    size = vocab.input_sentence_size
    # input_sentence_size counts sentences per sentencepiece model: a joint one sees both sides.
    pairs = (size + 1) // 2 if vocab.joint and size > 0 else size
    if config.data.multilingual:
        return _train_multilingual_vocab(config, paths["src"], seed)
    src, tgt, read = sample_pairs(split_corpora(config, "train"), pairs, seed, config.data.train_limit,
                                  skip_invalid=config.data.filters.text.enabled)
    sampled = len(src) < read
    before, distinct = len(src), len(set(zip(src, tgt)))
    src, tgt = filter_sample(filters[0], src, tgt, workers or usable_cores(), config.data.pairs[0].name,
                             [path for pair in split_corpora(config, "train") for path in pair])
    if config.data.augment.enabled:  # the vocabulary sees the casings training will draw
        src = cased_like_training(src, config.data.augment, seed)
        tgt = cased_like_training(tgt, config.data.augment, seed + 1, source=False)
    try:
        if vocab.joint:
            train_sentencepiece(src + tgt, paths["src"], config, sampled)
        else:
            train_sentencepiece(src, paths["src"], config, sampled)
            train_sentencepiece(tgt, paths["tgt"], config, sampled)
    except TfmError as exc:
        if len(src) == before or "vocab" not in str(exc):
            raise
        # Say what the filters left: 3,000 copies of one pair support 109 pieces, and the reason is theirs.
        raise TfmError(f"{exc} (the corpus filters left {len(src):,} of the {before:,} pairs sampled; "
                       f"{before - distinct:,} were repeats of another pair: data.filters.duplicates)") from None
    return read, len(src)


def _train_multilingual_vocab(config: ExperimentConfig, target: Path, seed: int) -> tuple[int, int]:
    """One joint vocabulary over every language of the directions, each language's sentences
    sampled at its temperature rate (a language with little data is not drowned by one with much),
    and every target language's tag a piece of its own. Returns (pairs read, sentences sampled)."""
    languages = dict.fromkeys(lang for d in config.data.pairs for lang in (d.src, d.tgt))
    files = {language: language_files(config, language) for language in languages}
    limit = config.data.train_limit
    lines = {path: count_lines(path, limit) for paths in files.values() for path in paths}
    sizes = {language: sum(lines[path] for path in paths) for language, paths in files.items()}
    budget = config.vocab.input_sentence_size or sum(sizes.values())
    rates = sampling_rates(list(sizes.values()), config.data.temperature)
    sentences: list[str] = []
    for (language, paths), rate in zip(files.items(), rates):
        wanted = min(sizes[language], max(1, round(budget * rate)))
        sentences += sample_lines(paths, wanted, seed, limit)
    if config.data.augment.enabled:  # each language is a source of some direction
        sentences = cased_like_training(sentences, config.data.augment, seed)
    tags = [tag_piece(language) for language in sorted({d.tgt for d in config.data.pairs})]
    train_sentencepiece(sentences, target, config, len(sentences) < sum(sizes.values()), tags)
    read = sum(lines[src] for d in config.data.pairs for src, _ in direction_corpora(config, "train", d))
    return read, len(sentences)


def source_tags(config: ExperimentConfig, src_vocab: Path) -> list[str | None]:
    """Each direction's source tag (None: untagged). Every source of a multilingual run is tagged
    (the vocabulary must have each target's tag); a bilingual run's too where its vocabulary has
    its target's tag (a direction fine-tuned from a multilingual parent: its model expects it)."""
    processor = load_sentencepiece(src_vocab)
    known = known_languages(processor.id_to_piece(i) for i in range(processor.get_piece_size()))
    if not config.data.multilingual:
        return [tag(config.data.tgt_lang) if config.data.tgt_lang in known else None]
    for direction in config.data.pairs:
        if direction.tgt not in known:
            raise TfmError(f"key 'data.directions': {direction.name}: the vocabulary ({src_vocab}) has no tag "
                           f"{tag(direction.tgt)}; it has tags for {', '.join(known) or 'no language'}")
    return [tag(direction.tgt) for direction in config.data.pairs]


@dataclass
class ParentVocab:
    """The vocabulary of the run that `vocab.from_run` names."""

    files: dict[str, Path]  # side → its sentencepiece model
    shared_ids: bool  # two sentencepiece models over one id map (an imported Marian model's)


def parent_vocab(config: ExperimentConfig) -> ParentVocab:
    """The sentencepiece model files of the run that `vocab.from_run` names, checked against this
    config: the same `vocab.joint` and `vocab.size`, and not this run itself."""
    parent = config.parent_run
    assert parent is not None  # (called where vocab.from_run is set)
    key = "key 'vocab.from_run'"
    if not parent.manifest_file.is_file():
        raise TfmError(f"{key}: {parent.root} is not a tfm run directory (no {parent.manifest_file.name}; "
                       "run `tfm prepare` there, or name the run directory of the model to fine-tune)")
    if parent.root.resolve() == config.run_path.resolve():
        raise TfmError(f"{key}: {parent.root} is this run's own directory; name the parent run")
    manifest = parent.load_manifest()
    files = {side: parent.vocab_file(manifest, side) for side in SIDES}
    for path in dict.fromkeys(files.values()):
        if not path.is_file():
            raise TfmError(f"{key}: {path} not found (the parent run's sentencepiece model)")
    joint = files["src"] == files["tgt"]
    if joint != config.vocab.joint:
        raise TfmError(f"key 'vocab.joint': {config.vocab.joint} in the config, but {parent.root} has a "
                       f"{'joint' if joint else 'separate'} vocabulary: set vocab.joint={str(joint).lower()}")
    sizes = {load_sentencepiece(path).vocab_size() for path in files.values()}
    if sizes != {config.vocab.size}:
        raise TfmError(f"key 'vocab.size': {config.vocab.size} in the config, but {parent.root}'s vocabulary has "
                       f"{' and '.join(map(str, sorted(sizes)))} pieces: set vocab.size to the parent's")
    return ParentVocab(files, manifest.shared_ids)


def _inherit_vocab(config: ExperimentConfig, parent: ParentVocab, paths: dict[str, Path]) -> int:
    """Copy the parent run's sentencepiece model(s) byte for byte; returns the training pairs."""
    for side, source in parent.files.items():
        atomic_write_bytes(paths[side], source.read_bytes())
    return sum(len(chunk.src) for _, chunk in corpora_chunks(split_corpora(config, "train"), 100_000,
                                                             config.data.train_limit))


def _encode_split(config: ExperimentConfig, split: str, paths: dict[str, Path], tags: list[str | None], dtype: str,
                  workers: int, bar: tqdm, cleaning: Cleaning | None = None) -> tuple[dict, int, list[int]]:
    """Stream one split through the encoders into its token/offset files, direction after direction.

    Returns stats (with the pairs written per direction), pairs read and the line numbers of
    valid/test pairs that were truncated to the model's positions (they are kept: scores must cover
    every line). The training split is filtered (`cleaning`, whose report counts what was dropped).
    """
    is_train = split == "train"
    limit = config.data.train_limit if is_train else None
    hash_by = config.data.filters.duplicates.by if is_train and config.data.filters.duplicates.enabled else None
    corpora_of = [direction_corpora(config, split, direction) for direction in config.data.pairs]

    def tasks():  # each direction's corpora in turn (train_limit counts each direction's pairs)
        for which, corpora in enumerate(corpora_of):
            for number, chunk in corpora_chunks(corpora, config.prepare.chunk_lines, limit):
                yield number, EncodeTask(chunk, str(corpora[number][0]), str(corpora[number][1]), dtype,
                                         config.data.max_len if is_train else None,
                                         config.data.max_len_ratio if is_train else None,
                                         None if is_train else source_token_limit(config.model.max_positions),
                                         tags[which], which, filtered=is_train,
                                         keep_dropped=bool(cleaning and cleaning.dropped), hash_by=hash_by)
    numbers: list[int] = []  # each task's corpus number, in order (results come back in order)

    def numbered_tasks():
        for number, task in tasks():
            numbers.append(number)
            yield task
    writers = {side: NpyAppender(array_path(config.run.binary_stem(split, side), "tokens"), np.dtype(dtype))
               for side in SIDES}
    lengths: dict[str, list[np.ndarray]] = {side: [] for side in SIDES}
    unk = {side: 0 for side in SIDES}
    read = 0
    truncated: list[int] = []
    kept = [0] * len(config.data.pairs)  # pairs written, per direction
    initargs = (str(paths["src"]), str(paths["tgt"]), cleaning.filters if cleaning and is_train else None)
    try:
        for index, result in enumerate(ordered_map(encode_chunk, numbered_tasks(), workers, init_encoder, initargs)):
            if is_train and cleaning is not None:
                clean_result(result, cleaning, str(corpora_of[result.direction][numbers[index]][0]))
            for side, encoded in (("src", result.src), ("tgt", result.tgt)):
                writers[side].append(encoded.tokens)
                lengths[side].append(encoded.lengths)
                unk[side] += encoded.unk
            read += result.read
            kept[result.direction] += len(result.src.lengths)
            truncated += result.truncated
            bar.update(result.read)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    stats = {}
    for side in SIDES:
        writers[side].close()
        side_lengths = np.concatenate(lengths[side]) if lengths[side] else np.zeros(0, dtype=np.int32)
        offsets = np.zeros(len(side_lengths) + 1, dtype=np.int64)
        np.cumsum(side_lengths, out=offsets[1:])
        with atomic_path(array_path(config.run.binary_stem(split, side), "offsets")) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, offsets)
        stats[side] = _side_stats(side_lengths, unk[side])
    stats["pairs_per_direction"] = kept
    return stats, read, truncated


def prepare(config: ExperimentConfig, force: bool = False, progress: bool = True,
            discard_checkpoints: bool = False, dropped: Path | None = None) -> PrepareResult:
    """Train the vocab and binarise train/valid/test into `config.run_dir` (idempotent).

    Streams: sentencepiece trains on a bounded uniform sample, and each split is encoded chunk by
    chunk in `prepare.workers` processes and appended to disk, so memory does not grow with the
    corpus. The output is the same whatever the number of workers. Holds the run_dir's lock
    (a training on the same directory makes it refuse) and writes the resolved config.yaml.

    A run that has checkpoints is never rebuilt under them (they would go on with ids that now mean
    other pieces): refused, unless `discard_checkpoints`, which moves its training aside first.
    """
    check_corpus_files(config)  # before anything is created or locked
    check_run_dir(config.run_path)
    if dropped is not None:
        check_dropped_file(config, dropped)
    parent = parent_vocab(config) if config.vocab.from_run else None
    with RunLock(config.run_path, "tfm prepare"):
        for directory in (config.run.root, config.run.data_dir):
            remove_stale_temps(directory)  # left by an interrupted write
        result = _prepare(config, force, progress, parent, discard_checkpoints, dropped)
        atomic_write_text(config.run.config_file, config_to_yaml(config))
    return result


def check_run_dir(run_dir: Path) -> None:
    """run_dir under the output rule, as every other writer's output: a new or empty directory, or
    a run tfm made there (its lock or manifest); a folder of the user's (their own config.yaml,
    which prepare's resolved config replaced) or the working directory is refused before anything
    is written."""
    check_output(run_dir, flag="run_dir", directory=True, run_files=False,  # (a run's own writer: this one)
                 ours=lambda folder: (folder / LOCK_NAME).exists() or (folder / MANIFEST_NAME).is_file())


def check_dropped_file(config: ExperimentConfig, dropped: Path) -> None:
    """`--dropped` names a file to write that is none of the run's inputs and not in its directory."""
    reads = {f"data.{split}": [path for corpus in split_corpora(config, split) for path in corpus] for split in SPLITS}
    check_output(dropped, reads, flag="--dropped")
    twin = dropped.with_name(dropped.name[:-3] if dropped.name.endswith(".gz") else f"{dropped.name}.gz")
    for option, paths in reads.items():  # `train.de.gz` beside the corpus `train.de` would shadow it, or be shadowed
        for path in paths:
            if twin.resolve() in (Path(path).resolve(), Path(f"{path}.gz").resolve()):
                raise TfmError(f"--dropped {dropped}: the plain/.gz twin of {path} ({option}): a corpus reader could "
                               "not tell which is the corpus; name another file")
    if config.run_path.resolve() in dropped.resolve().parents:
        raise TfmError(f"--dropped {dropped}: is inside the run directory {config.run_path}, which prepare "
                       "rebuilds; name a file outside it")


def _prepare(config: ExperimentConfig, force: bool, progress: bool, parent: ParentVocab | None,
             discard_checkpoints: bool, dropped_file: Path | None) -> PrepareResult:
    run_dir, run = config.run_path, config.run
    manifest_path = run.manifest_file
    fingerprint = _fingerprint(config, parent)
    if manifest_path.is_file() and not force:
        reused = run.load_manifest()
        expected = [run.binary_stem(sp, si) for sp in SPLITS for si in SIDES]
        files_ok = all(array_path(p, n).is_file() for p in expected for n in ("tokens", "offsets")) and all(
            p.is_file() for p in run.vocab_files(config.vocab.joint).values())
        if reused.fingerprint == fingerprint and files_ok:
            if dropped_file is not None:
                raise TfmError(f"--dropped {dropped_file}: {run_dir} is already prepared with these settings, so "
                               f"no pair is filtered again (what was dropped is counted in {run.cleaning_report}); "
                               "add --force to filter again")
            return PrepareResult(run_dir, True, _summary_table(reused.stats), reused)

    discarded = _make_room(run, force, discard_checkpoints)
    started = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)

    # The directions' filters: language identification's common words and the lexical model are
    # learned from the training data, before the vocabulary (whose sample they clean).
    corpora = [direction_corpora(config, "train", d) for d in config.data.pairs]
    filters = build_filters(config, corpora, config.train.seed)
    # Vocabulary: trained on (a sample of) the training data only, or the parent run's, as it is.
    paths = run.vocab_files(config.vocab.joint)
    if parent is not None:
        train_read, sampled = _inherit_vocab(config, parent, paths), 0
    else:
        train_read, sampled = _train_vocab(config, paths, config.train.seed, filters, config.prepare.workers)
    vocab_seconds = time.perf_counter() - started
    vocab_sizes = {side: load_sentencepiece(paths[side]).vocab_size() for side in SIDES}
    dtype = "uint16" if max(vocab_sizes.values()) <= np.iinfo(np.uint16).max else "int32"
    workers = config.prepare.workers
    if workers is None:  # all cores, unless starting processes costs more than it saves (the model
        # filter's scoring costs a thousand times the encoding: it pays on any corpus)
        workers = usable_cores() if train_read >= 50_000 or config.data.filters.model.enabled else 1

    stats: dict = {}
    truncated: dict[str, dict] = {}
    per_direction: dict[str, list[int]] = {}
    tags = source_tags(config, paths["src"])  # each direction's source tag (None: untagged)
    cleaning = make_cleaning(config, corpora, dropped_file, filters)
    try:
        with tqdm(desc="encoding", unit=" pairs", unit_scale=True, disable=not progress, leave=False) as bar:
            for split in SPLITS:
                stats[split], _, lines = _encode_split(config, split, paths, tags, dtype, workers, bar, cleaning)
                per_direction[split] = stats[split].pop("pairs_per_direction")
                if lines:
                    truncated[split] = {"count": len(lines), "lines": lines[:10],
                                        "max_tokens": source_token_limit(config.model.max_positions)}
        cleaning.report.check_kept()
    except BaseException:
        if cleaning.dropped is not None:
            cleaning.dropped.abort()
        raise
    if cleaning.dropped is not None:
        cleaning.dropped.close()
    report = cleaning.report.to_json()
    atomic_write_text(run.cleaning_report, json.dumps(report, indent=2, ensure_ascii=False))

    manifest = {
        "fingerprint": fingerprint,
        "src_lang": config.data.src_lang,
        "tgt_lang": config.data.tgt_lang,
        "vocab": {side: paths[side].name for side in SIDES},  # files of this run, by name
        "vocab_size": vocab_sizes,
        **({"vocab_from": str(Path(config.vocab.from_run).resolve())} if config.vocab.from_run else {}),
        # Two sentencepiece models over one id map (an imported Marian model's): embeddings can be shared.
        **({"shared_ids": True} if parent is not None and parent.shared_ids else {}),
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        # Where each direction's pairs lie in each split: [start, end) (directions.split_ranges).
        "directions": _direction_ranges(config, per_direction),
        "tagged": tags[0] is not None,
        "files": {split: [str(p) for corpus in split_corpora(config, split) for p in corpus] for split in SPLITS},
        "train_pairs_read": train_read,
        "train_pairs_dropped": {reason: count for reason, count in report["dropped"].items() if count},
        "truncated": truncated,  # valid/test pairs cut to the model's positions (first line numbers)
        "vocab_sample_pairs": sampled,
        "workers": workers,
        "stats": stats,
        "data_digest": _data_digest(run),  # checkpoints carry it: --resume checks they were trained on this data
        "seconds": round(time.perf_counter() - started, 2),
        "seconds_vocab": round(vocab_seconds, 2),  # sampling pass + sentencepiece training
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2))
    return PrepareResult(run_dir, False, _summary_table(stats), Manifest.from_json(manifest, manifest_path), discarded,
                         cleaning.report)


def _direction_ranges(config: ExperimentConfig, per_direction: dict[str, list[int]]) -> list[dict]:
    ranges = [{"name": d.name} for d in config.data.pairs]
    for split, counts in per_direction.items():
        ends = np.cumsum(counts).tolist()
        for entry, end, count in zip(ranges, ends, counts):
            entry[split] = [end - count, end]
    return ranges


def _make_room(run: RunDirectory, force: bool, discard_checkpoints: bool) -> Path | None:
    """Before a rebuild: a run with checkpoints keeps them unless told to discard them (moved to
    discarded-<time>/, returned): rebuilt, its vocabulary and data would no longer be theirs."""
    if not run.has_checkpoints():
        return None
    if not discard_checkpoints:
        why = "--force rebuilds" if force else "its data or vocabulary settings or inputs changed, so prepare rebuilds"
        raise TfmError(f"{run.root} holds a trained model ({run.checkpoints}) and {why} its vocabulary and data, "
                       "which the checkpoints could no longer use: prepare into a new run_dir, or pass "
                       "--discard-checkpoints to move the training to a discarded-<time>/ folder of the run first")
    return run.discard_training()


def _data_digest(run: RunDirectory) -> str:
    """sha256 of every encoded split, as written: which data checkpoints were trained on."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for side in SIDES:
            for name in ("tokens", "offsets"):
                with open(array_path(run.binary_stem(split, side), name), "rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------- batching
