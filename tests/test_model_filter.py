"""The model filter (data.filters.model): pairs scored by translation models, misaligned and partly
aligned pairs dropped at thresholds learned without labels.

The scoring model is the reverse task's (conftest: src → the same words reversed, valid BLEU ~99):
the hand-made corpus holds its translations, pairs of one source with another's translation, and
translations run on by another pair's translation."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SYNTHETIC_FILTERS, WORDS, reverse_task_config, tfm_in_process
from transformer_cli.data.model_filter import REASON_MISALIGNED, REASON_PARTLY, PairScores, median_ratio, misalignment
from transformer_cli.data.prepare import _fingerprint, prepare
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.runtime.errors import TfmError

MODEL_REASONS = (REASON_MISALIGNED, REASON_PARTLY)


def test_the_overrun_counts_the_targets_extra_pieces_in_standard_deviations_of_a_count():
    scores = PairScores(np.zeros(4), src_pieces=np.array([4.0, 4.0, 12.0, 10.0]), tgt_pieces=np.array([4.0, 12.0, 4.0, 20.0]))
    assert scores.overrun(1.0) == pytest.approx([0.0, 8 / np.sqrt(17), -8 / np.sqrt(17), 10 / np.sqrt(31)])
    assert scores.overrun(2.0)[3] == 0.0  # a corpus whose targets are twice as long: this one is as expected
    assert median_ratio(scores) == pytest.approx(np.exp(np.median(np.log([5 / 5, 13 / 5, 5 / 13, 21 / 11]))))
    assert median_ratio(PairScores(np.zeros(0), np.zeros(0), np.zeros(0))) == 1.0


def test_a_side_run_on_is_partly_aligned_by_its_own_threshold_and_the_other_side_by_its_own(reverse_model):
    """The target's overrun and the source's each have a threshold: a target far longer than its
    source is partly aligned under the first, a source far longer under the second, and neither
    threshold reads the other side's."""
    from transformer_cli.data.model_filter import ModelFilter
    from transformer_cli.experiment.rundir import checkpoint_at

    config, _ = reverse_model
    found = ModelFilter([(checkpoint_at(config.run_dir), None)], 1000, target_longer_above=1.0, source_longer_above=3.0)
    same, longer = "wa wb wc wd", "wa wb wc wd we wf wa wb wc wd we wf"
    assert found.reasons([same, same, longer], [same, longer, same]) == [None, REASON_PARTLY, None]
    found.source_longer_above = 1.0
    assert found.reasons([longer], [same]) == [REASON_PARTLY]


def test_misalignment_is_minus_the_mean_source_gain_of_the_models_there_are():
    forward, backward = np.array([2.0, 0.0, 1.0]), np.array([4.0, 0.0, -1.0])
    assert misalignment(forward, backward).tolist() == [-3.0, 0.0, 0.0]
    assert misalignment(forward, None).tolist() == [-2.0, 0.0, -1.0]
    assert misalignment(None, backward).tolist() == [-4.0, 0.0, 1.0]


def test_a_threshold_whose_estimated_loss_is_over_twice_its_budget_is_warned_of():
    from transformer_cli.data.model_filter import LearnedThresholds, Threshold

    learned = LearnedThresholds(3000, "torch", Threshold(1.0, 0.1, 0.9, 0.049), Threshold(1.0, 0.1, 0.9, 0.006),
                                Threshold(1.0, 0.1, 0.9, 0.005), sample_dropped=0.295)
    warnings = learned.loose(clean_loss=0.005)
    assert len(warnings) == 2 and warnings[0].startswith("the misalignment threshold may drop good pairs: 4.9% ")
    assert "29.5% of the sample" in warnings[0] and warnings[1].startswith("the target longer threshold")
    assert learned.loose(clean_loss=0.05) == []  # within twice the budget: silent
    small = LearnedThresholds(8000, "torch", Threshold(1.0, 0.1, 0.9, 0.004), Threshold(1.0, 0.1, 0.9, 0.003),
                              Threshold(1.0, 0.1, 0.9, 0.001))
    assert small.loose(clean_loss=0.0025) == []  # over twice a small budget, but under half a percent: silent
    assert LearnedThresholds(1, "torch").loose(clean_loss=0.005) == []  # nothing learned
    assert LearnedThresholds(1, "torch").to_json() == {"sample_pairs": 1, "engine": "torch", "misaligned_above": None,
                                                       "target_longer_above": None, "source_longer_above": None}


def test_a_threshold_learned_without_labels_estimates_the_bad_share_and_keeps_the_good_pairs():
    """A sample of 2,700 good pairs (scores around 0) and 300 bad ones (around 6), and made-up bad
    pairs like the bad ones: the threshold falls between them, the bad share is estimated near 10%."""
    from transformer_cli.data.model_filter import learn_threshold

    rng = np.random.default_rng(0)
    good, bad, made_up = rng.normal(0, 1, 2700), rng.normal(6, 1, 300), rng.normal(6, 1, 3000)
    found = learn_threshold(np.concatenate([good, bad]), made_up, recall=0.95, clean_loss=0.005, max_share=0.5)
    assert 0.08 <= found.noise <= 0.12, found
    assert np.mean(good > found.value) <= 0.01 and np.mean(bad > found.value) >= 0.9 and found.recall >= 0.95, found
    # made-up pairs no sample pair resembles: nothing to drop but what recall asks
    none_bad = learn_threshold(good, made_up, recall=0.95, clean_loss=0.005, max_share=0.5)
    assert none_bad.noise < 0.01 and np.mean(good > none_bad.value) <= 0.01, none_bad
    # a model that cannot tell them apart: never more than max_share of the sample
    alike = learn_threshold(good, rng.normal(0, 1, 1000), recall=0.95, clean_loss=0.005, max_share=0.3)
    assert np.mean(good > alike.value) <= 0.3 + 1e-9, alike


# --------------------------------------------------------------------------- a hand-made noisy corpus

CLEAN, MISALIGNED, PARTLY = 400, 60, 60


def write_noisy_reverse_corpus(folder: Path, seed: int = 7) -> list[str]:
    """train.{src,tgt}.gz of the reverse task (other sentences than the model's, same words) with
    misaligned and partly aligned pairs shuffled in; valid/test clean. Returns the training labels."""
    rng = random.Random(seed)

    def sentence() -> list[str]:
        return [rng.choice(WORDS) for _ in range(rng.randint(4, 8))]

    rows = []
    for _ in range(CLEAN):
        words = sentence()
        rows.append(("clean", words, words[::-1]))
    for _ in range(MISALIGNED):
        rows.append(("misaligned", sentence(), sentence()[::-1]))
    for _ in range(PARTLY):
        words = sentence()
        rows.append(("partly", words, words[::-1] + sentence()[::-1]))
    rng.shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    held_out = [row for row in rows if row[0] == "clean"][:40]
    for split, chosen in (("train", rows), ("valid", held_out), ("test", held_out)):
        for side, lang in ((1, "src"), (2, "tgt")):
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(" ".join(row[side]) + "\n" for row in chosen))
    return [row[0] for row in rows]


@pytest.fixture(scope="module")
def noisy_reverse(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("noisy_reverse")
    return folder, write_noisy_reverse_corpus(folder)


def filter_config(data: Path, run: Path, way: str, model_run: Path | str, **rule) -> dict:
    """The reverse task's config over the noisy corpus, model filter on with `model_run` as the
    forward model (the corpus read src → tgt) or the backward one (read tgt → src)."""
    raw = reverse_task_config(data, run)
    if way == "backward":
        raw["data"]["src_lang"], raw["data"]["tgt_lang"] = "tgt", "src"
    raw["prepare"] = {"workers": rule.pop("workers", 1)}
    raw["data"]["filters"] = {**SYNTHETIC_FILTERS, "model": {"enabled": True, way: str(model_run), **rule}}
    return raw


def drops_by_label(labels: list[str], dropped_file: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {label: {} for label in set(labels)}
    for line in dropped_file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        row = out[labels[record["line"] - 1]]
        row[record["reason"]] = row.get(record["reason"], 0) + 1
    return out


@pytest.mark.parametrize("way", ["forward", "backward"])
def test_the_model_filter_drops_misaligned_and_partly_aligned_pairs_at_thresholds_learned_without_labels(
        reverse_model, noisy_reverse, tmp_path, way):
    """The thresholds come from the corpus's own pairs re-paired and run on; no label is read. The
    backward model reads the corpus the other way round (its pieces measure the length ratio)."""
    config, _ = reverse_model
    data, labels = noisy_reverse
    # every clean pair here has sides of one length: the overrun may drop 95% of the made-up pairs,
    # and the (estimated) 4% of clean pairs a score may drop: 2% each side, the test allows 3%
    raw = filter_config(data, tmp_path / "run", way, config.run_dir, partial_recall=0.95, clean_loss=0.04)
    dropped = tmp_path / "dropped.jsonl"
    result = prepare(config_from_dict(raw), progress=False, dropped=dropped)
    by_label = drops_by_label(labels, dropped)
    model_drops = {label: sum(n for reason, n in row.items() if reason in MODEL_REASONS)
                   for label, row in by_label.items()}
    assert model_drops["misaligned"] >= 0.9 * MISALIGNED, by_label
    assert by_label["partly"].get(REASON_PARTLY, 0) + by_label["partly"].get(REASON_MISALIGNED, 0) >= 0.8 * PARTLY, by_label
    assert by_label["partly"].get(REASON_PARTLY, 0) >= 0.5 * PARTLY, by_label  # the overrun, not chance
    assert sum(by_label["clean"].values()) <= 0.03 * CLEAN, by_label
    # the report names the reasons with examples and says what was learned
    report = json.loads((Path(config_from_dict(raw).run_dir) / "prepare_report.json").read_text())
    examples = report["directions"][0]["examples"]
    assert set(MODEL_REASONS) <= set(examples) and all(examples[r] for r in MODEL_REASONS)
    learned = report["filters"]["model"]["learned"]
    assert learned["sample_pairs"] == CLEAN + MISALIGNED + PARTLY
    assert np.isfinite(learned["misaligned_above"]) and 0 < learned["target_longer_above"] < float("inf")
    assert 0 < learned["source_longer_above"] < float("inf") and learned["median_length_ratio"] == pytest.approx(1.0, abs=0.1)
    assert "dropped: partly_aligned" in result.cleaning.table()


def int8_products_saturate() -> bool:
    """CTranslate2's int8 products on this CPU go through oneDNN's u8·s8 kernels without VNNI, whose
    16-bit partial sums saturate (an AVX2-only CPU, an AVX-512 one before Cascade Lake, or a cap)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in {"SSE41", "AVX", "AVX2", "AVX512_CORE"}:
        return True
    from transformer_cli.runtime.cpu import cpu_flags

    return not cpu_flags() & {"avx512_vnni", "avx_vnni"}


def test_ctranslate2_scores_as_tfms_engine_does(reverse_model, noisy_reverse):
    """CTranslate2's score_batch on the checkpoint's conversion gives tfm's log-probabilities: the
    same at float32, within int8's rounding at int8 (what `engine: auto` scores with on a CPU).
    Without VNNI that rounding is coarser (saturated sums): on the reverse model ~2% of the scores'
    range on average and ~7% at most under ONEDNN_MAX_CPU_ISA=AVX2, ~0.1% / 0.4% with VNNI."""
    from transformer_cli.data.model_filter import CT2Scorer, ModelFilter
    from transformer_cli.experiment.rundir import checkpoint_at

    config, _ = reverse_model
    data, _ = noisy_reverse
    src = gzip.decompress((data / "train.src.gz").read_bytes()).decode().splitlines()[:300]
    tgt = gzip.decompress((data / "train.tgt.gz").read_bytes()).decode().splitlines()[:300]
    checkpoint = checkpoint_at(config.run_dir)
    by_torch = ModelFilter([(checkpoint, checkpoint)], 500)
    assert by_torch.use_engine("torch") == "torch"
    expected = by_torch.scores(src, tgt)
    by_ct2 = ModelFilter([(checkpoint, checkpoint)], 500, threads=1)  # (prepare.workers: the cores it may use)
    assert by_ct2.use_engine("auto").startswith("ctranslate2 ") and by_ct2.engine == "ctranslate2"
    assert by_ct2._loaded[checkpoint].translator.num_translators == 1
    assert by_ct2.conversions[checkpoint].is_dir() and pickle.loads(pickle.dumps(by_ct2)).conversions == by_ct2.conversions
    at_int8 = by_ct2.scores(src, tgt)
    by_ct2._loaded[checkpoint] = CT2Scorer(by_ct2.conversions[checkpoint], "float32")
    at_float32 = by_ct2.scores(src, tgt)
    for scores in (at_int8, at_float32):
        assert scores.src_pieces.tolist() == expected.src_pieces.tolist()
        assert scores.tgt_pieces.tolist() == expected.tgt_pieces.tolist()
    assert at_float32.misalignment == pytest.approx(expected.misalignment, abs=1e-4)
    error, scale = np.abs(at_int8.misalignment - expected.misalignment), np.ptp(expected.misalignment)
    if int8_products_saturate():
        assert error.mean() < 0.03 * scale and error.max() < 0.10 * scale, (error.mean() / scale, error.max() / scale)
    else:
        assert error.max() < 0.05 * scale, error.max() / scale
    assert np.corrcoef(at_int8.misalignment, expected.misalignment)[0, 1] > 0.99


def test_without_ctranslate2_the_filter_scores_with_tfms_engine_unless_told_otherwise(reverse_model, monkeypatch):
    import sys

    from transformer_cli.data.model_filter import ModelFilter
    from transformer_cli.experiment.rundir import checkpoint_at

    config, _ = reverse_model
    checkpoint = checkpoint_at(config.run_dir)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    found = ModelFilter([(checkpoint, None)], 500)
    assert found.use_engine("auto").startswith("torch (CTranslate2 cannot score here: ctranslate2 is not installed")
    assert found.engine == "torch" and not found.conversions
    assert found.reasons(["wa wb"], ["wb wa"]) == [None]
    with pytest.raises(TfmError, match=r"^data\.filters\.model\.engine: ctranslate2: ctranslate2 is not installed"):
        ModelFilter([(checkpoint, None)], 500).use_engine("ctranslate2")


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_encoding_workers_score_as_one_process_does(reverse_model, noisy_reverse, tmp_path, engine, monkeypatch):
    """The filter travels to spawned encoding workers without its models (each loads them once), and
    scores chunk by chunk: what it holds does not grow with the corpus (at 1M pairs:
    `scripts/bench_prepare.py --filters default model`)."""
    from transformer_cli.data.model_filter import ModelFilter

    config, _ = reverse_model
    data, labels = noisy_reverse
    scored: list[int] = []  # the pairs of each call, in this process (one worker)
    reasons = ModelFilter.reasons
    monkeypatch.setattr(ModelFilter, "reasons", lambda self, src, tgt: scored.append(len(src)) or reasons(self, src, tgt))
    outcomes = []
    for workers in (1, 2):
        raw = filter_config(data, tmp_path / f"run{workers}", "forward", config.run_dir, workers=workers, engine=engine)
        raw["prepare"]["chunk_lines"] = 100  # several chunks, so both workers score some
        dropped = tmp_path / f"dropped{workers}.jsonl"
        prepare(config_from_dict(raw), progress=False, dropped=dropped)
        outcomes.append([(r["line"], r["reason"]) for r in map(json.loads, dropped.read_text().splitlines())])
        if workers == 1:
            assert len(scored) >= len(labels) // 100 and max(scored) <= 100, scored
    assert outcomes[0] == outcomes[1] and outcomes[0]


def test_the_filter_pickles_without_its_models(reverse_model, noisy_reverse):
    from transformer_cli.data.model_filter import ModelFilter
    from transformer_cli.experiment.rundir import checkpoint_at

    config, _ = reverse_model
    found = ModelFilter([(checkpoint_at(config.run_dir), None)], 1000, misaligned_above=1.0, target_longer_above=1.0)
    src, tgt = ["wa wb wc wd"], ["wd wc wb wa"]
    before = found.reasons(src, tgt)
    copy = pickle.loads(pickle.dumps(found))
    assert found._loaded and not copy._loaded and len(pickle.dumps(found)) < 2000
    assert copy.reasons(src, tgt) == before == [None]


def test_the_fingerprint_names_the_scoring_models_and_ignores_the_filter_when_off(reverse_model, noisy_reverse,
                                                                                 tmp_path):
    import shutil

    config, _ = reverse_model
    base = reverse_task_config(noisy_reverse[0], tmp_path / "run")
    off = config_from_dict(base)
    off_with_keys = config_from_dict({**base, "data": {**base["data"], "filters": {
        **SYNTHETIC_FILTERS, "model": {"enabled": False, "forward": "elsewhere", "recall": 0.5}}}})
    assert _fingerprint(off, None) == _fingerprint(off_with_keys, None)  # runs prepared before stay prepared
    copy = tmp_path / "model.pt"
    shutil.copy(Path(config.run_dir) / "checkpoints" / "checkpoint_best.pt", copy)
    on = config_from_dict({**base, "data": {**base["data"], "filters": {"model": {"enabled": True, "forward": str(copy)}}}})
    first = _fingerprint(on, None)
    assert first != _fingerprint(off, None)
    copy.write_bytes(copy.read_bytes()[:-1] + bytes([copy.read_bytes()[-1] ^ 1]))  # another model, same path
    assert _fingerprint(on, None) != first


def test_bad_model_filter_settings_are_one_line_errors(reverse_model, noisy_reverse, tmp_path):
    config, _ = reverse_model
    data, _ = noisy_reverse
    # No model named: `tfm prepare` trains them (below); a program calling prepare() itself is told so.
    no_models = filter_config(data, tmp_path / "none", "forward", config.run_dir)
    del no_models["data"]["filters"]["model"]["forward"]
    with pytest.raises(TfmError, match="data.filters.model: names no model, and the models tfm trains itself are "
                                       "not in .*filter_models: `tfm prepare` trains them first"):
        prepare(config_from_dict(no_models), progress=False)
    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("hello\n")
    cases = [
        ("forward", tmp_path / "missing", "data.filters.model.forward: .*missing: no such run directory"),
        ("forward", tmp_path, "data.filters.model.forward: no checkpoint in"),
        ("backward", not_a_checkpoint, "data.filters.model.backward: .*notes.txt: not a checkpoint"),
        # the reverse model translates src → tgt: as the backward model of src → tgt it is the wrong way round
        ("backward", config.run_dir, "data.filters.model.backward: .* translates src-tgt, not tgt-src"),
    ]
    for way, model, says in cases:
        raw = filter_config(data, tmp_path / "run", way, model)
        if way == "backward":  # read src → tgt, so the backward model must translate tgt → src
            raw["data"]["src_lang"], raw["data"]["tgt_lang"] = "src", "tgt"
        config_file = tmp_path / "config.json"
        config_file.write_text(json.dumps(raw))
        result = tfm_in_process("prepare", "--config", config_file)
        assert result.exit_code == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(says, errors[0]) and "Traceback" not in result.stderr, result.stderr


def test_a_prepare_killed_while_scoring_leaves_nothing_and_runs_again_to_the_same_result(reverse_model, tmp_path):
    """kill -9 while the encoding workers score: no manifest, report or --dropped file is left half
    written, and the next `tfm prepare` drops exactly the pairs an uninterrupted one drops."""
    import signal
    import subprocess
    import sys
    import time

    config, _ = reverse_model
    data = tmp_path / "data"
    write_noisy_reverse_corpus(data)
    for lang in ("src", "tgt"):  # five times the pairs (each copy a duplicate: that filter is off here)
        lines = gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8").read()
        with gzip.open(data / f"train.{lang}.gz", "wt", encoding="utf-8") as f:
            f.write(lines * 5)
    results = []
    for name, kill in (("killed", True), ("whole", False)):
        raw = filter_config(data, tmp_path / name, "forward", config.run_dir, partial_recall=0.95, clean_loss=0.04)
        raw["prepare"]["chunk_lines"] = 200
        config_file = tmp_path / f"{name}.json"
        config_file.write_text(json.dumps(raw))
        dropped = tmp_path / f"{name}.dropped.jsonl"
        command = [sys.executable, "-m", "transformer_cli.cli", "prepare", "--config", str(config_file),
                   "--dropped", str(dropped)]
        if kill:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            while "thresholds from" not in (line := proc.stdout.readline()):  # the sample is scored: encoding starts
                assert line, "prepare ended before it learned its thresholds"
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            run = tmp_path / name
            assert not (run / "prepare.json").exists() and not (run / "prepare_report.json").exists() and not dropped.exists(), \
                sorted(p.name for p in run.iterdir())
        finished = subprocess.run(command, capture_output=True, text=True)
        assert finished.returncode == 0, finished.stderr
        results.append([(r["line"], r["reason"]) for r in map(json.loads, dropped.read_text().splitlines())])
    differing = set(results[0]) ^ set(results[1])
    assert not differing and len(results[0]) >= 5 * (MISALIGNED + PARTLY) // 2, (len(results[0]), sorted(differing)[:10])


# --------------------------------------------------------------------------- the filter's own models


def self_trained_config(data: Path, run: Path, max_steps: int) -> dict:
    """The noisy corpus's config with the model filter on and no model named; the filter's own
    models train `max_steps` steps (a time budget would make them weaker on a slower CPU)."""
    raw = reverse_task_config(data, run, max_steps=max_steps, eval_every=max_steps)
    raw["prepare"] = {"workers": 1}
    raw["data"]["filters"] = {**SYNTHETIC_FILTERS, "model": {"enabled": True, "train_updates": max_steps}}
    return raw


@pytest.mark.parametrize("model_filter, run_steps, size, steps, max_time", [
    ({}, 100_000, "d128", 1000, None),  # the default: updates, the shape auto gives the filter's 5 minutes
    ({"train_updates": 300}, 200, "d128", 200, None),  # the run's own max_steps ends first
    ({"train_time": "5m"}, 100_000, "auto", 1000, "5m"),  # a time cap: auto times the machine for it
    ({"train_time": "5m", "train_updates": None}, 100_000, "auto", 100_000, "5m"),  # the time budget alone
])
def test_the_filters_own_models_train_to_a_number_of_updates_and_a_fixed_shape(model_filter, run_steps, size, steps,
                                                                              max_time, tmp_path):
    """A budget of updates and a pinned shape: the same models on a busy machine as on an idle one
    (trained for minutes, they were weaker there, and the thresholds learned with them dropped other
    pairs); auto's d128 at the learning rate auto gives it, unless the config gives train.lr."""
    from transformer_cli.experiment.shapes import SHAPES
    from transformer_cli.training.filter_models import describe_budget, filter_model_config

    raw = {"run_dir": str(tmp_path / "run"), "data": {"src_lang": "de", "tgt_lang": "en", "train": "t", "valid": "v",
                                                       "filters": {"model": {"enabled": True, **model_filter}}},
           "model": {"size": "auto"}, "train": {"max_steps": run_steps, "max_tokens": 3000}}
    config = config_from_dict(raw, "test")
    for fold, backward in ((0, False), (1, True)):
        sub = filter_model_config(config, fold, backward)
        assert (sub.model.size, sub.train.max_steps, sub.train.max_time) == (size, steps, max_time)
        assert (sub.data.src_lang, sub.data.tgt_lang) == (("en", "de") if backward else ("de", "en"))
        assert sub.train.lr_schedule == "budget" and not sub.data.filters.model.enabled
    if size == "d128":
        assert sub.train.lr == SHAPES["d128"].lr_for(3000) != config.train.lr
        assert describe_budget(sub.train) == f"{steps:,} updates"
        pinned = config_from_dict({**raw, "train": {**raw["train"], "lr": 0.002}}, "test")
        assert filter_model_config(pinned, 0, False).train.lr == 0.002
    else:
        assert describe_budget(sub.train) == ("5m" if steps == 100_000 else "1,000 updates (at most 5m)")
    named = config_from_dict({**raw, "model": {"size": "d192"}}, "test")
    assert filter_model_config(named, 0, False).model.size == "d192"  # a shape the run names, it keeps


@pytest.mark.slow
def test_without_models_prepare_trains_its_own_on_each_half_and_scores_each_pair_with_the_others(
        noisy_reverse, tmp_path):
    """`tfm prepare` with the model filter on and no model named: a forward and a backward model
    trained on each half of the corpus (split by a hash of each pair), each pair scored by the
    models that never saw it: a model finds the misaligned pairs it learned from likely. Run again,
    nothing is trained; with a larger budget, the models go on from where they stopped."""
    import torch

    from transformer_cli.data.model_filter import ModelFilter, fold_of, self_trained_runs
    from transformer_cli.experiment.rundir import RunDirectory, checkpoint_at
    from transformer_cli.runtime.files import read_lines

    data, labels = noisy_reverse
    run = tmp_path / "run"
    config_file, dropped = tmp_path / "config.json", tmp_path / "dropped.jsonl"
    config_file.write_text(json.dumps(self_trained_config(data, run, max_steps=120)))
    result = tfm_in_process("prepare", "--config", config_file, "--dropped", dropped)
    assert result.exit_code == 0, result.stderr
    assert "data.filters.model: forward model 1 of 2 (src→tgt" in result.stdout

    pairs = list(zip(read_lines(data / "train.src.gz"), read_lines(data / "train.tgt.gz")))
    runs = self_trained_runs(RunDirectory(run), "src", "tgt")
    halves = [list(zip(read_lines(forward.parent / "train.src.gz"), read_lines(forward.parent / "train.tgt.gz")))
              for forward, _ in runs]
    assert sorted(halves[0] + halves[1]) == sorted(pairs) and all(halves)  # each pair in one half...
    assert all(fold_of(s, t) == k for k, half in enumerate(halves) for s, t in half)  # ...the one its hash says
    by_label = drops_by_label(labels, dropped)
    model_drops = {label: sum(n for reason, n in row.items() if reason in MODEL_REASONS)
                   for label, row in by_label.items()}
    assert model_drops["misaligned"] >= 0.8 * MISALIGNED, by_label
    assert model_drops["partly"] >= 0.3 * PARTLY, by_label
    assert sum(by_label["clean"].values()) <= 0.06 * CLEAN, by_label

    # Why the halves: the misaligned pairs a half's models learned from score lower (more likely)
    # under them than the other half's misaligned pairs, which they never saw.
    misaligned = {pair for pair, label in zip(pairs, labels) if label == "misaligned"}
    for k, (forward, backward) in enumerate(runs):
        alone = ModelFilter([(checkpoint_at(forward), checkpoint_at(backward))], 1000)
        seen, unseen = ([p for p in halves[h] if p in misaligned] for h in (k, 1 - k))
        seen_scores = alone.scores([s for s, _ in seen], [t for _, t in seen]).misalignment
        unseen_scores = alone.scores([s for s, _ in unseen], [t for _, t in unseen]).misalignment
        assert seen_scores.mean() < unseen_scores.mean(), (k, seen_scores.mean(), unseen_scores.mean())

    # Again: up to date, nothing trained. A larger budget: each model goes on from its last step.
    checkpoints = [way / "checkpoints" / "checkpoint_last.pt" for ways in runs for way in ways]
    stamps = [path.stat().st_mtime_ns for path in checkpoints]
    again = tfm_in_process("prepare", "--config", config_file)
    assert again.exit_code == 0 and "up to date" in again.stdout, again.stderr
    assert [path.stat().st_mtime_ns for path in checkpoints] == stamps
    config_file.write_text(json.dumps(self_trained_config(data, run, max_steps=130)))
    longer = tfm_in_process("prepare", "--config", config_file)
    assert longer.exit_code == 0, longer.stderr
    assert (longer.stdout + longer.stderr).count("resuming from") == 4, longer.stdout + longer.stderr
    for path in checkpoints:
        assert torch.load(path, weights_only=False)["progress"]["step"] == 130


@pytest.mark.slow
def test_a_run_prepared_before_trains_the_filters_own_models_when_the_filter_is_turned_on(noisy_reverse, tmp_path):
    """Its sub-runs' spm.model was called "one of the run directory's own files" of the outer run."""
    from transformer_cli.data.model_filter import self_trained_runs
    from transformer_cli.experiment.rundir import RunDirectory

    data, _ = noisy_reverse
    run = tmp_path / "run"
    config_file = tmp_path / "config.json"
    plain = self_trained_config(data, run, max_steps=10)
    plain["data"]["filters"] = SYNTHETIC_FILTERS
    config_file.write_text(json.dumps(plain))
    assert tfm_in_process("prepare", "--config", config_file).exit_code == 0
    config_file.write_text(json.dumps(self_trained_config(data, run, max_steps=10)))
    result = tfm_in_process("prepare", "--config", config_file)
    assert result.exit_code == 0, result.stderr
    assert "data.filters.model: forward model 1 of 2" in result.stdout
    assert all(way.joinpath("spm.model").is_file() for ways in self_trained_runs(RunDirectory(run), "src", "tgt") for way in ways)


def test_the_filters_own_models_need_one_direction_and_pairs_in_both_halves(noisy_reverse, tmp_path):
    data, _ = noisy_reverse
    one_pair = tmp_path / "one"
    one_pair.mkdir()
    for split in ("train", "valid", "test"):
        for lang, line in (("src", "wa wb wc wd"), ("tgt", "wd wc wb wa")):
            with gzip.open(one_pair / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write(line + "\n")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(self_trained_config(one_pair, tmp_path / "run", max_steps=5)))
    result = tfm_in_process("prepare", "--config", config_file)
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"half [12] of the training pairs is empty", errors[0]), result.stderr
