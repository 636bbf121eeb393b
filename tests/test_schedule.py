"""The budget schedule follows the work done: a run on a machine that is busy for a while loses the
steps it could not make, not the learning rate of the steps it makes later. Runs are simulated on
a fake clock (no waiting): each step takes the seconds the scenario gives it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import pytest

from transformer_cli.experiment.config import TrainConfig
from transformer_cli.training.schedule import budget_used, learning_rate, next_learning_rate
from transformer_cli.training.train import TrainProgress

PEAK = 1e-3
THIRTY_MINUTES = TrainConfig(lr_schedule="budget", lr=PEAK, warmup=100, max_time="30m", max_steps=10**6)


def simulated_run(config: TrainConfig, seconds_per_step: Callable[[int, float], float],
                  progress: TrainProgress | None = None,
                  stop_at: int | None = None) -> tuple[list[float], TrainProgress]:
    """The learning rate of every step a run makes until max_time, as the trainer computes them
    (`next_learning_rate` with the progress it keeps); step n, started at time t, lasts
    seconds_per_step(n, t). `stop_at`: stop after that many steps (a kill); `progress`: resume from it."""
    progress = progress or TrainProgress()
    lrs = []
    while progress.elapsed < 1800.0 and (stop_at is None or progress.step < stop_at):
        lr, progress.pace_marks = next_learning_rate(progress.step, progress.elapsed, progress.pace_marks, config, 256)
        lrs.append(lr)
        progress.elapsed += seconds_per_step(progress.step, progress.elapsed)
        progress.step += 1
    return lrs, progress


def undisturbed_curve(config: TrainConfig, steps: int) -> list[float]:
    """The learning rates of a run that makes `steps` steps at an even pace: its budget is those steps."""
    by_steps = config.model_copy(update={"max_time": None, "max_steps": steps})
    return [learning_rate(step + 1, by_steps, 256, budget_used(step, 0.0, by_steps)) for step in range(steps)]


def distance(lrs: list[float], curve: list[float]) -> tuple[float, float]:
    """Mean and largest gap between two learning-rate curves, in units of the peak."""
    gaps = [abs(a - b) / PEAK for a, b in zip(lrs, curve, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)


def slow_first_third(step: int, t: float) -> float:
    """Other jobs take the CPU for the first 10 minutes: a step takes 2 s there, 0.5 s after."""
    return 2.0 if t < 600 else 0.5


def test_a_slow_start_costs_only_the_steps_it_could_not_make():
    lrs, _ = simulated_run(THIRTY_MINUTES, slow_first_third)
    curve = undisturbed_curve(THIRTY_MINUTES, len(lrs))
    mean, _ = distance(lrs, curve)
    assert mean < 0.05
    # Once the pace is measured again (a window after the machine is free), the steps follow the
    # undisturbed curve: with the clock they ran up to a quarter of the peak below it.
    _, after = distance(lrs[len(lrs) // 3 :], curve[len(lrs) // 3 :])
    assert after < 0.01
    assert lrs[-1] == pytest.approx(0.0, abs=1e-3 * PEAK)  # and it still ends at lr_min when the time ends

    # The wall clock alone (budget_used without marks: the pace since the start) fails this: every
    # step made after the slow third ran at the rate of a run a third further along.
    clock, step, elapsed = [], 0, 0.0
    while elapsed < 1800.0:
        clock.append(learning_rate(step + 1, THIRTY_MINUTES, 256, budget_used(step, elapsed, THIRTY_MINUTES)))
        step, elapsed = step + 1, elapsed + slow_first_third(step, elapsed)
    mean, _ = distance(clock, undisturbed_curve(THIRTY_MINUTES, len(clock)))
    assert mean > 0.1


def test_an_even_pace_with_evaluation_pauses_stays_on_the_curve():
    """Every 200 steps a 15-second evaluation: the measured pace includes them, without swinging
    the schedule away from the curve of a run that makes as many steps."""
    lrs, _ = simulated_run(THIRTY_MINUTES, lambda step, t: 0.5 + (15.0 if step % 200 == 199 else 0.0))
    mean, largest = distance(lrs, undisturbed_curve(THIRTY_MINUTES, len(lrs)))
    assert mean < 0.01 and largest < 0.05


def test_a_step_budget_that_ends_first_wins():
    """max_steps ending before max_time: the steps' fraction, as without max_time."""
    config = THIRTY_MINUTES.model_copy(update={"max_steps": 1000})
    lrs, progress = simulated_run(config, lambda step, t: 0.5, stop_at=1000)
    assert progress.step == 1000
    assert lrs == pytest.approx(undisturbed_curve(config, 1000), abs=1e-6 * PEAK)


def test_resume_continues_the_same_curve():
    """The schedule's state is in the checkpoint's progress (step, elapsed, pace marks): a run
    killed at step 700 (in the slow part's aftermath) and resumed from its saved progress makes the
    same learning rates as one that was never stopped."""
    whole, _ = simulated_run(THIRTY_MINUTES, slow_first_third)
    first, progress = simulated_run(THIRTY_MINUTES, slow_first_third, stop_at=700)
    saved = TrainProgress(**asdict(progress))  # what checkpoint_last.pt keeps and --resume reads
    rest, _ = simulated_run(THIRTY_MINUTES, slow_first_third, progress=saved)
    assert first + rest == whole


def test_a_checkpoint_without_pace_marks_resumes():
    """Checkpoints written before the marks existed resume with the pace since the start."""
    old = {k: v for k, v in asdict(TrainProgress(step=500, elapsed=600.0)).items() if k != "pace_marks"}
    progress = TrainProgress(**old)
    lr, marks = next_learning_rate(progress.step, progress.elapsed, progress.pace_marks, THIRTY_MINUTES, 256)
    clock = learning_rate(501, THIRTY_MINUTES, 256, budget_used(500, 600.0, THIRTY_MINUTES))
    assert marks and lr == pytest.approx(clock)
