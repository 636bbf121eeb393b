"""Stage 3, training: teacher forcing, label smoothing, warm-up schedules, checkpoints, validation.

`train()` runs one `Trainer`, whose loop reads top to bottom:

    batches → learning rate → loss step (forward + backward) → update (clip, skip a non-finite
    step, optimizer, moving average) → log → stop? → evaluate and save?

Under torchrun every process runs this same code (training/distributed.py); rank 0 alone prints, logs and
writes checkpoints. Schedules are in training/schedule.py, the loss in training/loss.py, where a run keeps its
files in experiment/rundir.py.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ..data.augmented_data import AugmentedData, training_split
from ..data.augmented_data import describe as describe_augmentation
from ..data.batch_stream import BatchStream, CollatedUpdates, Update
from ..data.batches import ParallelData, padding_ratio
from ..experiment.checkpoint import TrainingState, load_initial_weights, model_payload, training_payload
from ..experiment.config import ExperimentConfig, TrainConfig, config_to_yaml, parse_duration
from ..experiment.rundir import AVERAGE, BEST, EMA, LAST, Manifest, MetricsLog, RunDirectory, checkpoint_at, step_name
from ..experiment.runlock import RunLock
from ..model.kernels import compile_for_training
from ..model.transformer import Transformer
from ..runtime.allocator import loaded_allocator
from ..runtime.console import TrainingConsole, warn
from ..runtime.cpu import keep_freed_memory, release_freed_memory
from ..runtime.devices import describe_machine, is_out_of_memory, resolve_device
from ..runtime.errors import Interrupted, TfmError
from ..runtime.files import atomic_write_text, remove_stale_temps
from ..runtime.precision import autocast_dtype, choose_precision
from ..runtime.signals import EXIT_CODES, StopRequest
from .builders import adam, build_model
from .distributed import StopVote, World, all_max, all_rng_states, all_sum, join, leave, world_from_environment
from .ema import WeightAverage
from .final_models import FinalModels
from .loss import batch_loss
from .schedule import next_learning_rate
from .shape_choice import PlanCheck, TrainedSoFar, choose_shape, record_check, resolve_size
from .step_health import StepLedger, gradient_norm
from .tensorboard_log import TensorBoardLog
from .validation import Validation


def check_vocab_matches(config: ExperimentConfig, manifest: Manifest) -> None:
    """The config's vocab settings must be those the run_dir was prepared with."""
    mismatch = config.vocab_mismatch(manifest)
    if mismatch:
        raise TfmError(f"{mismatch}; re-run `tfm prepare` (on a trained run: with --discard-checkpoints) "
                       "or change the config")


# --------------------------------------------------------------------------- what a run keeps


@dataclass
class TrainProgress:
    """Everything besides weights/optimizer needed to resume exactly (saved in checkpoints)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    elapsed: float = 0.0  # seconds of training so far (across resumes)
    pace_marks: list[list[float]] = field(default_factory=list)  # [step, elapsed] the budget schedule's pace is from
    target_tokens: int = 0
    best_score: float | None = None
    best_step: int = 0
    bad_evals: int = 0
    bad_steps: int = 0  # consecutive skipped (non-finite) updates
    skipped_steps: int = 0  # all skipped updates of the run
    evaluated_step: int = 0  # the step of the last evaluation
    finished: str = ""  # why the run ended ("max_steps=…"); empty while it can go on
    machines: list[str] = field(default_factory=list)  # what it trained on (devices.describe_machine), in order


@dataclass
class TrainSummary:
    steps: int
    seconds: float
    best_score: float | None
    best_metric: str
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    stop_reason: str
    plan_gap: str = ""  # why the run stopped to time the shapes again (model.size auto's plan check)


@dataclass
class StepResult:
    """One update's loss sums over this process's micro-batches (device tensors: never read here),
    and the update's target tokens."""

    loss: torch.Tensor
    nll: torch.Tensor
    padding: float = 0.0  # summed padding ratios of the micro-batches
    batches: int = 0
    tokens: int = 0  # target tokens of the whole update (all processes), the loss normaliser


def budget_spent(train_cfg: TrainConfig, progress: TrainProgress) -> str:
    """Why a run with this progress cannot go on under these settings ("" if it can)."""
    if progress.step >= train_cfg.max_steps:
        return f"max_steps={train_cfg.max_steps}"
    if train_cfg.max_time is not None and progress.elapsed >= parse_duration(train_cfg.max_time):
        return f"max_time={train_cfg.max_time}"
    if train_cfg.max_epochs is not None and progress.epoch >= train_cfg.max_epochs:
        return f"max_epochs={train_cfg.max_epochs}"
    if train_cfg.patience is not None and progress.bad_evals >= train_cfg.patience:
        return f"no improvement in {train_cfg.patience} evaluations"
    return ""


def announce(say: Callable[[str], None], model: Transformer, device: torch.device, precision: str, pairs: int,
             processes: int, train_cfg: TrainConfig) -> None:
    """The lines a run starts with: the model, the update's size, the allocator, the warm-up."""
    say(f"model: {model.num_parameters():,} parameters on {device}, {precision}; {pairs:,} training pairs")
    per_update = processes * train_cfg.accum_steps * train_cfg.max_tokens
    say(f"effective batch: {processes} process(es) x {train_cfg.accum_steps} accumulation step(s) x "
        f"{train_cfg.max_tokens:,} tokens = {per_update:,} tokens per update (padding included)")
    if device.type == "cpu":
        say(f"memory allocator: {loaded_allocator()} (train.allocator: {train_cfg.allocator})")
    if train_cfg.warmup_ratio is not None and train_cfg.warmup:
        say(f"learning rate: {train_cfg.lr_schedule}, warm-up {train_cfg.warmup} steps or "
            f"{train_cfg.warmup_ratio:.0%} of the budget, whichever ends first")


def train_record(window: dict[str, float], loss: float, nll: float, padding: float, batches: float,
                 progress: TrainProgress, lr: float, log_every: int) -> dict:
    """A metrics.jsonl "train" record of a log window (`window`: the ledger's read; the loss sums,
    padding and batches summed over the processes)."""
    tokens = max(window["tokens"], 1.0)  # of the updates that stepped: the same on every process
    return {"kind": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr, "loss": loss / tokens,
            "ppl": math.exp(min(nll / tokens, 50)), "tokens_per_s": tokens / window["seconds"],
            "padding": padding / max(batches, 1), "tokens_per_update": tokens / log_every,
            "elapsed": round(progress.elapsed, 1)}


def weight_average(model: Transformer, train_cfg: TrainConfig, saved: dict | None, resumed_from: Path | None,
                   say: Callable[[str], None]) -> WeightAverage | None:
    """The moving average of the weights (train.ema_decay), as saved where resumed."""
    if not train_cfg.ema_decay:
        return None
    ema = WeightAverage(model, train_cfg.ema_decay)  # from the (resumed) weights
    if saved is not None:
        ema.load_state_dict(saved)
    elif resumed_from is not None:
        say(f"train.ema_decay: {resumed_from} has no weight average; it starts from the resumed weights")
    return ema


# --------------------------------------------------------------------------- the trainer


def check_run_directory(run_dir: RunDirectory, config: ExperimentConfig, manifest: Manifest, resume: bool) -> None:
    """A new run needs a run_dir without training; --resume one with checkpoint_last.pt."""
    last = run_dir.last_checkpoint
    if last.exists() and not resume:
        raise TfmError(f"{run_dir.root} already holds a training run ({last}); "
                       "continue it with --resume or choose another run_dir")
    if resume and not last.exists():
        raise TfmError(f"--resume: no checkpoint to resume from at {last}")
    check_vocab_matches(config, manifest)


def initialise_from(model: Transformer, path: Path, spm_files: dict[str, bytes], say: Callable[[str], None]) -> None:
    """Fine-tuning: the weights of a trained model; optimizer, schedule, steps and data order start afresh."""
    path = checkpoint_at(path)
    parent = load_initial_weights(model, path, spm_files)
    step = parent.get("progress", {}).get("step", "?")
    say(f"initialised from {path} (step {step} of its run); optimizer and schedule start afresh")


def training_updates(data: ParallelData | AugmentedData, train_cfg: TrainConfig, progress: TrainProgress, world: World,
                     device: torch.device) -> CollatedUpdates:
    """The updates from where `progress` stands, collated ahead on a thread where train.prefetch
    says (default: on CUDA, into pinned memory)."""
    ahead = train_cfg.prefetch if train_cfg.prefetch is not None else device.type == "cuda"
    stream = BatchStream(data, train_cfg, progress.epoch, progress.batch_in_epoch)
    return CollatedUpdates(stream, train_cfg.accum_steps * world.size, data.collate, world.rank, world.size,
                           ahead=ahead, pin=ahead and device.type == "cuda")


def progress_line(step: int, record: dict, lr: float) -> str:
    return (f"step {step}: loss {record['loss']:.3f} ppl {record['ppl']:.1f} lr {lr:.2e} "
            f"{record['tokens_per_s']:.0f} tok/s padding {100 * record['padding']:.1f}% {record['elapsed'] / 60:.1f} min")


def done_line(summary: TrainSummary, progress: TrainProgress) -> str:
    best = "n/a" if summary.best_score is None else (
        f"{summary.best_score:.2f}" if summary.best_metric == "bleu" else f"{-summary.best_score:.3f}")
    return (f"done ({summary.stop_reason}): {progress.step} steps in {progress.elapsed / 60:.1f} min, "
            f"best valid {summary.best_metric} {best} at step {progress.best_step} → {summary.best_checkpoint}")


class Trainer:
    """One training run, as a recipe: `__init__` builds (reads the run, the data, the checkpoint to
    resume; writes nothing), `setup()` writes the run's files, `run()` trains."""

    def __init__(self, config: ExperimentConfig, world: World, device: torch.device, resume: bool,
                 progress_bar: bool, on_step: Callable[[int, Transformer], None] | None, spent: float = 0.0,
                 plan_check: PlanCheck | None = None):
        self.config, self.train_cfg, self.world, self.device = config, config.train, world, device
        self.plan_check, self.plan_gap = plan_check, ""
        self.on_step, self.progress_bar = on_step, progress_bar
        self.run_dir = config.run
        self.writer = world.rank == 0  # prints, logs and writes checkpoints
        self.metrics = MetricsLog(self.run_dir.metrics)
        self.tensorboard: TensorBoardLog | None = None  # set once the run's step is known
        self.console = TrainingConsole(self.writer, progress_bar, self._console_lost)
        self.manifest = self.run_dir.load_manifest()
        self.spm_files = {side: self.run_dir.vocab_file(self.manifest, side).read_bytes() for side in ("src", "tgt")}
        # What each checkpoint holds of the config, made once: a second signal while saving raises
        # KeyboardInterrupt wherever it lands, and inside pydantic's serializer it became another error.
        self.config_json = config.model_dump(mode="json")
        check_run_directory(self.run_dir, config, self.manifest, resume)
        torch.manual_seed(self.train_cfg.seed)
        if self.train_cfg.threads:
            torch.set_num_threads(self.train_cfg.threads)
        self.precision = choose_precision(self.train_cfg.precision, device, (config.model.d_model, config.model.d_ff))
        if device.type == "cpu":
            keep_freed_memory()
        self.train_data = training_split(self.run_dir, config, self.spm_files)
        if len(self.train_data) == 0:
            raise TfmError(f"{self.run_dir.root}: the training split is empty after filtering")
        self.validation = Validation(self.run_dir, self.manifest, config, device)
        self.model = build_model(config, self.manifest.vocab_size["src"], self.manifest.vocab_size["tgt"],
                                 self.manifest.shared_ids).to(device)
        self.optimizer = adam(self.model, self.train_cfg)
        # `spent`: seconds of max_time gone outside training (the shape probe's); the pace is measured from after them
        self.progress = TrainProgress(elapsed=spent, pace_marks=[[0, spent]] if spent else [])
        saved_ema = self._restore() if resume else None
        if resume:
            self.progress.elapsed += spent
        if not resume and self.train_cfg.init_from:
            initialise_from(self.model, Path(self.train_cfg.init_from), self.spm_files, self.console.print)
        # A run that ended and whose limits still hold is complete: --resume changes nothing.
        self.complete = budget_spent(self.train_cfg, self.progress) if self.progress.finished else ""
        self.progress.finished = ""  # resumed with a larger budget: the run goes on
        if describe_machine(device) not in self.progress.machines:  # (a model card names them)
            self.progress.machines.append(describe_machine(device))
        if resume and not self.complete:
            self.console.print(f"resuming from {self.run_dir.last_checkpoint} at step {self.progress.step}")
        if not resume and world.rank > 0:  # same initial weights (DDP syncs them), own dropout
            torch.manual_seed(self.train_cfg.seed + 7919 * world.rank)
        self.ema = weight_average(self.model, self.train_cfg, saved_ema,
                                  self.run_dir.last_checkpoint if resume else None, self.console.print)
        # DDP all-reduces (averages) gradients during backward; the model itself stays unwrapped for
        # validation, checkpoints and decoding.
        self.ddp = (DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
                    if world.enabled else None)
        forward_model = self.ddp or self.model
        self.forward_model = compile_for_training(forward_model) if self.train_cfg.compile else forward_model
        self.ledger = StepLedger(device, self.progress.bad_steps)  # what steps leave on the device
        self.stop_vote = StopVote(world)
        self.updates = training_updates(self.train_data, self.train_cfg, self.progress, world, device)

    # -- building (reads only)

    def _restore(self) -> dict | None:
        """Weights, optimizer, RNG states and progress of checkpoint_last.pt; returns its weight average."""
        state = TrainingState.read(self.run_dir.last_checkpoint, map_location=self.device)
        state.check_made_for(self.spm_files, self.manifest.data_digest, self.run_dir.root)
        if asdict(state.model_config) != asdict(self.model.cfg):
            raise TfmError(f"--resume: the model section of the config differs from {state.path}'s")
        self.model.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        state.restore_random_states(self.world.rank, self.world.size, self.train_cfg.seed + state.progress["step"])
        self.progress = TrainProgress(**state.progress)
        return state.ema

    def _console_lost(self, error: str) -> None:
        self._log({"kind": "console_lost", "time": time.time(), "error": error})

    def _log(self, record: dict) -> None:
        if self.writer:
            self.metrics.append(record)
        if self.tensorboard is not None:
            self.tensorboard.add(record)

    # -- set-up (writes)

    def setup(self) -> None:
        """The run's files before training: leftovers of writes a kill -9 interrupted removed (the
        lock is held: nobody else writes), a torn metrics line ended, the resolved config.yaml, the
        TensorBoard log."""
        if not self.writer:
            return
        for stale in remove_stale_temps(self.run_dir.root) + remove_stale_temps(self.run_dir.checkpoints):
            self.console.print(f"removed {stale.name}, left by an interrupted write")
        self.metrics.end_torn_line()
        self.run_dir.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir.config_file, config_to_yaml(self.config))
        if self.train_cfg.tensorboard:
            self.tensorboard = TensorBoardLog(self.run_dir.tensorboard, self.progress.step)

    # -- the loop

    def run(self) -> TrainSummary:
        if self.complete:
            self.console.print(f"{self.run_dir.root} is complete ({self.complete}): nothing to do; raise the limit "
                               "(e.g. --set train.max_steps=…) to train further")
            return self.summary(self.complete)
        self.setup()
        announce(self.console.print, self.model, self.device, self.precision.describe(), len(self.train_data),
                 self.world.size, self.train_cfg)
        if self.config.data.augment.enabled:
            self.console.print(describe_augmentation(self.config.data.augment))
        self.console.start_bar(self.train_cfg.max_steps, self.progress.step)
        self.model.train()
        self.started = time.perf_counter() - self.progress.elapsed
        self.ledger.started = time.perf_counter()
        self.evaluating_seconds = 0.0
        stop_reason = budget_spent(self.train_cfg, self.progress)  # a run stopped at its very last step
        with StopRequest(announce=self.writer) as stop:
            try:
                while not stop_reason:
                    update = self.updates.next()
                    self.progress.epoch, self.progress.batch_in_epoch = update.epoch, update.batch_in_epoch
                    if update.indices is None:
                        stop_reason = f"max_epochs={self.train_cfg.max_epochs}"
                        break
                    lr = self.set_learning_rate()
                    self.update(self.loss_step(update))
                    self.log(lr)
                    stop_reason = self.stop_decision(stop)
                    if not stop_reason and self.check_plan():
                        break
                    evaluating = self.progress.step % self.train_cfg.eval_every == 0 or bool(stop_reason)
                    if evaluating:
                        stop_reason = self.evaluate_and_save(stop_reason)
                    elif self.train_cfg.save_every and self.progress.step % self.train_cfg.save_every == 0:
                        self.save_checkpoints(None)
                self.stop_vote.close()
            finally:
                self.updates.close()
                self.console.close_bar()
        if self.plan_gap:  # the shapes are timed again (train()): from here, or afresh
            self.save_checkpoints(None)
            return self.summary("plan check")
        return self.finish(stop_reason)

    def check_plan(self) -> str:
        """model.size auto's plan checked against the speed trained at (`PlanCheck`; evaluations not
        counted): once decided, said, recorded and returned ("" where it holds)."""
        seconds = self.progress.elapsed - self.evaluating_seconds
        verdict = self.plan_check.observe(seconds, self.progress.target_tokens) if self.plan_check else None
        if verdict is None or self.plan_check is None:
            return ""
        if verdict.read_again:
            self.console.print(f"plan check: {verdict.read_again}")
        self.console.print(f"plan check over {verdict.seconds:.0f} s of training: {self.plan_check.shape} trains at "
                           f"{verdict.tokens_per_second:,.0f} target tokens/s (the probe timed "
                           f"{self.plan_check.tokens_per_second:,.0f}; other work took {verdict.busy:.0%} of the "
                           "CPUs meanwhile)" + (f": {verdict.gap}, so the shapes are timed again" if verdict.gap
                                                else ": the plan holds"))
        self.plan_check, self.plan_gap = None, verdict.gap
        if self.writer:
            record_check(self.run_dir, {"after_seconds": round(seconds, 1), "step": self.progress.step,
                                             "tokens_per_second": round(verdict.tokens_per_second, 1),
                                             "busy": round(verdict.busy, 3), "replan": verdict.gap,
                                             **({"read_again": verdict.read_again} if verdict.read_again else {})})
        return self.plan_gap

    def set_learning_rate(self) -> float:
        progress = self.progress
        lr, progress.pace_marks = next_learning_rate(progress.step, progress.elapsed, progress.pace_marks,
                                                     self.train_cfg, self.config.model.d_model)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def loss_step(self, update: Update) -> StepResult:
        """Forward and backward over this process's share of the update's batches (collated);
        gradients accumulate, normalised by the target tokens of the whole update."""
        zero = torch.zeros((), device=self.device)
        result = StepResult(zero, zero, tokens=sum(self.train_data.target_tokens(idx) for idx in update.indices or []))
        my_batches = update.collated or []
        amp_dtype = autocast_dtype(self.precision)
        for i, host_batch in enumerate(my_batches):
            batch = host_batch.to(self.device)
            # Gradients are all-reduced once per update: on the last micro-batch only.
            sync = self.ddp is None or i == len(my_batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss, nll = batch_loss(self.forward_model, batch, self.train_cfg.label_smoothing)
                # x world.size: DDP averages the processes' gradients, the loss wants their sum.
                (loss * (self.world.size / result.tokens)).backward()
            result.loss, result.nll = result.loss + loss.detach(), result.nll + nll.detach()
            result.padding += padding_ratio(host_batch)
            result.batches += 1
        return result

    def update(self, step: StepResult) -> None:
        """Clip, then step the optimizer and the moving average. A non-finite gradient norm (the same
        on every process) skips the update on the device: fused Adam reads it as `found_inf` and
        leaves weights and moments as they were; the skip is counted, and read at the next log or
        checkpoint (`check_health`), without the step waiting for the device."""
        progress = self.progress
        grad_norm = gradient_norm(self.model, self.train_cfg.clip_norm)
        skipped = (~torch.isfinite(grad_norm)).to(torch.float32)
        self.optimizer.found_inf, self.optimizer.grad_scale = skipped, None  # type: ignore[attr-defined]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model, skipped)
        progress.step += 1
        progress.target_tokens += step.tokens
        self.ledger.add(step.loss, step.nll, step.tokens, skipped, progress.step, step.padding, step.batches)
        progress.elapsed = time.perf_counter() - self.started
        if self.on_step is not None:
            self.on_step(progress.step, self.model)

    def check_health(self, new_window: bool) -> dict[str, float]:
        """The ledger read (`StepLedger.account`: at log and checkpoint points only)."""
        return self.ledger.account(self.progress, new_window, self.train_cfg.max_bad_steps, self.console.print,
                                   self.run_dir.last_checkpoint, self.console.close_bar)

    def log(self, lr: float) -> None:
        """Every log_every updates: a metrics.jsonl record and a progress line (the updates that
        stepped; the ledger read here is the only wait for the device between logs)."""
        progress = self.progress
        if progress.step % self.train_cfg.log_every:
            self.console.advance()
            return
        window = self.check_health(new_window=True)
        loss, nll, padding, batches = all_sum([window["loss"], window["nll"], window["padding"], window["batches"]],
                                              self.world, self.device)
        record = train_record(window, loss, nll, padding, batches, progress, lr, self.train_cfg.log_every)
        self._log(record)
        self.console.advance({"loss": f"{record['loss']:.3f}", "lr": f"{lr:.2e}",
                              "tok/s": f"{record['tokens_per_s']:.0f}"})
        if not self.progress_bar:  # no live bar (a log file, CI): one line per log interval instead
            self.console.print(progress_line(progress.step, record, lr))

    def stop_decision(self, stop: StopRequest) -> str:
        """Why training stops after this step ("" to go on). A signal saves and raises Interrupted.
        Decisions that can differ between processes (clock, signals) are agreed on: the largest
        request wins, so every process stops after the same step (with several processes the step
        after the request: StopVote reads each vote a step later, so no step waits for it)."""
        max_time = parse_duration(self.train_cfg.max_time) if self.train_cfg.max_time is not None else math.inf
        request = 2 if stop.signum is not None else int(self.progress.elapsed >= max_time)
        request = self.stop_vote.agree(request)  # several processes: the previous step's, agreed
        if request == 2:
            self.stop_vote.close()
            self.save_checkpoints(None)
            self.console.close_bar()
            signum = stop.signum or signal.SIGTERM
            saved = (f"{signal.Signals(signum).name}: saved step {self.progress.step} to {self.run_dir.last_checkpoint} "
                     "(continue with --resume)")
            raise Interrupted(saved if self.writer else "", EXIT_CODES[signum])
        if self.progress.step >= self.train_cfg.max_steps:
            return f"max_steps={self.train_cfg.max_steps}"
        return f"max_time={self.train_cfg.max_time}" if request == 1 else ""

    # -- evaluation and checkpoints

    def evaluate_and_save(self, stop_reason: str) -> str:
        """Validate (rank 0; the others wait in the checkpoint's collective), log, save the step,
        last and (if best) best checkpoints; returns why training stops ("" to go on), patience included."""
        progress, train_cfg = self.progress, self.train_cfg
        evaluation_started = time.perf_counter()
        metrics = self.validate(self.model) if self.writer else {}
        if self.writer:
            score = self.validation.score(metrics)
            if progress.best_score is None or score > progress.best_score:
                progress.best_score, progress.best_step, progress.bad_evals = score, progress.step, 0
            else:
                progress.bad_evals += 1
            self._log({"kind": "valid", "step": progress.step, "epoch": progress.epoch,
                       "elapsed": round(time.perf_counter() - self.started, 1), **metrics})
            self.console.print(f"step {progress.step}: valid loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} "
                               f"BLEU {metrics['bleu']:.2f} (greedy, {train_cfg.eval_bleu_sentences} sentences)")
        patience_over = train_cfg.patience is not None and progress.bad_evals >= train_cfg.patience
        if all_max(int(patience_over), self.world, self.device) and not stop_reason:
            stop_reason = f"no improvement in {train_cfg.patience} evaluations"
        progress.elapsed = time.perf_counter() - self.started
        progress.evaluated_step, progress.finished = progress.step, stop_reason
        self.save_checkpoints(metrics)
        release_freed_memory()  # what decoding and saving allocated, training will not reuse
        self.ledger.started = time.perf_counter()  # validation time is not training throughput
        self.evaluating_seconds += self.ledger.started - evaluation_started
        return stop_reason

    def validate(self, model: Transformer) -> dict[str, float]:
        metrics = self.validation(model)
        self.model.train()
        return metrics

    def save_checkpoints(self, metrics: dict | None) -> None:
        """checkpoint_last.pt (everything to resume), and after an evaluation (`metrics`) the step's
        weights and, if it is the best so far, checkpoint_best.pt; then prune. Every process calls
        it (it gathers their RNG states)."""
        self.check_health(new_window=False)  # the progress it saves counts every skipped update
        rng_states = all_rng_states(self.world)
        if not self.writer:
            return
        progress = self.progress
        if metrics is not None:
            weights = self.weights_payload(self.model)
            self.run_dir.save(step_name(progress.step), weights)
            if progress.best_step == progress.step:
                self.run_dir.save(BEST, weights)
        self.run_dir.save(LAST, self.training_state(rng_states))
        self.run_dir.prune_step_checkpoints(self.train_cfg.keep_last)

    def weights_payload(self, model: Transformer) -> dict:
        """A checkpoint to translate with; it names the prepared data it learnt from (--resume
        refuses a run prepared again since)."""
        digest = {"data_digest": self.manifest.data_digest} if self.manifest.data_digest is not None else {}
        return model_payload(model, self.config_json, self.spm_files, asdict(self.progress), **digest)

    def training_state(self, rng_states: list[torch.Tensor]) -> dict:
        return training_payload(self.weights_payload(self.model), self.optimizer, rng_states,
                                self.ema.state_dict() if self.ema is not None else None)

    # -- the end

    def finish(self, stop_reason: str) -> TrainSummary:
        """The final evaluation if the last step had none, the averaged and moving-average
        checkpoints, scores.json, and the summary."""
        progress = self.progress
        if progress.evaluated_step != progress.step:
            self.evaluate_and_save(stop_reason)
        elif progress.finished != stop_reason:  # stopped between evaluations (max_epochs): record why
            progress.finished = stop_reason
            self.save_checkpoints(None)
        if self.writer:
            final = FinalModels(self.model, self.run_dir, self.validation, self.weights_payload, self._log,
                                self.console.print, self.train_cfg, progress.step, progress.elapsed)
            scores = {BEST: progress.best_score}
            if self.train_cfg.average_last > 1:
                scores[AVERAGE] = final.average()
            if self.ema is not None:
                scores[EMA] = final.moving_average(self.ema)
            self.model.train()
            self.run_dir.write_scores(self.train_cfg.best_metric, scores)
        if self.tensorboard is not None:
            self.tensorboard.close()
        summary = self.summary(stop_reason)
        self.console.print(done_line(summary, progress))
        return summary

    def summary(self, stop_reason: str) -> TrainSummary:
        best = self.run_dir.checkpoints / BEST
        return TrainSummary(self.progress.step, self.progress.elapsed, self.progress.best_score,
                            self.train_cfg.best_metric, best if best.exists() else None,
                            self.run_dir.last_checkpoint, stop_reason, self.plan_gap)

# --------------------------------------------------------------------------- entry point


def train(config: ExperimentConfig, resume: bool = False, progress_bar: bool = True,
          on_step: Callable[[int, Transformer], None] | None = None) -> TrainSummary:
    """Train; under torchrun every process runs this same function (see training/distributed.py).

    `on_step(step, model)` is called on every process after each optimizer step (tests, tooling).
    """
    world = world_from_environment()
    config.run.load_manifest()  # a clear error for an unprepared run_dir before anything
    finished = False
    try:
        device = join(world, resolve_device(config.train.device))
        with run_lock(world, device, config.run_path):
            say = TrainingConsole(world.rank == 0, False, lambda error: None).print
            asked, probe_seconds, plan_check = config, 0.0, None
            resolved = resolve_size(asked, resume, asked.run.last_checkpoint, say)
            if resolved is None:  # model.size auto on a new run: the shapes are timed here
                resolved, probe_seconds, plan_check = probe_shapes(asked, world, device, say)
            config = resolved
            budget = config.train.max_time
            if probe_seconds and budget is not None and probe_seconds >= parse_duration(budget):
                # without this, 0 steps, exit 0 and an untrained checkpoint that translate would use
                raise TfmError(f"train.max_time={budget}: model.size auto's probe took {probe_seconds:.1f} s of it "
                               "and left no time to train; give a longer train.max_time or name the shape "
                               "(model.size: d128, …)")
            summary = Trainer(config, world, device, resume, progress_bar, on_step, probe_seconds, plan_check).run()
            if summary.plan_gap:
                summary = train_replanned(asked, config, world, device, progress_bar, on_step, summary, say)
        finished = True
        return summary
    except Exception as exc:
        if is_out_of_memory(exc):
            raise TfmError(f"out of memory while training ({str(exc).strip().splitlines()[0][:120]}): lower "
                           f"train.max_tokens (now {config.train.max_tokens}) and raise train.accum_steps to keep "
                           "the tokens per update, or use a smaller model") from None
        raise
    finally:
        leave(world, finished)


def train_replanned(asked: ExperimentConfig, trained: ExperimentConfig, world: World, device: torch.device,
                    progress_bar: bool, on_step: Callable[[int, Transformer], None] | None, first: TrainSummary,
                    say: Callable[[str], None]) -> TrainSummary:
    """After a plan check that failed: the shapes timed again for the budget left, the shape being
    trained credited with its updates. That shape goes on from the run's last checkpoint (at the batch
    and learning rate chosen now: its epoch's place read in the new batches); another starts the run
    afresh, what was trained dropped."""
    so_far = TrainedSoFar(trained.model.size or "", trained.train.max_tokens, first.steps)
    chosen, seconds, _ = probe_shapes(asked, world, device, say, first.seconds, first.plan_gap, so_far)
    if chosen.model.size == trained.model.size:
        say(f"plan check: timed again, {trained.model.size} goes on from step {first.steps:,}"
            + (f" at {chosen.train.max_tokens:,}-token batches" if chosen.train.max_tokens != trained.train.max_tokens
               else ""))
        going_on = trained.model_copy(update={"train": trained.train.model_copy(
            update={"max_tokens": chosen.train.max_tokens, "lr": chosen.train.lr})})
        return Trainer(going_on, world, device, True, progress_bar, on_step, seconds).run()
    asked.run.remove_training()
    say(f"plan check: timed again, the run starts afresh as {chosen.model.size} at {chosen.train.max_tokens:,}-token "
        f"batches ({first.steps:,} updates of {trained.model.size} dropped; {first.seconds + seconds:.0f} s of the "
        "budget spent)")
    return Trainer(chosen, world, device, False, progress_bar, on_step, first.seconds + seconds).run()


def probe_shapes(config: ExperimentConfig, world: World, device: torch.device, say: Callable[[str], None],
                 spent_before: float = 0.0, replanned: str = "",
                 so_far: TrainedSoFar | None = None) -> tuple[ExperimentConfig, float, PlanCheck | None]:
    """model.size auto on a new run: time the named shapes here and take the best for the budget
    (`replanned`: again, after the plan check, `spent_before` seconds into the budget)."""
    if world.enabled:
        raise TfmError("model.size auto times the shapes in one process; under torchrun name the shape "
                       "(model.size: d192, … or the shape keys): docs/training.md")
    run_dir = config.run
    manifest = run_dir.load_manifest()
    if not replanned:  # a run already trained: refused before the probe
        check_run_directory(run_dir, config, manifest, resume=False)
    data = ParallelData(run_dir, "train", config.data.temperature)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    if device.type == "cpu":
        keep_freed_memory()
    vocab = (manifest.vocab_size["src"], manifest.vocab_size["tgt"])
    return choose_shape(config, data, vocab, manifest.shared_ids, device, run_dir, say,
                        spent_before, replanned, so_far)


@contextlib.contextmanager
def run_lock(world: World, device: torch.device, run_dir: Path) -> Iterator[None]:
    """The run directory's lock, held by rank 0 (the only writer). Every process learns at once
    whether rank 0 got it: rank 0 reports a busy directory, the others stop quietly with it. Of
    several processes, rank 0 says so before the others learn it: once one has stopped, torchrun
    ends the rest, and the line would be lost if rank 0 were ended before it had written it."""
    lock, refused = RunLock(run_dir, "tfm train") if world.rank == 0 else None, None
    if lock is not None:
        try:
            lock.__enter__()
        except TfmError as exc:
            lock, refused = None, exc
            if world.enabled:
                warn(f"error: {exc}")
    if all_max(int(refused is not None), world, device):
        raise refused if refused is not None and not world.enabled else Interrupted("", 2)
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
