import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from transformer_cli.config import config_from_dict
from transformer_cli.data import (BOS_ID, EOS_ID, PAD_ID, UNK_ID, ParallelData, TokenArray, binary_stem,
                                  prepare, token_batches)
from transformer_cli.errors import TfmError
from transformer_cli.io_utils import read_lines

from .conftest import multi30k_config


@pytest.fixture(scope="module")
def prepared(multi30k_2k, tmp_path_factory):
    config = config_from_dict(multi30k_config(multi30k_2k, tmp_path_factory.mktemp("prep") / "run"))
    return config, prepare(config, progress=False)


def test_vocab_has_fixed_special_ids(prepared):
    config, result = prepared
    sp = spm.SentencePieceProcessor(model_file=str(config.run_path / "spm.model"))
    assert sp.vocab_size() == 1000
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)


def test_binary_round_trip_decodes_to_the_original(prepared):
    config, _ = prepared
    sp = spm.SentencePieceProcessor(model_file=str(config.run_path / "spm.model"))
    test = TokenArray.load(binary_stem(config.run_path, "test", "tgt"))
    raw = read_lines(f"{config.data.test}.en.gz")
    assert len(test) == len(raw)
    for i in range(0, len(raw), 97):
        # sentencepiece normalises whitespace (NFKC + collapsed spaces); compare modulo that
        assert sp.decode(np.asarray(test[i]).tolist()) == " ".join(raw[i].split())


def test_valid_and_test_line_counts_kept(prepared):
    config, result = prepared
    stats = result.manifest["stats"]
    for split, prefix in (("valid", config.data.valid), ("test", config.data.test)):
        for side, lang in (("src", "de"), ("tgt", "en")):
            assert stats[split][side]["lines"] == len(read_lines(f"{prefix}.{lang}.gz"))
    dropped = sum(result.manifest["train_pairs_dropped"].values())
    assert stats["train"]["src"]["lines"] == 2000 - dropped


def test_summary_and_idempotent_rerun(prepared):
    config, result = prepared
    assert "unk%" in result.summary and "train" in result.summary
    again = prepare(config, progress=False)
    assert again.reused and again.manifest["fingerprint"] == result.manifest["fingerprint"]
    forced = prepare(config, force=True, progress=False)
    assert not forced.reused


def test_filters_long_and_empty_pairs(multi30k_2k, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    src = read_lines(f"{multi30k_2k}/train.de.gz")[:300] + ["", "kurz", "wort " * 200]
    tgt = read_lines(f"{multi30k_2k}/train.en.gz")[:300] + ["empty source", "", "word " * 200]
    for lang, lines in (("de", src), ("en", tgt)):
        (data / f"train.{lang}").write_text("\n".join(lines) + "\n")
    for split in ("val", "test_2016_flickr"):
        for lang in ("de", "en"):
            (data / f"{split}.{lang}").write_text("ein Hund\n\n")
    raw = multi30k_config(data, tmp_path / "run", vocab={"size": 300})
    raw["data"]["max_len"] = 150
    result = prepare(config_from_dict(raw), progress=False)
    assert result.manifest["train_pairs_dropped"]["empty"] == 2
    assert result.manifest["train_pairs_dropped"]["too_long"] == 1
    assert result.manifest["stats"]["valid"]["src"]["lines"] == 2  # the empty line is kept


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
    # Through the real CLI: exit 2, one line, no traceback.
    config_path = tmp_path / "c.yaml"
    import yaml

    config_path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "transformer_cli.cli", "prepare", "--config", str(config_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "100 lines" in proc.stderr


def test_token_batches_respect_budget_and_cover_everything(prepared):
    config, _ = prepared
    data = ParallelData(config.run_path, "train")
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
