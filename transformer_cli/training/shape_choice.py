"""`model.size: auto`: given the budget and the machine, choose what to train, and check the choice.

Before the first step, every named shape (experiment/shapes.py) trains the run's first updates, on
this device, in the precision `tfm train` would use for it: interleaved, each shape in turn on each
update over several passes, each (shape, update)'s fastest pass counting, so that a moment's load
falls on every shape alike and on one pass, not on a shape's figure; a larger shape measured faster
than a smaller (which cannot be) is timed again, and the share of the CPUs other work took meanwhile
is measured and said. A shape's speed (target tokens a second), with the run's evaluations at that
shape (timed on a sample of the valid set: they spend the same budget), turns the budget left into the
updates it would make, and its measured curve into the valid BLEU those updates reached. The shape with the
highest prediction is trained; within `TIE_BLEU` of it, the fastest (it also translates fastest).
Nothing here reads a CPU's name: a slow machine buys fewer tokens, and the curves say which shape
learns most from those.

A budget that buys few updates learns more from more, smaller batches: with `train.min_updates`
a shape that would make fewer updates than that trains on 1,000-token batches (`batch_for_budget`).

Each shape trains at the peak learning rate its curve was measured with (`NamedShape.lr`) unless
the config gives `train.lr`, and at the dropout its curve was measured with, or a higher one where
the budget runs past the point that shape was seen to overfit (`NamedShape.dropout_for`: in passes
over the corpus, so that it carries to a corpus of another size), unless the config gives
`model.dropout`.

The plan is checked as the run trains on a CPU (`PlanCheck`): after a minute, or after a busy
probe the first quiet window, the speed trained at against the probe's; off by more than
`PLAN_HOLDS`, the shapes are timed again for the budget left (train.py `train_replanned`), the
shape being trained credited with its updates.

A resumed run never probes or re-plans: its checkpoint's shape, batch, learning rate and dropout
are the run's (`shape_of_run`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..data.batches import Batch, ParallelData
from ..decoding.torch_engine import decode_in_batches
from ..experiment.checkpoint import TrainedSettings
from ..experiment.config import ExperimentConfig, TrainConfig, parse_duration
from ..experiment.rundir import RunDirectory, ShapeChoice, checkpoint_at
from ..experiment.shapes import AUTO, SHAPES, STUDENT, NamedShape, decoding_cost, parameters_of, student_of
from ..model.shape import SHAPE_KEYS, Shape
from ..runtime.cpu import BUSY_SHARE, CpuReading, cpu_reading, others_share
from ..runtime.errors import TfmError
from ..runtime.precision import autocast_dtype, choose_precision, forget_busy_measurements
from .builders import adam, build_model
from .loss import batch_loss
from .step_health import gradient_norm

BATCH_FLOOR = 1000  # tokens: the smallest batch train.min_updates shrinks to (docs/training.md)
PROBE_ROUNDS = 5  # after a warm-up update, rounds of one update each, every shape in turn: a shape's median counts
EXTRA_ROUNDS = 3  # for shapes whose figures cannot be true
PROBE_UPDATES = 2 + PROBE_ROUNDS + EXTRA_ROUNDS  # the run's first updates: each trained in one round only
PROBE_SHARE = 0.05  # of a max_time budget, at most, before the shapes not yet timed are left out
TIE_BLEU = 0.25  # predictions this close are a tie, and the fastest shape wins it
CHECK_AFTER = 60.0  # seconds of training after which the run checks the plan (restarting is cheap so early)...
CHECK_SHARE = 0.1  # ... or this share of the budget, whichever comes first
PLAN_HOLDS = 1.25  # a speed trained at within this factor of the probe's (either way) keeps the plan
CHECK_WINDOW = 20.0  # seconds: after a busy probe, the run's speed is read in windows this long until one is quiet...
CHECK_DEADLINE = 0.3  # ... until this share of the budget (a machine busy so long is the machine)
# A check that finds the run slowed while other work took this share of the CPUs or more reads one
# more CHECK_WINDOW before it re-plans: a moment's work beside the run (a type check of ~20 s, 16% of
# 2 CPUs, slowed a quickstart to 0.76x at its check, and the re-plan to 1,000-token batches cost it
# 1.6 BLEU) is not the machine; a slowdown that lasts is re-planned one window later.
SLOWED_BY_OTHERS = 0.05


@dataclass(frozen=True)
class ShapeTiming:
    name: str
    seconds_per_update: float
    tokens_per_update: float  # target tokens
    precision: str
    seconds_per_evaluation: float = 0.0  # the run's validation (loss and greedy BLEU) at this shape

    def seconds_per_update_with_evaluations(self, batch_scale: float, eval_every: int | None) -> float:
        """An update at `batch_scale` times the timed batch, with its share of the evaluations made
        every `eval_every` updates (they spend the same budget)."""
        share = self.seconds_per_evaluation / eval_every if eval_every else 0.0
        return self.seconds_per_update * batch_scale + share

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_update / self.seconds_per_update


@dataclass(frozen=True)
class Prediction:
    timing: ShapeTiming
    max_tokens: int  # the batch it would train with (train.max_tokens, or smaller: batch_for_budget)
    updates: int  # the budget left, in this shape's updates of that batch
    bleu: float  # predicted valid greedy BLEU after those updates


@dataclass(frozen=True)
class TrainedSoFar:
    """What a run re-planning has trained: `updates` of `shape` at `batch`-token batches."""

    shape: str
    batch: int
    updates: int


def predict(timings: Sequence[ShapeTiming], seconds_left: float | None, updates_left: int, max_tokens: int,
            min_updates: int | None = None, so_far: TrainedSoFar | None = None,
            eval_every: int | None = None) -> list[Prediction]:
    """What each timed shape (timed at `max_tokens`) reaches in the budget left: `seconds_left` of
    training (None: no time limit) and at most `updates_left` updates, at the batch
    `batch_for_budget` gives it (a smaller batch takes proportionally less time: its tokens a second
    hold), each `eval_every`-th followed by an evaluation of the shape's timed seconds. A run
    re-planning (`so_far`) goes on with the shape it trains: its updates made count, in tokens,
    towards that shape's."""
    predictions = []
    for timing in timings:
        batch = batch_for_budget(max_tokens, min_updates, timing, seconds_left, eval_every)
        seconds_per_update = timing.seconds_per_update_with_evaluations(batch / max_tokens, eval_every)
        by_time = math.inf if seconds_left is None else max(seconds_left, 0.0) / seconds_per_update
        made = so_far.updates * so_far.batch / batch if so_far is not None and so_far.shape == timing.name else 0
        updates = int(min(by_time, updates_left) + made)
        predictions.append(Prediction(timing, batch, updates, SHAPES[timing.name].predicted_bleu(updates, batch)))
    return predictions


def choose(predictions: Sequence[Prediction]) -> Prediction:
    """The highest predicted BLEU; among those within TIE_BLEU of it, the fastest (then the name)."""
    if not predictions:
        raise TfmError("model.size auto: no shape could be timed")
    best = max(p.bleu for p in predictions)
    close = [p for p in predictions if p.bleu >= best - TIE_BLEU]
    return min(close, key=lambda p: (p.timing.seconds_per_update, p.timing.name))


def batch_for_budget(max_tokens: int, min_updates: int | None, timing: ShapeTiming,
                     seconds_left: float | None, eval_every: int | None = None) -> int:
    """train.max_tokens, or BATCH_FLOOR where the budget left would make fewer than `min_updates`
    updates with it at the timed shape's speed, evaluations counted (measured: at the same seconds,
    1,000-token batches scored more than 1,500 and far more than 3,000 there; docs/training.md)."""
    if min_updates is None or seconds_left is None or max_tokens <= BATCH_FLOOR:
        return max_tokens
    updates = max(seconds_left, 0.0) / timing.seconds_per_update_with_evaluations(1.0, eval_every)
    return max_tokens if updates >= min_updates else BATCH_FLOOR


def table(predictions: Sequence[Prediction], chosen: Prediction) -> list[str]:
    lines = [f"  {'shape':<6} {'precision':<9} {'tok/s':>7} {'batch':>6} {'updates':>8} {'valid BLEU':>10}"]
    for p in predictions:
        mark = "  ← chosen" if p is chosen else ""
        lines.append(f"  {p.timing.name:<6} {p.timing.precision:<9} {p.timing.tokens_per_second:>7,.0f} "
                     f"{p.max_tokens:>6,} {p.updates:>8,} {p.bleu:>10.1f}{mark}")
    return lines


# --------------------------------------------------------------------------- timing on this machine


def with_shape(config: ExperimentConfig, shape: NamedShape, max_tokens: int | None = None,
               lr: float | None = None, dropout: float | None = None) -> ExperimentConfig:
    """The config with this named shape (every shape key set: an ordinary, pinned run), batch, peak
    learning rate and dropout (None: the config's)."""
    chosen_dropout = {} if dropout is None else {"dropout": dropout}
    model = config.model.model_copy(update={"size": shape.name, **shape.keys(), **chosen_dropout})
    train = config.train.model_copy(update={"max_tokens": max_tokens or config.train.max_tokens,
                                            "lr": lr or config.train.lr})
    return config.model_copy(update={"model": model, "train": train})


def lr_of_choice(config: ExperimentConfig, shape: NamedShape, batch: int) -> float | None:
    """The peak learning rate `auto` trains `shape` with at `batch`-token batches: the one measured for
    it (`NamedShape.lr_for`), unless the config gives train.lr."""
    return None if "lr" in config.train.model_fields_set else shape.lr_for(batch)


def passes(chosen: Prediction, corpus_tokens: int) -> float:
    """The passes over a corpus of `corpus_tokens` target tokens that the predicted updates make."""
    return chosen.updates * chosen.max_tokens / max(corpus_tokens, 1)


def dropout_of_choice(config: ExperimentConfig, shape: NamedShape, chosen: Prediction,
                      corpus_tokens: int) -> float | None:
    """The dropout `auto` trains `shape` with for the passes over the corpus (of `corpus_tokens` target
    tokens) it predicted, unless the config gives model.dropout (None)."""
    if "dropout" in config.model.model_fields_set:
        return None
    return shape.dropout_for(passes(chosen, corpus_tokens))


def probe_batches(data: ParallelData, config: ExperimentConfig, count: int) -> list[list[np.ndarray]]:
    """The run's first `count` updates (each `accum_steps` batches of pair indices): every shape times the same."""
    order = data.batches(config.train.max_tokens, seed=config.train.seed)
    per_update = config.train.accum_steps
    updates = [order[i * per_update:(i + 1) * per_update] for i in range(min(count, len(order) // per_update))]
    return [update for update in updates if update]


def _train_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch],
                  device: torch.device, amp_dtype: torch.dtype | None, train_cfg: TrainConfig) -> None:
    """One update of `batches` as `tfm train` makes it, gradient norm and clipping included (on a GPU,
    queued: not finished when it returns)."""
    for batch in batches:
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss, _ = batch_loss(model, batch, train_cfg.label_smoothing)
        loss.backward()
    gradient_norm(model, train_cfg.clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class ShapeRun:
    """One named shape built to be timed: its model and optimizer, in the precision `tfm train`
    would train it with."""

    shape: NamedShape
    precision: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    amp_dtype: torch.dtype | None


def build_shape_run(config: ExperimentConfig, shape: NamedShape, vocab: tuple[int, int], shared_ids: bool,
                    device: torch.device) -> ShapeRun:
    precision = choose_precision(config.train.precision, device, (shape.d_model, shape.d_ff))
    model = build_model(with_shape(config, shape), *vocab, shared_ids).to(device)
    optimizer = adam(model, config.train)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    model.train()
    return ShapeRun(shape, precision.name, model, optimizer, autocast_dtype(precision))


def train_timed(run: ShapeRun, updates: list[list[np.ndarray]], collate: Callable[[np.ndarray], Batch],
                device: torch.device, train_cfg: TrainConfig) -> float:
    """Seconds to train `updates` (on a GPU queued as in training, and waited for once at the end).
    On a CPU collating the batches is timed too, as the training loop does it there; a GPU run
    collates ahead, on a thread."""
    if device.type == "cuda":
        updates_collated = [[collate(indices) for indices in update] for update in updates]
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if device.type != "cuda":
        updates_collated = [[collate(indices) for indices in update] for update in updates]
    for batches in updates_collated:
        _train_update(run.model, run.optimizer, batches, device, run.amp_dtype, train_cfg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def evaluation_seconds(run: ShapeRun, valid: ParallelData, config: ExperimentConfig, device: torch.device) -> float:
    """What one of the run's evaluations (training/validation.py) costs this shape, from a sample:
    the loss of one valid batch, scaled to the valid set's target tokens, and the greedy decoding
    of one batch of the sentences validation BLEU decodes, each forced to their mean reference
    length (an untrained model stops anywhere), scaled to their count. Checkpoint writes are not
    counted. 0 where the valid split is empty."""
    batches = valid.batches(config.train.max_tokens, seed=0)
    sentences = min(config.train.eval_bleu_sentences, len(valid))
    if not batches or not sentences:
        return 0.0
    was_training = run.model.training
    run.model.eval()
    try:
        loss_batch = valid.collate(batches[0]).to(device)
        batch_loss(run.model, loss_batch, config.train.label_smoothing)  # warm-up: not counted
        started = time.perf_counter()
        batch_loss(run.model, loss_batch, config.train.label_smoothing)
        valid_tokens = sum(valid.target_tokens(indices) for indices in batches)
        loss_seconds = (time.perf_counter() - started) * valid_tokens / valid.target_tokens(batches[0])
        decode = config.decode.updated(beam=1, nbest=1)
        sample = list(range(min(decode.batch_size, sentences)))
        sources = [np.asarray(valid.src[i]).tolist() for i in sample]
        length = max(1, round(statistics.mean(len(valid.tgt[i]) for i in sample)))
        decode_in_batches(run.model, sources[:2], decode, device, min_len=2, max_len=2)  # warm-up
        started = time.perf_counter()
        decode_in_batches(run.model, sources, decode, device, min_len=length, max_len=length)
        decode_seconds = (time.perf_counter() - started) * sentences / len(sample)
    finally:
        run.model.train(was_training)
    return loss_seconds + decode_seconds


Rounds = dict[str, list[tuple[int, float]]]  # shape → (probe update, seconds) of each counted round


def interleaved_seconds(names: Sequence[str], updates: int, train_one: Callable[[str, int], float],
                        limit_seconds: float | None, clock: Callable[[], float], say: Callable[[str], None],
                        rounds: int = PROBE_ROUNDS, first: int = 0) -> Rounds:
    """Each shape, smallest first, warms up on probe update `first` (it builds kernels: not counted)
    and trains the next; a shape not begun once `limit_seconds` are spent is left out (said). Then
    more rounds while the limit allows, each on an update none has trained (as every update of
    training is), every shape in turn, the order rotating: a moment's load falls on every shape
    alike, and on a round or two of each, which its median leaves out. (Of `updates` fewer than
    needed, they are taken again in turn.)"""
    started, seconds = clock(), {}
    for name in names:
        if limit_seconds is not None and seconds and clock() - started > limit_seconds:
            say(f"model.size auto: {name} not timed (the probe's {limit_seconds:.3g} s are spent)")
            continue
        train_one(name, first % updates)
        seconds[name] = [((first + 1) % updates, train_one(name, (first + 1) % updates))]
    timed = list(seconds)
    for r in range(2, rounds + 1):
        k = (first + r) % updates
        for name in timed[r % len(timed):] + timed[:r % len(timed)]:
            if limit_seconds is not None and clock() - started > limit_seconds:
                return seconds  # (under load a round takes long: the limit is looked at before each update)
            seconds[name].append((k, train_one(name, k)))
    return seconds


def typical(rounds: list[tuple[int, float]], tokens: Sequence[float]) -> tuple[float, float]:
    """(seconds, target tokens) of an update: the median round's seconds a token, at the rounds' mean tokens."""
    mean_tokens = statistics.mean(tokens[k] for k, _ in rounds)
    return statistics.median(seconds / tokens[k] for k, seconds in rounds) * mean_tokens, mean_tokens


def implausible(timings: Sequence[ShapeTiming]) -> list[str]:
    """Shapes whose figures cannot both be true: of two in the same precision, the one with more
    weights a layer faster per token than the other (by more than a tenth)."""
    suspects: set[str] = set()
    for small in timings:
        for large in timings:
            if (small.precision == large.precision and layer_weights(SHAPES[large.name]) > layer_weights(
                    SHAPES[small.name]) and large.tokens_per_second > 1.1 * small.tokens_per_second):
                suspects |= {small.name, large.name}
    return sorted(suspects, key=lambda name: layer_weights(SHAPES[name]))


def layer_weights(shape: NamedShape) -> int:
    """Weights of the encoder and decoder layers (attention and FFN): what a token's step costs."""
    attention, ffn = 4 * shape.d_model ** 2, 2 * shape.d_model * shape.d_ff
    return shape.enc_layers * (attention + ffn) + shape.dec_layers * (2 * attention + ffn)


def time_shapes(config: ExperimentConfig, data: ParallelData, vocab: tuple[int, int], shared_ids: bool,
                device: torch.device, limit_seconds: float | None, say: Callable[[str], None],
                valid: ParallelData | None = None) -> tuple[list[ShapeTiming], float, float]:
    """Every named shape timed on the run's first updates, interleaved (`interleaved_seconds`), smallest
    first; figures that cannot be true timed again; then each timed shape's evaluation on `valid`
    (`evaluation_seconds`). Returns the timings, the seconds spent and the share of the CPUs other
    work took meanwhile."""
    updates = probe_batches(data, config, PROBE_UPDATES)
    if not updates:
        batches = len(data.batches(config.train.max_tokens, seed=config.train.seed))
        raise TfmError(f"model.size auto: the training split makes {batches:,} batches of train.max_tokens "
                       f"{config.train.max_tokens:,}, fewer than one update of train.accum_steps "
                       f"{config.train.accum_steps:,}: lower train.accum_steps, or name the shape (model.size: d128, …)")
    forget_busy_measurements()  # a bf16 screen of a busy moment is measured again
    before, started = cpu_reading(), time.perf_counter()
    names = sorted(SHAPES, key=lambda name: layer_weights(SHAPES[name]))
    runs: dict[str, ShapeRun] = {}

    # A GPU's first pass over new batch shapes picks its kernels and grows its memory pool, and
    # waiting for each update idles it where training queues the next: timed so, an H200 looked
    # 2.4x slower than it trains (3,183 updates predicted for 150 s, 6,058 made). There the unit
    # timed is a pass over four of the probe's updates, queued as in training, in every round.
    units = [[update] for update in updates] if device.type != "cuda" else [updates[:4]]

    def train_one(name: str, k: int) -> float:
        if name not in runs:
            runs[name] = build_shape_run(config, SHAPES[name], vocab, shared_ids, device)
        return train_timed(runs[name], units[k], data.collate, device, config.train) / len(units[k])

    tokens = [statistics.mean(float(sum(data.target_tokens(indices) for indices in update)) for update in unit)
              for unit in units]
    timings = probe_timings(names, tokens, train_one, lambda name: runs[name].precision, limit_seconds,
                            time.perf_counter, say)
    if valid is not None and config.train.eval_every:
        timings = [replace(timing, seconds_per_evaluation=evaluation_seconds(runs[timing.name], valid, config, device))
                   for timing in timings]
    busy = others_share(before, cpu_reading(), torch.get_num_threads()) if device.type == "cpu" else 0.0
    return timings, time.perf_counter() - started, busy


def probe_timings(names: Sequence[str], tokens: Sequence[float], train_one: Callable[[str, int], float],
                  precision: Callable[[str], str], limit_seconds: float | None, clock: Callable[[], float],
                  say: Callable[[str], None]) -> list[ShapeTiming]:
    """The shapes' timings (`interleaved_seconds`, `PROBE_ROUNDS` on the first updates); those that
    cannot be true timed again on the next updates (`EXTRA_ROUNDS`, within half the probe's limit
    again), and the faster of their two figures taken (what made them contradict is a slowdown)."""
    timed = interleaved_seconds(names, len(tokens), train_one, limit_seconds, clock, say)
    timings = {name: ShapeTiming(name, *typical(timed[name], tokens), precision(name)) for name in timed}
    suspects = implausible(list(timings.values()))
    if suspects:
        say(f"model.size auto: {' and '.join(suspects)} timed again (a larger shape measured faster than a smaller)")
        again = interleaved_seconds(suspects, len(tokens), train_one, None if limit_seconds is None else
                                    limit_seconds / 2, clock, lambda line: None, EXTRA_ROUNDS, PROBE_ROUNDS + 1)
        for name, rounds in again.items():
            second = ShapeTiming(name, *typical(rounds, tokens), precision(name))
            timings[name] = min(timings[name], second, key=lambda t: t.seconds_per_update / t.tokens_per_update)
    return list(timings.values())


# --------------------------------------------------------------------------- the run's shape


@dataclass(frozen=True)
class Teacher:
    """What a student's shape is derived from and compared with: the teacher's default checkpoint
    (the run vocab.from_run names), its shape keys, target vocabulary and peak learning rate."""

    path: Path
    shape: Shape
    vocab: int
    lr: float | None


def read_teacher(config: ExperimentConfig) -> Teacher:
    """The teacher of `config` (vocab.from_run's run); a TfmError where it has no checkpoint or
    its checkpoint does not say its shape."""
    assert config.parent_run is not None  # (a student's config names its teacher's run)
    trained = TrainedSettings.read(config.parent_run.default_checkpoint())
    if trained.shape is None:
        raise TfmError(f"model.size student: {trained.path} does not say its model's shape; give the student's "
                       "shape keys (model.d_model, …) with model.size null")
    return Teacher(trained.path, trained.shape, trained.tgt_vocab_size or config.vocab.size, trained.lr)


def with_lr(config: ExperimentConfig, lr: float | None) -> ExperimentConfig:
    """`config` at peak learning rate `lr`, unless the config gives train.lr (or `lr` is None)."""
    if lr is None or "lr" in config.train.model_fields_set:
        return config
    return config.model_copy(update={"train": config.train.model_copy(update={"lr": lr})})


def student_config(config: ExperimentConfig, resumed: bool, last_checkpoint: Path,
                   say: Callable[[str], None]) -> ExperimentConfig:
    """model.size student: the shape `student_of` its teacher's (the default checkpoint of the run
    vocab.from_run names; a resumed run keeps the shape it started with), the keys the config gives
    overriding it; a student that would decode slower than its teacher is refused, with the numbers."""
    if resumed:  # the shape and learning rate it started with
        started = TrainedSettings.read(last_checkpoint)
        config = with_lr(config, started.lr)
        keys = started.shape.keys() if started.shape is not None else {}
        return config.model_copy(update={"model": config.model.model_copy(update=keys)})
    if not config.vocab.from_run:
        raise TfmError("model.size student: a student's shape follows its teacher's; set vocab.from_run to the "
                       "teacher's run directory (the run whose distilled corpus it trains on)")
    teacher = read_teacher(config)
    given = {key: getattr(config.model, key) for key in SHAPE_KEYS if key in config.model.model_fields_set}
    student = replace(student_of(teacher.shape), **given)
    cost, teacher_cost = decoding_cost(student, teacher.vocab), decoding_cost(teacher.shape, teacher.vocab)
    if student.dec_layers > teacher.shape.dec_layers or cost > teacher_cost:
        raise TfmError(f"model.size student: this student ({student.describe()}) would decode slower than its "
                       f"teacher {teacher.path} ({teacher.shape.describe()}): {cost / teacher_cost:.2f}x its "
                       "multiply-adds per token; drop the model keys given beside it "
                       f"({', '.join(f'model.{key}' for key in given)}) or make them smaller")
    if student.d_model % student.n_heads:
        raise TfmError(f"model.size student: d_model {student.d_model} is not divisible by n_heads {student.n_heads}")
    say(f"model.size student: {student.describe()}, {parameters_of(student, teacher.vocab) / 1e6:.1f}M weights, "
        f"from the teacher's {teacher.shape.describe()}, {parameters_of(teacher.shape, teacher.vocab) / 1e6:.1f}M "
        f"({teacher.path}): {teacher_cost / cost:.2f}x fewer multiply-adds per decoded token"
        + (f"; {', '.join(f'model.{key} {value}' for key, value in given.items())} as given" if given else ""))
    # The teacher's peak learning rate where the config gives none: the student keeps its width.
    config = with_lr(config, teacher.lr)
    return config.model_copy(update={"model": config.model.model_copy(update=student.keys())})


def warn_if_slower_than_teacher(config: ExperimentConfig, say: Callable[[str], None]) -> None:
    """A student given its own shape (trained on its vocabulary parent's distilled corpus) that
    decodes slower than that teacher: said with the numbers (it trains as asked)."""
    parent = config.parent_run
    if parent is None:
        return
    distilled = parent.distilled.resolve()
    if not any(Path(path).resolve().is_relative_to(distilled) for path in config.data.train):
        return
    try:
        teacher = read_teacher(config)
    except TfmError:
        return  # no teacher to compare with: distill says so where it matters
    student = Shape(**{key: getattr(config.model, key) for key in SHAPE_KEYS})
    ratio = decoding_cost(student, teacher.vocab) / decoding_cost(teacher.shape, teacher.vocab)
    if ratio > 1.0 or student.dec_layers > teacher.shape.dec_layers:
        say(f"warning: this student ({student.describe()}, {parameters_of(student, teacher.vocab) / 1e6:.1f}M "
            f"weights) decodes slower than its teacher {teacher.path} ({teacher.shape.describe()}, "
            f"{parameters_of(teacher.shape, teacher.vocab) / 1e6:.1f}M): {ratio:.2f}x its multiply-adds per token, "
            f"{student.dec_layers} decoder layers against {teacher.shape.dec_layers}; model.size student "
            "derives a cheaper shape from the teacher's")


def shape_of_run(config: ExperimentConfig, last_checkpoint: Path, keep_batch: bool = True) -> ExperimentConfig:
    """A resumed `auto` run trains the shape its checkpoint holds (`keep_batch`: and its batches):
    never another probe. Fine-tuning (`train.init_from`) takes its parent's shape the same way."""
    trained = TrainedSettings.read(last_checkpoint)
    if trained.shape is None:
        raise TfmError(f"{last_checkpoint} does not say its model's shape; give the shape keys "
                       "(model.d_model, …) instead of model.size auto")
    # ... and its dropout where the config leaves it to `auto` (it may have chosen one for its budget)
    dropout = ({"dropout": trained.dropout} if keep_batch and trained.dropout is not None
               and "dropout" not in config.model.model_fields_set else {})
    model = config.model.model_copy(update={"size": trained.size if trained.size in SHAPES else None,
                                            **trained.shape.keys(), **dropout})
    # ... its batches (the data order, batches taken of each epoch, is counted in them) and its
    # learning rate (the schedule goes on where it was)
    lr = trained.lr if keep_batch and trained.lr is not None and "lr" not in config.train.model_fields_set else None
    max_tokens = trained.max_tokens if keep_batch and trained.max_tokens is not None else None
    train = config.train.model_copy(update={"max_tokens": max_tokens or config.train.max_tokens,
                                            "lr": config.train.lr if lr is None else lr})
    return config.model_copy(update={"model": model, "train": train})


@dataclass(frozen=True)
class PlanVerdict:
    seconds: float  # of training measured (evaluations not counted)
    tokens_per_second: float
    busy: float  # the share of the CPUs other work took meanwhile
    gap: str  # why the shapes are timed again; "" where the plan holds
    read_again: str = ""  # why the window before this one did not decide (slowed beside other work)


@dataclass
class PlanCheck:
    """What a run on a CPU checks the probe's plan against while it trains: the chosen shape's
    target tokens a second as the probe timed them. After `after_seconds` of training the speed
    trained at is compared with them; where the probe was timed on a busy machine, the first quiet
    `CHECK_WINDOW` of training is, from the start (until `deadline_seconds` of the budget: a machine
    busy that long is the machine)."""

    shape: str
    tokens_per_second: float
    probe_busy: float
    after_seconds: float
    deadline_seconds: float
    window: tuple[float, int, CpuReading] | None = None  # (seconds, tokens, reading) where the window began
    started: float = 0.0  # the seconds of the first update observed
    rechecking: str = ""  # a slowdown beside other work (what it was): one more window decides

    def observe(self, seconds: float, tokens: int) -> PlanVerdict | None:
        """After an update, `seconds` of training and `tokens` target tokens so far: None until the
        verdict, then the verdict (once)."""
        if self.window is None:
            self.window, self.started = (seconds, tokens, cpu_reading()), seconds
            return None
        began, tokens_then, reading = self.window
        length = seconds - began
        busy_probe = self.probe_busy >= BUSY_SHARE
        waiting = busy_probe and seconds < self.deadline_seconds
        if (not busy_probe and not self.rechecking and seconds - self.started < self.after_seconds) or length <= 0 \
                or ((waiting or self.rechecking) and length < CHECK_WINDOW):
            return None
        now = cpu_reading()
        busy, speed = others_share(reading, now, torch.get_num_threads()), (tokens - tokens_then) / length
        if waiting and busy >= BUSY_SHARE:  # still busy: the next window
            self.window = (seconds, tokens, now)
            return None
        if (not self.rechecking and busy >= SLOWED_BY_OTHERS and speed * PLAN_HOLDS < self.tokens_per_second
                and seconds < self.deadline_seconds):  # slowed while other work ran: is it lasting?
            self.window = (seconds, tokens, now)
            self.rechecking = (f"its first {length:.0f} s ran at {speed / self.tokens_per_second:.2f}x while other "
                               f"work took {busy:.0%} of the CPUs, so another {CHECK_WINDOW:.0f} s were read")
            return None
        return PlanVerdict(length, speed, busy, self.gap(speed), self.rechecking)

    def gap(self, tokens_per_second: float) -> str:
        """Why the shapes are timed again ("" where the plan holds): the run trains at a speed more
        than PLAN_HOLDS from the probe's, either way. Within it, a measurement is noise, not news."""
        ratio = tokens_per_second / self.tokens_per_second
        if ratio > PLAN_HOLDS or ratio < 1 / PLAN_HOLDS:
            return (f"it trains at {ratio:.2f}x the {self.tokens_per_second:,.0f} target tokens/s the probe timed"
                    + (f" on a busy machine (other work {self.probe_busy:.0%})" if self.probe_busy >= BUSY_SHARE else ""))
        return ""


def choose_shape(config: ExperimentConfig, data: ParallelData, vocab: tuple[int, int], shared_ids: bool,
                 device: torch.device, run: RunDirectory, say: Callable[[str], None], spent_before: float = 0.0,
                 replanned: str = "", so_far: TrainedSoFar | None = None) -> tuple[ExperimentConfig, float,
                                                                                PlanCheck | None]:
    """The config with the shape `auto` chooses for the budget left (`spent_before` seconds of it
    gone) on this device, the probe's seconds (the trainer counts them as spent) and what the run
    checks the plan against. Prints the table and writes it to the run (a re-plan, `replanned`
    saying why, keeps the first plan's record inside its own, and credits the shape it trains with
    its updates `so_far`)."""
    train_cfg = config.train
    budget = parse_duration(train_cfg.max_time) if train_cfg.max_time is not None else None
    limit = None if budget is None else PROBE_SHARE * budget
    valid = ParallelData(run, "valid") if budget is not None else None  # evaluations spend a budget
    timings, spent, busy = time_shapes(config, data, vocab, shared_ids, device, limit, say, valid)
    seconds_left = None if budget is None else budget - spent_before - spent
    predictions = predict(timings, seconds_left, train_cfg.max_steps, train_cfg.max_tokens, train_cfg.min_updates,
                          so_far, train_cfg.eval_every)
    chosen = choose(predictions)
    limit_text = f"{budget:.0f} s budget" if budget is not None else f"{train_cfg.max_steps:,} updates"
    say(f"model.size auto: timed {len(timings)} shapes on {device} in {spent:.1f} s of the {limit_text}; "
        "valid BLEU (greedy) predicted by the curves measured on Multi30k (docs/training.md):")
    for line in table(predictions, chosen):
        say(line)
    if busy >= BUSY_SHARE:
        say(f"model.size auto: the machine was busy: other work took {busy:.0%} of its CPUs while the shapes "
            "were timed (each shape's median round counts); the run checks its speed again once it trains")
    shape = SHAPES[chosen.timing.name]
    lr = lr_of_choice(config, shape, chosen.max_tokens)
    corpus_tokens = int(data.tgt.lengths.sum())
    dropout = dropout_of_choice(config, shape, chosen, corpus_tokens)
    say(f"model.size auto: training {shape.name} ({shape.describe()}), {chosen.max_tokens:,}-token batches"
        + (f" (train.min_updates {train_cfg.min_updates:,}: smaller than train.max_tokens "
           f"{train_cfg.max_tokens:,})" if chosen.max_tokens != train_cfg.max_tokens else "")
        + (f", peak lr {lr:g} (the shape's; train.lr would pin another)" if lr is not None
           else f", peak lr {train_cfg.lr:g} (train.lr)")
        + (f", dropout {dropout:g} (for {chosen.updates:,} updates, {passes(chosen, corpus_tokens):.1f} passes over "
           "the corpus; model.dropout would pin another)"
           if dropout is not None else f", dropout {config.model.dropout:g} (model.dropout)"))
    first = run.shape_choice() if replanned else None
    run.write_shape_choice(ShapeChoice(
        shape.name, chosen.max_tokens, lr or train_cfg.lr, config.model.dropout if dropout is None else dropout,
        round(spent, 2), round(busy, 3), budget, train_cfg.max_steps, str(device),
        [{**asdict(p.timing), "tokens_per_second": round(p.timing.tokens_per_second, 1), "max_tokens": p.max_tokens,
          "updates": p.updates, "predicted_bleu": round(p.bleu, 2)} for p in predictions],
        {"why": replanned, "after_seconds": round(spent_before, 1), "first": first.to_json() if first else {}}
        if replanned else None))
    check = None if budget is None or replanned or device.type != "cpu" else PlanCheck(
        shape.name, chosen.timing.tokens_per_second, busy, min(CHECK_AFTER, CHECK_SHARE * budget),
        CHECK_DEADLINE * budget)
    return with_shape(config, shape, chosen.max_tokens, lr, dropout), spent, check


def record_check(run: RunDirectory, check: dict) -> None:
    """The in-run check of the plan, added to the run's shape_choice.json."""
    choice = run.shape_choice()
    if choice is not None:
        run.write_shape_choice(replace(choice, check=check))


def resolve_size(config: ExperimentConfig, resume: bool, last_checkpoint: Path,
                 say: Callable[[str], None]) -> ExperimentConfig | None:
    """The config `tfm train` trains: as given, with a named shape's learning rate where train.lr is
    not given; under model.size auto, the resumed (or fine-tuned) run's shape; None where model.size
    auto is to time the shapes now (`choose_shape`): a new run."""
    if config.model.size not in (AUTO, STUDENT) and not resume:
        warn_if_slower_than_teacher(config, say)
    if config.model.size in SHAPES:  # a named shape trains at its measured learning rate, as under auto...
        lr = lr_of_choice(config, SHAPES[config.model.size], config.train.max_tokens)
        if lr and resume and last_checkpoint.exists():  # ...and a resumed run at the one it started with
            lr = TrainedSettings.read(last_checkpoint).lr or lr
        return config.model_copy(update={"train": config.train.model_copy(update={"lr": lr})}) if lr else config
    if config.model.size == STUDENT:
        return student_config(config, resume and last_checkpoint.exists(), last_checkpoint, say)
    if config.model.size != AUTO:
        return config
    if resume and last_checkpoint.exists():
        resumed = shape_of_run(config, last_checkpoint)
        name = resumed.model.size or "its own shape"
        say(f"model.size auto: resuming the shape this run chose, {name} (d_model {resumed.model.d_model}, "
            f"{resumed.model.enc_layers}+{resumed.model.dec_layers} layers, FFN {resumed.model.d_ff})")
        return resumed
    if config.train.init_from:
        parent = checkpoint_at(config.train.init_from)
        started = shape_of_run(config, parent, keep_batch=False)
        say(f"model.size auto: fine-tuning keeps the shape of {parent} (d_model {started.model.d_model}, "
            f"{started.model.enc_layers}+{started.model.dec_layers} layers, FFN {started.model.d_ff})")
        return started
    return None
