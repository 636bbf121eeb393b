"""Multilingual runs: data.directions, target-language tags, temperature sampling, per-direction
evaluation. The model is a tiny one that learned a checkable mapping: source words shifted one
letter forward (target language "up") or back ("dn"), chosen by the tag alone."""

from __future__ import annotations

import gzip
import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import (
    SHIFT,
    assert_same_final_weights,
    shift_config,
    shifted,
    tfm_in_process,
    write_shift_task,
)
from transformer_cli.data import language_id
from transformer_cli.data.batches import ParallelData
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.experiment.directions import DirectionRange, epoch_sample, sampling_rates, tag_piece
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train


def follows(output: str, source: str, language: str) -> bool:
    return output.split() == shifted(source.split(), language)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("directions, message", [
    (["en-de", "en-de"], "en-de is listed twice"),
    (["ende"], "'ende' is not a direction"),
    (["en-en"], "the source and target language are the same"),
    (["en-d e"], "is not a direction"),
    ([{"direction": "en-de", "trian": "x"}], r"did you mean 'data\.directions\.0\.train'"),
    ([], "at least 1 item"),
])
def test_bad_directions_name_the_key(directions, message):
    with pytest.raises(TfmError, match=f"key 'data\\.directions[.0-9a-z]*'.*{message}"):
        config_from_dict({"data": {"directions": directions}})


def test_directions_set_the_languages_and_refuse_others():
    config = config_from_dict({"data": {"directions": ["fr-en", "en-fr"]}})
    assert (config.data.src_lang, config.data.tgt_lang) == ("fr", "en") and config.data.multilingual
    with pytest.raises(TfmError, match="key 'data.tgt_lang': de differs from the first of data.directions"):
        config_from_dict({"data": {"directions": ["fr-en"], "tgt_lang": "de"}})
    with pytest.raises(TfmError, match="key 'vocab.joint': false: data.directions needs one joint vocabulary"):
        config_from_dict({"data": {"directions": ["fr-en"]}, "vocab": {"joint": False}})
    with pytest.raises(TfmError, match="key 'data.temperature'"):
        config_from_dict({"data": {"directions": ["fr-en"], "temperature": 0.5}})


# --------------------------------------------------------------------------- temperature sampling


@pytest.mark.parametrize("temperature", [1.0, 5.0, 1000.0])
def test_epochs_draw_each_direction_at_its_temperature_rate(temperature):
    ranges = [DirectionRange("a-b", 0, 1000), DirectionRange("a-c", 1000, 1100), DirectionRange("a-d", 1100, 1110)]
    shares = np.array([1000, 100, 10]) / 1110
    expected = shares ** (1 / temperature) / (shares ** (1 / temperature)).sum()
    assert np.allclose(sampling_rates([1000, 100, 10], temperature), expected)
    for seed in (1, 2):
        drawn = epoch_sample(ranges, temperature, seed)
        counts = [int(((drawn >= r.start) & (drawn < r.end)).sum()) for r in ranges]
        assert len(drawn) == 1110 and sum(counts) == 1110
        assert all(abs(c - e * 1110) < 1 for c, e in zip(counts, expected)), (counts, expected * 1110)
        # a direction drawn less than its size takes distinct pairs; one drawn more repeats them all
        big = drawn[drawn < 1000]
        assert len(np.unique(big)) == len(big)
        small = drawn[drawn >= 1100]
        assert set(small.tolist()) == set(range(1100, 1110)) or len(small) < 10
    assert np.array_equal(epoch_sample(ranges, temperature, 7), epoch_sample(ranges, temperature, 7))


def test_training_batches_follow_the_sampled_directions(shift_model):
    data, config_path = shift_model
    run = Path(json.loads(config_path.read_text())["run_dir"])
    split = ParallelData(RunDirectory(run), "train", temperature=5.0)
    assert [(r.direction, r.size) for r in split.directions] == [("src-up", 3000), ("src-dn", 3000)]
    batches = split.batches(max_tokens=1500, seed=3)
    drawn = np.sort(np.concatenate(batches))
    assert np.array_equal(drawn, epoch_sample(split.directions, 5.0, 3))  # equal sizes: every pair once
    assert np.array_equal(drawn, np.arange(6000))


def test_directions_with_corpora_of_their_own_are_drawn_at_their_rates(tmp_path):
    write_shift_task(tmp_path / "big", n_train=2000, n_test=10, seed=1)
    write_shift_task(tmp_path / "small", n_train=200, n_test=10, seed=2)
    raw = shift_config(tmp_path / "big", tmp_path / "run")
    raw["data"]["directions"] = ["src-up", {"direction": "src-dn", "train": str(tmp_path / "small" / "train")}]
    raw["data"]["temperature"] = 5.0
    config = config_from_dict(raw)
    prepare(config, progress=False)
    manifest = json.loads((tmp_path / "run" / "prepare.json").read_text())
    assert [d["train"] for d in manifest["directions"]] == [[0, 2000], [2000, 2200]]
    assert manifest["files"]["train"][2:] == [str(tmp_path / "small" / f"train.{lang}.gz") for lang in ("src", "dn")]
    split = ParallelData(RunDirectory(tmp_path / "run"), "train", temperature=5.0)
    rates = sampling_rates([2000, 200], 5.0)  # 0.614, 0.386: the small direction drawn ~4.3x as often as its share
    for seed in (1, 2):
        drawn = np.concatenate(split.batches(max_tokens=1500, seed=seed))
        small = int((drawn >= 2000).sum())
        assert len(drawn) == 2200 and abs(small - rates[1] * 2200) < 1, small
        assert set(drawn[drawn >= 2000].tolist()) == set(range(2000, 2200))  # every small pair, repeated
    # the data section's prefixes are the default of a direction without its own (valid, test here)
    assert manifest["files"]["valid"][2:] == [str(tmp_path / "big" / f"valid.{lang}.gz") for lang in ("src", "dn")]


# --------------------------------------------------------------------------- tags


def test_tags_are_single_pieces_leading_every_source(shift_model):
    import sentencepiece as spm

    data, config_path = shift_model
    run = Path(json.loads(config_path.read_text())["run_dir"])
    manifest = json.loads((run / "prepare.json").read_text())
    assert manifest["tagged"] and [d["name"] for d in manifest["directions"]] == ["src-up", "src-dn"]
    processor = spm.SentencePieceProcessor(model_file=str(run / "spm.model"))
    up, dn = processor.piece_to_id(tag_piece("up")), processor.piece_to_id(tag_piece("dn"))
    assert processor.encode(">>up<< wa wb") == [up, *processor.encode("wa wb")]
    train_split = ParallelData(RunDirectory(run), "train")
    firsts = [int(train_split.src[i][0]) for i in range(len(train_split))]
    assert firsts == [up] * 3000 + [dn] * 3000
    assert all(tag_piece(lang) not in processor.encode(">>up<< wa", out_type=str)[1:] for lang in SHIFT)


def test_the_tag_chooses_the_output_language(shift_model):
    data, config_path = shift_model
    sources = [line for line in gzip.open(data / "test.src.gz", "rt").read().splitlines()][:40]
    outputs = {}
    for language in SHIFT:
        result = tfm_in_process("translate", "--config", config_path, "--tgt-lang", language, "--engine", "torch",
                                input="\n".join(sources) + "\n")
        assert result.exit_code == 0, result.stderr
        outputs[language] = result.stdout.splitlines()
    for language, other in (("up", "dn"), ("dn", "up")):
        right = sum(follows(o, s, language) for o, s in zip(outputs[language], sources))
        wrong = sum(follows(o, s, other) for o, s in zip(outputs[language], sources))
        assert right >= 36 and wrong == 0, (language, right, wrong)
    # a line's own tag wins over --tgt-lang
    mixed = tfm_in_process("translate", "--config", config_path, "--tgt-lang", "up", "--engine", "torch",
                           input=f">>dn<< {sources[0]}\n{sources[0]}\n")
    assert mixed.stdout.splitlines() == [outputs["dn"][0], outputs["up"][0]]


def test_a_missing_or_unknown_tag_is_an_error_listing_the_languages(shift_model):
    data, config_path = shift_model
    missing = tfm_in_process("translate", "--config", config_path, input="wa wb\n")
    assert missing.exit_code == 2 and "translates into several languages (dn, up): give --tgt-lang" in missing.stderr
    unknown = tfm_in_process("translate", "--config", config_path, "--tgt-lang", "xx", input="wa wb\n")
    assert unknown.exit_code == 2 and "knows no tag >>xx<<; it knows dn, up" in unknown.stderr
    line = tfm_in_process("translate", "--config", config_path, "--tgt-lang", "up", input="wa\n>>zz<< wa\n")
    assert line.exit_code == 2 and "input line 2: tag zz" in line.stderr
    for proc in (missing,):
        assert "Traceback" not in proc.stderr


def test_the_exported_model_translates_the_same(shift_model, tmp_path):
    pytest.importorskip("ctranslate2", reason="the ctranslate2 extra is not installed")
    data, config_path = shift_model
    sources = gzip.open(data / "test.src.gz", "rt").read().splitlines()[:20]
    text = "\n".join(f">>{'up' if i % 2 else 'dn'}<< {s}" for i, s in enumerate(sources)) + "\n"
    torch_out = tfm_in_process("translate", "--config", config_path, "--engine", "torch", "--beam", "1", input=text)
    ct2_out = tfm_in_process("translate", "--config", config_path, "--engine", "ctranslate2", "--beam", "1",
                             "--compute-type", "float32", "--set", "decode.precision=auto", input=text)
    assert torch_out.exit_code == ct2_out.exit_code == 0, ct2_out.stderr
    assert torch_out.stdout == ct2_out.stdout
    right = sum(follows(o, s, "up" if i % 2 else "dn")
                for i, (o, s) in enumerate(zip(ct2_out.stdout.splitlines(), sources)))
    assert right >= 18


# --------------------------------------------------------------------------- evaluation


@pytest.mark.slow
def test_evaluate_scores_every_direction_and_gates_one(shift_model):
    data, config_path = shift_model
    table = tfm_in_process("evaluate", "--config", config_path, "--engine", "torch", "--min-bleu", "src-up=80")
    assert table.exit_code == 0, table.stderr
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines() if line[:1].isalpha()}
    assert {"src-up", "src-dn", "average"} <= set(rows)
    bleu = {name: float(rows[name][1]) for name in ("src-up", "src-dn", "average")}
    assert min(bleu.values()) > 80 and abs(bleu["average"] - (bleu["src-up"] + bleu["src-dn"]) / 2) < 0.01
    assert "PASS: src-up BLEU" in table.stderr

    as_json = tfm_in_process("evaluate", "--config", config_path, "--engine", "torch", "--json",
                             "--directions", "src-dn,up-dn", "--min-bleu", "101")
    assert as_json.exit_code == 1 and "FAIL: average BLEU" in as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["directions"]["up-dn"]["zero_shot"] and not report["directions"]["src-dn"]["zero_shot"]
    assert report["averaged_over"] == ["src-dn"]  # zero-shot directions are reported, not averaged in
    # the made-up languages are none the identifier knows: no off-target rate rather than a wrong one
    assert all(r["off_target"] is None for r in report["directions"].values()) and "lid.176" in report["language_id"]

    absent = tfm_in_process("evaluate", "--config", config_path, "--min-bleu", "xx-yy=1")
    assert absent.exit_code == 2 and "direction xx-yy was not scored" in absent.stderr
    untagged = tfm_in_process("evaluate", "--config", config_path, "--directions", "up-src")
    assert untagged.exit_code == 2 and "direction up-src: target src: the model knows no tag >>src<<" in untagged.stderr


def test_language_id_tells_the_multi30k_languages_apart(multi30k_2k):
    languages = ("de", "en", "fr", "cs")
    for lang in languages:
        held_out = gzip.open(multi30k_2k / f"test_2016_flickr.{lang}.gz", "rt").read().splitlines()[:300]
        assert language_id.off_target_rate(held_out, lang) < 0.03, lang
        assert language_id.off_target_rate(held_out, "en" if lang != "en" else "de") > 0.97, lang
    assert language_id.model_language("pt_BR") == "pt" and language_id.model_language("xx") is None


# --------------------------------------------------------------------------- training


@pytest.mark.slow
def test_resuming_a_multilingual_run_is_exact(tmp_path):
    write_shift_task(tmp_path / "data", n_train=600, n_test=20)
    runs = {}
    for name, stop in (("whole", None), ("halves", 20)):
        # inverse_sqrt: the schedule does not depend on max_steps, which the first half lowers
        raw = shift_config(tmp_path / "data", tmp_path / name, max_steps=40, eval_every=20, save_every=10,
                           warmup=10, eval_bleu_sentences=5, lr_schedule="inverse_sqrt")
        raw["data"]["temperature"] = 2.0
        config = config_from_dict(raw)
        prepare(config, progress=False)
        if stop is not None:
            raw["train"]["max_steps"] = stop
            train(config_from_dict(raw), progress_bar=False)
            raw["train"]["max_steps"] = 40
        train(config_from_dict(raw), progress_bar=False, resume=stop is not None)
        runs[name] = tmp_path / name / "checkpoints" / "checkpoint_last.pt"
    assert_same_final_weights(runs["whole"], runs["halves"], 40)


def test_one_direction_fine_tuned_from_a_multilingual_run_keeps_the_tags(shift_model, tmp_path):
    data, config_path = shift_model
    parent = Path(json.loads(config_path.read_text())["run_dir"])
    raw = shift_config(data, tmp_path / "child", max_steps=5, eval_every=5)
    raw["data"] = {"src_lang": "src", "tgt_lang": "up", **{k: raw["data"][k] for k in ("train", "valid", "test")}}
    raw["vocab"]["from_run"] = str(parent)
    raw["train"]["init_from"] = str(parent / "checkpoints" / "checkpoint_best.pt")
    config = config_from_dict(raw)
    prepare(config, progress=False)
    manifest = json.loads((tmp_path / "child" / "prepare.json").read_text())
    assert manifest["tagged"]
    up = json.loads((parent / "prepare.json").read_text())  # same vocabulary, same tag id
    assert up["vocab_size"] == manifest["vocab_size"]
    first = int(ParallelData(RunDirectory(tmp_path / "child"), "train").src[0][0])
    import sentencepiece as spm
    assert spm.SentencePieceProcessor(model_file=str(parent / "spm.model")).id_to_piece(first) == tag_piece("up")
    train(config, progress_bar=False)
    # a multilingual child with a direction the parent vocabulary has no tag for is refused at prepare
    raw["run_dir"] = str(tmp_path / "other")
    raw["data"] = {"directions": ["src-up", "src-dn2"], **{k: raw["data"][k] for k in ("train", "valid", "test")}}
    shutil.copy(data / "train.dn.gz", data / "train.dn2.gz")
    shutil.copy(data / "valid.dn.gz", data / "valid.dn2.gz")
    shutil.copy(data / "test.dn.gz", data / "test.dn2.gz")
    with pytest.raises(TfmError, match=r"src-dn2: the vocabulary .* has no tag >>dn2<<; it has tags for dn, up"):
        prepare(config_from_dict(raw), progress=False)


# --------------------------------------------------------------------------- the rest of tfm on a multilingual run


@pytest.mark.slow
def test_serve_takes_the_target_language_per_request(shift_model):
    pytest.importorskip("fastapi", reason="tfm serve needs the [serve] extra (CI installs it with [test])")
    from tests.test_serve import Server, post

    data, config_path = shift_model
    run = Path(json.loads(config_path.read_text())["run_dir"])
    server = Server(run / "checkpoints" / "checkpoint_best.pt", "--workers", "1", "--engine", "torch")
    try:
        source = "wa wb wc wd"
        answers = {language: post(server.port, {"text": source, "tgt_lang": language}) for language in SHIFT}
        for language, (status, body) in answers.items():
            assert status == 200 and follows(body["translations"][0], source, language), (language, body)
        status, body = post(server.port, {"text": source})
        assert status == 422 and "several languages (dn, up)" in json.dumps(body)
        status, body = post(server.port, {"text": source, "tgt_lang": "xx"})
        assert status == 422 and "knows no tag >>xx<<; it knows dn, up" in json.dumps(body)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/languages", timeout=10) as answer:
            languages = json.loads(answer.read())
        assert languages["source"] == ["src"] and languages["target"] == ["dn", "up"] and languages["multilingual"]
    finally:
        server.stop()


def test_an_ensemble_and_attention_maps_take_tags(shift_model, tmp_path):
    data, config_path = shift_model
    run = Path(json.loads(config_path.read_text())["run_dir"])
    best, last = run / "checkpoints" / "checkpoint_best.pt", run / "checkpoints" / "checkpoint_last.pt"
    source = "wa wb wc wd"
    ensemble = tfm_in_process("translate", "--checkpoint", best, "--checkpoint", last, "--tgt-lang", "dn",
                              "--set", "decode.precision=fp32", input=source + "\n")
    assert ensemble.exit_code == 0 and follows(ensemble.stdout.strip(), source, "dn"), ensemble.stderr
    picture = tmp_path / "attention.png"
    drawn = tfm_in_process("attention", "--checkpoint", best, "--src", f">>up<< {source}", "-o", picture)
    assert drawn.exit_code == 0 and picture.stat().st_size > 0, drawn.stderr


@pytest.mark.slow
def test_evaluate_augment_scores_one_direction_of_a_multilingual_run(shift_model):
    """--augment --directions src-dn: that direction's sources tagged with its target, as written
    and as typed (lower case and no punctuation are the clean split here); without one direction, a line."""
    data, config_path = shift_model
    result = tfm_in_process("evaluate", "--config", config_path, "--engine", "torch", "--json", "--augment",
                            "upper,lower,typos", "--directions", "src-dn")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["direction"] == "src-dn" and report["scores"]["bleu"]["score"] > 80
    rows = report["variants"]
    assert rows["lower"]["share"]["bleu"] == 1.0 and rows["upper"]["in_capitals"] == 1.0
    missing = tfm_in_process("evaluate", "--config", config_path, "--augment", "upper")
    assert missing.exit_code == 2 and "give --directions" in missing.stderr
