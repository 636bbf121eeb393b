"""Learning-rate schedules: the paper's (Vaswani et al. eq. 3, "noam"), inverse square root,
constant, and "budget" (warm-up, then cosine decay that reaches lr_min exactly when the run's
budget of time or steps ends). All warm up linearly; all take the optimizer step, 1-based."""

from __future__ import annotations

import math

from .config import TrainConfig, parse_duration


def budget_used(step: int, elapsed: float, config: TrainConfig) -> float:
    """Fraction of the run's budget spent: training seconds of `max_time` or steps of `max_steps`,
    whichever is further along (both are kept in checkpoints, so this survives --resume)."""
    used = step / config.max_steps
    if config.max_time is not None:
        used = max(used, elapsed / parse_duration(config.max_time))
    return min(max(used, 0.0), 1.0)


def warmup_steps(step: int, config: TrainConfig, budget: float = 0.0) -> float:
    """Length of the linear warm-up: `warmup` steps, or fewer when `warmup_ratio` of the budget comes
    first. The budget's length in steps is projected from the pace so far (step / budget), which is
    exact for max_steps and follows the CPU's speed for max_time; step and elapsed time are both in
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
