"""The moving average of the weights (`train.ema_decay`, checkpoint_ema.pt)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_run
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.model.transformer import Transformer, TransformerConfig
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.ema import WeightAverage
from transformer_cli.training.train import train


def test_update_is_the_warmed_up_exponential_average():
    model = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    ema = WeightAverage(model, decay=0.9)
    expected = [s.double() for s in start]
    for n in range(1, 100):  # (1 + n) / (10 + n) reaches 0.9 at n = 80
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        decay = min(0.9, (1 + n) / (10 + n))  # warm-up: 2/11, 3/12, … until it reaches 0.9
        expected = [decay * e + (1 - decay) * p.detach().double() for e, p in zip(expected, model.parameters())]
    assert ema.current_decay() == 0.9
    for mine, want in zip(ema.weights, expected):
        assert torch.allclose(mine.double(), want, atol=1e-6)
    # not simply the last or the first weights
    assert not torch.allclose(ema.weights[0], model.weight.detach(), atol=1e-3)
    assert not torch.allclose(ema.weights[0], start[0], atol=1e-3)


def test_applied_swaps_in_the_average_and_restores_exactly_with_tied_weights():
    model = Transformer(TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=2, enc_layers=1,
                                          dec_layers=1, d_ff=32, share_embeddings=True, tie_output=True))
    ema = WeightAverage(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.updates = 100  # past the warm-up: decay 0.5
    ema.update(model)  # average = trained - 0.5
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied(model) as averaged:
        state = averaged.state_dict()
        for name, tensor in trained.items():
                assert torch.allclose(state[name], tensor - 0.5, atol=1e-6), name
        # tied: the output projection is the embedding, also inside the average
        assert averaged.output_proj.weight is averaged.tgt_embed.embedding.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def initial_parameters(config) -> list[torch.Tensor]:
    """The weights `train()` starts from: the same seed builds the same model."""
    from transformer_cli.training.train import build_model

    manifest = RunDirectory(config.run_path).load_manifest()
    torch.manual_seed(config.train.seed)
    model = build_model(config, manifest.vocab_size["src"], manifest.vocab_size["tgt"])
    return [p.detach().double() for p in model.parameters()]


@pytest.mark.slow
def test_checkpoint_ema_matches_an_independent_recomputation(tiny_prepared, tmp_path):
    """checkpoint_ema.pt = the warmed-up average of the initial weights and those after every step."""
    decay = 0.7
    config = load_config(tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=10, ema_decay=decay))
    average = initial_parameters(config)
    names: list[str] = []

    def follow(step, model):
        names[:] = [n for n, _ in model.named_parameters()]
        d = min(decay, (1 + step) / (10 + step))
        average[:] = [d * a + (1 - d) * p.detach().double() for a, p in zip(average, model.parameters())]

    train(config, progress_bar=False, on_step=follow)
    ckpts = tmp_path / "run/checkpoints"
    saved = load_checkpoint(ckpts / "checkpoint_ema.pt")
    last = load_checkpoint(ckpts / "checkpoint_last.pt")
    assert saved["ema_decay"] == decay and saved["progress"]["step"] == 20
    for name, want in zip(names, average):
        assert torch.allclose(saved["model"][name].double(), want, atol=1e-6), name
    assert any(not torch.allclose(saved["model"][n], last["model"][n], atol=1e-4) for n in names)  # not the last


@pytest.mark.slow
def test_resume_continues_the_average_exactly(tiny_prepared, tmp_path):
    """A run stopped at step 15 and resumed writes the same checkpoint_ema.pt as one run straight to 30."""
    straight = tiny_run(tiny_prepared, tmp_path / "straight", max_steps=30, eval_every=5, ema_decay=0.8)
    train(load_config(straight), progress_bar=False)
    split = tiny_run(tiny_prepared, tmp_path / "split", max_steps=15, eval_every=5, ema_decay=0.8)
    train(load_config(split), progress_bar=False)
    train(load_config(split, ["train.max_steps=30"]), resume=True, progress_bar=False)
    a = load_checkpoint(tmp_path / "straight/run/checkpoints/checkpoint_ema.pt")["model"]
    b = load_checkpoint(tmp_path / "split/run/checkpoints/checkpoint_ema.pt")["model"]
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
    scores = json.loads((tmp_path / "split/run/checkpoints/scores.json").read_text())
    assert set(scores) == {"metric", "checkpoint_best.pt", "checkpoint_ema.pt"}


@pytest.mark.slow
def test_default_checkpoint_takes_the_best_validated_of_avg_ema_best(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, eval_every=4, keep_last=5, average_last=3,
                      average_window=0.5, ema_decay=0.9)
    train(load_config(config), progress_bar=False)
    ckpts = tmp_path / "run/checkpoints"
    scores = json.loads((ckpts / "scores.json").read_text())
    assert set(scores) == {"metric", "checkpoint_best.pt", "checkpoint_avg.pt", "checkpoint_ema.pt"}
    cfg = load_config(config)
    for avg, ema, best, chosen in ((1, 2, 0, "checkpoint_ema.pt"), (2, 1, 0, "checkpoint_avg.pt"),
                                   (0, 1, 2, "checkpoint_best.pt"), (1, 1, 1, "checkpoint_avg.pt"),
                                   (0, 1, 1, "checkpoint_ema.pt")):
        (ckpts / "scores.json").write_text(json.dumps({"metric": "bleu", "checkpoint_avg.pt": avg,
                                                       "checkpoint_ema.pt": ema, "checkpoint_best.pt": best}))
        assert RunDirectory(cfg.run_path).default_checkpoint().name == chosen


@pytest.mark.parametrize("value", ["1", "0", "-0.5", "1.5", "soon"])
def test_bad_ema_decay_names_the_key(value):
    with pytest.raises(TfmError, match=r"key 'train.ema_decay'"):
        load_config(None, [f"train.ema_decay={value}"])
