"""CPU inference: the trained model's linear layers laid out once for oneDNN, or quantized to int8.

Decoding multiplies a few rows by each weight matrix per step, so how a weight is stored matters
as much as the arithmetic. These transformations change how a model computes, never what: each is
probed or tested against the plain model (tests/test_translate.py, tests/test_model.py).
They change the weights in place: for a model that is not trained again.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import MultiHeadAttention, PositionwiseFeedForward, Transformer


def fold_query_scale(attention: MultiHeadAttention) -> bool:
    """Scale the query projection by 1/√Dh once, so that no attention call scales its queries again
    (one elementwise op fewer per attention call and decoding step). Done only where 1/√Dh is a
    power of two (Dh = 4, 16, 64, 256, …): then every weight is scaled exactly and outputs stay
    bit-identical. Returns whether it folded (False: not exact, or done already)."""
    scale = attention.d_head**-0.5
    if attention.queries_prescaled or math.frexp(scale)[0] != 0.5:
        return False
    projection = attention.qkv_proj if attention.self_attention else attention.q_proj  # Q rows come first
    d_model = attention.n_heads * attention.d_head
    with torch.no_grad():
        projection.weight[:d_model].mul_(scale)
        if projection.bias is not None:
            projection.bias[:d_model].mul_(scale)
    attention.queries_prescaled = True
    return True


def quantize_int8(model: Transformer) -> Transformer:
    """Dynamic int8 quantization, in place: every nn.Linear keeps its weight as int8 (per tensor)
    and quantizes its input on the fly; embeddings, LayerNorms and the attention core stay fp32.

    The tied output projection becomes an int8 copy; the embedding it was tied to stays fp32.
    """
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # torch ≥ 2.10 marks torch.ao.quantization as deprecated in favour of torchao, which is
        # not a dependency; the eager dynamic path still works and is what we test.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


@functools.cache
def int8_quantization_works() -> bool:
    """Whether this torch build and CPU quantize a Linear layer to int8 and it agrees with the
    float layer on a probe (`torch.ao.quantization` is deprecated: a torch without it says no)."""
    generator = torch.Generator().manual_seed(0)
    probe = nn.Sequential(nn.Linear(64, 32))
    with torch.no_grad():
        probe[0].weight.copy_(torch.randn(32, 64, generator=generator) / 8)
        x = torch.randn(4, 64, generator=generator)
        expected = probe(x)
        try:
            got = quantize_int8(probe)(x)
        except (ImportError, AttributeError, RuntimeError, NotImplementedError):
            return False
    return bool(torch.allclose(got, expected, atol=0.05 * float(expected.abs().max())))


class PackedLinear(nn.Module):
    """An nn.Linear for CPU inference whose weight is laid out once, ahead of time, for oneDNN.

    F.linear hands the plain (out, in) weight to the BLAS on every call; decoding multiplies a few
    rows (batch × beam, one position) by each weight, so re-laying out the weight is a large part of
    each call. The same op torch.compile's freezing uses.
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 64, activation: str = "none"):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)  # not a buffer: opaque layout
        self.bias = None if linear.bias is None else linear.bias.detach()
        # "relu" / "gelu": applied by oneDNN to the output as it is written (no second pass over it)
        self.activation = activation
        self._algorithm = "none" if activation == "gelu" else ""  # gelu: the exact (erf) form, as F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self.activation, [],
                                                  self._algorithm)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _packs_correctly(dtype: torch.dtype, activation: str = "none") -> bool:
    """Whether this torch build and CPU run a PackedLinear (with `activation` fused: "none", "relu",
    "gelu") and agree with nn.Linear (+ the activation) on a probe."""
    probe = nn.Linear(16, 8).to(dtype)
    x = torch.randn(3, 1, 16).to(dtype)
    expected_fn = _identity if activation == "none" else getattr(F, activation)
    try:
        with torch.no_grad():
            packed = PackedLinear(probe, activation=activation)(x).float()
            return torch.allclose(packed, expected_fn(probe(x)).float(), atol=0.05, rtol=0.02)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack_linear_layers(model: Transformer) -> bool:
    """Replace every nn.Linear of an inference-only CPU model by a PackedLinear, in place; an FFN's
    activation moves into its first matmul where oneDNN computes it as torch does (probed), and
    each attention's 1/√Dh moves into its query projection where that is exact (fold_query_scale).

    Returns False (model untouched) where this torch build or CPU lacks the oneDNN ops or they
    disagree with F.linear on a probe, e.g. bf16 on a CPU without bf16 support.
    """
    dtype = next(model.parameters()).dtype
    if not _packs_correctly(dtype):
        return False
    fuses: dict[str, bool] = {}  # activation → probed once
    with torch.no_grad():
        for module in list(model.modules()):
            if isinstance(module, PositionwiseFeedForward) and type(module.w1) is nn.Linear:
                activation = {F.relu: "relu", F.gelu: "gelu"}.get(module.activation)
                if activation and activation not in fuses:
                    fuses[activation] = _packs_correctly(dtype, activation)
                if activation and fuses[activation]:  # act(W1 x + b1) in one pass instead of two
                    module.w1, module.activation = PackedLinear(module.w1, activation=activation), _identity
            if isinstance(module, MultiHeadAttention):
                fold_query_scale(module)  # before its projections are packed
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child))
    return True
