"""Learning-rate schedules: the paper's (Vaswani et al. eq. 3, "noam"), inverse square root,
constant, and "budget" (warm-up, then cosine decay that reaches lr_min exactly when the run's
budget of time or steps ends). All warm up linearly; all take the optimizer step, 1-based."""

from __future__ import annotations

import math

from ..experiment.config import TrainConfig, parse_duration

# The recent pace is measured over the last one to two windows of this fraction of max_time (3 to 6
# minutes of a 30-minute run): long enough to span evaluations and uneven batches, short enough to
# follow a machine that gets busy or free. Simulated (a slow first third, or evaluations every few
# minutes), a twentieth followed a slow start closer but swung with every evaluation, and a fifth
# strayed twice as far from the undisturbed curve after a slow start.
PACE_WINDOW = 0.1

Mark = list[float]  # [step, elapsed seconds]: a point the recent pace is measured from


def budget_used(step: int, elapsed: float, config: TrainConfig, marks: list[Mark] | None = None) -> float:
    """Fraction of the run's budget spent: steps of `max_steps`, or, with `max_time`, the steps
    done over the steps the run will have made when its time ends, whichever is further along.

    The steps still to come are the remaining seconds at the recent pace (steps per second since
    `marks[0]`, see `pace_marks`; without marks, the pace since the start, which makes this the
    elapsed fraction of max_time). So the schedule follows the work done: a machine that is busy
    for a while slows the schedule with the steps, and the steps made once it is free get the
    learning rate of an undisturbed run of that many steps, not the decayed rate of a clock that
    kept running. The step, elapsed time and marks are all kept in checkpoints: --resume continues
    the same curve."""
    used = step / config.max_steps
    if config.max_time is not None and step > 0:
        remaining = max(parse_duration(config.max_time) - elapsed, 0.0)
        mark_step, mark_elapsed = marks[0] if marks else (0.0, 0.0)
        if elapsed > mark_elapsed:
            pace = (step - mark_step) / (elapsed - mark_elapsed)
        else:  # no time since the mark (a checkpoint written at it): the pace since the start
            pace = step / elapsed if elapsed > 0 else 0.0
        ahead = remaining * pace  # steps the remaining time allows
        used = max(used, step / (step + ahead))
    return min(max(used, 0.0), 1.0)


def pace_marks(marks: list[Mark], step: int, elapsed: float, config: TrainConfig) -> list[Mark]:
    """The marks `budget_used` measures the recent pace from, after `step` steps in `elapsed`
    seconds: the start of the run, then, once a window (PACE_WINDOW of max_time) has passed, the
    last two window starts; the pace is measured from the older, over one to two windows."""
    if config.max_time is None:
        return marks
    marks = marks or [[0, 0.0]]
    if elapsed - marks[-1][1] >= PACE_WINDOW * parse_duration(config.max_time):
        marks = [*marks[-1:], [step, elapsed]]
    return marks


def next_learning_rate(step: int, elapsed: float, marks: list[Mark], config: TrainConfig,
                       d_model: int) -> tuple[float, list[Mark]]:
    """The learning rate of optimizer step `step` + 1, after `step` steps in `elapsed` training
    seconds, and the pace marks to keep (in the checkpoint's progress) for the next one."""
    marks = pace_marks(marks, step, elapsed, config)
    return learning_rate(step + 1, config, d_model, budget_used(step, elapsed, config, marks)), marks


def warmup_steps(step: int, config: TrainConfig, budget: float = 0.0) -> float:
    """Length of the linear warm-up: `warmup` steps, or fewer when `warmup_ratio` of the budget comes
    first. The budget's length in steps is projected from the pace (step / budget), which is exact
    for max_steps and follows the CPU's recent speed for max_time; what it is computed from is in
    checkpoints, so it survives --resume."""
    if config.warmup_ratio is None or budget <= 0.0:
        return float(config.warmup)
    return min(float(config.warmup), config.warmup_ratio * step / budget)


def learning_rate(step: int, config: TrainConfig, d_model: int, budget: float = 0.0) -> float:
    """Learning rate at optimizer step `step` (1-based); `budget` = `budget_used()` (budget schedule,
    `warmup_ratio`)."""
    step = max(step, 1)
    warmup = max(warmup_steps(step, config, budget), 1.0)
    if config.lr_schedule == "budget":
        # warm-up x cosine decay over the whole budget: at the end, exactly lr_min.
        warm = min(1.0, step / warmup) if config.warmup else 1.0
        return config.lr_min + (config.lr * warm - config.lr_min) * 0.5 * (1.0 + math.cos(math.pi * budget))
    if config.lr_schedule == "noam":
        # Vaswani et al. eq. (3): linear warm-up, then inverse square-root decay.
        return config.lr_factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if config.lr_schedule == "inverse_sqrt":
        # Same shape, parameterised by its peak: lr(warmup) = config.lr.
        return config.lr * min(step / warmup, math.sqrt(warmup / step))
    return config.lr * min(1.0, step / warmup) if config.warmup else config.lr
