"""The models a training run makes at its end, each validated, saved and logged like the step
checkpoints: checkpoint_avg.pt (the mean of the last evaluated checkpoints) and checkpoint_ema.pt
(the moving average of the weights)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from ..experiment.checkpoint import average_state_dicts
from ..experiment.config import TrainConfig
from ..experiment.rundir import AVERAGE, EMA, RunDirectory, step_of
from ..model.transformer import Transformer
from .ema import WeightAverage
from .validation import Validation


class FinalModels:
    """`model` is the trained model; `payload(model)` a checkpoint of it (the run's configs,
    vocabularies and progress), `log(record)` and `say(line)` the run's metrics log and console."""

    def __init__(self, model: Transformer, run_dir: RunDirectory, validation: Validation,
                 payload: Callable[[Transformer], dict], log: Callable[[dict], None], say: Callable[[str], None],
                 train_cfg: TrainConfig, step: int, elapsed: float):
        self.model, self.run_dir, self.validation, self.payload = model, run_dir, validation, payload
        self.log, self.say, self.train_cfg, self.step, self.elapsed = log, say, train_cfg, step, elapsed

    def average(self) -> float | None:
        """checkpoint_avg.pt: the mean of the last `average_last` step checkpoints of the run's final
        `average_window`; returns its score (None: too few checkpoints, and an older run's average is
        removed: it would no longer be its final one)."""
        path = self.run_dir.checkpoints / AVERAGE
        first_step = (1.0 - self.train_cfg.average_window) * self.step
        chosen = [p for p in self.run_dir.step_checkpoints() if step_of(p) > first_step][-self.train_cfg.average_last:]
        if len(chosen) < 2:
            path.unlink(missing_ok=True)
            self.say(f"no checkpoint_avg.pt: {len(chosen)} evaluated checkpoint(s) in the last "
                     f"{100 * self.train_cfg.average_window:.0f}% of the run (evaluate more often: train.eval_every)")
            return None
        averaged = copy.deepcopy(self.model)
        averaged.load_state_dict(average_state_dicts(chosen))
        names = [p.name for p in chosen]
        return self.record(averaged, AVERAGE, {"averaged": names}, "valid_avg", f"mean of {', '.join(names)}")

    def moving_average(self, ema: WeightAverage) -> float:
        """checkpoint_ema.pt: the moving average of the weights; returns its score."""
        with ema.applied(self.model):
            return self.record(self.model, EMA, {"ema_decay": ema.decay}, "valid_ema",
                               f"moving average of the weights (decay {ema.decay})")

    def record(self, model: Transformer, name: str, extra: dict, kind: str, what: str) -> float:
        """Validate `model`, save it as `name`, log it; its score."""
        metrics = self.validation(model)
        self.run_dir.save(name, {**self.payload(model), **extra})
        self.log({"kind": kind, "step": self.step, **extra, "elapsed": round(self.elapsed, 1), **metrics})
        self.say(f"{name} = {what}: valid loss {metrics['loss']:.3f} BLEU {metrics['bleu']:.2f} "
                 f"(greedy, {self.train_cfg.eval_bleu_sentences} sentences)")
        return self.validation.score(metrics)
