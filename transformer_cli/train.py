"""Stage 3, training: teacher forcing, label smoothing, warm-up schedules, checkpoints, validation.

`train()` runs one `Trainer`, whose loop reads top to bottom:

    batches → learning rate → loss step (forward + backward) → update (clip, skip a non-finite
    step, optimizer, moving average) → log → stop? → evaluate and save?

Under torchrun every process runs this same code (distributed.py); rank 0 alone prints, logs and
writes checkpoints. Schedules are in schedule.py, the loss in loss.py, where a run keeps its
files in rundir.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
from torch.nn.parallel import DistributedDataParallel

from .allocator import loaded_allocator
from .checkpoint import (
    average_state_dicts,
    bytes_to_tensor,
    load_checkpoint,
    load_initial_weights,
    tensor_to_bytes,
)
from .config import ExperimentConfig, TrainConfig, config_to_yaml, parse_duration
from .console import TrainingConsole
from .cpu import keep_freed_memory, release_freed_memory
from .data import PAD_ID, ParallelData, padding_ratio
from .devices import is_out_of_memory, resolve_device
from .distributed import (
    World,
    all_max,
    all_rng_states,
    all_sum,
    join,
    leave,
    world_from_environment,
)
from .ema import WeightAverage
from .errors import Diverged, Interrupted, TfmError
from .files import atomic_write_text, read_lines, remove_stale_temps
from .loss import batch_loss
from .model import Transformer, TransformerConfig
from .precision import autocast_dtype, choose_precision
from .rundir import AVERAGE, BEST, EMA, LAST, MetricsLog, RunDirectory, step_of
from .runlock import RunLock
from .schedule import next_learning_rate
from .signals import EXIT_CODES, StopRequest
from .tensorboard_log import TensorBoardLog
from .translate import decode_in_batches


def build_model(config: ExperimentConfig, src_vocab_size: int, tgt_vocab_size: int,
                shared_ids: bool = False) -> Transformer:
    """The config's Transformer. Embeddings are shared where both sides have one id space: a joint
    vocabulary, or two sentencepiece models over one id map (`shared_ids`: imported Marian models)."""
    share = config.model.share_embeddings and (config.vocab.joint or shared_ids)
    model_cfg = TransformerConfig(
        src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
        **{**config.model.model_dump(), "share_embeddings": share}, pad_id=PAD_ID,
    )
    return Transformer(model_cfg)


def check_vocab_matches(config: ExperimentConfig, manifest: dict) -> None:
    """The config's vocab settings must be those the run_dir was prepared with."""
    prepared = manifest.get("vocab_size", {})
    if any(size != config.vocab.size for size in prepared.values()):
        raise TfmError(f"key 'vocab.size': {config.vocab.size} in the config, but {config.run_dir} was prepared with "
                       f"{sorted(set(prepared.values()))[0]}; re-run `tfm prepare` (on a trained run: "
                       "with --discard-checkpoints) or change vocab.size")
    joint = manifest["vocab"]["src"] == manifest["vocab"]["tgt"]
    if joint != config.vocab.joint:
        raise TfmError(f"key 'vocab.joint': {config.vocab.joint} in the config, but {config.run_dir} was prepared "
                       f"with joint={joint}; re-run `tfm prepare` (on a trained run: with "
                       "--discard-checkpoints)")


def gradient_norm(model: torch.nn.Module, clip_norm: float) -> float:
    """Total L2 norm of the gradients (before clipping); clips to `clip_norm` when it is > 0."""
    if clip_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


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


@dataclass
class TrainSummary:
    steps: int
    seconds: float
    best_score: float | None
    best_metric: str
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    stop_reason: str


@dataclass
class StepResult:
    """One update's loss sums over this process's micro-batches, and the update's target tokens."""

    loss: float = 0.0
    nll: float = 0.0
    padding: float = 0.0  # summed padding ratios of the micro-batches
    batches: int = 0
    tokens: int = 0  # target tokens of the whole update (all processes), the loss normaliser


@dataclass
class LogWindow:
    """Sums over the updates since the last log line (skipped updates excluded)."""

    loss: float = 0.0
    nll: float = 0.0
    padding: float = 0.0
    batches: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, step: StepResult) -> None:
        self.loss, self.nll = self.loss + step.loss, self.nll + step.nll
        self.padding, self.batches = self.padding + step.padding, self.batches + step.batches
        self.tokens += step.tokens


class BatchStream:
    """The training batches in order, epoch after epoch, resumable: the epoch and the position in
    it live in TrainProgress. Each epoch's batches are shuffled by seed + epoch."""

    def __init__(self, data: ParallelData, train_cfg: TrainConfig, progress: TrainProgress):
        self.data, self.train_cfg, self.progress = data, train_cfg, progress
        self.batches = data.batches(train_cfg.max_tokens, seed=train_cfg.seed + progress.epoch)

    def next_update(self, count: int) -> list[np.ndarray] | None:
        """The next `count` batches (rolling over into the next epoch), or None once max_epochs ends."""
        progress, taken = self.progress, []
        while len(taken) < count:
            if progress.batch_in_epoch >= len(self.batches):
                progress.epoch += 1
                progress.batch_in_epoch = 0
                if self.train_cfg.max_epochs is not None and progress.epoch >= self.train_cfg.max_epochs:
                    return None
                self.batches = self.data.batches(self.train_cfg.max_tokens, seed=self.train_cfg.seed + progress.epoch)
            taken.append(self.batches[progress.batch_in_epoch])
            progress.batch_in_epoch += 1
        return taken


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


# --------------------------------------------------------------------------- validation


@torch.no_grad()
def evaluate_loss(model: Transformer, data: ParallelData, config: ExperimentConfig,
                  device: torch.device) -> dict[str, float]:
    model.eval()
    loss_sum = nll_sum = tokens = 0.0
    for batch in data.iterate(config.train.max_tokens, seed=0):
        batch = batch.to(device)
        loss, nll = batch_loss(model, batch, config.train.label_smoothing)
        loss_sum, nll_sum, tokens = loss_sum + float(loss), nll_sum + float(nll), tokens + batch.n_tgt_tokens
    return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50))}


def validation_bleu(model: Transformer, data: ParallelData, references: list[str], tgt_sp: spm.SentencePieceProcessor,
                    config: ExperimentConfig, device: torch.device) -> float:
    """Greedy-decode the first N valid sentences and score them against the raw references."""
    n = min(config.train.eval_bleu_sentences, len(data), len(references))
    src = [np.asarray(data.src[i]).tolist() for i in range(n)]
    hyps = decode_in_batches(model, src, config.decode, device, beam=1)
    texts = [tgt_sp.decode(h[0].tokens) for h in hyps]
    return sacrebleu.corpus_bleu(texts, [references[:n]]).score


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """One training run: everything is set up in __init__, `run()` trains."""

    def __init__(self, config: ExperimentConfig, world: World, device: torch.device, resume: bool,
                 progress_bar: bool, on_step: Callable[[int, Transformer], None] | None):
        self.config, self.train_cfg, self.world, self.device = config, config.train, world, device
        self.on_step, self.progress_bar = on_step, progress_bar
        self.run_dir = RunDirectory(config.run_path)
        self.writer = world.rank == 0  # prints, logs and writes checkpoints
        self.metrics = MetricsLog(self.run_dir.metrics)
        self.tensorboard: TensorBoardLog | None = None  # set once the run's step is known
        self.console = TrainingConsole(self.writer, progress_bar, self._console_lost)
        self.manifest = self.run_dir.load_manifest()
        self._check_run_directory(resume)
        torch.manual_seed(self.train_cfg.seed)
        if self.train_cfg.threads:
            torch.set_num_threads(self.train_cfg.threads)
        self.precision = choose_precision(self.train_cfg.precision, device, (config.model.d_model, config.model.d_ff))
        if device.type == "cpu":
            keep_freed_memory()
        self._load_data()
        self.model = build_model(config, self.manifest["vocab_size"]["src"], self.manifest["vocab_size"]["tgt"],
                                 self.manifest.get("shared_ids", False)).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=tuple(self.train_cfg.adam_betas),
                                          eps=self.train_cfg.adam_eps, fused=True,
                                          weight_decay=self.train_cfg.weight_decay)
        self.progress = TrainProgress()
        saved_ema = self._restore() if resume else None
        if not resume and self.train_cfg.init_from:
            self._initialise_from(Path(self.train_cfg.init_from))
        # A run that ended and whose limits still hold is complete: --resume changes nothing.
        self.complete = budget_spent(self.train_cfg, self.progress) if self.progress.finished else ""
        self.progress.finished = ""  # resumed with a larger budget: the run goes on
        if resume and not self.complete:
            self.console.print(f"resuming from {self.run_dir.checkpoints / LAST} at step {self.progress.step}")
        if not resume and world.rank > 0:  # same initial weights (DDP syncs them), own dropout
            torch.manual_seed(self.train_cfg.seed + 7919 * world.rank)
        self.ema = self._weight_average(saved_ema, resume)
        if self.writer and self.train_cfg.tensorboard and not self.complete:
            self.tensorboard = TensorBoardLog(self.run_dir.root / "tensorboard", self.progress.step)
        if self.writer and not self.complete:
            self.run_dir.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir.config_file, config_to_yaml(config))
        # DDP all-reduces (averages) gradients during backward; the model itself stays unwrapped for
        # validation, checkpoints and decoding.
        self.ddp = (DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
                    if world.enabled else None)
        forward_model = self.ddp or self.model
        self.forward_model = torch.compile(forward_model) if self.train_cfg.compile else forward_model
        self.stream = BatchStream(self.train_data, self.train_cfg, self.progress)
        self.batches_per_update = self.train_cfg.accum_steps * world.size

    # -- set-up

    def _check_run_directory(self, resume: bool) -> None:
        last = self.run_dir.checkpoints / LAST
        if last.exists() and not resume:
            raise TfmError(f"{self.run_dir.root} already holds a training run ({last}); "
                           "continue it with --resume or choose another run_dir")
        if resume and not last.exists():
            raise TfmError(f"--resume: no checkpoint to resume from at {last}")
        check_vocab_matches(self.config, self.manifest)
        if self.writer:
            # Temporary files of writes that a kill -9 interrupted (we hold the lock: nobody is writing).
            for stale in remove_stale_temps(self.run_dir.root) + remove_stale_temps(self.run_dir.checkpoints):
                self.console.print(f"removed {stale.name}, left by an interrupted write")
            self.metrics.end_torn_line()

    def _load_data(self) -> None:
        self.train_data = ParallelData(self.run_dir.root, "train")
        self.valid_data = ParallelData(self.run_dir.root, "valid")
        if len(self.train_data) == 0:
            raise TfmError(f"{self.run_dir.root}: the training split is empty after filtering")
        self.references = read_lines(self.manifest["files"]["valid"][1])
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(self.run_dir.vocab_file(self.manifest, "tgt")))

    def _restore(self) -> dict | None:
        """Weights, optimizer, RNG states and progress of checkpoint_last.pt; returns its weight average."""
        path = self.run_dir.checkpoints / LAST
        ckpt = load_checkpoint(path, map_location=self.device)
        self._check_trained_here(ckpt, path)
        if asdict(TransformerConfig(**ckpt["model_config"])) != asdict(self.model.cfg):  # older ones lack new keys
            raise TfmError(f"--resume: the model section of the config differs from {path}'s")
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"].cpu())
        rank_states = ckpt.get("torch_rng_ranks")
        if self.world.enabled:
            if rank_states is not None and len(rank_states) == self.world.size:
                torch.set_rng_state(rank_states[self.world.rank].cpu())
            elif self.world.rank > 0:  # a different number of processes: fresh, distinct dropout streams
                torch.manual_seed(self.train_cfg.seed + 7919 * self.world.rank + ckpt["progress"]["step"])
        if "cuda_rng" in ckpt and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in ckpt["cuda_rng"]])
        self.progress = TrainProgress(**ckpt["progress"])
        return ckpt.get("ema")

    def _check_trained_here(self, ckpt: dict, path: Path) -> None:
        """checkpoint_last.pt must be training state made on this run's vocabulary and encoded data:
        a run prepared again since (other ids) would go on training on what its ids now mean."""
        if "optimizer" not in ckpt or "progress" not in ckpt:
            raise TfmError(f"--resume: {path} holds no training state (weights only: another command's output "
                           "written over it); nothing to continue from")
        for side, name in (("src", "source"), ("tgt", "target")):
            if tensor_to_bytes(ckpt[f"spm_{side}"]) != self.run_dir.vocab_file(self.manifest, side).read_bytes():
                raise TfmError(f"--resume: {path} was trained with another {name} vocabulary than "
                               f"{self.run_dir.root} holds now (prepared again since?): prepare a new run_dir, "
                               "or fine-tune from the checkpoint there (train.init_from, vocab.from_run)")
        trained_on, prepared = ckpt.get("data_digest"), self.manifest.get("data_digest")
        if trained_on and prepared and trained_on != prepared:
            raise TfmError(f"--resume: {path} was trained on other encoded data than {self.run_dir.root} holds now "
                           "(prepared again since, with other data settings?): prepare it as it was, or train a "
                           "new run (train.init_from to start from this checkpoint)")

    def _initialise_from(self, path: Path) -> None:
        """Fine-tuning: the weights of a trained model; optimizer, schedule, steps and data order start afresh."""
        if path.is_dir():
            path = RunDirectory(path).default_checkpoint()
        spm_files = {side: self.run_dir.vocab_file(self.manifest, side).read_bytes() for side in ("src", "tgt")}
        parent = load_initial_weights(self.model, path, spm_files)
        step = parent.get("progress", {}).get("step", "?")
        self.console.print(f"initialised from {path} (step {step} of its run); optimizer and schedule start afresh")

    def _weight_average(self, saved: dict | None, resume: bool) -> WeightAverage | None:
        if not self.train_cfg.ema_decay:
            return None
        ema = WeightAverage(self.model, self.train_cfg.ema_decay)  # from the (resumed) weights
        if saved is not None:
            ema.load_state_dict(saved)
        elif resume:
            self.console.print(f"train.ema_decay: {self.run_dir.checkpoints / LAST} has no weight average; it starts "
                               "from the resumed weights")
        return ema

    def _console_lost(self, error: str) -> None:
        self._log({"kind": "console_lost", "time": time.time(), "error": error})

    def _log(self, record: dict) -> None:
        if self.writer:
            self.metrics.append(record)
        if self.tensorboard is not None:
            self.tensorboard.add(record)

    # -- the loop

    def run(self) -> TrainSummary:
        if self.complete:
            self.console.print(f"{self.run_dir.root} is complete ({self.complete}): nothing to do; raise the limit "
                               "(e.g. --set train.max_steps=…) to train further")
            return self.summary(self.complete)
        self._announce()
        self.model.train()
        self.started = time.perf_counter() - self.progress.elapsed
        self.window = LogWindow()
        stop_reason = budget_spent(self.train_cfg, self.progress)  # a run stopped at its very last step
        with StopRequest(announce=self.writer) as stop:
            try:
                while not stop_reason:
                    batches = self.stream.next_update(self.batches_per_update)
                    if batches is None:
                        stop_reason = f"max_epochs={self.train_cfg.max_epochs}"
                        break
                    lr = self.set_learning_rate()
                    step = self.loss_step(batches)
                    if not self.update(step):
                        continue
                    self.log(step, lr)
                    stop_reason = self.stop_decision(stop)
                    evaluating = self.progress.step % self.train_cfg.eval_every == 0 or bool(stop_reason)
                    if evaluating:
                        stop_reason = self.evaluate_and_save(stop_reason)
                    elif self.train_cfg.save_every and self.progress.step % self.train_cfg.save_every == 0:
                        self.save_checkpoints(None)
            finally:
                self.console.close_bar()
        return self.finish(stop_reason)

    def _announce(self) -> None:
        train_cfg = self.train_cfg
        self.console.print(f"model: {self.model.num_parameters():,} parameters on {self.device}, "
                           f"{self.precision.describe()}; {len(self.train_data):,} training pairs")
        self.console.print(f"effective batch: {self.world.size} process(es) x {train_cfg.accum_steps} accumulation "
                           f"step(s) x {train_cfg.max_tokens:,} tokens = "
                           f"{self.batches_per_update * train_cfg.max_tokens:,} tokens per update (padding included)")
        if self.device.type == "cpu":
            self.console.print(f"memory allocator: {loaded_allocator()} (train.allocator: {train_cfg.allocator})")
        if train_cfg.warmup_ratio is not None and train_cfg.warmup:
            self.console.print(f"learning rate: {train_cfg.lr_schedule}, warm-up {train_cfg.warmup} steps or "
                               f"{train_cfg.warmup_ratio:.0%} of the budget, whichever ends first")
        self.console.start_bar(train_cfg.max_steps, self.progress.step)

    def set_learning_rate(self) -> float:
        progress = self.progress
        lr, progress.pace_marks = next_learning_rate(progress.step, progress.elapsed, progress.pace_marks,
                                                     self.train_cfg, self.config.model.d_model)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def loss_step(self, batches: list[np.ndarray]) -> StepResult:
        """Forward and backward over this process's share of the update's batches (rank r takes
        r, r + N, …); gradients accumulate, normalised by the target tokens of the whole update."""
        lengths = self.train_data.tgt.lengths
        result = StepResult(tokens=sum(int(lengths[idx].sum()) + len(idx) for idx in batches))
        my_batches = batches[self.world.rank::self.world.size]
        amp_dtype = autocast_dtype(self.precision)
        for i, indices in enumerate(my_batches):
            batch = self.train_data.collate(indices).to(self.device)
            # Gradients are all-reduced once per update: on the last micro-batch only.
            sync = self.ddp is None or i == len(my_batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss, nll = batch_loss(self.forward_model, batch, self.train_cfg.label_smoothing)
                # x world.size: DDP averages the processes' gradients, the loss wants their sum.
                (loss * (self.world.size / result.tokens)).backward()
            result.loss += float(loss.detach())
            result.nll += float(nll.detach())
            result.padding += padding_ratio(batch)
            result.batches += 1
        return result

    def update(self, step: StepResult) -> bool:
        """Clip, then step the optimizer and the moving average; a non-finite gradient skips the
        update (weights, optimizer state and step count stay as they were). Returns whether it stepped."""
        progress = self.progress
        grad_norm = gradient_norm(self.model, self.train_cfg.clip_norm)  # the same on every process
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            progress.bad_steps += 1
            progress.skipped_steps += 1
            self.console.print(f"warning: non-finite loss/gradient at step {progress.step + 1} (norm {grad_norm}); "
                               f"update skipped ({progress.bad_steps}/{self.train_cfg.max_bad_steps} in a row)")
            if progress.bad_steps >= self.train_cfg.max_bad_steps:
                self.console.close_bar()
                raise Diverged(f"training diverged: {progress.bad_steps} consecutive steps with a NaN/Inf loss or "
                               f"gradient after step {progress.step}; the last good checkpoint is "
                               f"{self.run_dir.checkpoints / LAST} (lower train.lr, or set train.clip_norm)")
            return False
        progress.bad_steps = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        progress.step += 1
        progress.target_tokens += step.tokens
        self.window.add(step)
        progress.elapsed = time.perf_counter() - self.started
        if self.on_step is not None:
            self.on_step(progress.step, self.model)
        return True

    def log(self, step: StepResult, lr: float) -> None:
        """Every log_every updates: a metrics.jsonl record and a progress line."""
        progress, window = self.progress, self.window
        if progress.step % self.train_cfg.log_every:
            self.console.advance()
            return
        seconds = time.perf_counter() - window.started
        loss, nll, padding, batches = all_sum([window.loss, window.nll, window.padding, window.batches],
                                              self.world, self.device)
        record = {"kind": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr,
                  "loss": loss / window.tokens, "ppl": math.exp(min(nll / window.tokens, 50)),
                  "tokens_per_s": window.tokens / seconds, "padding": padding / max(batches, 1),
                  "tokens_per_update": window.tokens / self.train_cfg.log_every,
                  "elapsed": round(progress.elapsed, 1)}
        self._log(record)
        self.console.advance({"loss": f"{record['loss']:.3f}", "lr": f"{lr:.2e}",
                              "tok/s": f"{record['tokens_per_s']:.0f}"})
        if not self.progress_bar:  # no live bar (a log file, CI): one line per log interval instead
            self.console.print(f"step {progress.step}: loss {record['loss']:.3f} ppl {record['ppl']:.1f} "
                               f"lr {lr:.2e} {record['tokens_per_s']:.0f} tok/s "
                               f"padding {100 * record['padding']:.1f}% {record['elapsed'] / 60:.1f} min")
        self.window = LogWindow()

    def stop_decision(self, stop: StopRequest) -> str:
        """Why training stops after this step ("" to go on). A signal saves and raises Interrupted.
        Decisions that can differ between processes (clock, signals) are agreed on: the largest
        request wins, so every process stops after the same step."""
        max_time = parse_duration(self.train_cfg.max_time) if self.train_cfg.max_time is not None else math.inf
        request = 2 if stop.signum is not None else int(self.progress.elapsed >= max_time)
        request = all_max(request, self.world, self.device)
        if request == 2:
            self.save_checkpoints(None)
            self.console.close_bar()
            signum = stop.signum or signal.SIGTERM
            saved = (f"{signal.Signals(signum).name}: saved step {self.progress.step} to {self.run_dir.checkpoints / LAST} "
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
        metrics = self.validate(self.model) if self.writer else {}
        if self.writer:
            score = self.score(metrics)
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
        self.window.started = time.perf_counter()  # validation time is not training throughput
        return stop_reason

    def validate(self, model: Transformer) -> dict[str, float]:
        metrics = evaluate_loss(model, self.valid_data, self.config, self.device)
        metrics["bleu"] = validation_bleu(model, self.valid_data, self.references, self.tgt_sp, self.config,
                                          self.device)
        self.model.train()
        return metrics

    def score(self, metrics: dict[str, float]) -> float:
        """Higher is better, whichever train.best_metric."""
        return metrics["bleu"] if self.train_cfg.best_metric == "bleu" else -metrics["loss"]

    def save_checkpoints(self, metrics: dict | None) -> None:
        """checkpoint_last.pt (everything to resume), and after an evaluation (`metrics`) the step's
        weights and, if it is the best so far, checkpoint_best.pt; then prune. Every process calls
        it (it gathers their RNG states)."""
        rng_states = all_rng_states(self.world)
        if not self.writer:
            return
        progress = self.progress
        if metrics is not None:
            weights = self.weights_payload(self.model)
            self.run_dir.save(f"step_{progress.step}.pt", weights)
            if progress.best_step == progress.step:
                self.run_dir.save(BEST, weights)
        self.run_dir.save(LAST, self.training_state(rng_states))
        self.run_dir.prune_step_checkpoints(self.train_cfg.keep_last)

    def weights_payload(self, model: Transformer) -> dict:
        """A checkpoint to translate with: weights, configs, progress, both sentencepiece models."""
        return {
            "model": model.state_dict(),
            "model_config": asdict(model.cfg),
            "config": self.config.model_dump(mode="json"),
            "progress": asdict(self.progress),
            "spm_src": bytes_to_tensor(self.run_dir.vocab_file(self.manifest, "src").read_bytes()),
            "spm_tgt": bytes_to_tensor(self.run_dir.vocab_file(self.manifest, "tgt").read_bytes()),
            # which prepared data it learnt from: --resume refuses a run prepared again since
            **({"data_digest": self.manifest["data_digest"]} if "data_digest" in self.manifest else {}),
        }

    def training_state(self, rng_states: list[torch.Tensor]) -> dict:
        """checkpoint_last.pt: the weights payload plus optimizer, RNG states and moving average."""
        payload = self.weights_payload(self.model)
        payload["optimizer"] = self.optimizer.state_dict()
        payload["torch_rng"] = torch.get_rng_state()
        if len(rng_states) > 1:
            payload["torch_rng_ranks"] = rng_states  # one per torchrun process
        if torch.cuda.is_available():
            payload["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self.ema is not None:
            payload["ema"] = self.ema.state_dict()
        return payload

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
            scores = {BEST: progress.best_score}
            if self.train_cfg.average_last > 1:
                scores[AVERAGE] = self.save_average()
            if self.ema is not None:
                scores[EMA] = self.save_moving_average()
            self.run_dir.write_scores(self.train_cfg.best_metric, scores)
        if self.tensorboard is not None:
            self.tensorboard.close()
        summary = self.summary(stop_reason)
        best = "n/a" if summary.best_score is None else (
            f"{summary.best_score:.2f}" if self.train_cfg.best_metric == "bleu" else f"{-summary.best_score:.3f}")
        self.console.print(f"done ({stop_reason}): {progress.step} steps in {progress.elapsed / 60:.1f} min, "
                           f"best valid {self.train_cfg.best_metric} {best} at step {progress.best_step} → "
                           f"{summary.best_checkpoint}")
        return summary

    def summary(self, stop_reason: str) -> TrainSummary:
        best = self.run_dir.checkpoints / BEST
        return TrainSummary(self.progress.step, self.progress.elapsed, self.progress.best_score,
                            self.train_cfg.best_metric, best if best.exists() else None,
                            self.run_dir.checkpoints / LAST, stop_reason)

    def save_average(self) -> float | None:
        """checkpoint_avg.pt: the mean of the last `average_last` step checkpoints of the run's final
        `average_window`, validated like the others; returns its score."""
        train_cfg, progress = self.train_cfg, self.progress
        path = self.run_dir.checkpoints / AVERAGE
        first_step = (1.0 - train_cfg.average_window) * progress.step
        chosen = [p for p in self.run_dir.step_checkpoints() if step_of(p) > first_step][-train_cfg.average_last:]
        if len(chosen) < 2:
            path.unlink(missing_ok=True)  # an older run's average would no longer be its final one
            self.console.print(f"no checkpoint_avg.pt: {len(chosen)} evaluated checkpoint(s) in the last "
                               f"{100 * train_cfg.average_window:.0f}% of the run (evaluate more often: "
                               "train.eval_every)")
            return None
        averaged = copy.deepcopy(self.model)
        averaged.load_state_dict(average_state_dicts(chosen))
        names = [p.name for p in chosen]
        metrics = self.record_final_model(averaged, AVERAGE, {"averaged": names}, "valid_avg",
                                          f"mean of {', '.join(names)}")
        return self.score(metrics)

    def save_moving_average(self) -> float:
        """checkpoint_ema.pt: the moving average of the weights, validated like the others; returns its score."""
        with self.ema.applied(self.model):
            metrics = self.record_final_model(self.model, EMA, {"ema_decay": self.ema.decay}, "valid_ema",
                                              f"moving average of the weights (decay {self.ema.decay})")
        return self.score(metrics)

    def record_final_model(self, model: Transformer, name: str, extra: dict, kind: str, what: str) -> dict:
        """Validate a model made at the end of the run, save it as `name` and log it."""
        metrics = self.validate(model)
        self.run_dir.save(name, {**self.weights_payload(model), **extra})
        self._log({"kind": kind, "step": self.progress.step, **extra, "elapsed": round(self.progress.elapsed, 1),
                   **metrics})
        self.console.print(f"{name} = {what}: valid loss {metrics['loss']:.3f} BLEU {metrics['bleu']:.2f} "
                           f"(greedy, {self.train_cfg.eval_bleu_sentences} sentences)")
        return metrics


# --------------------------------------------------------------------------- entry point


def train(config: ExperimentConfig, resume: bool = False, progress_bar: bool = True,
          on_step: Callable[[int, Transformer], None] | None = None) -> TrainSummary:
    """Train; under torchrun every process runs this same function (see distributed.py).

    `on_step(step, model)` is called on every process after each optimizer step (tests, tooling).
    """
    world = world_from_environment()
    RunDirectory(config.run_path).load_manifest()  # a clear error for an unprepared run_dir before anything
    finished = False
    try:
        device = join(world, resolve_device(config.train.device))
        with run_lock(world, device, config.run_path):
            summary = Trainer(config, world, device, resume, progress_bar, on_step).run()
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


@contextlib.contextmanager
def run_lock(world: World, device: torch.device, run_dir: Path) -> Iterator[None]:
    """The run directory's lock, held by rank 0 (the only writer). Every process learns at once
    whether rank 0 got it: rank 0 reports a busy directory, the others stop quietly with it."""
    lock, refused = RunLock(run_dir, "tfm train") if world.rank == 0 else None, None
    if lock is not None:
        try:
            lock.__enter__()
        except TfmError as exc:
            lock, refused = None, exc
    if all_max(int(refused is not None), world, device):
        raise refused if refused is not None else Interrupted("", 2)
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
