"""Named model shapes, and the quality each was measured to reach on Multi30k de→en for the target
tokens it has trained on: the table `model.size` reads.

A name (`model.size: d192`) fills the shape keys a config leaves out; `auto` lets `tfm train` time
every shape of the table on the machine it runs on and train the one whose curve promises the most
for the budget (training/shape_choice.py). The curves are measurements, not a law: valid greedy
BLEU after N updates on Multi30k de→en with the quickstart's recipe (dropout 0.1, inverse_sqrt,
warm-up 400 steps or a quarter of the run, joint BPE 8k) at the shape's own peak learning rate
(`lr`); docs/training.md says how each was made.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TypeVar

from ..model.shape import SHAPE_KEYS, Shape

AUTO = "auto"
# A distilled student's shape, from its teacher's (the run `vocab.from_run` names): `student_of`.
STUDENT = "student"
T = TypeVar("T")
# The dropout every curve was measured at, and the one a budget past a shape's overfitting point takes
# (measured on d256 over 30 minutes of a Zen 5: 0.3 kept the valid loss falling to the end and scored
# higher than 0.1; docs/training.md).
CURVE_DROPOUT = 0.1
LONG_BUDGET_DROPOUT = 0.3
# The target tokens of the training corpus every curve was measured on (Multi30k de→en: 28,971 pairs
# after cleaning, joint BPE 8k). Where a shape overfits is a number of passes over the corpus: on a
# corpus a third the size, a third of the tokens; on a large one, never within a short budget.
CURVE_CORPUS_TOKENS = 415_210


@dataclass(frozen=True, kw_only=True)
class NamedShape(Shape):
    """A shape of the table (its keys: model/shape.py `Shape`; the rest of the model section,
    dropout, norm position, …, is the config's) and what was measured of it."""

    name: str
    # (updates, valid greedy BLEU), ascending in updates, at the smallest batch measured
    curve: tuple[tuple[float, float], ...]
    # The peak learning rate the curve was measured with, which `auto` trains the shape with (unless
    # the config gives train.lr): a narrow model takes a higher one.
    lr: float = 1e-3
    # Curves measured at larger batches: (batch tokens, curve), ascending in tokens. A batch reads the
    # curve of the largest measured batch it reaches, else `curve`: an update of a larger batch learns
    # at least as much, so a smaller batch's curve is the cautious prediction for it.
    larger_batches: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()
    # Peak learning rates measured better at larger batches: (batch tokens, lr), ascending in tokens; a
    # batch takes the rate of the largest it reaches, else `lr`.
    larger_batch_lr: tuple[tuple[int, float], ...] = ()
    # Passes over the training corpus (updates × train.max_tokens over its target tokens) after which
    # this shape's valid loss was seen to rise at the curves' dropout (CURVE_DROPOUT); None: not seen
    # within any run of it.
    overfits_after: float | None = None

    def dropout_for(self, passes: float) -> float:
        """The dropout `auto` trains with for a budget of `passes` over the corpus (updates × batch
        tokens over the corpus's target tokens): the curves' own, unless the budget runs past where
        this shape overfit at it."""
        past = self.overfits_after is not None and passes > self.overfits_after
        return LONG_BUDGET_DROPOUT if past else CURVE_DROPOUT

    def lr_for(self, batch: int | None) -> float:
        """The peak learning rate `batch`-token updates of this shape train at (None: the smallest batch's)."""
        return _of_largest_batch_reached(self.lr, self.larger_batch_lr, batch)

    def curve_for(self, batch: int | None) -> tuple[tuple[float, float], ...]:
        """The curve that `batch`-token updates read (None: the smallest batch's)."""
        return _of_largest_batch_reached(self.curve, self.larger_batches, batch)

    def predicted_bleu(self, updates: float, batch: int | None = None) -> float:
        """BLEU reached after `updates` of `batch` tokens: linear in log(updates) between measured
        points; below the first, proportional to the updates (0 at none); past the last, the last
        measured value (a curve is never extrapolated upwards: what was not measured is not promised)."""
        curve = self.curve_for(batch)
        xs = [x for x, _ in curve]
        ys = [y for _, y in curve]
        if updates <= xs[0]:
            return ys[0] * max(updates, 0.0) / xs[0]
        if updates >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, updates)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (math.log(updates) - math.log(x0)) / (math.log(x1) - math.log(x0))


def _of_largest_batch_reached(smallest: T, larger: tuple[tuple[int, T], ...], batch: int | None) -> T:
    """What was measured at the largest batch (of `larger`, ascending in tokens) that `batch` reaches,
    else `smallest`."""
    value = smallest
    for tokens, measured in larger:
        if batch is not None and batch >= tokens:
            value = measured
    return value


# Each point: the valid greedy BLEU (whole Multi30k valid set) a run had after that many updates, each
# at its shape's peak lr (d128 at 1,000-token batches 3e-3: 1e-3 and 2e-3 learned slower, 5e-3 no
# faster). `curve`: 1,000-token batches (d192's 1,500), where a budget makes few updates (10- and 30-minute runs on a 2-core AVX2
# CPU); d128 also at 3,000 tokens (a 30-minute run on that CPU), d256 too (its first point a 10-minute
# run on that CPU, the others runs on a 2-core Zen 5). A curve keeps the evaluations that bettered
# every earlier one. docs/training.md#choosing-the-shape-modelsize names each run. `overfits_after`:
# d256's from its dropout-0.1 run on the Zen 5; d128's from a run on a third of the corpus (on the whole
# of it, 2,871 updates of 3,000 tokens at 0.1, 20.7 passes, still bettered the valid BLEU at their
# last evaluation); d192 was not run that long.
SHAPES: dict[str, NamedShape] = {shape.name: shape for shape in (
    NamedShape(name="d128", d_model=128, n_heads=4, enc_layers=3, dec_layers=3, d_ff=512, lr=3e-3,
               curve=((500, 17.21), (750, 23.96), (1000, 27.86), (1250, 31.13), (1500, 32.72), (1750, 34.39),
                      (2000, 35.43)),
               larger_batches=((3000, ((250, 11.02), (500, 26.68), (750, 31.96), (1000, 34.64), (1250, 36.64),
                                       (1500, 36.72), (1750, 38.14), (2000, 38.89), (2871, 39.92))),),
               # at 3,000-token batches 5e-3 beat 3e-3 at every evaluation of 15 minutes under AVX2 caps (test2016
               # 40.56 against 39.63); its curve stays the one measured at 3e-3, which errs low
               larger_batch_lr=((3000, 5e-3),),
               # on a third of Multi30k de→en (134,128 target tokens), 3,000-token batches at dropout 0.1, 10
               # minutes on a Zen 4: the valid loss bottomed at 1,000 updates and rose to the end
               overfits_after=1000 * 3000 / 134_128),  # 22.4 passes
    NamedShape(name="d192", d_model=192, n_heads=4, enc_layers=3, dec_layers=3, d_ff=768,
               curve=((500, 18.62), (750, 25.79), (1024, 29.53))),
    NamedShape(name="d256", d_model=256, n_heads=4, enc_layers=3, dec_layers=3, d_ff=1024,
               curve=((500, 19.34), (750, 26.68), (1001, 28.12), (1250, 30.70), (1500, 33.90), (1750, 34.55),
                      (2000, 35.33), (2750, 36.92)),
               larger_batches=((3000, ((356, 22.78), (1500, 38.58), (4250, 41.13))),),
               # 3,000-token batches at dropout 0.1, 30 minutes on a Zen 5: the valid loss bottomed at ~2,000
               # updates and rose to the end
               overfits_after=2000 * 3000 / CURVE_CORPUS_TOKENS),  # 14.5 passes
)}


# What `auto` trains where it does not choose: a shape key given beside it pins the shape, the keys
# left out come from this one (the shape the Multi30k configs trained before `auto`).
FALLBACK = "d256"


def shape_names() -> str:
    return ", ".join([AUTO, STUDENT, *SHAPES])


def student_of(teacher: Shape) -> Shape:
    """A student's shape from its teacher's shape keys: the teacher's width, one decoder layer, and
    the encoder deepened by all but two of the decoder layers it gives up (6+6 → 10+1, 3+3 → 4+1).
    Decoding runs the decoder once per output token and the encoder once per sentence, so the
    decoder's depth is where a student's speed lies (Kasai et al. 2021: 12-1 layers at the
    teacher's quality); the deeper encoder keeps capacity, and the parameters shrink with every
    decoder layer dropped (a decoder layer holds two attentions, an encoder layer one). The width
    stays: at d128 a narrower model loses more than the speed is worth (docs/distillation.md)."""
    return Shape(**{**teacher.keys(), "enc_layers": teacher.enc_layers + max(teacher.dec_layers - 2, 0), "dec_layers": 1})


def decoding_cost(shape: Shape, vocab: int, source_tokens: float = 1.0) -> float:
    """Multiply-adds to decode one target token greedily (for `source_tokens` source tokens each):
    the decoder's layers (self-attention's four projections, cross-attention's query and output,
    the FFN) and the output layer, plus the encoder's layers per source token. A comparison of
    shapes, not a speed: a small model's time also goes to each layer's fixed cost, which counts
    the layers, and so favours the shallower decoder further."""
    d, ff = shape.d_model, shape.d_ff
    decoder = shape.dec_layers * (6 * d * d + 2 * d * ff) + d * vocab
    encoder = shape.enc_layers * (4 * d * d + 2 * d * ff)
    return float(decoder + source_tokens * encoder)


def parameters_of(shape: Shape, vocab: int) -> int:
    """The weights of a shape with one shared embedding (tied output), biases and norms left out."""
    d, ff = shape.d_model, shape.d_ff
    return vocab * d + shape.enc_layers * (4 * d * d + 2 * d * ff) + shape.dec_layers * (8 * d * d + 2 * d * ff)


def fill_shape(model_section: dict) -> dict:
    """The model section with `size` applied (a raw mapping, before validation): a name fills the
    shape keys not given (ValueError where a given one says otherwise: a name means its shape);
    `auto` with none given fills the fallback's (the probe may replace them); `auto` with any given
    is a pinned shape (`size` null, the rest from the fallback)."""
    size = model_section.get("size")
    if size is None or not isinstance(size, str) or (size != AUTO and size not in SHAPES):
        # no size, a bad one (the field's own validator says so), or `student`: its shape is the
        # teacher's, read when tfm train starts (the keys given stay marked as given: they override it)
        return model_section
    given = [key for key in SHAPE_KEYS if key in model_section]
    shape = SHAPES[FALLBACK if size == AUTO else size]
    if size != AUTO:
        differ = [f"{key} {model_section[key]!r}" for key in given if model_section[key] != getattr(shape, key)]
        if differ:
            raise ValueError(f"size: {size} is {shape.describe()}, but {', '.join(differ)} is given: name a shape "
                             "or give the shape keys (with size null), not both")
    filled = {**shape.keys(), **{key: model_section[key] for key in given}}
    pinned = size == AUTO and given
    if pinned:  # said, not silent: the run trains this fixed shape, and its config.yaml has size null
        from ..runtime.console import warn_once

        warn_once(f"model.size auto beside {', '.join(f'model.{key} {model_section[key]!r}' for key in given)}: the "
                  f"shape keys pin the shape ({', '.join(f'{key} {filled[key]}' for key in SHAPE_KEYS)}; the keys "
                  f"not given are {FALLBACK}'s), so nothing is timed or chosen; drop them to let auto choose")
    return {**model_section, **filled, "size": None if pinned else size}
