"""What a training step leaves on the device, read back only at log and checkpoint points: the
loss sums of the log window, and whether updates were skipped for a non-finite gradient.

A step never waits for the device: `.item()`, `float(t)`, `if t:` on a device tensor make the host
wait for every queued kernel (on a GPU, the end of the step's backward) before it can queue the
next batch's. So the loss and NLL are summed into device tensors, the gradient norm's finiteness
becomes a 0/1 tensor that fused Adam reads itself (`found_inf`: the update is skipped on the device,
weights and moments untouched), and the counts of skipped updates are kept beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..runtime.errors import Diverged


def gradient_norm(model: torch.nn.Module, clip_norm: float) -> torch.Tensor:
    """Total L2 norm of the gradients before clipping, a 0-d device tensor; clips to `clip_norm`
    when it is > 0 (a non-finite norm makes the gradients non-finite too: the update is skipped)."""
    if clip_norm > 0:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm, foreach=True)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


class StepLedger:
    """Device-side sums: the loss, NLL and target tokens of the updates that stepped since the log
    window began; over the whole run, the updates skipped and the target tokens they held; the last
    skipped step, and the run of consecutive skipped updates."""

    LOSS, NLL, TOKENS, SKIPPED, SKIPPED_TOKENS, LAST_SKIPPED, RUN = range(7)
    NAMES = ("loss", "nll", "tokens", "skipped", "skipped_tokens", "last_skipped", "consecutive")

    def __init__(self, device: torch.device, consecutive: int = 0):
        self.sums = torch.zeros(7, dtype=torch.float64, device=device)
        self.sums[self.RUN] = consecutive
        self.padding, self.batches, self.started = 0.0, 0, time.perf_counter()
        self.skips_counted = self.skipped_tokens_counted = 0  # what `account` has put into the progress

    def add(self, loss: torch.Tensor, nll: torch.Tensor, tokens: int, skipped: torch.Tensor, step: int,
            padding: float, batches: int) -> None:
        """One update: `skipped` is 1.0 where it did not step (a 0-d device tensor), `step` its number."""
        was_skipped = skipped.double()
        kept = 1.0 - was_skipped
        run = (self.sums[self.RUN] + was_skipped) * was_skipped
        self.sums += torch.stack([loss.double() * kept, nll.double() * kept, tokens * kept, was_skipped,
                                  tokens * was_skipped, (step - self.sums[self.LAST_SKIPPED]) * was_skipped,
                                  run - self.sums[self.RUN]])
        self.padding, self.batches = self.padding + padding, self.batches + batches

    def read(self, new_window: bool) -> dict[str, float]:
        """The sums as numbers (one wait for the device); `new_window`: the log window starts again."""
        read = dict(zip(self.NAMES, self.sums.tolist()))
        read.update(padding=self.padding, batches=self.batches, seconds=time.perf_counter() - self.started)
        if new_window:
            self.sums[: self.SKIPPED] = 0.0
            self.padding, self.batches, self.started = 0.0, 0, time.perf_counter()
        return read

    def account(self, progress: Any, new_window: bool, max_bad_steps: int, say: Callable[[str], None],
                last_checkpoint: Path, before_raising: Callable[[], None]) -> dict[str, float]:
        """`read`, and the updates skipped since the last account put into `progress` (a
        TrainProgress: skipped_steps, bad_steps, target_tokens) with a warning; a run of
        `max_bad_steps` skips in a row raises Diverged."""
        read = self.read(new_window)
        new = int(read["skipped"]) - self.skips_counted
        if new:
            self.skips_counted += new
            progress.skipped_steps += new
            progress.target_tokens -= int(read["skipped_tokens"]) - self.skipped_tokens_counted
            self.skipped_tokens_counted = int(read["skipped_tokens"])
            say(f"warning: non-finite loss/gradient: {new} update(s) skipped up to step {progress.step}, the last at "
                f"step {int(read['last_skipped'])} ({int(read['consecutive'])}/{max_bad_steps} in a row)")
        progress.bad_steps = int(read["consecutive"])
        if progress.bad_steps >= max_bad_steps:
            before_raising()
            raise Diverged(f"training diverged: {progress.bad_steps} consecutive steps with a NaN/Inf loss or "
                           f"gradient up to step {progress.step}; the last good checkpoint is {last_checkpoint} "
                           "(lower train.lr, or set train.clip_norm)")
        return read
