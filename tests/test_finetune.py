"""Starting from a model: a child run that takes its parent's vocabulary (`vocab.from_run`) and
weights (`train.init_from`), with a fresh optimizer, schedule and step count."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.conftest import reverse_task_config, write_reverse_task
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train


def child_config(folder: Path, parent_run: str, **train_settings) -> dict:
    """The reverse task on new sentences (another seed), sharing the parent's vocabulary."""
    write_reverse_task(folder / "data", n_train=1000, n_test=100, seed=5)
    settings = {"max_steps": 20, "eval_every": 20, "log_every": 5, "lr_schedule": "constant", "lr": 1e-4,
                "warmup": 0, "precision": "fp32", **train_settings}
    raw = reverse_task_config(folder / "data", folder / "run", **settings)
    raw["vocab"]["from_run"] = parent_run
    return raw


def test_a_fine_tuned_child_starts_from_its_parent_with_a_fresh_optimizer(reverse_model, tmp_path):
    parent_config, parent_summary = reverse_model
    parent_run = Path(parent_config.run_dir)
    child = config_from_dict(child_config(tmp_path / "child", parent_config.run_dir,
                                          init_from=str(parent_summary.best_checkpoint)))
    manifest = prepare(child, progress=False).manifest
    assert (tmp_path / "child/run/spm.model").read_bytes() == (parent_run / "spm.model").read_bytes()
    assert manifest.vocab_from == str(parent_run.resolve())

    summary = train(child, progress_bar=False)
    last = load_checkpoint(tmp_path / "child/run/checkpoints/checkpoint_last.pt")
    assert summary.steps == last["progress"]["step"] == 20  # the step count starts afresh (the parent made 400)
    assert {int(s["step"]) for s in last["optimizer"]["state"].values()} == {20}  # Adam's own count too
    # 20 steps at lr 1e-4 cannot teach a model to reverse: the child reverses because it starts from
    # its parent (valid BLEU ~99). The same steps from random weights stay near 0.
    assert summary.best_score >= 90, summary.best_score
    scratch = config_from_dict(child_config(tmp_path / "scratch", parent_config.run_dir))
    prepare(scratch, progress=False)
    assert train(scratch, progress_bar=False).best_score < 30


def test_init_from_a_run_directory_takes_the_checkpoint_its_config_would(reverse_model, tmp_path):
    parent_config, _ = reverse_model
    raw = child_config(tmp_path, parent_config.run_dir, init_from=parent_config.run_dir, max_steps=1, eval_every=1,
                       eval_bleu_sentences=20)
    config = config_from_dict(raw)
    prepare(config, progress=False)
    assert train(config, progress_bar=False).best_score >= 90


def test_a_parent_whose_vocabulary_changed_is_prepared_again(tiny_prepared, tmp_path):
    _, run = tiny_prepared
    parent = tmp_path / "parent"
    shutil.copytree(run, parent)
    config = config_from_dict(child_config(tmp_path / "child", str(parent)))
    assert not prepare(config, progress=False).reused
    assert prepare(config, progress=False).reused
    # Another 40-piece model in the parent: the child's vocabulary and data are made again from it.
    other = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(f"{a}{b}{a} {b}{a}{b}" for a in "abcdefgh" for b in "ijklmnop"),
                                   model_writer=other, vocab_size=40, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                   minloglevel=2)
    (parent / "spm.model").write_bytes(other.getvalue())
    assert not prepare(config, progress=False).reused
    assert (tmp_path / "child/run/spm.model").read_bytes() == other.getvalue()
    (parent / "spm.model").unlink()
    with pytest.raises(TfmError, match="key 'vocab.from_run': .*spm.model not found"):
        prepare(config, progress=False)
