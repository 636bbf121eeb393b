"""Checkpoint averaging (`tfm average`, `train.average_last`): the element-wise mean, usable as a model."""

from __future__ import annotations

import torch

from tests.conftest import tfm, tiny_run
from transformer_cli.checkpoint import load_checkpoint


def mean_of(*paths):
    states = [load_checkpoint(p)["model"] for p in paths]
    return {k: sum(s[k].double() for s in states) / len(states) for k in states[0]}


def test_tfm_average_is_the_elementwise_mean_and_translates(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=5, keep_last=4)
    assert tfm("train", "--config", config).returncode == 0
    ckpts = tmp_path / "run/checkpoints"
    a, b, c = ckpts / "step_10.pt", ckpts / "step_15.pt", ckpts / "step_20.pt"
    proc = tfm("average", a, b, c, "-o", tmp_path / "avg.pt")
    assert proc.returncode == 0, proc.stderr
    averaged = load_checkpoint(tmp_path / "avg.pt")
    expected = mean_of(a, b, c)
    assert all(torch.allclose(averaged["model"][k].double(), expected[k], atol=1e-7) for k in expected)
    last = load_checkpoint(c)["model"]
    assert any(not torch.equal(averaged["model"][k], last[k]) for k in expected)  # not just a copy
    assert "optimizer" not in averaged and averaged["averaged"] == [str(a), str(b), str(c)]
    translated = tfm("translate", "--checkpoint", tmp_path / "avg.pt", input="wa wb wc\nwd we\n")
    assert translated.returncode == 0 and translated.stdout.count("\n") == 2, translated.stderr


def test_average_last_writes_the_mean_of_the_last_evaluations(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=5, keep_last=4, average_last=2)
    assert tfm("train", "--config", config).returncode == 0
    ckpts = tmp_path / "run/checkpoints"
    averaged = load_checkpoint(ckpts / "checkpoint_avg.pt")
    assert averaged["averaged"] == ["step_15.pt", "step_20.pt"]
    expected = mean_of(ckpts / "step_15.pt", ckpts / "step_20.pt")
    assert all(torch.allclose(averaged["model"][k].double(), expected[k], atol=1e-7) for k in expected)
