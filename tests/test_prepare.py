import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from transformer_cli.data.batches import ParallelData, TokenArray, token_batches
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_cli.runtime.errors import TfmError
from transformer_cli.runtime.files import read_lines

from .conftest import multi30k_config, tfm_in_process


@pytest.fixture(scope="module")
def prepared(multi30k_2k, tmp_path_factory):
    config = config_from_dict(multi30k_config(multi30k_2k, tmp_path_factory.mktemp("prep") / "run"))
    return config, prepare(config, progress=False)


@pytest.mark.slow
def test_vocab_has_fixed_special_ids(prepared):
    config, result = prepared
    sp = spm.SentencePieceProcessor(model_file=str(config.run_path / "spm.model"))
    assert sp.vocab_size() == 1000
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)


def test_binary_round_trip_decodes_to_the_original(prepared):
    config, _ = prepared
    sp = spm.SentencePieceProcessor(model_file=str(config.run_path / "spm.model"))
    test = TokenArray.load(RunDirectory(config.run_path).binary_stem("test", "tgt"))
    raw = read_lines(f"{config.data.test}.en.gz")
    assert len(test) == len(raw)
    for i in range(0, len(raw), 97):
        # sentencepiece normalises whitespace (NFKC + collapsed spaces); compare modulo that
        assert sp.decode(np.asarray(test[i]).tolist()) == " ".join(raw[i].split())


def test_valid_and_test_line_counts_kept(prepared):
    config, result = prepared
    stats = result.manifest.stats
    for split, prefix in (("valid", config.data.valid), ("test", config.data.test)):
        for side, lang in (("src", "de"), ("tgt", "en")):
            assert stats[split][side]["lines"] == len(read_lines(f"{prefix}.{lang}.gz"))
    dropped = sum(result.manifest.train_pairs_dropped.values())
    assert stats["train"]["src"]["lines"] == 2000 - dropped


@pytest.mark.slow
def test_summary_and_idempotent_rerun(prepared):
    config, result = prepared
    assert "unk%" in result.summary and "train" in result.summary
    again = prepare(config, progress=False)
    assert again.reused and again.manifest.fingerprint == result.manifest.fingerprint
    forced = prepare(config, force=True, progress=False)
    assert not forced.reused


def test_filters_long_and_empty_pairs(multi30k_2k, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    src = read_lines(f"{multi30k_2k}/train.de.gz")[:300]
    tgt = read_lines(f"{multi30k_2k}/train.en.gz")[:300]
    # an empty side twice, and a pair of 12 sentences on one line (more pieces than max_len)
    src, tgt = src + ["", "kurz", " ".join(src[:12])], tgt + ["empty source", "", " ".join(tgt[:12])]
    for lang, lines in (("de", src), ("en", tgt)):
        (data / f"train.{lang}").write_text("\n".join(lines) + "\n")
    for split in ("val", "test_2016_flickr"):
        for lang in ("de", "en"):
            (data / f"{split}.{lang}").write_text("ein Hund\n\n")
    raw = multi30k_config(data, tmp_path / "run", vocab={"size": 300})
    raw["data"]["max_len"] = 150
    raw["data"]["filters"] = {"length": {"max_sentences": 20}}  # the pieces' bound must meet the long line
    result = prepare(config_from_dict(raw), progress=False)
    assert result.manifest.train_pairs_dropped["empty"] == 2
    assert result.manifest.train_pairs_dropped["too_long"] == 1
    assert result.manifest.stats["valid"]["src"]["lines"] == 2  # the empty line is kept


def test_mismatched_line_counts_is_a_clear_error(multi30k_2k, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    with gzip.open(multi30k_2k / "train.de.gz", "rt") as f:
        lines = f.read().splitlines()
    (data / "train.de").write_text("\n".join(lines[:100]) + "\n")
    (data / "train.en").write_text("\n".join(lines[:99]) + "\n")
    raw = multi30k_config(multi30k_2k, tmp_path / "run")
    raw["data"]["train"] = str(data / "train")
    with pytest.raises(TfmError, match=r"train.de has 100 lines, .*train.en has 99"):
        prepare(config_from_dict(raw), progress=False)
    # Through the command line: exit 2, one line.
    config_path = tmp_path / "c.yaml"
    import yaml

    config_path.write_text(yaml.safe_dump(raw))
    proc = tfm_in_process("prepare", "--config", config_path)
    assert proc.exit_code == 2
    assert proc.stderr.strip().count("\n") == 0 and "100 lines" in proc.stderr


def test_token_batches_respect_budget_and_cover_everything(prepared):
    config, _ = prepared
    data = ParallelData(config.run, "train")
    batches = token_batches(data.src.lengths, data.tgt.lengths, 1024, seed=3)
    seen = np.sort(np.concatenate(batches))
    assert np.array_equal(seen, np.arange(len(data)))
    for b in batches:
        width = max(max(data.src.lengths[b]), max(data.tgt.lengths[b])) + 1
        assert width * len(b) <= 1024 or len(b) == 1
    other = token_batches(data.src.lengths, data.tgt.lengths, 1024, seed=4)
    assert [list(b) for b in batches] != [list(b) for b in other]
    batch = data.collate(batches[0])
    assert (batch.tgt_in[:, 0] == BOS_ID).all()
    assert ((batch.tgt_out == EOS_ID).sum(dim=1) == 1).all()
    assert json.loads((config.run_path / "prepare.json").read_text())["special_ids"]["pad"] == PAD_ID


def test_a_batch_is_its_sentences_padded_row_by_row(prepared):
    """ParallelData.collate gathers a batch's sentences in one scatter from the memory-mapped
    arrays; each row must be exactly its own sentence with <eos> (source, target out) or <bos>
    (target in) and then padding, the counts and loss positions those of the real tokens."""
    config, _ = prepared
    data = ParallelData(config.run, "train")
    for indices in token_batches(data.src.lengths, data.tgt.lengths, 1024, seed=5)[:20]:
        batch = data.collate(indices)
        assert batch.src.dtype == batch.tgt_in.dtype == torch.int64
        for row, i in enumerate(indices):
            src, tgt = [int(t) for t in data.src[i]], [int(t) for t in data.tgt[i]]
            pad = lambda ids, width: ids + [PAD_ID] * (width - len(ids))  # noqa: E731
            assert batch.src[row].tolist() == pad(src + [EOS_ID], batch.src.size(1))
            assert batch.tgt_in[row].tolist() == pad([BOS_ID] + tgt, batch.tgt_in.size(1))
            assert batch.tgt_out[row].tolist() == pad(tgt + [EOS_ID], batch.tgt_out.size(1))
        assert batch.src.size(1) == max(data.src.lengths[indices]) + 1
        assert batch.n_tgt_tokens == int(data.tgt.lengths[indices].sum()) + len(indices) == len(batch.rows)
        assert batch.n_src_tokens == int(data.src.lengths[indices].sum()) + len(indices)
        assert torch.equal(batch.targets, batch.tgt_out.view(-1)[batch.rows])
        assert (batch.targets != PAD_ID).all()


def _prepared_arrays(run_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "data").glob("*.npy"))}


def _pieces(model: Path) -> list[tuple[str, float]]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.vocab_size())]


@pytest.mark.slow
def test_parallel_workers_write_the_same_files_as_one_process(multi30k_2k, tmp_path):
    """Chunked encoding in 2 worker processes (small chunks, so many tasks) = in-process encoding."""
    outputs = []
    for workers in (1, 2):
        raw = multi30k_config(multi30k_2k, tmp_path / f"w{workers}", prepare={"workers": workers, "chunk_lines": 150})
        result = prepare(config_from_dict(raw), progress=False)
        assert result.manifest.workers == workers
        outputs.append((_prepared_arrays(tmp_path / f"w{workers}"), result.manifest.stats,
                        result.manifest.train_pairs_dropped))
    assert outputs[0] == outputs[1]
    assert _pieces(tmp_path / "w1/spm.model") == _pieces(tmp_path / "w2/spm.model")
    # The same settings again: the same vocabulary file, byte for byte (it records the thread count,
    # but no temporary path).
    raw = multi30k_config(multi30k_2k, tmp_path / "again", prepare={"workers": 2, "chunk_lines": 150})
    prepare(config_from_dict(raw), progress=False)
    assert (tmp_path / "again/spm.model").read_bytes() == (tmp_path / "w2/spm.model").read_bytes()
    assert len(outputs[0][0]) == 12  # 3 splits x 2 sides x (tokens, offsets)
    # The streamed .npy files are ordinary numpy arrays (memory-mapped by training).
    data = ParallelData(RunDirectory(tmp_path / "w2"), "train")
    assert data.src.tokens.dtype == np.uint16 and data.src.offsets[-1] == len(data.src.tokens)


def test_vocab_sample_is_uniform_aligned_and_in_corpus_order(tmp_path):
    from transformer_cli.data.corpus import sample_pairs

    (tmp_path / "a.src").write_text("".join(f"s{i}\n" for i in range(5000)))
    (tmp_path / "a.tgt").write_text("".join(f"t{i}\n" for i in range(5000)))
    src, tgt, read = sample_pairs([(tmp_path / "a.src", tmp_path / "a.tgt")], 500, seed=1)
    assert read == 5000 and len(src) == len(tgt) == 500
    numbers = [int(s[1:]) for s in src]
    assert [int(t[1:]) for t in tgt] == numbers  # pairs stay aligned
    assert numbers == sorted(numbers) and len(set(numbers)) == 500
    # Uniform over the corpus: each fifth of the file holds about a fifth of the sample.
    counts = np.bincount(np.array(numbers) // 1000, minlength=5)
    assert counts.min() > 60, counts
    assert sample_pairs([(tmp_path / "a.src", tmp_path / "a.tgt")], 500, seed=2)[0] != src
    everything, _, _ = sample_pairs([(tmp_path / "a.src", tmp_path / "a.tgt")], 0, seed=1)
    assert everything == [f"s{i}" for i in range(5000)]
    limited = sample_pairs([(tmp_path / "a.src", tmp_path / "a.tgt")], 10_000, seed=1, limit=300)
    assert limited[2] == 300 and limited[0] == [f"s{i}" for i in range(300)]


@pytest.mark.slow
def test_small_vocab_sample_still_builds_a_working_vocab(multi30k_2k, tmp_path):
    raw = multi30k_config(multi30k_2k, tmp_path / "run", vocab={"size": 500, "input_sentence_size": 600})
    result = prepare(config_from_dict(raw), progress=False)
    assert result.manifest.vocab_sample_pairs == 300  # joint: half the sentences from each side
    assert result.manifest.train_pairs_read == 2000
    assert result.manifest.stats["test"]["tgt"]["unk_rate"] < 0.01


def test_npy_appender_round_trip_and_abort(tmp_path):
    from transformer_cli.data.corpus import NpyAppender

    writer = NpyAppender(tmp_path / "x.npy", np.uint16)
    parts = [np.arange(n, dtype=np.uint16) for n in (0, 5, 70_000 % 65_536, 3)]
    for part in parts:
        writer.append(part)
    assert not (tmp_path / "x.npy").exists()  # appears only when complete
    writer.close()
    assert np.array_equal(np.load(tmp_path / "x.npy"), np.concatenate(parts))
    aborted = NpyAppender(tmp_path / "y.npy", np.int32)
    aborted.append(np.arange(4, dtype=np.int32))
    aborted.abort()
    assert list(tmp_path.iterdir()) == [tmp_path / "x.npy"]  # no partial file, no temp file left


def test_truncated_gzip_corpus_is_a_clear_error(multi30k_2k, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    for lang in ("de", "en"):
        blob = (multi30k_2k / f"train.{lang}.gz").read_bytes()
        (data / f"train.{lang}.gz").write_bytes(blob[: len(blob) // 2] if lang == "en" else blob)
    raw = multi30k_config(multi30k_2k, tmp_path / "run")
    raw["data"]["train"] = str(data / "train")
    with pytest.raises(TfmError, match=r"train.en.gz: cannot read it to the end: truncated or corrupt"):
        prepare(config_from_dict(raw), progress=False)


@pytest.mark.slow
def test_several_training_corpora_prepare_as_their_concatenation(multi30k_2k, tmp_path):
    """`data.train` as a list (e.g. real + back-translated pairs) gives the same vocabulary and
    arrays as one file holding the corpora one after the other; a bad line names its own file."""
    parts = tmp_path / "parts"
    parts.mkdir()
    for lang in ("de", "en"):
        with gzip.open(multi30k_2k / f"train.{lang}.gz", "rt") as f:
            lines = f.read().splitlines(keepends=True)
        (parts / f"a.{lang}").write_text("".join(lines[:1200]))
        (parts / f"b.{lang}").write_text("".join(lines[1200:]))
        (parts / f"all.{lang}").write_text("".join(lines))
    vocab = {"size": 1000, "input_sentence_size": 1500}  # a sample: the reservoir must span both corpora
    one = prepare(config_from_dict(multi30k_config(
        multi30k_2k, tmp_path / "one", data={"train": str(parts / "all")}, vocab=vocab)), progress=False)
    two = prepare(config_from_dict(multi30k_config(
        multi30k_2k, tmp_path / "two", data={"train": [str(parts / "a"), str(parts / "b")]}, vocab=vocab)),
        progress=False)
    assert two.manifest.train_pairs_read == one.manifest.train_pairs_read == 2000
    assert _pieces(tmp_path / "two/spm.model") == _pieces(tmp_path / "one/spm.model")
    assert _prepared_arrays(tmp_path / "two") == _prepared_arrays(tmp_path / "one")
    assert two.manifest.files["train"] == [str(parts / f"{c}.{lang}") for c in "ab" for lang in ("de", "en")]
    # train_limit counts pairs over all the corpora.
    limited = prepare(config_from_dict(multi30k_config(
        multi30k_2k, tmp_path / "limited", data={"train": [str(parts / "a"), str(parts / "b")],
                                                  "train_limit": 1500})), progress=False)
    assert limited.manifest.train_pairs_read == 1500
    # The second corpus's files disagree: the error names them, not the first corpus's.
    (parts / "b.en").write_text("".join(lines[1200:1999]))
    raw = multi30k_config(multi30k_2k, tmp_path / "bad", data={"train": [str(parts / "a"), str(parts / "b")]})
    with pytest.raises(TfmError, match=r"b\.de has 800 lines, .*b\.en has 799"):
        prepare(config_from_dict(raw), progress=False)


def test_an_empty_list_of_training_corpora_is_a_config_error(multi30k_2k, tmp_path):
    with pytest.raises(TfmError, match=r"data\.train.*at least 1 item"):
        config_from_dict(multi30k_config(multi30k_2k, tmp_path / "run", data={"train": []}))


def test_run_dir_over_a_users_folder_or_the_working_directory_is_refused_before_a_file_is_written(
        multi30k_2k, tmp_path, monkeypatch):
    """`tfm prepare --set run_dir=DIR` over a folder of the user's own replaced their config.yaml
    with tfm's (exit 0): run_dir is under the output rule, as every other writer's output."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("my own: notes\n")
    with pytest.raises(TfmError, match=r"run_dir .*mine is not empty and holds files tfm did not write there"):
        prepare(config_from_dict(multi30k_config(multi30k_2k, folder)), progress=False)
    assert (folder / "config.yaml").read_text() == "my own: notes\n" and sorted(folder.iterdir()) == [
        folder / "config.yaml"]  # not even the lock
    monkeypatch.chdir(folder)
    with pytest.raises(TfmError, match="run_dir . is the working directory"):
        prepare(config_from_dict(multi30k_config(multi30k_2k, Path("."))), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    config = config_from_dict(multi30k_config(multi30k_2k, empty, vocab={"size": 300}))
    prepare(config, progress=False)  # new or empty: prepared; and a run tfm made is prepared again
    assert prepare(config, progress=False).reused


def test_a_dropped_file_that_would_shadow_a_corpus_is_refused_before_prepare_runs(multi30k_2k, tmp_path):
    """`--dropped train.de` beside the corpus `train.de.gz`: the whole prepare ran, then "both exist"."""
    config = config_from_dict(multi30k_config(multi30k_2k, tmp_path / "run"))
    for dropped in (multi30k_2k / "train.de", multi30k_2k / "val.en"):
        with pytest.raises(TfmError, match=r"--dropped .*: the plain/.gz twin of"):
            prepare(config, progress=False, dropped=dropped)
        assert not dropped.exists()
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_fetching_a_corpus_again_leaves_the_same_files_as_they_are_and_prepared_runs_prepared(tmp_path):
    """scripts/get_data.sh run again over its own output: the same bytes are not written again (a
    new file time is a new input: a prepared run, and the model filter's own models, would be
    prepared and trained again); another slice is written."""
    from tests.conftest import get_corpus_slice

    dest = get_corpus_slice(tmp_path / "m30k", 50)
    times = {path.name: path.stat().st_mtime_ns for path in dest.iterdir()}
    os.utime(dest / "train.de.gz", ns=(1, 1))  # a file time the same bytes would not get again
    get_corpus_slice(dest, 50)
    assert (dest / "train.de.gz").stat().st_mtime_ns == 1
    assert {path.name: path.stat().st_mtime_ns for path in dest.iterdir() if path.name != "train.de.gz"} == \
        {name: time for name, time in times.items() if name != "train.de.gz"}
    get_corpus_slice(dest, 60)
    assert (dest / "train.de.gz").stat().st_mtime_ns != 1 and sum(1 for _ in gzip.open(dest / "train.de.gz", "rt")) == 60
