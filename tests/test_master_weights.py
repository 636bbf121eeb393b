"""bf16 weights with fp32 master copies (transformer_cli.training.master_weights), what
`scripts/bench_train.py --bf16-weights` trains with: the masters start as the exact fp32 weights,
updates too small for bf16 still add up, and a tiny Transformer learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_model import tiny_config
from transformer_cli.data.batches import collate
from transformer_cli.model.transformer import Transformer
from transformer_cli.training.loss import batch_loss
from transformer_cli.training.master_weights import MasterWeights


def test_masters_are_the_exact_fp32_weights_and_the_model_runs_in_bf16():
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    masters = MasterWeights(model)
    assert [m.dtype for m in masters.masters] == [torch.float32] * len(before)
    for (name, p), master in zip(model.named_parameters(), masters.masters):
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(master, before[name]), name  # not rounded through bf16
        assert torch.equal(p, before[name].to(torch.bfloat16)), name
    assert model.src_pos.table.dtype == model.tgt_pos.table.dtype == torch.bfloat16  # buffers too: nothing promotes the stream to fp32


def test_updates_below_bf16_resolution_accumulate_in_the_masters():
    """Adam's steps of ~lr = 1e-3 on weights of 1.0: bf16's spacing there is 2^-8 ≈ 0.0039, so a
    bf16 weight updated in place never moves; the fp32 master moves by ~lr a step and, once the
    sum passes half a spacing, so does the bf16 weight cast from it."""
    def trained(with_masters: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = torch.nn.Linear(4, 4, bias=False)
        torch.nn.init.ones_(layer.weight)
        masters = MasterWeights(layer) if with_masters else None
        if masters is None:
            layer.to(torch.bfloat16)
        optimizer = masters.optimizer(lr=1e-3) if masters else torch.optim.Adam(layer.parameters(), lr=1e-3)
        x = torch.ones(8, 4, dtype=torch.bfloat16)
        for _ in range(10):
            layer(x).sum().backward()  # gradient +8 on every weight: Adam steps down by ~lr
            if masters:
                masters.step(optimizer)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        assert layer.weight.grad is None  # step() clears the bf16 gradients as zero_grad would
        return layer.weight.detach(), None if masters is None else masters.masters[0]

    plain, _ = trained(with_masters=False)
    assert torch.equal(plain, torch.ones_like(plain))  # every update rounded away
    weight, master = trained(with_masters=True)
    assert torch.allclose(master, torch.full_like(master, 1 - 10e-3), atol=1e-4)
    assert torch.equal(weight, master.to(torch.bfloat16)) and (weight < 1).all()


@pytest.mark.slow
def test_a_tiny_transformer_learns_to_copy_with_bf16_weights():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    sentences = [rng.integers(4, 50, rng.integers(3, 8)) for _ in range(16)]
    batch = collate(sentences, sentences)
    model = Transformer(tiny_config(dropout=0.0)).train()
    masters = MasterWeights(model)
    optimizer = masters.optimizer(lr=3e-3, betas=(0.9, 0.98))
    losses = []
    for _ in range(60):
        loss, _ = batch_loss(model, batch, smoothing=0.0)
        (loss / batch.n_tgt_tokens).backward()
        masters.step(optimizer)
        losses.append(loss.item() / batch.n_tgt_tokens)
    assert losses[0] > 3.0  # ~ln(50) at the start
    assert losses[-1] < 0.1 * losses[0], losses[::10]
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in model.parameters())
    for p, master in zip(model.parameters(), masters.masters):
        assert torch.equal(p, master.to(torch.bfloat16))
