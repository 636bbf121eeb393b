"""Shared set-up for the benchmark scripts: a tfm model and a HuggingFace MarianMTModel of the
identical shape, built from one tfm config (random init, no downloads)."""

from __future__ import annotations

import os
import platform

import torch

from transformer_cli.experiment.config import ExperimentConfig
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID, PAD_ID
from transformer_cli.model.transformer import Transformer, ffn_dropout
from transformer_cli.runtime.cpu import cpu_model_name
from transformer_cli.training.train import build_model


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def tfm_model(config: ExperimentConfig, vocab_size: int) -> Transformer:
    return build_model(config, vocab_size, vocab_size)


def hf_model(config: ExperimentConfig, vocab_size: int):
    """MarianMTModel with tfm's shape: same d_model/heads/layers/FFN/vocab/dropout (residual, attention and
    inside the FFN, as tfm's), tied embeddings."""
    from transformers import MarianConfig, MarianMTModel

    m = config.model
    hf_config = MarianConfig(
        vocab_size=vocab_size, d_model=m.d_model, encoder_layers=m.enc_layers, decoder_layers=m.dec_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff,
        decoder_ffn_dim=m.d_ff, activation_function=m.activation, dropout=m.dropout,
        attention_dropout=m.attention_dropout, activation_dropout=ffn_dropout(m), max_position_embeddings=m.max_positions,
        scale_embedding=True, pad_token_id=PAD_ID, eos_token_id=EOS_ID, forced_eos_token_id=None,
        decoder_start_token_id=BOS_ID, bos_token_id=BOS_ID, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )
    return MarianMTModel(hf_config)


def machine_line(device: torch.device | None = None) -> str:
    import os

    cpu = cpu_model_name()

    gpu = f"GPU {torch.cuda.get_device_name(device)}, " if device is not None and device.type == "cuda" else ""
    # The instruction set torch's kernels run at (AVX2, AVX512…): "AMD EPYC" alone does not tell a
    # Zen 3 from a Zen 4, and ATEN_CPU_CAPABILITY can lower it.
    return (f"machine: {gpu}{cpu} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}")
