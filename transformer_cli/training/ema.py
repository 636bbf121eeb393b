"""An exponential moving average of the weights (Polyak averaging), kept next to training.

After every optimizer step: ema ← decay · ema + (1 − decay) · weights. With decay 0.999 the
average spans the last ~1,000 updates — like averaging checkpoints, but over every step instead of
the few that were saved. Early on the decay is warmed up, (1 + n) / (10 + n) after n updates, so the
random initial weights do not linger in the average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class WeightAverage:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        # fp32 copies of the trainable weights (tied weights once: parameters() skips repeats)
        self.weights = [p.detach().clone() for p in model.parameters()]

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """One step towards the model's weights; none where `skipped` (a 0-d device tensor, 1.0
        for an update the optimizer skipped): decided on the device, never read back."""
        self.updates += 1
        step = 1.0 - self.current_decay()
        params = [p.detach() for p in model.parameters()]
        if skipped is None:
            torch._foreach_lerp_(self.weights, params, step)
        else:
            weight = (1.0 - skipped) * step
            torch._foreach_lerp_(self.weights, params, [weight] * len(params))

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The model with the averaged weights in place (to validate or save it); restored after."""
        params = list(model.parameters())
        trained = [p.detach().clone() for p in params]
        torch._foreach_copy_(params, self.weights)
        try:
            yield model
        finally:
            torch._foreach_copy_(params, trained)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "weights": [w.clone() for w in self.weights]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["weights"]) != len(self.weights):
            raise ValueError(f"the saved weight average has {len(state['weights'])} tensors, the model {len(self.weights)}")
        self.updates = int(state["updates"])
        for weight, saved in zip(self.weights, state["weights"]):
            weight.copy_(saved)
