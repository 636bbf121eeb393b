"""Checkpoint averaging (`tfm average`, `train.average_last`): the element-wise mean, usable as a model."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tfm_in_process as tfm
from tests.conftest import tiny_run
from tests.test_bad_inputs import other_vocabulary_same_size
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory


def mean_of(*paths):
    states = [load_checkpoint(p)["model"] for p in paths]
    return {k: sum(s[k].double() for s in states) / len(states) for k in states[0]}


@pytest.mark.slow
def test_tfm_average_is_the_elementwise_mean_and_translates(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=5, keep_last=4)
    assert tfm("train", "--config", config).exit_code == 0
    ckpts = tmp_path / "run/checkpoints"
    a, b, c = ckpts / "step_10.pt", ckpts / "step_15.pt", ckpts / "step_20.pt"
    proc = tfm("average", a, b, c, "-o", tmp_path / "avg.pt")
    assert proc.exit_code == 0, proc.stderr
    averaged = load_checkpoint(tmp_path / "avg.pt")
    expected = mean_of(a, b, c)
    assert all(torch.allclose(averaged["model"][k].double(), expected[k], atol=1e-7) for k in expected)
    last = load_checkpoint(c)["model"]
    assert any(not torch.equal(averaged["model"][k], last[k]) for k in expected)  # not just a copy
    assert "optimizer" not in averaged and averaged["averaged"] == [str(a), str(b), str(c)]
    translated = tfm("translate", "--checkpoint", tmp_path / "avg.pt", input="wa wb wc\nwd we\n")
    assert translated.exit_code == 0 and translated.stdout.count("\n") == 2, translated.stderr


@pytest.mark.slow
def test_average_last_writes_the_mean_of_the_final_evaluations(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=4, keep_last=5, average_last=3,
                      average_window=0.5)
    proc = tfm("train", "--config", config)
    assert proc.exit_code == 0, proc.stderr
    ckpts = tmp_path / "run/checkpoints"
    averaged = load_checkpoint(ckpts / "checkpoint_avg.pt")
    # the last 3 of the final half (steps > 10): step_12, 16, 20 — never an earlier one
    assert averaged["averaged"] == ["step_12.pt", "step_16.pt", "step_20.pt"]
    expected = mean_of(*(ckpts / name for name in averaged["averaged"]))
    assert all(torch.allclose(averaged["model"][k].double(), expected[k], atol=1e-7) for k in expected)
    scores = json.loads((ckpts / "scores.json").read_text())
    assert set(scores) == {"metric", "checkpoint_best.pt", "checkpoint_avg.pt"} and "checkpoint_avg.pt = mean" in proc.stderr
    # translate/evaluate --config take the average only if it validated at least as well as the best
    cfg = load_config(config)
    for avg_score, chosen in ((scores["checkpoint_best.pt"] - 1, "checkpoint_best.pt"),
                              (scores["checkpoint_best.pt"], "checkpoint_avg.pt")):
        (ckpts / "scores.json").write_text(json.dumps({**scores, "checkpoint_avg.pt": avg_score}))
        assert RunDirectory(cfg.run_path).default_checkpoint().name == chosen


@pytest.mark.slow
def test_no_average_of_early_checkpoints(tiny_prepared, tmp_path):
    """With evaluations at 5, 10, 15, 20 only step_20 lies in the last 20%: nothing is averaged."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=5, average_last=3)
    proc = tfm("train", "--config", config)
    assert proc.exit_code == 0 and "no checkpoint_avg.pt: 1 evaluated checkpoint(s) in the last 20%" in proc.stderr
    assert not (tmp_path / "run/checkpoints/checkpoint_avg.pt").exists()
    assert RunDirectory(load_config(config).run_path).default_checkpoint().name == "checkpoint_best.pt"


@pytest.mark.slow
def test_average_refuses_checkpoints_of_another_vocabulary_or_other_settings(tiny_prepared, tmp_path):
    """Weights of the same shapes that mean other things (other pieces, other heads) average into no
    model: it was written without a word (an ensemble of them was refused)."""
    ours = tmp_path / "run/checkpoints/step_2.pt"
    assert tfm("train", "--config", tiny_run(tiny_prepared, tmp_path, max_steps=2, eval_every=2)).exit_code == 0
    other_vocabulary_same_size(tmp_path / "vocabulary.pt", ours)
    heads = tiny_run(tiny_prepared, tmp_path / "heads", max_steps=2, eval_every=2)
    assert tfm("train", "--config", heads, "--set", "model.n_heads=1").exit_code == 0
    for other, message in ((tmp_path / "vocabulary.pt", "its source vocabulary differs from"),
                           (tmp_path / "heads/run/checkpoints/step_2.pt", "model.n_heads is 1 there but 2")):
        proc = tfm("average", ours, other, "-o", tmp_path / "avg.pt")
        assert proc.exit_code == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "avg.pt").exists()


def test_a_checkpoints_settings_read_mapped_equal_those_of_a_legacy_pickle_and_of_a_full_load(tmp_path):
    """TrainedSettings.read maps the file's tensors instead of reading them (a multi-GB checkpoint_last.pt
    costs no read of its weights); a checkpoint in torch's legacy pickle format cannot be mapped and is
    read whole: the same settings either way, and the mapped weights equal the loaded ones."""
    from transformer_cli.experiment.checkpoint import FORMAT, TrainedSettings, model_payload, save_checkpoint
    from transformer_cli.model.transformer import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(src_vocab_size=48, tgt_vocab_size=48, d_model=32, n_heads=2, enc_layers=2,
                                          dec_layers=1, d_ff=64))
    config = {"model": {"size": None, "dropout": 0.2}, "train": {"lr": 0.004, "max_tokens": 1500}}
    payload = model_payload(model, config, {"src": b"s", "tgt": b"t"}, {"step": 3})
    save_checkpoint(tmp_path / "zip.pt", payload)
    torch.save({"format": FORMAT, **payload}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "legacy.pt").read_bytes()[:1] == b"\x80"  # (the format that cannot be mapped)
    mapped, legacy = TrainedSettings.read(tmp_path / "zip.pt"), TrainedSettings.read(tmp_path / "legacy.pt")
    assert mapped.shape is not None and mapped.shape.keys() == {"d_model": 32, "n_heads": 2, "enc_layers": 2,
                                                                "dec_layers": 1, "d_ff": 64}
    assert (mapped.tgt_vocab_size, mapped.lr, mapped.max_tokens, mapped.dropout) == (48, 0.004, 1500, 0.2)
    assert {**mapped.__dict__, "path": None} == {**legacy.__dict__, "path": None}
    loaded, by_map = load_checkpoint(tmp_path / "zip.pt"), load_checkpoint(tmp_path / "zip.pt", mapped=True)
    assert loaded["model"].keys() == by_map["model"].keys()
    assert all(torch.equal(loaded["model"][k], by_map["model"][k]) for k in loaded["model"])
