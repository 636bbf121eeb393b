"""TensorBoard event files (`train.tensorboard: true`), read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import tiny_run
from transformer_cli.experiment.config import load_config
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train


@pytest.mark.slow
def test_event_files_hold_the_runs_scalars_and_a_resume_appends_to_them(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=10, eval_every=10, log_every=5, tensorboard=True)
    train(load_config(config), progress_bar=False)
    last = tmp_path / "run/checkpoints/checkpoint_last.pt"
    at_step_10 = last.read_bytes()
    train(load_config(config, ["train.max_steps=20"]), resume=True, progress_bar=False)
    # As if that process had been killed after logging steps 15 and 20 but before its checkpoint:
    # the resumed run logs them again, and TensorBoard shows each step once (the latest).
    last.write_bytes(at_step_10)
    train(load_config(config, ["train.max_steps=20"]), resume=True, progress_bar=False)

    events = EventAccumulator(str(tmp_path / "run/tensorboard"))
    events.Reload()
    assert {"train/loss", "train/ppl", "train/lr", "train/tokens_per_s", "valid/loss", "valid/ppl",
            "valid/bleu"} <= set(events.Tags()["scalars"])
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    for kind, name in (("train", "loss"), ("train", "lr"), ("valid", "bleu")):
        logged = sorted({r["step"]: r[name] for r in records if r["kind"] == kind}.items())  # the latest per step
        shown = [(e.step, e.value) for e in events.Scalars(f"{kind}/{name}")]
        assert [step for step, _ in shown] == [step for step, _ in logged] == (
            [5, 10, 15, 20] if kind == "train" else [10, 20])
        assert [value for _, value in shown] == pytest.approx([value for _, value in logged], rel=1e-6)


def test_without_the_tensorboard_package_it_is_one_error_naming_the_extra(tiny_prepared, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the extra were not installed
    config = tiny_run(tiny_prepared, tmp_path, tensorboard=True)
    with pytest.raises(TfmError, match=r"key 'train.tensorboard': .*pip install 'transformer-cli\[tensorboard\]'"):
        train(load_config(config), progress_bar=False)
    assert not (tmp_path / "run/checkpoints").exists()
