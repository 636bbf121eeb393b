"""Training pairs as people type them (data.augment) and lines answered in their casing (decode.casing):
each modifier's effect on text, its rates, the epochs' draws (deterministic, resumable), the
vocabulary's sample, the ALL-CAPS rule through both engines, and `tfm evaluate --augment`."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from tests.conftest import multi30k_config, prepare_and_train, tfm_in_process
from transformer_cli.data.augment import (
    VARIANTS,
    Draw,
    apply_modifiers,
    as_read,
    cased_like_training,
    draw_modifiers,
    lower,
    parse_variants,
    shouted,
    shouted_as_read,
    split_variant,
    title,
    titled,
    typo,
    upper,
    with_typos,
    without_end_punctuation,
)
from transformer_cli.data.augmented_data import AugmentedData, training_split
from transformer_cli.data.augmented_data import describe as describe_augmentation
from transformer_cli.data.batch_stream import BatchStream
from transformer_cli.experiment.config import AugmentConfig, config_from_dict, load_config
from transformer_cli.runtime.errors import TfmError

LINE = "Ein Mann mit einem orangefarbenen Hut starrt auf etwas."


def test_each_casing_and_the_end_punctuation_exactly():
    assert upper(LINE) == "EIN MANN MIT EINEM ORANGEFARBENEN HUT STARRT AUF ETWAS."
    assert title(LINE) == "Ein Mann Mit Einem Orangefarbenen Hut Starrt Auf Etwas."
    assert title("a man's hat, (big) 3 dogs") == "A Man's Hat, (big) 3 Dogs"
    assert lower(LINE) == "ein mann mit einem orangefarbenen hut starrt auf etwas."
    assert without_end_punctuation(LINE) == LINE[:-1]
    assert without_end_punctuation("Wer ist da ?! ") == "Wer ist da"
    assert without_end_punctuation("kein Punkt") == "kein Punkt"
    assert shouted("EIN MANN, 3 HUNDE.") and shouted("ÄRGER") and not shouted("Ein MANN") and not shouted("A 1")
    assert not shouted("123 !") and shouted("XY")
    assert titled("Ein Mann Mit (Rotem) Hut 3") and titled("A Man's Big Hat") and not titled("Ein Mann mit Hut")
    assert not titled("Zwei Hunde") and not titled("EIN MANN MIT HUT") and not titled("")
    assert shouted_as_read("Weiße Straße") == "weisse strasse" and as_read("Weiße Straße") == "weiße straße"


def _edits(a: str, b: str) -> str:
    """Which single typing error turns a into b ('' if none does)."""
    if len(b) == len(a) - 1 and any(a[:i] + a[i + 1:] == b for i in range(len(a))):
        return "drop"
    if len(b) == len(a) + 1 and any(b[:i + 1] + b[i + 2:] == a and b[i] == b[i + 1] for i in range(len(a))):
        return "repeat"
    diff = [i for i in range(len(a)) if len(a) == len(b) and a[i] != b[i]]
    if len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]:
        return "swap"
    if len(diff) == 1:
        return "neighbour"
    return ""


def test_a_typo_is_one_typing_error_and_every_kind_occurs():
    kinds = Counter()
    for seed in range(400):
        word = random.Random(-seed).choice(["Straße", "orangefarbenen", "Hut", "ab", "Mann"])
        typed = typo(word, random.Random(seed))
        kind = _edits(word, typed)
        assert kind, (word, typed)
        kinds[kind] += 1
    assert set(kinds) == {"drop", "repeat", "swap", "neighbour"}, kinds
    assert typo("a", random.Random(0)) == "a" and typo("3.", random.Random(0)) == "3."


def test_typos_hit_words_at_their_rate_and_a_training_pair_gets_one():
    rng = random.Random(7)
    words = "alpha bravo charlie delta echo foxtrot golf hotel".split()
    changed = sum(a != b for _ in range(3000) for a, b in zip(words, with_typos(" ".join(words), rng, 0.125).split()))
    assert changed / (3000 * len(words)) == pytest.approx(0.125, abs=0.01)
    assert all(with_typos("zwei Hunde", random.Random(s), 1e-9, at_least_one=True) != "zwei Hunde" for s in range(50))
    assert with_typos("a 1 ?", random.Random(0), 1.0, at_least_one=True) == "a 1 ?"  # nothing to mistype


def test_the_draws_come_at_their_rates_with_one_casing_at_most():
    cfg = AugmentConfig(upper=0.02, title=0.05, lower=0.15, typos=0.1, end_punctuation=0.2)
    n = 200_000
    draws = draw_modifiers(cfg, np.random.default_rng(3), n)
    cases = Counter(d.case for _, d in draws)
    for name in ("upper", "title", "lower"):
        assert cases[name] / n == pytest.approx(getattr(cfg, name), abs=0.004), name
    assert sum(d.typos for _, d in draws) / n == pytest.approx(0.1, abs=0.004)
    assert sum(d.end_punctuation for _, d in draws) / n == pytest.approx(0.2, abs=0.004)
    assert all(d for _, d in draws) and len({k for k, _ in draws}) == len(draws)
    assert draw_modifiers(AugmentConfig(), np.random.default_rng(3), 1000) == []


def test_which_side_each_modifier_changes():
    src, tgt = LINE, "A man in an orange hat stares at something."
    # ALL CAPS as the engines read it (decode.casing lowers it), the target as written
    assert apply_modifiers("Die Straße.", tgt, Draw(case="upper"), 0.1, random.Random(0)) == ("die strasse.", tgt)
    assert apply_modifiers(src, tgt, Draw(case="title"), 0.1, random.Random(0)) == (title(src), title(tgt))
    assert apply_modifiers(src, tgt, Draw(case="lower"), 0.1, random.Random(0)) == (lower(src), tgt)
    # the source's final punctuation alone: a target without its own teaches the model to end early
    assert apply_modifiers(src, tgt, Draw(end_punctuation=True), 0.1, random.Random(0)) == (src[:-1], tgt)
    typed, same = apply_modifiers(src, tgt, Draw(typos=True), 0.1, random.Random(0))
    assert same == tgt and typed != src and len(typed.split()) == len(src.split())
    # no punctuation on the source: the target keeps its own
    assert apply_modifiers("kein Punkt", "no stop.", Draw(end_punctuation=True), 0.1, random.Random(0)) == \
        ("kein Punkt", "no stop.")


@pytest.mark.parametrize("spec, says", [("upper,shout", "'shout'"), ("", "unknown variant ''"), (",", "''")])
def test_an_unknown_variant_is_one_line(spec, says):
    with pytest.raises(TfmError, match=says) as err:
        parse_variants(spec)
    assert "\n" not in str(err.value)


def test_test_variants_are_the_same_lines_on_every_call():
    src = [LINE, "Zwei Hunde spielen im Schnee.", "", "Kinder"]
    ref = ["A man in an orange hat.", "Two dogs play in the snow.", "", "Children"]
    assert parse_variants("all") == list(VARIANTS) and parse_variants("mix, upper") == ["upper", "mix"]
    for name in VARIANTS:
        assert split_variant(name, src, ref) == split_variant(name, src, ref)
        assert split_variant(name, src, ref)[0][2] == ""
    assert split_variant("upper", src, ref) == ([upper(s) for s in src], ref)
    assert split_variant("nopunct", src, ref) == ([s.rstrip(".") for s in src], [r.rstrip(".") for r in ref])
    mixed = split_variant("mix", src * 50, ref * 50)[0]
    assert len(set(mixed)) > 4  # lines drawn differently


def test_the_vocabulary_sample_is_cased_as_training_cases_it():
    lines = [f"Die Straße Nummer {i} ist weiß." for i in range(20_000)]
    cfg = AugmentConfig(lower=0.2, title=0.1, upper=0.05)
    kind_of = {lower(lines[0]): "lower", shouted_as_read(lines[0]): "upper", title(lines[0]): "title",
               lines[0]: "same"}
    kinds = Counter(kind_of[c.replace(str(i), "0")] for i, c in enumerate(cased_like_training(lines, cfg, seed=1)))
    assert kinds["lower"] / len(lines) == pytest.approx(0.2, abs=0.01)
    assert kinds["title"] / len(lines) == pytest.approx(0.1, abs=0.01)
    assert kinds["upper"] / len(lines) == pytest.approx(0.05, abs=0.01)
    targets = cased_like_training(lines, AugmentConfig(lower=0.5, upper=0.5), seed=1, source=False)
    assert targets == lines  # lower case and ALL CAPS as read change the source alone


# ------------------------------------------------------------------ the epochs' draws in training


@pytest.fixture(scope="module")
def prepared_multi30k(multi30k_2k, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("augment") / "run"
    raw = multi30k_config(multi30k_2k, run, vocab={"size": 1000},
                          train={"max_steps": 6, "eval_every": 6, "eval_bleu_sentences": 5, "log_every": 2,
                                 "max_tokens": 600, "precision": "fp32"})
    raw["data"]["augment"] = {"lower": 0.3, "title": 0.1, "typos": 0.2, "end_punctuation": 0.3}
    prepare_and_train(raw, train_it=False)
    (run.parent / "config.json").write_text(json.dumps(raw))
    return run.parent / "config.json"


def _augmented(config_path: Path, **rates) -> AugmentedData:
    raw = json.loads(config_path.read_text())
    if rates:
        raw["data"]["augment"] = rates
    config = config_from_dict(raw)
    spm_files = {side: (config.run_path / "spm.model").read_bytes() for side in ("src", "tgt")}
    data = training_split(config.run, config, spm_files)
    assert isinstance(data, AugmentedData)
    return data


def _texts(data: AugmentedData, indices: np.ndarray) -> list[tuple[str, str]]:
    batch = data.collate(indices)
    # pad, unk, bos and eos left out (a piece the 1k vocabulary lacks: unk), spaces as one
    decode = lambda row: " ".join(data.src_sp.decode([int(t) for t in row if t > 3]).split())  # noqa: E731
    return [(decode(s), decode(t)) for s, t in zip(batch.src.tolist(), batch.tgt_out.tolist())]


def test_an_epoch_changes_its_drawn_pairs_exactly_as_the_modifiers_say(prepared_multi30k):
    """lower: 1.0 — (almost) every pair of the epoch is in its store, its source the prepared one
    in lower case and its target as prepared; the epoch still holds every pair once."""
    data = _augmented(prepared_multi30k, lower=1.0)
    batches = data.batches(800, seed=5)
    store = data.stores[-1]
    keys = np.concatenate(batches)
    assert len(keys) == len(data) and len(store.src) > 0.99 * len(data)
    assert sorted(store.pairs + [int(k) for k in keys if k < store.first]) == list(range(len(data)))
    as_prepared = _augmented(prepared_multi30k, end_punctuation=1e-9)  # nothing drawn (but a 1e-9 chance)
    prepared = _texts(as_prepared, np.asarray(store.pairs))
    changed = _texts(data, store.first + np.arange(len(store.src)))
    assert changed == [(lower(src), tgt) for src, tgt in prepared]


def test_the_draws_are_the_seeds_alone_and_a_resumed_stream_takes_the_same_batches(prepared_multi30k):
    raw_cfg = config_from_dict(json.loads(prepared_multi30k.read_text())).train
    a, b = _augmented(prepared_multi30k), _augmented(prepared_multi30k)
    assert [_texts(a, i) for i in a.batches(600, 3)] == [_texts(b, i) for i in b.batches(600, 3)]
    assert [_texts(a, i) for i in a.batches(600, 4)] != [_texts(b, i) for i in b.batches(600, 3)]
    # an unbroken stream over an epoch's end, and one started where it stood (as --resume starts it)
    train_cfg = raw_cfg.model_copy(update={"max_tokens": 600})
    whole = BatchStream(_augmented(prepared_multi30k), train_cfg, 0, 0)
    per_epoch = len(whole.batches)
    taken = [whole.next_update(3) for _ in range(per_epoch // 3 + 2)]
    crossing = next(u for u in taken if u.epoch == 1)  # an update whose batches span both epochs' stores
    unbroken = [_texts(whole.data, i) for i in crossing.indices]
    middle = taken[2]
    resumed = BatchStream(_augmented(prepared_multi30k), train_cfg, middle.epoch, middle.batch_in_epoch)
    after_resume = resumed.next_update(3)
    after_unbroken = taken[3]
    assert [_texts(resumed.data, i) for i in after_resume.indices] == \
        [_texts(whole.data, i) for i in after_unbroken.indices]
    assert all(len(t) == len(i) for t, i in zip(unbroken, crossing.indices))
    assert a.target_tokens(a.batches(600, 3)[0]) == sum(len(t) + 1 for t in
                                                         (a._pairs(a.batches(600, 3)[0])[1]))


def test_draws_once_change_each_pair_the_same_way_every_epoch(prepared_multi30k):
    """draws: once — the epochs change the same pairs into the same text (typos too), in another
    order; draws: epoch changes others each epoch."""
    rates = {"lower": 0.3, "typos": 0.5, "end_punctuation": 0.3}

    def changes(data: AugmentedData, seed: int) -> dict[int, tuple[str, str]]:
        data.batches(600, seed)
        store = data.stores[-1]
        return dict(zip(store.pairs, _texts(data, store.first + np.arange(len(store.src)))))

    once = _augmented(prepared_multi30k, **rates, draws="once")
    first, second = changes(once, 3), changes(once, 4)
    assert len(first) > 0.5 * len(once) and first == second
    fresh = _augmented(prepared_multi30k, **rates)
    assert changes(fresh, 3).keys() != changes(fresh, 4).keys()
    assert "drawn once per pair" in describe_augmentation(once.cfg)


def test_training_with_augmentation_says_so_and_resumes_to_the_same_weights(prepared_multi30k, tmp_path,
                                                                                  capfd):
    import shutil

    from tests.conftest import assert_same_final_weights
    from transformer_cli.training.train import train

    raw = json.loads(prepared_multi30k.read_text())
    runs = {}
    for name in ("straight", "split"):
        shutil.copytree(Path(raw["run_dir"]), tmp_path / name)
        runs[name] = {**raw, "run_dir": str(tmp_path / name),
                      "train": {**raw["train"], "max_steps": 12, "eval_every": 6}}
        (tmp_path / f"{name}.json").write_text(json.dumps(runs[name]))
    train(load_config(tmp_path / "straight.json"), progress_bar=False)
    assert "augmentation, drawn each epoch: title 10%, lower 30%, typos 20%, end_punctuation 30%" in capfd.readouterr().err
    train(load_config(tmp_path / "split.json", ["train.max_steps=5"]), progress_bar=False)
    train(load_config(tmp_path / "split.json"), resume=True, progress_bar=False)
    assert_same_final_weights(tmp_path / "straight/checkpoints/checkpoint_last.pt",
                              tmp_path / "split/checkpoints/checkpoint_last.pt", 12)


def test_the_augmented_vocabulary_spells_lower_case_in_fewer_pieces(prepared_multi30k, multi30k_2k, tmp_path):
    """The run above learned its vocabulary from a sample cased as training cases it; the same run
    without augmentation learns another (the fingerprint holds the casing rates), which spells
    lower-case German in more pieces, and clean text in as many."""
    import gzip

    raw = json.loads(prepared_multi30k.read_text())
    plain = {**raw, "run_dir": str(tmp_path / "plain"), "data": {**raw["data"], "augment": {}}}
    prepare_and_train(plain, train_it=False)
    augmented = spm.SentencePieceProcessor(model_file=str(Path(raw["run_dir"]) / "spm.model"))
    sentence_case = spm.SentencePieceProcessor(model_file=str(tmp_path / "plain/spm.model"))
    with gzip.open(multi30k_2k / "val.de.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:500]
    pieces = lambda sp, case: sum(len(sp.encode(case(line))) for line in lines)  # noqa: E731
    assert pieces(augmented, lower) < 0.97 * pieces(sentence_case, lower)
    assert pieces(augmented, str) < 1.03 * pieces(sentence_case, str)


# ------------------------------------------------------------------ ALL CAPS in, ALL CAPS out


def _caps_cases(reverse_model) -> tuple[list[str], list[str]]:
    from transformer_cli.runtime.files import read_lines

    config, _ = reverse_model
    lines = read_lines(f"{config.data.test}.src.gz")[:12]
    return [line.upper() for line in lines], lines


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_an_all_caps_line_is_answered_in_capitals_by_either_engine(reverse_model, engine):
    from transformer_cli.decoding.engine import open_engine

    config, summary = reverse_model
    shouting, plain = _caps_cases(reverse_model)
    cfg = config.model_copy(deep=True)
    translator = open_engine(cfg, ["decode.precision=fp32"], [summary.best_checkpoint], device="cpu", engine=engine)
    try:
        as_written = [t[0].text for t in translator.translate(plain)]
        answered = [t[0].text for t in translator.translate(shouting)]
        raw = [t[0].text for t in translator.translate(shouting, decode=translator.settings(casing="model"))]
        mixed = [t[0].text for t in translator.translate([shouting[0], plain[1], title(plain[2])])]
    finally:
        translator.close()
    assert answered == [t.upper() for t in as_written] and all(shouted(a) for a in answered)
    assert raw != answered  # the model alone: the letters of ALL CAPS are not in its vocabulary
    assert mixed == [as_written[0].upper(), as_written[1], title(as_written[2])]


def test_the_casing_key_is_checked(reverse_model, tmp_path):
    config, summary = reverse_model
    with pytest.raises(TfmError, match="decode.casing"):
        load_config(None, ["decode.casing=shout"])
    with pytest.raises(TfmError, match="decode.end_punctuation"):
        load_config(None, ["decode.end_punctuation=strip"])
    result = tfm_in_process("translate", "--checkpoint", summary.best_checkpoint, "--set", "decode.casing=upper",
                            input="wa wb\n")
    assert result.exit_code == 2 and result.stderr.count("error:") == 1 and "decode.casing" in result.stderr


def test_each_line_is_read_and_finished_as_it_came():
    from transformer_cli.decoding.terms import LineTerms
    from transformer_cli.decoding.translation import Translation, finished, follow_input

    decode = load_config(None).decode
    lines = ["EIN MANN MIT HUT.", "Ein Mann Mit Hut", "Ein Mann mit Hut", ">>en<< ZWEI HUNDE!", "", "Kinder."]
    read, finish = follow_input(lines, decode, None)
    assert read == ["ein mann mit hut.", "ein mann mit hut", "Ein Mann mit Hut", ">>en<< zwei hunde!", "", "Kinder."]
    assert sorted(finish) == [0, 1, 2, 3]
    texts = ["A man with a hat.", "A man with a hat.", "A man with a hat .", "Two dogs!", "", "Children."]
    done = [finished(Translation(t, 0.0, 1, "0-0 1-1 2-3 3-5"), finish.get(i)) for i, t in enumerate(texts)]
    assert [t.text for t in done] == ["A MAN WITH A HAT.", "A Man With A Hat", "A man with a hat", "TWO DOGS!", "",
                                      "Children."]
    assert done[2].alignment == "0-0 1-1 2-3" and done[1].alignment == "0-0 1-1 2-3 3-5"  # the " ." was word 5
    model = decode.updated(casing="model", end_punctuation="model")
    assert follow_input(lines, model, None) == (lines, {})
    with_terms = [LineTerms(prefix="A") if i == 0 else LineTerms() for i in range(len(lines))]
    assert 0 not in follow_input(lines, decode, with_terms)[1] and follow_input(lines, decode, with_terms)[0][0] == lines[0]


# ------------------------------------------------------------------ tfm evaluate --augment


def test_evaluate_scores_each_variant_beside_the_clean_split(reverse_model, tmp_path):
    config, summary = reverse_model
    path = tmp_path / "reverse.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    result = tfm_in_process("evaluate", "--config", path, "--augment", "all", "--json", "--set", "decode.precision=fp32",
                            "--set", "decode.engine=torch")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["variants"]
    assert list(rows) == list(VARIANTS)
    # The reverse task is written in lower case without punctuation: those variants are the clean split.
    assert rows["lower"]["share"]["bleu"] == 1.0 and rows["nopunct"]["share"]["bleu"] == 1.0
    assert rows["upper"]["in_capitals"] == 1.0 and rows["upper"]["share"]["bleu"] == 1.0  # lower-cased, answered in caps
    assert rows["typos"]["share"]["bleu"] < 1.0 and rows["title"]["caseless"] and not rows["typos"]["caseless"]
    assert "case:lc" in rows["title"]["scores"]["bleu"]["signature"] or "lc" in rows["title"]["scores"]["bleu"]["signature"]
    table = tfm_in_process("evaluate", "--config", path, "--augment", "upper,typos", "--min-bleu", "typos=101",
                           "--set", "decode.precision=fp32", "--set", "decode.engine=torch")
    assert table.exit_code == 1 and "FAIL: typos BLEU" in table.stderr
    assert [line.split()[0] for line in table.stdout.splitlines()[2:5]] == ["clean", "upper", "typos"]


@pytest.mark.parametrize("args, says", [
    (["--augment", "upper,shout"], "unknown variant 'shout'"),
    (["--augment", "upper", "--min-bleu", "title=3"], "title is not a variant"),
    (["--augment", "all", "--directions", "all"], "give one direction"),
    (["--augment", "all", "--directions", "src-tgt,tgt-src"], "give one direction"),
])
def test_evaluate_refuses_a_bad_variant_list_in_one_line(reverse_model, tmp_path, args, says):
    config, _ = reverse_model
    path = tmp_path / "reverse.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    result = tfm_in_process("evaluate", "--config", path, *args)
    assert result.exit_code == 2 and says in result.stderr and result.stderr.count("error:") == 1, result.stderr
    no_config = tfm_in_process("evaluate", "--hyp", path, "--ref", path, "--augment", "upper")
    assert no_config.exit_code == 2 and "--augment goes with --config" in no_config.stderr
