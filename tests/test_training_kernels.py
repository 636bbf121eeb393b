"""What a training step hands torch's fused attention, checked on CPU for the GPU's sake: the
flash and memory-efficient kernels take `is_causal` or a small boolean key-padding mask, while a
materialised (B, H, T, S) float mask would rule the flash kernel out and cost memory traffic."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_run
from transformer_cli.data.batches import collate
from transformer_cli.model.transformer import Transformer, TransformerConfig
from transformer_cli.training.loss import batch_loss


def test_training_attention_is_causal_or_a_boolean_key_mask(monkeypatch):
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4, enc_layers=2, dec_layers=2,
                            d_ff=64, pad_id=0)
    model = Transformer(cfg).train()
    batch = collate([np.array([5, 6, 7, 8]), np.array([5, 6])], [np.array([8, 9]), np.array([8, 9, 10, 11, 12])])
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.shape, k.shape, attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    loss, _ = batch_loss(model, batch, 0.1)
    loss.backward()
    assert len(calls) == cfg.enc_layers + 2 * cfg.dec_layers  # every attention went through the fused kernel
    causal = [c for c in calls if c[3]]
    assert len(causal) == cfg.dec_layers and all(mask is None for _, _, mask, _ in causal)
    for q_shape, k_shape, mask, is_causal in calls:
        if not is_causal:  # encoder self- and decoder cross-attention: padded keys only
            assert mask is not None and mask.dtype == torch.bool
            assert mask.shape == (q_shape[0], 1, 1, k_shape[2])  # never expanded over heads or queries


@pytest.mark.slow
def test_the_training_forward_compiles_as_one_graph():
    """`train.compile: true` hands the model to torch.compile: a graph break (an op dynamo cannot
    trace, such as the CPU dropout's in-place `random_`) splits the step into many small graphs,
    and per-call-site recompiles hit dynamo's limit and fall back to eager. The training forward,
    dropout on, in fp32 and under bf16 autocast, must trace as one graph."""
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4, enc_layers=2, dec_layers=2,
                            d_ff=64, pad_id=0, dropout=0.1, attention_dropout=0.1)
    model = Transformer(cfg).train()
    batch = collate([np.array([5, 6, 7, 8]), np.array([5, 6])], [np.array([8, 9]), np.array([8, 9, 10, 11, 12])])
    for dtype in (None, torch.bfloat16):
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            explained = torch._dynamo.explain(model)(batch.src, batch.tgt_in, batch.rows, project=False)
        assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
        assert explained.graph_count == 1
    torch._dynamo.reset()


@pytest.mark.slow
def test_training_compiles_one_graph_per_layer_kind_for_batches_of_every_shape():
    """Batches of three shapes through `train.compile`'s regional compilation (dynamo's graph
    capture with the eager backend: what is compiled, without the compiler's minutes): one graph
    for the encoder layers, one for the decoder layers and one for the output loss's chunks,
    however many layers, shapes and rows; the weights keep their names. torch.compile's default
    would specialise on the first shape and capture again at the second."""
    from torch._dynamo.utils import counters

    from transformer_cli.model.kernels import compile_for_training

    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4, enc_layers=3, dec_layers=2,
                            d_ff=64, pad_id=0, dropout=0.1)
    rng = np.random.default_rng(0)
    graphs = {}
    for dynamic in (True, None):
        torch._dynamo.reset()
        counters.clear()
        model = Transformer(cfg).train()
        names = list(model.state_dict())
        if dynamic:
            assert compile_for_training(model, backend="eager") is model
        else:
            for layer in (*model.encoder_layers, *model.decoder_layers):
                layer.compile(backend="eager")
        assert list(model.state_dict()) == names
        for rows, src_len, tgt_len in ((3, 5, 6), (4, 9, 7), (2, 12, 11)):
            batch = collate([rng.integers(4, 50, src_len) for _ in range(rows)],
                            [rng.integers(4, 50, tgt_len) for _ in range(rows)])
            loss, _ = batch_loss(model, batch, 0.1)
            loss.backward()
        graphs[dynamic] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == {True: 3, None: 4}  # (the layers compiled one by one leave the loss eager)


@pytest.mark.slow
def test_a_compiled_run_trains_checkpoints_and_resumes_as_an_eager_one(tiny_prepared, tmp_path):
    """`train.compile: true` end to end with torch's own compiler (inductor, on CPU): the loss
    falls, the checkpoints load into an eager model under the usual names, the weight average is
    made, and --resume goes on from the step reached."""
    from transformer_cli.experiment.checkpoint import load_checkpoint
    from transformer_cli.experiment.config import load_config
    from transformer_cli.training.train import train

    config_path = tiny_run(tiny_prepared, tmp_path, max_steps=40, eval_every=4, compile=True, average_last=2)
    config = load_config(config_path)
    first = train(config, progress_bar=False)
    assert first.steps == 40
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert losses[-1] < 0.8 * losses[0]
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_last.pt")
    eager = Transformer(TransformerConfig(**state["model_config"]))
    eager.load_state_dict(state["model"])  # no "_orig_mod." in any name
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_avg.pt").exists()
    resumed = train(config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 50})}),
                    resume=True, progress_bar=False)
    assert resumed.steps == 50


def test_cuda_attention_is_chosen_among_kernels_that_build_nothing_per_shape():
    """On CUDA tfm leaves cuDNN's attention out of SDPA's choice (it builds a graph per new batch
    shape, kernels.leave_out_cudnn_attention); flash and memory-efficient attention stay, and the
    switch restores torch's default. A CPU device changes nothing."""
    from transformer_cli.model.kernels import leave_out_cudnn_attention
    from transformer_cli.runtime.devices import resolve_device

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        leave_out_cudnn_attention(False)
        resolve_device("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        leave_out_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        leave_out_cudnn_attention(False)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_capped_process_keeps_its_compiled_kernels_apart(monkeypatch):
    """inductor's on-disk kernels built under ATEN_CPU_CAPABILITY=avx2 and loaded uncapped computed
    wrong losses: a capped process compiles into a folder named by its cap; an uncapped one, or a
    user's own TORCHINDUCTOR_CACHE_DIR, is left as torch has it."""
    from transformer_cli.model.kernels import keep_compiled_kernels_per_isa_cap

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    keep_compiled_kernels_per_isa_cap()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    folders = set()
    for cap in ("avx2", "AVX512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        keep_compiled_kernels_per_isa_cap()
        folders.add(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(f"aten-{cap.lower()}")
    assert len(folders) == 2
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    keep_compiled_kernels_per_isa_cap()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"
