"""bf16 weights with fp32 master copies: the alternative to autocast that `scripts/bench_train.py
--bf16-weights` measures (`tfm train` trains with autocast).

Under autocast the parameters stay fp32: each matmul casts its weight to bf16 (once per forward,
cached for the backward), and the ops autocast keeps in fp32 (layer norm, softmax) hand fp32
activations to the residual stream, so the elementwise work between matmuls (dropout, residual
adds, norms) moves fp32 bytes. With the parameters themselves in bf16 there are no weight casts
and the whole stream is bf16: half the bytes for that memory-bound work, half the gradient memory.
bf16 keeps 8 bits of mantissa, so an update smaller than ~0.4% of a weight would round away; the
optimizer therefore updates fp32 copies (the masters) and the bf16 weights are re-cast from them
after every step.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """Holds fp32 masters of `model`'s trainable parameters and casts the model to `dtype`.

    After each backward, `step()` copies the bf16 gradients into the masters' fp32 gradients, runs
    the optimizer (built by `optimizer()`, over the masters) and copies the updated masters back
    into the model: three grouped operations (two `_foreach_copy_`, one fused optimizer step), not a
    kernel per parameter."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        # the model's own Parameter objects: `.to(dtype)` swaps their data, not the objects
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]  # exact: taken before the cast
        for master in self.masters:
            master.grad = torch.zeros_like(master)  # persistent: each step overwrites it
        model.to(dtype)

    def optimizer(self, **adam: object) -> torch.optim.Adam:
        """Adam over the fp32 masters (`adam`: its keyword arguments, e.g. lr, betas, fused)."""
        return torch.optim.Adam(self.masters, **adam)  # type: ignore[arg-type]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update from the model's gradients (which it then clears, set to None)."""
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            torch._foreach_copy_([m.grad for m in self.masters], grads)  # bf16 → fp32
            optimizer.step()
            torch._foreach_copy_(self.params, self.masters)  # fp32 → bf16, rounded to nearest
        for p in self.params:
            p.grad = None
