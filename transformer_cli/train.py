"""Stage 3, training: teacher forcing, label smoothing, warm-up schedules, checkpoints, validation."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import sacrebleu
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .checkpoint import (
    average_state_dicts,
    bytes_to_tensor,
    load_checkpoint,
    save_checkpoint,
)
from .config import ExperimentConfig, TrainConfig, config_to_yaml, parse_duration
from .console import discard_stream
from .cpu import keep_freed_memory
from .data import PAD_ID, Batch, ParallelData, load_manifest, padding_ratio
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
from .errors import Diverged, Interrupted, TfmError, describe_os_error
from .files import atomic_write_text, read_lines, remove_stale_temps
from .model import Transformer, TransformerConfig
from .precision import choose_precision
from .runlock import RunLock
from .signals import EXIT_CODES, StopRequest


def autocast_dtype(config: TrainConfig, device: torch.device, shape: tuple[int, int] = (512, 2048)
                   ) -> torch.dtype | None:
    """bf16 autocast or None (fp32): see `precision.choose_precision` for what `auto` means."""
    return torch.bfloat16 if choose_precision(config.precision, device, shape).bf16 else None


def build_model(config: ExperimentConfig, src_vocab_size: int, tgt_vocab_size: int) -> Transformer:
    share = config.model.share_embeddings and config.vocab.joint
    model_cfg = TransformerConfig(
        src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
        **{**config.model.model_dump(), "share_embeddings": share}, pad_id=PAD_ID,
    )
    return Transformer(model_cfg)


# --------------------------------------------------------------------------- schedule and loss


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


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    """Per-row label-smoothed cross-entropy with a hand-written backward.

    Autograd through log_softmax → gather/mean → mask makes about eight passes over the
    (tokens × vocab) logits; the closed-form gradient, softmax − (1 − ε)·onehot − ε/V, needs
    four. On CPU that is ~10% of a training step for an 8k vocabulary.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, smoothing: float):  # (N, V), (N,)
        log_probs = F.log_softmax(logits, dim=-1)  # (N, V): one fused pass, unlike logsumexp's several
        nll = -log_probs.gather(1, target[:, None]).squeeze(1)
        loss = (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)
        ctx.save_for_backward(log_probs, target)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll: torch.Tensor | None):
        log_probs, target = ctx.saved_tensors
        eps, vocab = ctx.smoothing, log_probs.size(-1)
        grad = log_probs.exp_()  # softmax (N, V), in place: the saved tensor is not needed again
        grad.mul_(grad_loss[:, None]).sub_(grad_loss[:, None] * (eps / vocab))
        grad.scatter_add_(1, target[:, None], (-(1.0 - eps) * grad_loss)[:, None])
        return grad, None, None


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, pad_id: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL over non-pad targets.

    The smoothed target puts (1 - ε) on the gold token and ε spread uniformly over the whole
    vocabulary: loss = (1 - ε)·(-log p_gold) + ε·mean_v(-log p_v), as torch's cross_entropy.
    Padding rows are dropped before the vocabulary-sized work.
    """
    target = target.reshape(-1)
    rows = logits.reshape(-1, logits.size(-1))
    keep = (target != pad_id).nonzero().squeeze(1)
    if keep.numel() != target.numel():
        rows, target = rows.index_select(0, keep), target.index_select(0, keep)
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()  # the softmax over the vocabulary in fp32
    loss, nll = _LabelSmoothedCrossEntropy.apply(rows, target, smoothing)  # (N_real,) each
    return loss.sum(), nll.sum()


def target_rows(tgt_out: torch.Tensor, pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of real (non-pad) target tokens and those tokens: (N,), (N,)."""
    flat = tgt_out.reshape(-1)
    rows = (flat != pad_id).nonzero().squeeze(1)
    return rows, flat.index_select(0, rows)


def gradient_norm(model: torch.nn.Module, clip_norm: float) -> float:
    """Total L2 norm of the gradients (before clipping); clips to `clip_norm` when it is > 0."""
    if clip_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def batch_loss(model: torch.nn.Module, batch: Batch, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced summed loss and NLL of a batch; logits only where there is a target."""
    rows, targets = target_rows(batch.tgt_out)
    logits = model(batch.src, batch.tgt_in, rows)  # (N, V)
    return label_smoothed_loss(logits, targets, smoothing)


def check_vocab_matches(config: ExperimentConfig, manifest: dict) -> None:
    """The config's vocab settings must be those the run_dir was prepared with."""
    prepared = manifest.get("vocab_size", {})
    if any(size != config.vocab.size for size in prepared.values()):
        raise TfmError(f"key 'vocab.size': {config.vocab.size} in the config, but {config.run_dir} was prepared with "
                       f"{sorted(set(prepared.values()))[0]}; re-run `tfm prepare --force` or change vocab.size")
    joint = manifest["vocab"]["src"] == manifest["vocab"]["tgt"]
    if joint != config.vocab.joint:
        raise TfmError(f"key 'vocab.joint': {config.vocab.joint} in the config, but {config.run_dir} was prepared "
                       f"with joint={joint}; re-run `tfm prepare --force`")


# --------------------------------------------------------------------------- side effects


class RunOutput:
    """The single place that prints, appends metrics and writes checkpoints.

    Only rank 0 acts, so a distributed (torchrun) loop can call it from every process.
    The console (stderr) is only a view of the run: when writing to it fails (`2> train.log` on a
    disk that filled up, a pipe whose reader quit), training goes on without it. stderr points at
    /dev/null from then on, and metrics.jsonl, the run's record, says when and why the console
    stopped. Checkpoints and metrics.jsonl are another matter: their errors stop the run (exit 2).
    """

    def __init__(self, run_dir: Path, rank: int = 0, progress: bool = True):
        self.run_dir, self.rank, self.progress = run_dir, rank, progress
        self.ckpt_dir = run_dir / "checkpoints"
        self.metrics_path = run_dir / "metrics.jsonl"
        self.bar: tqdm | None = None

    @property
    def active(self) -> bool:
        return self.rank == 0

    def start_bar(self, total: int, initial: int) -> None:
        if self.active:
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                            disable=not self.progress, dynamic_ncols=True)

    def advance(self, postfix: dict | None = None) -> None:
        if self.bar is not None:
            bar = self.bar

            def update() -> None:
                bar.update(1)
                if postfix:
                    bar.set_postfix(postfix, refresh=False)

            self._console(update)

    def close_bar(self) -> None:
        if self.bar is not None:
            self._console(self.bar.close)
            self.bar = None

    def print(self, message: str) -> None:
        if self.active:
            self._console(lambda: tqdm.write(message, file=sys.stderr))

    def _console(self, write: Callable[[], object]) -> None:
        try:
            write()
            sys.stderr.flush()  # here, not at some later write or at exit
        except OSError as exc:  # the console is gone (BrokenPipeError included): carry on without it
            discard_stream(sys.stderr)
            self.log({"kind": "console_lost", "time": time.time(), "error": describe_os_error(exc, unnamed="stderr")})

    def log(self, record: dict) -> None:
        if self.active:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def end_torn_line(self) -> None:
        """A kill during an append can leave a half line in metrics.jsonl: end it, so the next record
        starts on a line of its own (readers skip the broken one)."""
        if self.active and self.metrics_path.is_file() and self.metrics_path.stat().st_size:
            with open(self.metrics_path, "rb+") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def save(self, name: str, payload: dict) -> Path | None:
        if not self.active:
            return None
        path = self.ckpt_dir / name
        save_checkpoint(path, payload)
        return path

    def prune(self, keep_last: int) -> None:
        if not self.active:
            return
        steps = sorted(self.ckpt_dir.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
        for old in steps[: max(len(steps) - keep_last, 0)]:
            old.unlink()


# --------------------------------------------------------------------------- training


@dataclass
class TrainProgress:
    """Everything besides weights/optimizer needed to resume exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    elapsed: float = 0.0  # seconds of training so far (across resumes)
    target_tokens: int = 0
    best_score: float | None = None
    best_step: int = 0
    bad_evals: int = 0
    bad_steps: int = 0  # consecutive skipped (non-finite) updates
    skipped_steps: int = 0  # all skipped updates of the run


@dataclass
class TrainSummary:
    steps: int
    seconds: float
    best_score: float | None
    best_metric: str
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    stop_reason: str


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


def validation_bleu(model: Transformer, data: ParallelData, references: list[str], tgt_sp,
                    config: ExperimentConfig, device: torch.device) -> float:
    """Greedy-decode the first N valid sentences and score them against the raw references."""
    from .translate import (
        decode_token_ids,  # translate imports train's helpers; avoid a cycle
    )

    n = min(config.train.eval_bleu_sentences, len(data), len(references))
    if n == 0:
        return 0.0
    src = [np.asarray(data.src[i]).tolist() for i in range(n)]
    hyps = decode_token_ids(model, src, config.decode, device, beam=1)
    texts = [tgt_sp.decode(h[0].tokens) for h in hyps]
    return sacrebleu.corpus_bleu(texts, [references[:n]]).score


def _checkpoint_payload(model: Transformer, config: ExperimentConfig, manifest: dict, progress: TrainProgress,
                        optimizer: torch.optim.Optimizer | None = None,
                        rng_states: list[torch.Tensor] | None = None, ema: WeightAverage | None = None) -> dict:
    vocab = manifest["vocab"]
    payload = {
        "model": model.state_dict(),
        "model_config": asdict(model.cfg),
        "config": config.model_dump(mode="json"),
        "progress": asdict(progress),
        "spm_src": bytes_to_tensor(Path(vocab["src"]).read_bytes()),
        "spm_tgt": bytes_to_tensor(Path(vocab["tgt"]).read_bytes()),
    }
    if optimizer is not None:
        payload["optimizer"] = optimizer.state_dict()
        payload["torch_rng"] = torch.get_rng_state()
        if rng_states is not None and len(rng_states) > 1:
            payload["torch_rng_ranks"] = rng_states  # one per torchrun rank
        if torch.cuda.is_available():
            payload["cuda_rng"] = torch.cuda.get_rng_state_all()
        if ema is not None:
            payload["ema"] = ema.state_dict()
    return payload


def average_final_checkpoints(model: Transformer, config: ExperimentConfig, manifest: dict, progress: TrainProgress,
                              out: RunOutput, valid_data: ParallelData, references: list[str], tgt_sp,
                              device: torch.device) -> float | None:
    """checkpoint_avg.pt: the mean of the last `average_last` step checkpoints of the run's final
    `average_window`, validated like the others; returns its score (for scores.json)."""
    tc = config.train
    avg_path = out.ckpt_dir / "checkpoint_avg.pt"
    first_step = (1.0 - tc.average_window) * progress.step
    steps = sorted(out.ckpt_dir.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    chosen = [p for p in steps if int(p.stem.split("_")[1]) > first_step][-tc.average_last:]
    if len(chosen) < 2:
        avg_path.unlink(missing_ok=True)  # an older run's average would no longer be its final one
        out.print(f"no checkpoint_avg.pt: {len(chosen)} evaluated checkpoint(s) in the last "
                  f"{100 * tc.average_window:.0f}% of the run (evaluate more often: train.eval_every)")
        return None
    averaged = copy.deepcopy(model)
    averaged.load_state_dict(average_state_dicts(chosen))
    metrics = evaluate_loss(averaged, valid_data, config, device)
    metrics["bleu"] = validation_bleu(averaged, valid_data, references, tgt_sp, config, device)
    score = metrics["bleu"] if tc.best_metric == "bleu" else -metrics["loss"]
    payload = _checkpoint_payload(averaged, config, manifest, progress)
    payload["averaged"] = [p.name for p in chosen]
    out.save(avg_path.name, payload)
    out.log({"kind": "valid_avg", "step": progress.step, "averaged": payload["averaged"],
             "elapsed": round(progress.elapsed, 1), **metrics})
    out.print(f"checkpoint_avg.pt = mean of {', '.join(payload['averaged'])}: valid loss {metrics['loss']:.3f} "
              f"BLEU {metrics['bleu']:.2f} (greedy, {tc.eval_bleu_sentences} sentences)")
    return score


def save_weight_average(model: Transformer, ema: WeightAverage, config: ExperimentConfig, manifest: dict,
                        progress: TrainProgress, out: RunOutput, valid_data: ParallelData, references: list[str],
                        tgt_sp, device: torch.device) -> float:
    """checkpoint_ema.pt: the moving average of the weights, validated like the others; returns its score."""
    tc = config.train
    with ema.applied(model):
        metrics = evaluate_loss(model, valid_data, config, device)
        metrics["bleu"] = validation_bleu(model, valid_data, references, tgt_sp, config, device)
        payload = _checkpoint_payload(model, config, manifest, progress)
        payload["ema_decay"] = ema.decay
        out.save("checkpoint_ema.pt", payload)  # inside: the payload holds the model's own tensors
    out.log({"kind": "valid_ema", "step": progress.step, "ema_decay": ema.decay,
             "elapsed": round(progress.elapsed, 1), **metrics})
    out.print(f"checkpoint_ema.pt = moving average of the weights (decay {ema.decay}): valid loss "
              f"{metrics['loss']:.3f} BLEU {metrics['bleu']:.2f} (greedy, {tc.eval_bleu_sentences} sentences)")
    return metrics["bleu"] if tc.best_metric == "bleu" else -metrics["loss"]


def train(config: ExperimentConfig, resume: bool = False, progress_bar: bool = True,
          on_step: Callable[[int, Transformer], None] | None = None) -> TrainSummary:
    """Train; under torchrun every rank runs this same function (see distributed.py).

    `on_step(step, model)` is called on every rank after each optimizer step (tests, tooling).
    """
    world = world_from_environment()
    load_manifest(config.run_path)  # a clear error for an unprepared run_dir before anything is created
    finished = False
    # Rank 0 is the only writer, so it alone holds the run directory's lock.
    lock = RunLock(config.run_path, "tfm train") if world.rank == 0 else contextlib.nullcontext()
    try:
        with lock:
            summary = _train(config, resume, progress_bar, world, on_step)
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


def _train(config: ExperimentConfig, resume: bool, progress_bar: bool, world: World,
           on_step: Callable[[int, Transformer], None] | None) -> TrainSummary:
    tc = config.train
    run_dir = config.run_path
    manifest = load_manifest(run_dir)
    out = RunOutput(run_dir, rank=world.rank, progress=progress_bar)
    last_path = out.ckpt_dir / "checkpoint_last.pt"
    if last_path.exists() and not resume:
        raise TfmError(f"{run_dir} already holds a training run ({last_path}); "
                       "continue it with --resume or choose another run_dir")
    if resume and not last_path.exists():
        raise TfmError(f"--resume: no checkpoint to resume from at {last_path}")
    check_vocab_matches(config, manifest)
    if out.active:
        # Temporary files of writes that a kill -9 interrupted (we hold the lock: nobody is writing).
        for stale in remove_stale_temps(run_dir) + remove_stale_temps(out.ckpt_dir):
            out.print(f"removed {stale.name}, left by an interrupted write")
        out.end_torn_line()

    torch.manual_seed(tc.seed)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = join(world, resolve_device(tc.device))
    precision = choose_precision(tc.precision, device, (config.model.d_model, config.model.d_ff))
    amp_dtype = torch.bfloat16 if precision.bf16 else None
    if device.type == "cpu":
        keep_freed_memory()

    train_data = ParallelData(run_dir, "train")
    valid_data = ParallelData(run_dir, "valid")
    if len(train_data) == 0:
        raise TfmError(f"{run_dir}: the training split is empty after filtering")
    references = read_lines(manifest["files"]["valid"][1])
    import sentencepiece as spm  # noqa: PLC0415 (only needed here for validation BLEU)

    tgt_sp = spm.SentencePieceProcessor(model_file=manifest["vocab"]["tgt"])
    model = build_model(config, manifest["vocab_size"]["src"], manifest["vocab_size"]["tgt"]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=tuple(tc.adam_betas), eps=tc.adam_eps, fused=True,
                                 weight_decay=tc.weight_decay)
    progress = TrainProgress()
    saved_ema = None
    if resume:
        ckpt = load_checkpoint(last_path, map_location=device)
        if ckpt["model_config"] != asdict(model.cfg):
            raise TfmError(f"--resume: the model section of the config differs from {last_path}'s")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"].cpu())
        rank_states = ckpt.get("torch_rng_ranks")
        if world.enabled:
            if rank_states is not None and len(rank_states) == world.size:
                torch.set_rng_state(rank_states[world.rank].cpu())
            elif world.rank > 0:  # a different number of processes: fresh, distinct dropout streams
                torch.manual_seed(tc.seed + 7919 * world.rank + ckpt["progress"]["step"])
        if "cuda_rng" in ckpt and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in ckpt["cuda_rng"]])
        progress = TrainProgress(**ckpt["progress"])
        saved_ema = ckpt.get("ema")
        out.print(f"resuming from {last_path} at step {progress.step}")
    elif world.rank > 0:
        torch.manual_seed(tc.seed + 7919 * world.rank)  # same initial weights (DDP syncs them), own dropout
    ema = WeightAverage(model, tc.ema_decay) if tc.ema_decay else None  # from the (resumed) weights
    if ema is not None and saved_ema is not None:
        ema.load_state_dict(saved_ema)
    elif ema is not None and resume:
        out.print(f"train.ema_decay: {last_path} has no weight average; it starts from the resumed weights")
    if out.active:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", config_to_yaml(config))

    # DDP all-reduces (averages) gradients during backward; the model itself stays unwrapped for
    # validation, checkpoints and decoding.
    ddp = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
           if world.enabled else None)
    step_model = ddp or model
    step_model = torch.compile(step_model) if tc.compile else step_model
    max_time = parse_duration(tc.max_time) if tc.max_time is not None else math.inf
    d_model = config.model.d_model
    out.print(f"model: {model.num_parameters():,} parameters on {device}, {precision.describe()}; "
              f"{len(train_data):,} training pairs")
    batches_per_step = tc.accum_steps * world.size
    out.print(f"effective batch: {world.size} process(es) x {tc.accum_steps} accumulation step(s) x "
              f"{tc.max_tokens:,} tokens = {batches_per_step * tc.max_tokens:,} tokens per update (padding included)")
    if tc.warmup_ratio is not None and tc.warmup:
        out.print(f"learning rate: {tc.lr_schedule}, warm-up {tc.warmup} steps or {tc.warmup_ratio:.0%} of the "
                  f"budget, whichever ends first")
    tgt_lengths = train_data.tgt.lengths
    out.start_bar(tc.max_steps, progress.step)

    def checkpoint(metrics: dict | None, at: TrainProgress) -> None:
        """Evaluate-time bookkeeping: step checkpoint, last, best, pruning (all ranks call it)."""
        rng_states = all_rng_states(world)
        if not out.active:
            return
        weights_only = _checkpoint_payload(model, config, manifest, at)
        if metrics is not None:
            out.save(f"step_{at.step}.pt", weights_only)
            if at.best_step == at.step:
                out.save("checkpoint_best.pt", weights_only)
        out.save("checkpoint_last.pt", _checkpoint_payload(model, config, manifest, at, optimizer, rng_states, ema))
        out.prune(tc.keep_last)

    def validate() -> dict:
        metrics = evaluate_loss(model, valid_data, config, device)
        metrics["bleu"] = validation_bleu(model, valid_data, references, tgt_sp, config, device)
        model.train()
        score = metrics["bleu"] if tc.best_metric == "bleu" else -metrics["loss"]
        if progress.best_score is None or score > progress.best_score:
            progress.best_score, progress.best_step, progress.bad_evals = score, progress.step, 0
        else:
            progress.bad_evals += 1
        return metrics

    model.train()
    started = time.perf_counter() - progress.elapsed
    window_tokens, window_start, window_sums = 0, time.perf_counter(), [0.0, 0.0, 0.0, 0.0]  # loss, nll, pad, n
    stop_reason = ""
    batches = train_data.batches(tc.max_tokens, seed=tc.seed + progress.epoch)
    with StopRequest(announce=out.active) as stop:
        try:
            while not stop_reason:
                # The next accum_steps x world.size batches of the (global) epoch order, rolling over
                # epochs; every rank computes the same list and takes its share: rank r gets r, r+N, …
                pending: list[np.ndarray] = []
                while len(pending) < batches_per_step:
                    if progress.batch_in_epoch >= len(batches):
                        progress.epoch += 1
                        progress.batch_in_epoch = 0
                        if tc.max_epochs is not None and progress.epoch >= tc.max_epochs:
                            stop_reason = f"max_epochs={tc.max_epochs}"
                            break
                        batches = train_data.batches(tc.max_tokens, seed=tc.seed + progress.epoch)
                    pending.append(batches[progress.batch_in_epoch])
                    progress.batch_in_epoch += 1
                if stop_reason:
                    break
                lr = learning_rate(progress.step + 1, tc, d_model, budget_used(progress.step, progress.elapsed, tc))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                # The loss is normalised by the target tokens of the whole update (all ranks).
                n_tokens = sum(int(tgt_lengths[idx].sum()) + len(idx) for idx in pending)
                mine = pending[world.rank::world.size]
                step_sums = [0.0, 0.0, 0.0, 0.0]  # loss, nll, padding, batches (into the log window if kept)
                for i, indices in enumerate(mine):
                    batch = train_data.collate(indices).to(device)
                    # Gradients are all-reduced once per update: on the last micro-batch only.
                    sync = ddp is None or i == len(mine) - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync():
                        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                            loss, nll = batch_loss(step_model, batch, tc.label_smoothing)
                        # x world.size: DDP averages the ranks' gradients, the loss wants their sum.
                        (loss * (world.size / n_tokens)).backward()
                    step_sums[0] += float(loss.detach())
                    step_sums[1] += float(nll.detach())
                    step_sums[2] += padding_ratio(batch)
                    step_sums[3] += 1
                grad_norm = gradient_norm(model, tc.clip_norm)  # the same on every rank (synced grads)
                if not math.isfinite(grad_norm):
                    # Skip the update: weights, optimizer state and the step count stay as they were.
                    optimizer.zero_grad(set_to_none=True)
                    progress.bad_steps += 1
                    progress.skipped_steps += 1
                    out.print(f"warning: non-finite loss/gradient at step {progress.step + 1} (norm {grad_norm}); "
                              f"update skipped ({progress.bad_steps}/{tc.max_bad_steps} in a row)")
                    if progress.bad_steps >= tc.max_bad_steps:
                        out.close_bar()
                        raise Diverged(f"training diverged: {progress.bad_steps} consecutive steps with a NaN/Inf "
                                       f"loss or gradient after step {progress.step}; the last good checkpoint is "
                                       f"{last_path} (lower train.lr, or set train.clip_norm)")
                    continue
                progress.bad_steps = 0
                window_sums = [a + b for a, b in zip(window_sums, step_sums)]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.update(model)
                progress.step += 1
                progress.target_tokens += n_tokens
                window_tokens += n_tokens
                progress.elapsed = time.perf_counter() - started
                if on_step is not None:
                    on_step(progress.step, model)

                if progress.step % tc.log_every == 0:
                    seconds = time.perf_counter() - window_start
                    loss_sum, nll_sum, pad_sum, n_batches = all_sum(window_sums, world, device)
                    record = {"kind": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr,
                              "loss": loss_sum / window_tokens, "ppl": math.exp(min(nll_sum / window_tokens, 50)),
                              "tokens_per_s": window_tokens / seconds, "padding": pad_sum / max(n_batches, 1),
                              "tokens_per_update": window_tokens / tc.log_every,
                              "elapsed": round(progress.elapsed, 1)}
                    out.log(record)
                    out.advance({"loss": f"{record['loss']:.3f}", "lr": f"{lr:.2e}",
                                 "tok/s": f"{record['tokens_per_s']:.0f}"})
                    if not progress_bar:  # no live bar (a log file, CI): one line per log interval instead
                        out.print(f"step {progress.step}: loss {record['loss']:.3f} ppl {record['ppl']:.1f} "
                                  f"lr {lr:.2e} {record['tokens_per_s']:.0f} tok/s "
                                  f"padding {100 * record['padding']:.1f}% {record['elapsed'] / 60:.1f} min")
                    window_tokens, window_start, window_sums = 0, time.perf_counter(), [0.0, 0.0, 0.0, 0.0]
                else:
                    out.advance()

                # Stop decisions that can differ between ranks (clock, signals) are agreed on: the
                # largest request wins, so all ranks stop after the same step.
                request = 2 if stop.signum is not None else int(progress.elapsed >= max_time)
                request = all_max(request, world, device)
                if request == 2:
                    checkpoint(None, progress)
                    out.close_bar()
                    signum = stop.signum or signal.SIGTERM
                    saved = (f"{signal.Signals(signum).name}: saved step {progress.step} to {last_path} "
                             "(continue with --resume)")
                    raise Interrupted(saved if out.active else "", EXIT_CODES[signum])
                if progress.step >= tc.max_steps:
                    stop_reason = f"max_steps={tc.max_steps}"
                elif request == 1:
                    stop_reason = f"max_time={tc.max_time}"
                evaluating = progress.step % tc.eval_every == 0 or bool(stop_reason)
                if tc.save_every and progress.step % tc.save_every == 0 and not evaluating:
                    checkpoint(None, progress)
                if evaluating:
                    # Rank 0 validates; the others wait for it inside checkpoint()'s collective.
                    metrics = validate() if out.active else {}
                    if out.active:
                        record = {"kind": "valid", "step": progress.step, "epoch": progress.epoch,
                                  "elapsed": round(time.perf_counter() - started, 1), **metrics}
                        out.log(record)
                        out.print(f"step {progress.step}: valid loss {metrics['loss']:.3f} ppl {metrics['ppl']:.2f} "
                                  f"BLEU {metrics['bleu']:.2f} (greedy, {tc.eval_bleu_sentences} sentences)")
                    progress.elapsed = time.perf_counter() - started
                    checkpoint(metrics, progress)
                    window_start = time.perf_counter()  # validation time is not training throughput
                    patience_over = tc.patience is not None and progress.bad_evals >= tc.patience
                    if all_max(int(patience_over), world, device) and not stop_reason:
                        stop_reason = f"no improvement in {tc.patience} evaluations"
        finally:
            out.close_bar()

    if progress.step % tc.eval_every != 0 and stop_reason.startswith("max_epochs"):
        metrics = validate() if out.active else {}
        out.log({"kind": "valid", "step": progress.step, "epoch": progress.epoch, **metrics})
        checkpoint(metrics, progress)
    if out.active:
        # scores.json: the valid scores `tfm translate/evaluate --config` choose the default model by
        scores = {"metric": tc.best_metric, "checkpoint_best.pt": progress.best_score}
        if tc.average_last > 1:
            scores["checkpoint_avg.pt"] = average_final_checkpoints(model, config, manifest, progress, out, valid_data,
                                                                    references, tgt_sp, device)
        if ema is not None:
            scores["checkpoint_ema.pt"] = save_weight_average(model, ema, config, manifest, progress, out, valid_data,
                                                              references, tgt_sp, device)
        scores = {name: score for name, score in scores.items() if score is not None}
        if len(scores) > 2:
            atomic_write_text(out.ckpt_dir / "scores.json", json.dumps(scores, indent=1))
        else:
            (out.ckpt_dir / "scores.json").unlink(missing_ok=True)  # an earlier run's would mislead
    best = out.ckpt_dir / "checkpoint_best.pt"
    summary = TrainSummary(progress.step, progress.elapsed, progress.best_score, tc.best_metric,
                           best if best.exists() else None, last_path, stop_reason)
    shown = "n/a" if summary.best_score is None else (
        f"{summary.best_score:.2f}" if tc.best_metric == "bleu" else f"{-summary.best_score:.3f}")
    out.print(f"done ({stop_reason}): {progress.step} steps in {progress.elapsed / 60:.1f} min, "
              f"best valid {tc.best_metric} {shown} at step {progress.best_step} → {summary.best_checkpoint}")
    return summary

