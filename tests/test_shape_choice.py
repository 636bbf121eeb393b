"""model.size: named shapes, and `auto` choosing what to train from the budget and the machine's
measured speed (training/shape_choice.py)."""

import dataclasses
import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import tfm_in_process, tiny_reverse_config
from transformer_cli.experiment.checkpoint import FORMAT
from transformer_cli.experiment.config import config_from_dict, load_config
from transformer_cli.experiment.shapes import (
    CURVE_CORPUS_TOKENS,
    CURVE_DROPOUT,
    FALLBACK,
    LONG_BUDGET_DROPOUT,
    SHAPE_KEYS,
    SHAPES,
    NamedShape,
)
from transformer_cli.model.shape import Shape
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training import shape_choice
from transformer_cli.training.shape_choice import ShapeTiming, choose, predict
from transformer_cli.training.train import train


# --------------------------------------------------------------------------- the config
def test_shape_choice_json_is_read_back_as_the_record_it_was_written_from_and_a_torn_one_is_none_or_one_line(tmp_path):
    """RunDirectory.shape_choice(): the typed record a run wrote (to_json ∘ from_json is the identity, a
    re-plan's first plan and the check kept), an older run's record with keys missing defaulted, none or a
    torn one (or one with a key of the wrong type) None for training and a one-line error naming the file
    for the model card (strict)."""
    from transformer_cli.experiment.rundir import RunDirectory, ShapeChoice

    run = RunDirectory(tmp_path / "run")
    assert run.shape_choice() is None and run.shape_choice(strict=True) is None
    first = ShapeChoice("d256", 1000, 1e-3, 0.1, 12.5, 0.4, 600.0, 100_000, "cpu",
                        [{"name": "d256", "updates": 900, "predicted_bleu": 30.1}])
    replanned = dataclasses.replace(first, chosen="d128", max_tokens=3000, replanned={
        "why": "faster", "after_seconds": 61.0, "first": first.to_json()}, check=None)
    run.write_shape_choice(replanned)
    record = json.loads(run.shape_choice_file.read_text())
    assert "check" not in record and record["budget_seconds"] == 600.0 and record["replanned"]["first"]["chosen"] == "d256"
    assert run.shape_choice() == replanned and ShapeChoice.from_json(record["replanned"]["first"]) == first
    run.write_shape_choice(dataclasses.replace(replanned, check={"after_seconds": 60.2, "replan": ""}))
    assert run.shape_choice().check == {"after_seconds": 60.2, "replan": ""}
    run.shape_choice_file.write_text(json.dumps({"chosen": "d128", "budget_seconds": None, "max_steps": 4000}))
    older = run.shape_choice()
    assert (older.chosen, older.max_steps, older.shapes, older.replanned, older.check) == ("d128", 4000, [], None, None)
    for torn in ('{"chosen": "d1', "[1, 2]", '{"budget_seconds": 60}', '{"chosen": "d128", "shapes": 5}',
                 '{"chosen": "d128", "max_tokens": "many"}'):
        run.shape_choice_file.write_text(torn)
        assert run.shape_choice() is None
        with pytest.raises(TfmError, match="shape_choice.json: torn") as caught:
            run.shape_choice(strict=True)
        assert "\n" not in str(caught.value)




def test_the_named_shapes_the_config_s_keys_and_the_model_take_one_definition_of_a_shape():
    """model/shape.py: the named shapes and the model's constructor arguments are `Shape`s, the config's
    shape keys default to its values, and every other key of the model section is an argument of the model."""
    from transformer_cli.experiment.config import ModelConfig
    from transformer_cli.model.shape import SHAPE_KEYS, Shape
    from transformer_cli.model.transformer import TransformerConfig

    assert SHAPE_KEYS == tuple(field.name for field in dataclasses.fields(Shape))
    assert all(isinstance(shape, Shape) for shape in SHAPES.values()) and issubclass(TransformerConfig, Shape)
    assert {key: getattr(ModelConfig(), key) for key in SHAPE_KEYS} == Shape().keys()
    assert set(ModelConfig.model_fields) - {"size"} == {field.name for field in dataclasses.fields(TransformerConfig)} \
        - {"src_vocab_size", "tgt_vocab_size", "pad_id"}
    with pytest.raises(TypeError):  # the vocabularies are named, never a shape key's place taken by position
        TransformerConfig(30, 30)  # type: ignore[misc]


def test_a_name_fills_the_shape_keys_and_refuses_keys_that_say_otherwise():
    cfg = load_config(None, ["model.size=d192", "model.enc_layers=3"])
    assert cfg.model.size == "d192"
    assert (cfg.model.d_model, cfg.model.enc_layers, cfg.model.dec_layers, cfg.model.d_ff) == (192, 3, 3, 768)
    with pytest.raises(TfmError, match=r"key 'model.size': d192 is d_model 192, .* but enc_layers 6 is given"):
        load_config(None, ["model.size=d192", "model.enc_layers=6"])
    with pytest.raises(TfmError, match="key 'model.size': d128 is"):  # a config with its own shape keys
        load_config("configs/tiny.yaml", ["model.size=d128"])


def test_auto_alone_stays_auto_and_holds_the_fallback_shape_until_train_chooses():
    cfg = load_config(None, ["model.size=auto"])
    assert cfg.model.size == "auto"
    assert {key: getattr(cfg.model, key) for key in SHAPE_KEYS} == SHAPES[FALLBACK].keys()


def test_a_shape_key_beside_auto_pins_the_shape_and_says_so_once(monkeypatch, capsys):
    """`--set model.d_model=…` on the shipped config means that width, as before `auto` (no probe);
    it trained that fixed shape with `size: null` in the run and no word on the console."""
    monkeypatch.delenv("TFM_SAID", raising=False)
    cfg = load_config("configs/de-en.yaml", ["model.d_model=128"])
    assert cfg.model.size is None
    assert cfg.model.d_model == 128 and cfg.model.enc_layers == SHAPES[FALLBACK].enc_layers
    load_config("configs/de-en.yaml", ["model.d_model=128"])  # read again (tfm train after its relaunch)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("model.size auto beside")]
    assert said == ["model.size auto beside model.d_model 128: the shape keys pin the shape (d_model 128, n_heads 4, "
                    "enc_layers 3, dec_layers 3, d_ff 1024; the keys not given are d256's), so nothing is timed or "
                    "chosen; drop them to let auto choose"]
    load_config("configs/de-en.yaml")
    assert "model.size auto beside" not in capsys.readouterr().err  # auto alone: nothing to say


@pytest.mark.parametrize("model", [{"size": "auto"}, {"size": "student"}, {"size": "student", "dec_layers": 1},
                                   {"size": "d128"}, {"d_model": 96, "n_heads": 2}])
def test_a_runs_config_yaml_written_before_training_means_the_same_read_back(model, monkeypatch, capsys):
    """`tfm prepare` writes config.yaml before `tfm train` chooses: `auto` beside the fallback's keys
    read back as a pinned d256, and a student's default keys as given ones over its teacher's shape."""
    from transformer_cli.experiment.config import config_to_yaml

    monkeypatch.delenv("TFM_SAID", raising=False)
    config = config_from_dict({"run_dir": "r", "data": {"src_lang": "de", "tgt_lang": "en", "train": "t", "valid": "v"},
                               "model": model})
    again = config_from_dict(yaml.safe_load(config_to_yaml(config)))
    assert again.model == config.model
    if config.model.size in ("auto", "student"):  # the keys it was given (auto: the fallback's filled in again)
        assert again.model.model_fields_set & set(SHAPE_KEYS) == config.model.model_fields_set & set(SHAPE_KEYS)
    assert "model.size auto beside" not in capsys.readouterr().err


def test_a_trained_runs_config_reads_back_as_the_same_shape(tmp_path):
    chosen = load_config(None, ["model.size=d128"])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(chosen.model_dump(mode="json"))))
    assert again.model == chosen.model


@pytest.mark.parametrize("value, message", [
    ("d19", r"unknown size 'd19' \(did you mean 'd192'\?\)"), ("AUTO", "unknown size 'AUTO'"),
    ("''", "unknown size ''"), ("5", "valid string"), ("true", "boolean"), ("[auto]", "valid string")])
def test_bad_sizes_are_one_line_errors_naming_the_key(value, message):
    with pytest.raises(TfmError, match=message) as caught:
        load_config(None, [f"model.size={value}"])
    assert "model.size" in str(caught.value) and "\n" not in str(caught.value)


# --------------------------------------------------------------------------- prediction and choice


def timings(seconds: dict[str, float], tokens: float = 2800.0) -> list[ShapeTiming]:
    return [ShapeTiming(name, seconds[name], tokens, "fp32") for name in SHAPES]


def test_the_prediction_follows_each_measured_curve():
    shape = NamedShape(name="x", d_model=64, n_heads=2, enc_layers=1, dec_layers=1, d_ff=128, curve=((1.0, 10.0), (4.0, 30.0)))
    assert shape.predicted_bleu(0.5) == pytest.approx(5.0)  # proportional below the first point
    assert shape.predicted_bleu(2.0) == pytest.approx(20.0)  # linear in log(tokens): halfway
    assert shape.predicted_bleu(100.0) == 30.0  # never above what was measured


def test_a_batch_reads_the_curve_of_the_largest_measured_batch_it_reaches():
    shape = NamedShape(name="x", d_model=64, n_heads=2, enc_layers=1, dec_layers=1, d_ff=128, curve=((1.0, 10.0), (4.0, 30.0)),
                       larger_batches=((3000, ((1.0, 20.0), (4.0, 40.0))), (6000, ((1.0, 25.0), (4.0, 45.0)))))
    assert shape.predicted_bleu(4.0) == shape.predicted_bleu(4.0, 2999) == 30.0  # below 3,000: the base curve
    assert shape.predicted_bleu(4.0, 3000) == shape.predicted_bleu(4.0, 5999) == 40.0
    assert shape.predicted_bleu(4.0, 6000) == shape.predicted_bleu(4.0, 10**6) == 45.0
    assert shape.predicted_bleu(2.0, 3000) == pytest.approx(30.0)  # each curve read as the base one is


def test_the_budget_becomes_updates_per_shape():
    slow = timings({name: 2.0 for name in SHAPES})
    for p in predict(slow, seconds_left=600.0, updates_left=100_000, max_tokens=3000):
        assert p.updates == 300 and p.max_tokens == 3000
        assert p.bleu == SHAPES[p.timing.name].predicted_bleu(300, 3000)
    for p in predict(slow, seconds_left=600.0, updates_left=50, max_tokens=3000):  # max_steps ends first
        assert p.updates == 50
    for p in predict(slow, seconds_left=None, updates_left=1_000, max_tokens=3000):  # no max_time: the steps alone
        assert p.updates == 1_000
    for p in predict(slow, seconds_left=600.0, updates_left=100_000, max_tokens=3000, min_updates=600):
        assert p.max_tokens == 1000 and p.updates == 900  # a third of the batch, a third of the time an update


def test_a_run_re_planning_credits_the_shape_it_trains_with_its_updates():
    slow = timings({name: 2.0 for name in SHAPES})
    so_far = shape_choice.TrainedSoFar("d128", 3000, 200)
    fresh = {p.timing.name: p for p in predict(slow, 600.0, 100_000, 3000)}
    going_on = {p.timing.name: p for p in predict(slow, 600.0, 100_000, 3000, so_far=so_far)}
    assert going_on["d128"].updates == fresh["d128"].updates + 200 and going_on["d128"].bleu > fresh["d128"].bleu
    assert going_on["d256"] == fresh["d256"]  # a shape started afresh has made nothing
    smaller = {p.timing.name: p for p in predict(slow, 600.0, 100_000, 3000, 600, so_far)}
    assert smaller["d128"].max_tokens == 1000 and smaller["d128"].updates == 900 + 600  # in tokens: 3x the updates


def test_the_choice_is_the_highest_prediction_and_is_deterministic():
    measured = timings({"d128": 0.6, "d192": 0.95, "d256": 1.4})
    for seconds in (60.0, 600.0, 1800.0, 10_000.0, 1e7):
        predictions = predict(measured, seconds, 10**9, 3000)
        chosen = choose(predictions)
        best = max(p.bleu for p in predictions)
        assert chosen.bleu >= best - shape_choice.TIE_BLEU
        assert choose(list(reversed(predictions))).timing.name == chosen.timing.name  # order does not matter
        assert choose(predict(measured, seconds, 10**9, 3000)).timing.name == chosen.timing.name


def test_a_slower_machine_never_chooses_a_larger_shape_for_the_same_budget():
    """Measured speeds, not CPU names, decide: the same relative speeds, 4x slower, buy 4x fewer
    tokens, and where that changes the choice it moves to a faster shape."""
    fast = timings({"d128": 0.15, "d192": 0.24, "d256": 0.35})
    slow = timings({name: 4 * t.seconds_per_update for name, t in zip(SHAPES, fast)})
    for seconds in (300.0, 600.0, 1800.0):
        on_fast = choose(predict(fast, seconds, 10**9, 3000)).timing
        on_slow = choose(predict(slow, seconds, 10**9, 3000)).timing
        assert on_slow.seconds_per_update / 4 <= on_fast.seconds_per_update


def test_a_budget_of_few_updates_takes_the_floor_batch():
    timing = ShapeTiming("d256", 1.6, 2700.0, "fp32")  # 375 updates in 600 s at max_tokens 3000
    batch = shape_choice.batch_for_budget
    assert batch(3000, None, timing, 600.0) == 3000  # min_updates unset: as given
    assert batch(3000, 1500, timing, None) == 3000  # no time limit: the steps are the budget
    assert batch(3000, 375, timing, 600.0) == 3000  # enough updates already
    assert batch(3000, 376, timing, 600.0) == shape_choice.BATCH_FLOOR
    assert batch(800, 100_000, timing, 600.0) == 800  # never raised


def test_evaluations_spend_the_budget_the_updates_are_predicted_from():
    """A 10-minute run at 1,000-token batches evaluates every 250 updates for ~6 s (a Zen 3's
    quickstart): 8 evaluations, ~8% of the budget, which the prediction once left out (+17%)."""
    plain = ShapeTiming("d128", 0.25, 1000.0, "fp32")
    evaluated = dataclasses.replace(plain, seconds_per_evaluation=6.0)
    assert predict([plain], 600.0, 10**9, 1000, eval_every=250)[0].updates == 2400
    assert predict([evaluated], 600.0, 10**9, 1000, eval_every=250)[0].updates == int(600 / (0.25 + 6.0 / 250))
    assert predict([evaluated], 600.0, 10**9, 1000)[0].updates == 2400  # no evaluations: none counted
    # ... and the floor batch is taken where the evaluations push the updates under train.min_updates
    at_max = ShapeTiming("d128", 0.39, 3000.0, "fp32", seconds_per_evaluation=6.0)  # 1,538 updates alone
    assert shape_choice.batch_for_budget(3000, 1500, at_max, 600.0) == 3000
    assert shape_choice.batch_for_budget(3000, 1500, at_max, 600.0, eval_every=250) == shape_choice.BATCH_FLOOR


def test_dropout_rises_only_for_a_budget_past_where_the_shape_overfit_in_passes_over_the_corpus():
    shape = NamedShape(name="x", d_model=64, n_heads=2, enc_layers=1, dec_layers=1, d_ff=128, curve=((1.0, 10.0),), overfits_after=14.0)
    assert shape.dropout_for(14.0) == CURVE_DROPOUT and shape.dropout_for(14.01) == LONG_BUDGET_DROPOUT
    assert NamedShape(name="y", d_model=64, n_heads=2, enc_layers=1, dec_layers=1, d_ff=128, curve=((1.0, 10.0),)).dropout_for(1e12) == CURVE_DROPOUT  # never seen
    d256 = SHAPES["d256"]
    auto = load_config(None, ["model.size=auto"])
    timing = ShapeTiming("d256", 1.0, 2800.0, "fp32")
    few, many = (shape_choice.Prediction(timing, 3000, updates, 30.0) for updates in (1373, 4917))
    multi30k = CURVE_CORPUS_TOKENS
    assert shape_choice.dropout_of_choice(auto, d256, few, multi30k) == CURVE_DROPOUT  # a Zen 3's 30 minutes
    assert shape_choice.dropout_of_choice(auto, d256, many, multi30k) == LONG_BUDGET_DROPOUT  # a Zen 5's
    # The same updates on a corpus ten times larger are a tenth of the passes; a third of it, three times as many.
    assert shape_choice.dropout_of_choice(auto, d256, many, 10 * multi30k) == CURVE_DROPOUT
    assert shape_choice.dropout_of_choice(auto, d256, few, multi30k // 3) == LONG_BUDGET_DROPOUT
    # d128's point (measured on a third of Multi30k): a quickstart's 10 minutes on the whole corpus keep the
    # curves' dropout, the same minutes on the third (2,211 updates predicted there) take the higher one
    d128 = SHAPES["d128"]
    quickstart, third = (shape_choice.Prediction(ShapeTiming("d128", 0.3, 2800.0, "bf16"), 3000, updates, 38.0)
                         for updates in (2047, 2211))
    assert shape_choice.dropout_of_choice(auto, d128, quickstart, multi30k) == CURVE_DROPOUT
    assert shape_choice.dropout_of_choice(auto, d128, third, 134_128) == LONG_BUDGET_DROPOUT
    assert shape_choice.dropout_of_choice(load_config(None, ["model.size=auto", "model.dropout=0.2"]), d256,
                                          many, multi30k) is None  # given: the config's
    assert shape_choice.with_shape(auto, d256, dropout=0.3).model.dropout == 0.3
    assert shape_choice.with_shape(auto, d256).model.dropout == auto.model.dropout


def test_ties_go_to_the_fastest_shape():
    measured = timings({name: 0.001 for name in SHAPES})  # every curve past its end: its last value
    predictions = predict(measured, 1e6, 10**9, 3000)
    tied = [p for p in predictions if p.bleu >= max(q.bleu for q in predictions) - shape_choice.TIE_BLEU]
    assert choose(predictions).timing.name == min(tied, key=lambda p: (p.timing.seconds_per_update,
                                                                      p.timing.name)).timing.name


# --------------------------------------------------------------------------- a probe a moment's load cannot fool

# seconds an update of each shape takes on an idle machine, per target token x 1,000 (d128 fastest)
IDLE = {"d128": 0.10, "d192": 0.16, "d256": 0.24}


TOKENS = [3000.0, 2900.0, 3100.0, 2700.0, 3050.0, 2950.0, 2800.0, 3000.0, 3100.0, 2900.0]  # the probe's updates


class FakeMachine:
    """A clock and a trainer: each update of shape `name` takes its idle seconds a token, times
    `slowdown` for the calls numbered in `busy` (for one shape only, or all)."""

    def __init__(self, busy: range = range(0), slowdown: float = 10.0, only: str | None = None):
        self.now, self.calls, self.busy, self.slowdown, self.only = 0.0, 0, busy, slowdown, only

    def clock(self) -> float:
        return self.now

    def train_one(self, name: str, k: int) -> float:
        seconds = IDLE[name] * TOKENS[k] / 1000
        if self.calls in self.busy and self.only in (None, name):
            seconds *= self.slowdown
        self.now, self.calls = self.now + seconds, self.calls + 1
        return seconds


def fake_probe(machine: FakeMachine, lines: list[str] | None = None) -> list[ShapeTiming]:
    names = sorted(IDLE, key=lambda name: IDLE[name])
    return shape_choice.probe_timings(names, TOKENS, machine.train_one, lambda name: "bf16", 300.0, machine.clock,
                                      (lines if lines is not None else []).append)


# The calls: each shape's warm-up and first round (0–5, d128's 0 and 1), then four rounds of three (6–17)
@pytest.mark.parametrize("busy, only", [(range(0, 6), None), (range(6, 12), None), (range(0, 2), "d128"),
                                        (range(12, 18), "d256"), (range(3, 9), None)])
def test_a_transient_slowdown_leaves_the_probes_choice_as_it_was(busy, only):
    """Ten times slower for a moment (every shape, or one): it falls on a round or two of each shape,
    which the median of its five leaves out; the figures, and the shape chosen for each budget, are
    those of the idle machine."""
    idle = fake_probe(FakeMachine())
    disturbed = fake_probe(FakeMachine(busy, only=only))
    for calm, moved in zip(idle, disturbed):
        assert moved.name == calm.name
        assert moved.tokens_per_second == pytest.approx(calm.tokens_per_second, rel=0.05)
    for seconds in (300.0, 600.0, 1800.0):
        assert choose(predict(disturbed, seconds, 10**9, 3000)).timing.name == \
            choose(predict(idle, seconds, 10**9, 3000)).timing.name


def test_timed_one_after_another_the_same_slowdown_would_have_moved_the_figures():
    """The control: timed shape after shape (as the probe once did), a moment of four updates falls on
    d128 alone, which reads ten times slower than it is and slower than d192; interleaved, it does not."""
    machine, sequential = FakeMachine(range(0, 4)), {}
    for name in sorted(IDLE, key=IDLE.get):
        machine.train_one(name, 0)
        sequential[name] = statistics.median(machine.train_one(name, k) / TOKENS[k] for k in (1, 2, 3))
    assert sequential["d128"] > sequential["d192"]
    interleaved = {t.name: t for t in fake_probe(FakeMachine(range(0, 4)))}
    assert interleaved["d128"].tokens_per_second > interleaved["d192"].tokens_per_second
    assert interleaved["d128"].tokens_per_second == pytest.approx(1000 / IDLE["d128"], rel=0.05)


def test_figures_that_cannot_be_true_are_timed_again():
    """d128 alone slowed for the whole probe (a load on its core, say): measured slower than d256,
    which cannot be; it and the shape it contradicts get three more rounds, and the figures come
    out true."""
    lines: list[str] = []
    timings = {t.name: t for t in fake_probe(FakeMachine(range(0, 18), slowdown=4.0, only="d128"), lines)}
    assert any(line.startswith("model.size auto: d128 and") and "timed again" in line for line in lines), lines
    assert timings["d128"].tokens_per_second > timings["d192"].tokens_per_second > timings["d256"].tokens_per_second
    assert timings["d128"].tokens_per_second == pytest.approx(1000 / IDLE["d128"], rel=0.05)
    assert shape_choice.implausible([ShapeTiming("d128", 1.0, 1000, "bf16"), ShapeTiming("d256", 0.5, 1000, "bf16")]) \
        == ["d128", "d256"]
    assert shape_choice.implausible([ShapeTiming("d128", 1.0, 1000, "fp32"), ShapeTiming("d256", 0.5, 1000, "bf16")]) \
        == []  # another precision may well be faster


def test_under_load_the_probe_keeps_to_its_share_within_one_update():
    """A busy machine's rounds take long: the limit is looked at before each update, not each round
    (a busy probe took 39 s of a 30-s share)."""
    machine = FakeMachine(range(0, 100), slowdown=10.0)
    names = sorted(IDLE, key=IDLE.get)
    timed = shape_choice.interleaved_seconds(names, len(TOKENS), machine.train_one, 40.0, machine.clock, print)
    assert 40.0 < machine.now <= 40.0 + 10 * max(IDLE.values()) * max(TOKENS) / 1000  # (the warm-ups took 29.5 s)
    assert sorted(timed) == names and all(timed.values())  # every shape timed at least once


def test_the_plan_check_replans_on_a_real_slowdown_and_not_on_noise():
    check = shape_choice.PlanCheck("d128", 10_000.0, probe_busy=0.0, after_seconds=60.0, deadline_seconds=180.0)
    for speed in (8_500.0, 9_300.0, 10_000.0, 11_000.0, 12_400.0):  # noise, and the loop's own cost
        assert check.gap(speed) == ""
    assert "0.50x" in check.gap(5_000.0)  # half the speed: the plan was made for another machine
    assert "1.60x" in check.gap(16_000.0)


def test_the_plan_check_reads_the_speed_after_its_seconds_and_after_a_busy_probe_a_quiet_window(monkeypatch):
    """Fed updates of a fake clock: a quiet probe's check decides at 60 s of training, over them; a
    busy probe's waits for a quiet window (20 s), and a machine busy until the deadline is taken as it is."""
    clock = {"now": 0.0, "busy_until": 0.0}
    monkeypatch.setattr(shape_choice, "cpu_reading", lambda: clock["now"])

    def others_share(start, end, threads):  # 90% of the CPUs taken until busy_until
        return 0.9 * max(0.0, min(end, clock["busy_until"]) - start) / (end - start)

    monkeypatch.setattr(shape_choice, "others_share", others_share)

    def feed(check, speed, until, busy_until=0.0, start=12.0):
        seconds, tokens, clock["busy_until"] = start, 0, busy_until
        while seconds < until:
            clock["now"] = seconds
            verdict = check.observe(seconds, tokens)
            if verdict is not None:
                return seconds, verdict
            seconds, tokens = seconds + 0.5, tokens + int(speed(seconds) * 0.5)
        return seconds, None

    quiet = shape_choice.PlanCheck("d128", 10_000.0, 0.0, after_seconds=60.0, deadline_seconds=180.0)
    at, verdict = feed(quiet, lambda t: 10_400.0, 600)
    assert at == pytest.approx(72.0) and verdict.gap == "" and verdict.tokens_per_second == pytest.approx(10_400, rel=0.01)
    slowed = shape_choice.PlanCheck("d128", 10_000.0, 0.0, after_seconds=60.0, deadline_seconds=180.0)
    assert "0.40x" in feed(slowed, lambda t: 4_000.0, 600)[1].gap  # another program since the probe
    # Timed under load at half the speed; the load ends 50 s in: the first quiet 20 s after it decide,
    # without waiting for the minute a quiet probe's check waits.
    busy_probe = shape_choice.PlanCheck("d128", 5_000.0, 0.8, after_seconds=60.0, deadline_seconds=180.0)
    at, verdict = feed(busy_probe, lambda t: 5_000.0 if t < 50 else 10_000.0, 600, busy_until=50.0)
    assert 70 <= at <= 75 and "2.00x" in verdict.gap and "busy machine" in verdict.gap
    stays_busy = shape_choice.PlanCheck("d128", 5_000.0, 0.8, after_seconds=60.0, deadline_seconds=180.0)
    at, verdict = feed(stays_busy, lambda t: 5_100.0, 600, busy_until=600.0)
    assert 180 <= at <= 201 and verdict.gap == ""  # as busy as when timed: what it trains at


# --------------------------------------------------------------------------- a real probe, and resume


def auto_config(tiny_prepared, tmp_path, **train):
    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "run")
    raw = tiny_reverse_config(data, tmp_path / "run", **train)
    for key in SHAPE_KEYS:
        raw["model"].pop(key, None)
    raw["model"]["size"] = "auto"
    return raw


@pytest.mark.slow
def test_auto_times_every_shape_trains_the_chosen_one_and_resume_keeps_it(tiny_prepared, tmp_path, monkeypatch,
                                                                         capsys):
    # 10 minutes that must make a million updates: the batch shrinks to the floor (from 1,500 tokens).
    raw = auto_config(tiny_prepared, tmp_path, max_steps=4, eval_every=4, eval_bleu_sentences=2, max_time=600,
                      min_updates=10**6)
    raw["train"].pop("lr", None)  # the chosen shape's own
    raw["model"].pop("dropout", None)  # ... and dropout: every shape "overfit" from the start, so 0.3
    for name, shape in list(SHAPES.items()):
        monkeypatch.setitem(SHAPES, name, dataclasses.replace(shape, overfits_after=0))
    summary = train(config_from_dict(raw), progress_bar=False)
    assert summary.steps == 4
    run = tmp_path / "run"
    record = json.loads((run / "shape_choice.json").read_text())
    assert sorted(s["name"] for s in record["shapes"]) == sorted(SHAPES)
    assert all(s["seconds_per_update"] > 0 and s["tokens_per_update"] > 0 for s in record["shapes"])
    assert all(s["seconds_per_evaluation"] > 0 for s in record["shapes"])  # a budget: evaluations spend it
    chosen = SHAPES[record["chosen"]]
    written = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert written["size"] == chosen.name and {k: written[k] for k in SHAPE_KEYS} == chosen.keys()
    assert record["max_tokens"] == shape_choice.BATCH_FLOOR
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["max_tokens"] == shape_choice.BATCH_FLOOR
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == chosen.lr == record["lr"]
    assert written["dropout"] == record["dropout"] == LONG_BUDGET_DROPOUT
    from transformer_cli.experiment.checkpoint import load_checkpoint
    trained = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")["model_config"]
    assert {k: trained[k] for k in SHAPE_KEYS} == chosen.keys()
    out = capsys.readouterr().err
    assert f"model.size auto: training {chosen.name}" in out and "← chosen" in out

    # Resumed with a larger budget under the same `auto` config: the checkpoint's shape, never a new probe.
    def no_probe(*args, **kwargs):
        raise AssertionError("a resumed run probed again")

    monkeypatch.setattr(shape_choice, "choose_shape", no_probe)
    raw["train"]["max_steps"] = 6
    summary = train(config_from_dict(raw), resume=True, progress_bar=False)
    assert summary.steps == 6
    assert f"resuming the shape this run chose, {chosen.name}" in capsys.readouterr().err
    resumed = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert {k: resumed["model_config"][k] for k in SHAPE_KEYS} == chosen.keys()
    assert resumed["config"]["train"]["max_tokens"] == shape_choice.BATCH_FLOOR  # the run's batches, not 1,500
    assert resumed["config"]["train"]["lr"] == chosen.lr  # and its learning rate
    assert resumed["config"]["model"]["dropout"] == LONG_BUDGET_DROPOUT  # and its dropout, not the default


@pytest.mark.slow
@pytest.mark.parametrize("second", ["d128", "d192"])
def test_a_plan_check_that_fails_times_the_shapes_again_and_goes_on_or_starts_afresh(
        tiny_prepared, tmp_path, monkeypatch, capsys, second):
    """The check after the first update (its band squeezed to nothing, so any speed is news): the
    shapes are timed again for the budget left; the same choice goes on from the run's checkpoint,
    another starts the run afresh as that shape. Either way the run makes its steps, once."""
    raw = auto_config(tiny_prepared, tmp_path, max_steps=6, eval_every=3, eval_bleu_sentences=2, max_time=600)
    monkeypatch.setattr(shape_choice, "CHECK_AFTER", 0.0)
    monkeypatch.setattr(shape_choice, "PLAN_HOLDS", 1.0)
    monkeypatch.setattr(shape_choice, "CHECK_DEADLINE", 0.0)  # a busy test machine: no waiting for a quiet window
    choices = iter(["d128", second])

    def choose_in_turn(predictions):
        name = next(choices)
        return next(p for p in predictions if p.timing.name == name)

    monkeypatch.setattr(shape_choice, "choose", choose_in_turn)
    summary = train(config_from_dict(raw), progress_bar=False)
    assert summary.steps == 6 and not summary.plan_gap
    run = tmp_path / "run"
    out = capsys.readouterr().err
    assert "plan check over" in out and "so the shapes are timed again" in out
    record = json.loads((run / "shape_choice.json").read_text())
    assert record["chosen"] == second and record["replanned"]["first"]["chosen"] == "d128"
    assert record["replanned"]["first"]["check"]["replan"] and "why" in record["replanned"]
    from transformer_cli.experiment.checkpoint import load_checkpoint
    trained = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert {k: trained["model_config"][k] for k in SHAPE_KEYS} == SHAPES[second].keys()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "valid"]
    assert steps == [3, 6]  # the dropped start leaves no record behind
    if second == "d128":
        assert "d128 goes on from step" in out and "resuming from" in out
    else:
        assert "the run starts afresh as d192" in out
    assert trained["progress"]["elapsed"] >= record["replanned"]["after_seconds"]  # the first minute counts


@pytest.mark.parametrize("size", ["d128", "d256"])
def test_a_named_shape_trains_at_its_measured_learning_rate_unless_train_lr_is_given(size, tmp_path):
    def resolved(*overrides: str, resume: bool = False, checkpoint: Path = tmp_path / "none.pt"):
        config = load_config(None, [f"model.size={size}", *overrides])
        return shape_choice.resolve_size(config, resume, checkpoint, print)

    shape = SHAPES[size]
    for batch in (1000, 3000):
        assert resolved(f"train.max_tokens={batch}").train.lr == shape.lr_for(batch)
    assert resolved("train.max_tokens=1000").train.lr == shape.lr  # the smallest batch's
    assert resolved("train.lr=0.0002").train.lr == 0.0002
    assert resolved("model.size=null", "model.d_model=64").train.lr == load_config(None).train.lr  # no name: as given
    # A resumed run goes on at the rate it started with, even where the shape's measured rate has changed since.
    checkpoint = tmp_path / "checkpoint_last.pt"
    torch.save({"format": FORMAT, "config": {"train": {"lr": 0.00123}}}, checkpoint)
    assert resolved("train.max_tokens=3000", resume=True, checkpoint=checkpoint).train.lr == 0.00123
    assert resolved("train.lr=0.0002", resume=True, checkpoint=checkpoint).train.lr == 0.0002


def test_a_batch_takes_the_learning_rate_of_the_largest_batch_measured_that_it_reaches():
    shape = dataclasses.replace(SHAPES["d128"], lr=3e-3, larger_batch_lr=((3000, 5e-3), (6000, 7e-3)))
    assert [shape.lr_for(b) for b in (None, 1000, 2999, 3000, 5999, 6000, 25000)] == [
        3e-3, 3e-3, 3e-3, 5e-3, 5e-3, 7e-3, 7e-3]
    assert SHAPES["d256"].lr_for(3000) == SHAPES["d256"].lr  # no larger batch measured: one rate


@pytest.mark.slow
def test_the_probe_leaves_out_what_it_cannot_time_within_its_share_of_the_budget(tiny_prepared, tmp_path,
                                                                                 monkeypatch, capsys):
    """A probe's share of 0.1% of 60 s: after the first shape its 0.06 s are spent; the rest are said
    to be left out, and the budget the probe used counts against max_time. (At the real 5% of a 1 s
    budget the one shape timed took 1.7 s on a loaded machine and left no time to train.)"""
    monkeypatch.setattr(shape_choice, "PROBE_SHARE", 0.001)
    raw = auto_config(tiny_prepared, tmp_path, max_time=60, max_steps=3, eval_every=3, eval_bleu_sentences=2)
    train(config_from_dict(raw), progress_bar=False)
    record = json.loads((tmp_path / "run" / "shape_choice.json").read_text())
    assert len(record["shapes"]) == 1 and record["chosen"] == record["shapes"][0]["name"]
    assert "not timed (the probe's 0.06 s are spent)" in capsys.readouterr().err


def test_auto_under_torchrun_is_refused_with_one_line(monkeypatch):
    from transformer_cli.training import train as train_module

    class TwoProcesses:
        enabled, rank, size = True, 0, 2

    cfg = load_config(None, ["model.size=auto"])
    with pytest.raises(TfmError, match="under torchrun name the shape"):
        train_module.probe_shapes(cfg, TwoProcesses(), None, print)


def test_fine_tuning_under_auto_takes_the_parents_shape_without_a_probe(tiny_prepared, tmp_path, monkeypatch, capsys):
    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "parent")
    parent = tiny_reverse_config(data, tmp_path / "parent", max_steps=2, eval_every=2, eval_bleu_sentences=2)
    train(config_from_dict(parent), progress_bar=False)  # a shape of its own (d_model 32), no name

    def no_probe(*args, **kwargs):
        raise AssertionError("fine-tuning probed")

    monkeypatch.setattr(shape_choice, "choose_shape", no_probe)
    child = auto_config(tiny_prepared, tmp_path, max_steps=2, eval_every=2, eval_bleu_sentences=2,
                        init_from=str(tmp_path / "parent"))
    train(config_from_dict(child), progress_bar=False)
    from transformer_cli.experiment.checkpoint import load_checkpoint
    trained = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_last.pt")["model_config"]
    assert {k: trained[k] for k in SHAPE_KEYS} == {k: parent["model"][k] for k in SHAPE_KEYS}
    assert "fine-tuning keeps the shape of" in capsys.readouterr().err


def test_a_new_auto_run_over_a_trained_one_is_refused_before_the_probe(tiny_prepared, tmp_path, monkeypatch):
    raw = auto_config(tiny_prepared, tmp_path, max_steps=2, eval_every=2, eval_bleu_sentences=2)
    raw["model"] = tiny_reverse_config(*tiny_prepared)["model"]  # a pinned shape trains first
    train(config_from_dict(raw), progress_bar=False)

    def no_probe(*args, **kwargs):
        raise AssertionError("probed a run that is refused")

    monkeypatch.setattr(shape_choice, "time_shapes", no_probe)
    raw["model"] = {"size": "auto"}
    with pytest.raises(TfmError, match="already holds a training run"):
        train(config_from_dict(raw), progress_bar=False)


@pytest.mark.slow
def test_a_budget_the_probe_uses_up_is_a_one_line_error_that_leaves_no_checkpoint(tiny_prepared, tmp_path,
                                                                                     monkeypatch):
    """train.max_time at or under the probe's own seconds: no step could be trained (the run once
    ended at 0 steps, exit 0, and left an untrained checkpoint_last.pt for translate)."""
    raw = auto_config(tiny_prepared, tmp_path, max_steps=4, eval_every=4, max_time=0.2)
    config_file = tmp_path / "auto.json"
    config_file.write_text(json.dumps(raw))
    result = tfm_in_process("train", "--config", config_file)
    assert result.exit_code == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.max_time=0.2" in errors[0] and "left no time to train" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.glob("*.pt"))
    raw["train"]["max_time"] = 600  # a budget that holds: the same run trains (it probes again,
    monkeypatch.setattr(shape_choice, "PROBE_SHARE", 0.0005)  # the first shape only: 0.3 s of the 600)
    config_file.write_text(json.dumps(raw))
    trained = tfm_in_process("train", "--config", config_file)
    assert trained.exit_code == 0 and "done (max_steps=4)" in trained.stderr, trained.stderr



# --------------------------------------------------------------------------- model.size student


@pytest.mark.parametrize("teacher", [*SHAPES.values(), Shape(d_model=512, n_heads=8, enc_layers=6, dec_layers=6, d_ff=2048)],
                         ids=[*SHAPES, "transformer-base"])
def test_every_teacher_gets_a_student_that_is_smaller_and_cheaper_to_decode(teacher):
    from transformer_cli.experiment.shapes import decoding_cost, parameters_of, student_of

    student = student_of(teacher)
    assert type(student) is Shape and student.dec_layers == 1 and student.enc_layers >= teacher.enc_layers
    assert (student.d_model, student.d_ff, student.n_heads) == (teacher.d_model, teacher.d_ff, teacher.n_heads)
    for vocab in (2000, 8000, 32000):
        assert parameters_of(student, vocab) < parameters_of(teacher, vocab)
        # fewer multiply-adds per decoded token (at d128 the output layer is most of them; the layers' fixed
        # costs, which scripts/bench_student_shapes.py measures, make the speed-up larger than their ratio)
        assert decoding_cost(student, vocab) < decoding_cost(teacher, vocab)


def test_model_size_student_trains_its_teachers_student_shape_resumes_it_and_refuses_a_slower_one(
        tiny_prepared, tmp_path, capsys):
    from transformer_cli.experiment.checkpoint import load_checkpoint

    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "teacher")
    teacher = tiny_reverse_config(data, tmp_path / "teacher", max_steps=2, eval_every=2, eval_bleu_sentences=2,
                                  lr=0.002)
    teacher["model"].update(enc_layers=2, dec_layers=3)
    train(config_from_dict(teacher), progress_bar=False)
    shutil.copytree(run, tmp_path / "run")
    raw = tiny_reverse_config(data, tmp_path / "run", max_steps=2, eval_every=2, eval_bleu_sentences=2)
    for key in SHAPE_KEYS:
        raw["model"].pop(key, None)
    raw["model"]["size"] = "student"
    raw["train"].pop("lr")  # the teacher's
    with pytest.raises(TfmError, match="set vocab.from_run to the teacher's run directory"):
        train(config_from_dict(raw), progress_bar=False)
    raw["vocab"]["from_run"] = str(tmp_path / "teacher")
    train(config_from_dict(raw), progress_bar=False)
    payload = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_last.pt")
    assert {k: payload["model_config"][k] for k in SHAPE_KEYS} == {"d_model": 32, "n_heads": 2, "enc_layers": 3,
                                                                   "dec_layers": 1, "d_ff": 64}
    assert payload["config"]["train"]["lr"] == 0.002 and payload["config"]["model"]["size"] == "student"
    said = capsys.readouterr().err
    assert "model.size student: d_model 32, 2 heads, 3+1 layers, FFN 64" in said
    assert "from the teacher's d_model 32, 2 heads, 2+3" in said
    # resumed, the shape is the run's own, whatever the teacher is now
    (tmp_path / "teacher" / "checkpoints").rename(tmp_path / "teacher" / "gone")
    raw["train"]["max_steps"] = 4
    assert train(config_from_dict(raw), resume=True, progress_bar=False).steps == 4
    payload = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_last.pt")
    assert (payload["model_config"]["enc_layers"], payload["model_config"]["dec_layers"]) == (3, 1)
    assert payload["config"]["train"]["lr"] == 0.002
    (tmp_path / "teacher" / "gone").rename(tmp_path / "teacher" / "checkpoints")
    # a key given beside `student` overrides it; one that decodes slower than the teacher is refused
    shutil.rmtree(tmp_path / "run")
    shutil.copytree(run, tmp_path / "run")
    slower = {**raw, "model": {**raw["model"], "dec_layers": 4}}
    with pytest.raises(TfmError, match=r"would decode slower than its teacher .*x its multiply-adds per token"):
        train(config_from_dict(slower), progress_bar=False)
    assert not (tmp_path / "run" / "checkpoints" / "checkpoint_last.pt").exists()


def test_a_student_given_its_own_shape_that_decodes_slower_than_its_teacher_is_warned(tiny_prepared, tmp_path):
    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "teacher")
    teacher = tiny_reverse_config(data, tmp_path / "teacher", max_steps=2, eval_every=2, eval_bleu_sentences=2)
    train(config_from_dict(teacher), progress_bar=False)  # d_model 32, 1+1 layers
    raw = tiny_reverse_config(data, tmp_path / "run")
    raw["vocab"]["from_run"] = str(tmp_path / "teacher")
    said: list[str] = []
    for train_on, shape, warned in (([str(tmp_path / "teacher" / "distilled" / "train"), str(data / "train")],
                                     {"d_model": 64, "d_ff": 128}, True),
                                    ([str(tmp_path / "teacher" / "distilled" / "train")], {}, False),
                                    ([str(data / "train")], {"d_model": 64, "d_ff": 128}, False)):
        said.clear()
        config = config_from_dict({**raw, "data": {**raw["data"], "train": train_on},
                                   "model": {**raw["model"], **shape}})
        shape_choice.warn_if_slower_than_teacher(config, said.append)
        assert bool(said) == warned, (train_on, shape, said)
    config = config_from_dict({**raw, "data": {**raw["data"], "train": [str(tmp_path / "teacher" / "distilled" / "t")]},
                               "model": {**raw["model"], "d_model": 64, "d_ff": 128}})
    shape_choice.warn_if_slower_than_teacher(config, said.append)
    assert "decodes slower than its teacher" in said[0] and "d_model 64, 2 heads, 1+1 layers, FFN 128" in said[0]


@pytest.mark.parametrize("sets, says", [
    ([], "model.size student: a student's shape follows its teacher's; set vocab.from_run"),
    (["vocab.from_run=nowhere"], "no checkpoint in nowhere/checkpoints"),
    (["vocab.from_run=TEACHER", "model.dec_layers=5"], "would decode slower than its teacher"),
    (["vocab.from_run=TEACHER", "model.n_heads=3"], "d_model 32 is not divisible by n_heads 3"),
])
def test_model_size_student_s_bad_settings_are_one_line_errors_that_write_no_checkpoint(tiny_prepared, tmp_path,
                                                                                         sets, says):
    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "teacher")
    teacher = tiny_reverse_config(data, tmp_path / "teacher", max_steps=1, eval_every=1, eval_bleu_sentences=2)
    train(config_from_dict(teacher), progress_bar=False)
    shutil.copytree(run, tmp_path / "run")
    raw = tiny_reverse_config(data, tmp_path / "run", max_steps=1)
    for key in SHAPE_KEYS:
        raw["model"].pop(key, None)
    raw["model"]["size"] = "student"
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    options = [a for s in sets for a in ("--set", s.replace("TEACHER", str(tmp_path / "teacher")))]
    result = tfm_in_process("train", "--config", tmp_path / "c.yaml", *options)
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "checkpoint_last.pt").exists()


def test_a_slowdown_beside_a_moments_other_work_is_read_again_before_the_plan_changes(monkeypatch):
    """A type check beside a quickstart (16% of the CPUs for ~20 s) slowed it to 0.76x at its check, and
    the re-plan cost 1.6 BLEU: a slowdown while other work ran reads one more window, and re-plans only
    if it lasts; a slowdown with nothing else running re-plans at once."""
    clock = {"now": 0.0, "busy_until": 0.0}
    monkeypatch.setattr(shape_choice, "cpu_reading", lambda: clock["now"])
    monkeypatch.setattr(shape_choice, "others_share",
                        lambda start, end, threads: 0.16 * max(0.0, min(end, clock["busy_until"]) - start) / (end - start))

    def feed(speed, busy_until):
        check = shape_choice.PlanCheck("d128", 10_000.0, 0.0, after_seconds=60.0, deadline_seconds=180.0)
        seconds, tokens, clock["busy_until"] = 12.0, 0, busy_until
        while seconds < 600:
            clock["now"] = seconds
            verdict = check.observe(seconds, tokens)
            if verdict is not None:
                return seconds, verdict
            seconds, tokens = seconds + 0.5, tokens + int(speed(seconds) * 0.5)
        raise AssertionError("no verdict")

    at, verdict = feed(lambda t: 5_000.0 if 40 <= t < 72 else 10_000.0, busy_until=72.0)  # a moment's work
    assert at == pytest.approx(92.0) and verdict.gap == "" and verdict.tokens_per_second == pytest.approx(10_000, rel=0.02)
    assert "ran at 0.73x while other work took 16% of the CPUs, so another 20 s were read" in verdict.read_again
    at, verdict = feed(lambda t: 7_000.0, busy_until=600.0)  # other work that stays
    assert at == pytest.approx(92.0) and "0.70x" in verdict.gap
    at, verdict = feed(lambda t: 7_000.0, busy_until=0.0)  # slowed with nothing else running: the machine
    assert at == pytest.approx(72.0) and "0.70x" in verdict.gap and verdict.read_again == ""
