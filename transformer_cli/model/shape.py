"""A model's shape: the sizes that fix the shapes of a Transformer's weights, its vocabularies aside.
One definition, without torch: what a named shape gives (experiment/shapes.py `NamedShape`), the
shape keys of the config's model section (experiment/config.py `ModelConfig`, bounds added) and
the first of the model's constructor arguments (`TransformerConfig`) all follow from it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Shape:
    """The paper's base model by default."""

    d_model: int = 512
    n_heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    d_ff: int = 2048

    def keys(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SHAPE_KEYS}

    def describe(self) -> str:
        return (f"d_model {self.d_model}, {self.n_heads} heads, {self.enc_layers}+{self.dec_layers} layers, "
                f"FFN {self.d_ff}")


SHAPE_KEYS = tuple(key.name for key in fields(Shape))
