"""The host never waits for the device inside a training step: on a GPU, every `.item()`,
`float(t)`, `int(t)` or `if t:` on a device tensor stalls the host until the queued kernels finish,
and the next batch is not queued meanwhile. On CPU the same calls show up as
`aten._local_scalar_dense`, which a dispatch mode can count."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import tiny_run
from transformer_cli.data.batch_stream import CollatedUpdates
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import load_config
from transformer_cli.training.train import Trainer, train


class ScalarReads(TorchDispatchMode):
    """Records, for each read of a tensor's value by the host, whether it happened inside a step."""

    def __init__(self, inside: list[bool]):
        super().__init__()
        self.inside, self.reads = inside, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(self.inside[0])
        return func(*args, **(kwargs or {}))


STEP_METHODS = ((Trainer, "loss_step"), (Trainer, "update"), (Trainer, "set_learning_rate"), (CollatedUpdates, "next"))


def mark_steps(inside: list[bool], methods=STEP_METHODS, assign=setattr) -> None:
    """Wrap each (class, method) so that `inside[0]` is True while it runs (`assign`: how to set
    the wrapper, e.g. monkeypatch.setattr)."""
    def within_step(method):
        def wrapped(*args, **kwargs):
            inside[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                inside[0] = False
        return wrapped

    for owner, name in methods:
        assign(owner, name, within_step(getattr(owner, name)))


@pytest.mark.parametrize("clip_norm, ema", [(1.0, None), (0.0, 0.999)])
@pytest.mark.slow
def test_no_training_step_reads_a_tensor_value(tiny_prepared, tmp_path, monkeypatch, clip_norm, ema):
    """20 updates, logged every 10: the next batches, the learning rate, forward and backward, the
    clip, the non-finite check, the optimizer and the moving average read no tensor value; the
    reads all fall at log, checkpoint and validation points (and there are some: the mode sees them)."""
    config = load_config(tiny_run(tiny_prepared, tmp_path, max_steps=20, log_every=10, eval_every=1000,
                                  clip_norm=clip_norm, ema_decay=ema))
    inside = [False]
    mark_steps(inside, assign=monkeypatch.setattr)
    with ScalarReads(inside) as mode:
        summary = train(config, progress_bar=False)
    assert summary.steps == 20
    assert mode.reads, "the dispatch mode saw no reads at all: it is not counting"
    assert not any(mode.reads), f"{sum(mode.reads)} tensor value(s) read inside training steps"


@pytest.mark.slow
def test_collating_ahead_changes_nothing_and_resumes_exactly(tiny_prepared, tmp_path):
    """Batches collated on a background thread one update ahead: the same weights as collating
    in the step, and a run stopped at step 10 and resumed ends where the straight run ends (the
    read-ahead never moves the position a checkpoint saves); max_epochs ends both at the same place."""
    def run(name: str, steps: int, prefetch: bool, resume: bool = False, **settings) -> dict:
        config = load_config(tiny_run(tiny_prepared, tmp_path / name, max_steps=steps, eval_every=10,
                                      prefetch=prefetch, **settings)) if not resume else \
            load_config(tmp_path / name / "tiny.yaml")
        if resume:
            config.train.max_steps, config.train.prefetch = steps, prefetch
        train(config, resume=resume, progress_bar=False)
        return load_checkpoint(tmp_path / name / "run/checkpoints/checkpoint_last.pt")

    inline = run("inline", 20, prefetch=False)
    ahead = run("ahead", 20, prefetch=True)
    run("split", 10, prefetch=True)
    split = run("split", 20, prefetch=True, resume=True)
    assert inline["progress"]["step"] == ahead["progress"]["step"] == split["progress"]["step"] == 20
    for name, tensor in inline["model"].items():
        assert torch.equal(tensor, ahead["model"][name]) and torch.equal(tensor, split["model"][name]), name
    assert inline["progress"]["batch_in_epoch"] == split["progress"]["batch_in_epoch"]
    ends = [run(f"epochs-{p}", 10_000, prefetch=p, max_epochs=1)["progress"] for p in (False, True)]
    assert ends[0]["step"] == ends[1]["step"] and ends[0]["epoch"] == ends[1]["epoch"] == 1

