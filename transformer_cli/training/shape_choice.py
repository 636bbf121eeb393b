"""`model.size: auto`: given the budget and the machine, choose what to train.

Before the first step, every named shape (experiment/shapes.py) trains a few updates on the run's
own batches, on this device, in the precision `tfm train` would use for it; its speed (target
tokens a second) turns the budget left into the updates it would make, and its measured curve
into the valid BLEU those updates reached. The shape with the highest prediction is trained; within
`TIE_BLEU` of it, the fastest (it also translates fastest). Nothing here reads a CPU's name: a slow
machine buys fewer tokens, and the curves say which shape learns most from those.

A budget that buys few updates learns more from more, smaller batches: with `train.min_updates`
a shape that would make fewer updates than that trains on 1,000-token batches (`batch_for_budget`).

Each shape trains at the peak learning rate its curve was measured with (`NamedShape.lr`) unless
the config gives `train.lr`, and at the dropout its curve was measured with, or a higher one where
the budget runs past the point that shape was seen to overfit (`NamedShape.dropout_for`), unless the
config gives `model.dropout`.

A resumed run never probes again: its checkpoint's shape, batch, learning rate and dropout are the
run's (`shape_of_run`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..data.batches import Batch, ParallelData
from ..experiment.checkpoint import load_checkpoint
from ..experiment.config import ExperimentConfig, TrainConfig, parse_duration
from ..experiment.rundir import RunDirectory
from ..experiment.shapes import AUTO, SHAPE_KEYS, SHAPES, NamedShape
from ..runtime.errors import TfmError
from ..runtime.files import atomic_write_text
from ..runtime.precision import autocast_dtype, choose_precision
from .builders import adam, build_model
from .loss import batch_loss
from .step_health import gradient_norm

BATCH_FLOOR = 1000  # tokens: the smallest batch train.min_updates shrinks to (docs/training.md)
PROBE_UPDATES = 4  # per shape: the first builds kernels and is not counted, the median of the others is
PROBE_SHARE = 0.05  # of a max_time budget, at most, before the shapes not yet timed are left out
TIE_BLEU = 0.25  # predictions this close are a tie, and the fastest shape wins it
CHOICE_FILE = "shape_choice.json"


@dataclass(frozen=True)
class ShapeTiming:
    name: str
    seconds_per_update: float
    tokens_per_update: float  # target tokens
    precision: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_update / self.seconds_per_update


@dataclass(frozen=True)
class Prediction:
    timing: ShapeTiming
    max_tokens: int  # the batch it would train with (train.max_tokens, or smaller: batch_for_budget)
    updates: int  # the budget left, in this shape's updates of that batch
    bleu: float  # predicted valid greedy BLEU after those updates


def predict(timings: Sequence[ShapeTiming], seconds_left: float | None, updates_left: int, max_tokens: int,
            min_updates: int | None = None) -> list[Prediction]:
    """What each timed shape (timed at `max_tokens`) reaches in the budget left: `seconds_left` of
    training (None: no time limit) and at most `updates_left` updates, at the batch
    `batch_for_budget` gives it (a smaller batch takes proportionally less time: its tokens a second hold)."""
    predictions = []
    for timing in timings:
        batch = batch_for_budget(max_tokens, min_updates, timing, seconds_left)
        seconds_per_update = timing.seconds_per_update * batch / max_tokens
        by_time = math.inf if seconds_left is None else max(seconds_left, 0.0) / seconds_per_update
        updates = int(min(by_time, updates_left))
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
                     seconds_left: float | None) -> int:
    """train.max_tokens, or BATCH_FLOOR where the budget left would make fewer than `min_updates`
    updates with it at the timed shape's speed (measured: at the same seconds, 1,000-token batches
    scored more than 1,500 and far more than 3,000 there; docs/training.md)."""
    if min_updates is None or seconds_left is None or max_tokens <= BATCH_FLOOR:
        return max_tokens
    updates = max(seconds_left, 0.0) / timing.seconds_per_update
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


def dropout_of_choice(config: ExperimentConfig, shape: NamedShape, chosen: Prediction) -> float | None:
    """The dropout `auto` trains `shape` with for the updates it predicted, unless the config gives
    model.dropout (None)."""
    if "dropout" in config.model.model_fields_set:
        return None
    return shape.dropout_for(chosen.updates * chosen.max_tokens)


def probe_batches(data: ParallelData, config: ExperimentConfig, count: int) -> list[list[Batch]]:
    """The run's first `count` updates (each `accum_steps` batches), collated: every shape times the same."""
    order = data.batches(config.train.max_tokens, seed=config.train.seed)
    per_update = config.train.accum_steps
    updates = [order[i * per_update:(i + 1) * per_update] for i in range(min(count, len(order) // per_update))]
    return [[data.collate(indices) for indices in update] for update in updates if update]


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


def time_shape(config: ExperimentConfig, shape: NamedShape, updates: list[list[Batch]], vocab: tuple[int, int],
               shared_ids: bool, device: torch.device) -> ShapeTiming:
    """Train `updates` from random weights of `shape`; seconds per update after the first (on a GPU,
    the mean of a second pass)."""
    shaped = with_shape(config, shape)
    precision = choose_precision(config.train.precision, device, (shape.d_model, shape.d_ff))
    amp_dtype = autocast_dtype(precision)
    model = build_model(shaped, *vocab, shared_ids).to(device)
    optimizer = adam(model, config.train)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    model.train()
    tokens = [sum(batch.n_tgt_tokens for batch in batches) for batches in updates]
    if device.type == "cuda":
        # A GPU's first pass over new batch shapes picks its kernels and grows its memory pool, and
        # waiting for each update idles it where training queues the next: timed so, an H200 looked
        # 2.4x slower than it trains (3,183 updates predicted for 150 s, 6,058 made). The batches
        # pass once untimed, then once timed as a whole, queued as in training. (Then a 300-s run made
        # half the updates predicted: its evaluations and the loop's host work are not timed here.)
        for batches in updates:
            _train_update(model, optimizer, batches, device, amp_dtype, config.train)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for batches in updates:
            _train_update(model, optimizer, batches, device, amp_dtype, config.train)
        torch.cuda.synchronize(device)
        return ShapeTiming(shape.name, (time.perf_counter() - start) / len(updates), statistics.mean(tokens),
                           precision.name)
    seconds = []
    for batches in updates:
        start = time.perf_counter()
        _train_update(model, optimizer, batches, device, amp_dtype, config.train)
        seconds.append(time.perf_counter() - start)
    counted = slice(1, None) if len(seconds) > 1 else slice(None)  # the first builds kernels
    return ShapeTiming(shape.name, statistics.median(seconds[counted]), statistics.mean(tokens[counted]),
                       precision.name)


def time_shapes(config: ExperimentConfig, data: ParallelData, vocab: tuple[int, int], shared_ids: bool,
                device: torch.device, limit_seconds: float | None,
                say: Callable[[str], None]) -> tuple[list[ShapeTiming], float]:
    """Every named shape timed, smallest first; once `limit_seconds` are spent the larger ones are
    left out (said). Returns the timings and the seconds spent."""
    updates = probe_batches(data, config, PROBE_UPDATES)
    if not updates:
        raise TfmError("model.size auto: the training split has no batch to time the shapes on")
    started = time.perf_counter()
    timings = []
    for shape in sorted(SHAPES.values(), key=lambda s: s.d_model * (s.enc_layers + s.dec_layers)):
        if limit_seconds is not None and timings and time.perf_counter() - started > limit_seconds:
            say(f"model.size auto: {shape.name} not timed (the probe's {limit_seconds:.3g} s are spent)")
            continue
        timings.append(time_shape(config, shape, updates, vocab, shared_ids, device))
    return timings, time.perf_counter() - started


# --------------------------------------------------------------------------- the run's shape


def shape_of_run(config: ExperimentConfig, last_checkpoint: Path, keep_batch: bool = True) -> ExperimentConfig:
    """A resumed `auto` run trains the shape its checkpoint holds (`keep_batch`: and its batches):
    never another probe. Fine-tuning (`train.init_from`) takes its parent's shape the same way."""
    payload = load_checkpoint(last_checkpoint, map_location="cpu")
    trained = payload.get("model_config", {})
    chosen = payload.get("config", {}).get("model", {}).get("size")
    keys = {key: trained[key] for key in SHAPE_KEYS if key in trained}
    if len(keys) != len(SHAPE_KEYS):
        raise TfmError(f"{last_checkpoint} does not say its model's shape; give the shape keys "
                       "(model.d_model, …) instead of model.size auto")
    # ... and its dropout where the config leaves it to `auto` (it may have chosen one for its budget)
    trained_model = payload.get("config", {}).get("model", {}) if keep_batch else {}
    dropout = ({"dropout": trained_model["dropout"]} if "dropout" in trained_model
               and "dropout" not in config.model.model_fields_set else {})
    model = config.model.model_copy(update={"size": chosen if chosen in SHAPES else None, **keys, **dropout})
    # ... its batches (the data order, batches taken of each epoch, is counted in them) and its
    # learning rate (the schedule goes on where it was)
    trained_train = payload.get("config", {}).get("train", {}) if keep_batch else {}
    train = config.train.model_copy(update={"max_tokens": trained_train.get("max_tokens", config.train.max_tokens),
                                            "lr": config.train.lr if "lr" in config.train.model_fields_set
                                            else trained_train.get("lr", config.train.lr)})
    return config.model_copy(update={"model": model, "train": train})


def choose_shape(config: ExperimentConfig, data: ParallelData, vocab: tuple[int, int], shared_ids: bool,
                 device: torch.device, run_root: Path, say: Callable[[str], None]) -> tuple[ExperimentConfig, float]:
    """The config with the shape `auto` chooses for this budget on this device, and the probe's
    seconds (the trainer counts them as spent). Prints the table and writes it to the run."""
    train_cfg = config.train
    budget = parse_duration(train_cfg.max_time) if train_cfg.max_time is not None else None
    limit = None if budget is None else PROBE_SHARE * budget
    timings, spent = time_shapes(config, data, vocab, shared_ids, device, limit, say)
    seconds_left = None if budget is None else budget - spent
    predictions = predict(timings, seconds_left, train_cfg.max_steps, train_cfg.max_tokens, train_cfg.min_updates)
    chosen = choose(predictions)
    limit_text = f"{budget:.0f} s budget" if budget is not None else f"{train_cfg.max_steps:,} updates"
    say(f"model.size auto: timed {len(timings)} shapes on {device} in {spent:.1f} s of the {limit_text}; "
        "valid BLEU (greedy) predicted by the curves measured on Multi30k (docs/training.md):")
    for line in table(predictions, chosen):
        say(line)
    shape = SHAPES[chosen.timing.name]
    lr = lr_of_choice(config, shape, chosen.max_tokens)
    dropout = dropout_of_choice(config, shape, chosen)
    say(f"model.size auto: training {shape.name} ({shape.describe()}), {chosen.max_tokens:,}-token batches"
        + (f" (train.min_updates {train_cfg.min_updates:,}: smaller than train.max_tokens "
           f"{train_cfg.max_tokens:,})" if chosen.max_tokens != train_cfg.max_tokens else "")
        + (f", peak lr {lr:g} (the shape's; train.lr would pin another)" if lr is not None
           else f", peak lr {train_cfg.lr:g} (train.lr)")
        + (f", dropout {dropout:g} (for {chosen.updates:,} updates; model.dropout would pin another)"
           if dropout is not None else f", dropout {config.model.dropout:g} (model.dropout)"))
    record = {"chosen": shape.name, "max_tokens": chosen.max_tokens, "lr": lr or train_cfg.lr,
              "dropout": config.model.dropout if dropout is None else dropout,
              "probe_seconds": round(spent, 2),
              "budget_seconds": budget, "max_steps": train_cfg.max_steps, "device": str(device),
              "shapes": [{**asdict(p.timing), "tokens_per_second": round(p.timing.tokens_per_second, 1),
                          "max_tokens": p.max_tokens, "updates": p.updates, "predicted_bleu": round(p.bleu, 2)}
                         for p in predictions]}
    run_root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_root / CHOICE_FILE, json.dumps(record, indent=1) + "\n")
    return with_shape(config, shape, chosen.max_tokens, lr, dropout), spent


def resolve_size(config: ExperimentConfig, resume: bool, last_checkpoint: Path,
                 choose_now: Callable[[], tuple[ExperimentConfig, float]],
                 say: Callable[[str], None]) -> tuple[ExperimentConfig, float]:
    """The config `tfm train` trains: as given, with a named shape's learning rate where train.lr is
    not given; under model.size auto, the resumed run's shape, or the one chosen now (`choose_now`).
    Returns it and the seconds a probe spent."""
    if config.model.size in SHAPES:  # a named shape trains at its measured learning rate, as under auto...
        lr = lr_of_choice(config, SHAPES[config.model.size], config.train.max_tokens)
        if lr and resume and last_checkpoint.exists():  # ...and a resumed run at the one it started with
            lr = load_checkpoint(last_checkpoint, map_location="cpu").get("config", {}).get("train", {}).get("lr", lr)
        return (config.model_copy(update={"train": config.train.model_copy(update={"lr": lr})}) if lr else config), 0.0
    if config.model.size != AUTO:
        return config, 0.0
    if resume and last_checkpoint.exists():
        resumed = shape_of_run(config, last_checkpoint)
        name = resumed.model.size or "its own shape"
        say(f"model.size auto: resuming the shape this run chose, {name} (d_model {resumed.model.d_model}, "
            f"{resumed.model.enc_layers}+{resumed.model.dec_layers} layers, FFN {resumed.model.d_ff})")
        return resumed, 0.0
    if config.train.init_from:
        parent = Path(config.train.init_from)
        parent = RunDirectory(parent).default_checkpoint() if parent.is_dir() else parent
        started = shape_of_run(config, parent, keep_batch=False)
        say(f"model.size auto: fine-tuning keeps the shape of {parent} (d_model {started.model.d_model}, "
            f"{started.model.enc_layers}+{started.model.dec_layers} layers, FFN {started.model.d_ff})")
        return started, 0.0
    return choose_now()
