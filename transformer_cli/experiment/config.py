"""Typed experiment configuration: YAML file + `--set a.b=c` overrides → `ExperimentConfig`.

Relative paths in a config are resolved against the *current working directory*
(as fairseq, JoeyNMT and Marian do), so `tfm train --config configs/de-en.yaml`
run from the project root finds `data/multi30k/...` and writes `runs/...`.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from ..model.shape import SHAPE_KEYS, Shape
from ..runtime.errors import TfmError
from ..runtime.files import CONFIG_NAME, MANIFEST_NAME
from .directions import Direction, parse_direction
from .rundir import Manifest, RunDirectory
from .shapes import AUTO, SHAPES, STUDENT, fill_shape, shape_names

# --------------------------------------------------------------------------- reading YAML strictly

MAX_YAML_DEPTH = 32  # sections nest 3 deep; a document nested 50,000 deep overflowed the parser's stack
MAX_YAML_VALUES = 100_000  # values a config may expand to, aliases counted where used (a config has ~200)


class StrictYamlLoader(yaml.SafeLoader):
    """YAML as tfm reads configs and `--set` values: a key given twice in one mapping is an error
    naming the key and both lines (PyYAML keeps the last silently: a second `decode:` section
    replaced the first), and nesting deeper than MAX_YAML_DEPTH is an error, not a RecursionError."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        """The document's node, refused where its aliases expand to more than MAX_YAML_VALUES values
        (946 bytes of nested aliases were 10^8 references: 51 s and 3 GB, then a message that
        printed them): bounded as XML's entity expansion is."""
        node = super().get_single_node()
        sizes: dict[int, int] = {}

        def expanded(n: Any) -> int:  # each alias counted every time it is used; shared nodes measured once
            if id(n) not in sizes:
                children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else (
                    n.value if isinstance(n, yaml.SequenceNode) else [])
                sizes[id(n)] = min(1 + sum(expanded(c) for c in children), MAX_YAML_VALUES + 1)
            return sizes[id(n)]

        if node is not None and expanded(node) > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(None, None, f"its aliases expand to more than {MAX_YAML_VALUES:,} "
                                              "values (an alias used within an alias, over and over)", node.start_mark)
        return node

    def construct_yaml_int(self, node: Any) -> Any:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python's limit on the digits of an integer read from text
            raise yaml.constructor.ConstructorError(None, None, f"an integer of more than {sys.get_int_max_str_digits():,} "
                                                    "digits", node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged below; its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' given twice (first on line {seen[key].line + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


StrictYamlLoader.add_constructor("tag:yaml.org,2002:int", StrictYamlLoader.construct_yaml_int)


def read_yaml(text: str) -> Any:
    """`text` parsed by StrictYamlLoader; yaml.YAMLError where it is not valid (with its line)."""
    return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader: plain data only)


def refuse_booleans_as_numbers(model: type[BaseModel], data: Any) -> Any:
    """pydantic reads `true` as 1 for an int field (`beam: true` was beam 1) and 1 as true: a boolean
    is refused where the key takes none, and a number or string where it takes only booleans
    (configs and serve requests alike)."""
    if isinstance(data, dict):
        own = _read_by_their_own_validators(model)  # such a key names its own values
        for name, value in data.items():
            field = model.model_fields.get(name) if isinstance(name, str) else None
            if field is None or name in own:
                continue
            if isinstance(value, bool) and not _takes_bool(field.annotation):
                raise ValueError(f"{name}: {str(value).lower()} is a boolean; give a {_kind(field.annotation)}")
            if isinstance(value, (int, float, str)) and not isinstance(value, bool) and _only_bool(field.annotation):
                raise ValueError(f"{name}: {value!r} is not a boolean; give true or false")
    return data


@functools.lru_cache(maxsize=None)
def _read_by_their_own_validators(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` with a `mode="before"` validator (computed once per model, not per request)."""
    return frozenset(name for d in model.__pydantic_decorators__.field_validators.values()
                     if d.info.mode == "before" for name in d.info.fields)


def _only_bool(annotation: Any) -> bool:
    """Whether a field takes booleans (and None) only: 1 or "yes" is refused there, not read as true."""
    args = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    return bool(args) and all(a is bool for a in args)


def _takes_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(_takes_bool(a) for a in typing.get_args(annotation))


def _kind(annotation: Any) -> str:
    names = {int: "number", float: "number", str: "string"}
    found = {names.get(a, "value") for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)}
    return " or ".join(sorted(found)) or "value"


class _Section(BaseModel):
    # Unknown keys are errors (typos must not be silently ignored); assignments are validated; NaN
    # and infinity are never a setting. Every number with a valid range says it here, so a bad
    # value is one line naming its key when the config is read, not a failure minutes later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        return refuse_booleans_as_numbers(cls, data)


def _rule(key: str, message: str) -> ValueError:
    """A rule across keys of one section, broken: the message names `key` (see _format_validation_error)."""
    return ValueError(f"{key}: {message}")


class DirectionData(_Section):
    """One direction of a multilingual run with corpora of its own (`data.directions` entry as a
    mapping); a prefix left out is the data section's."""

    direction: str
    train: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    valid: str | None = Field(None, min_length=1)
    test: str | None = Field(None, min_length=1)

    @field_validator("train", mode="before")
    @classmethod
    def _one_or_several(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("direction")
    @classmethod
    def _check_direction(cls, value: str) -> str:
        return parse_direction(value).name


class _Filter(_Section):
    enabled: bool = True


class LengthFilter(_Filter):
    # pieces: data.max_len and data.max_len_ratio, after encoding
    min_words: int = Field(3, ge=1)  # a pair whose sides both have fewer words is a fragment
    max_words: int = Field(250, ge=1)  # either side
    max_chars: int = Field(2000, ge=1)  # either side
    max_sentences: int = Field(4, ge=1)  # either side: more is a failed sentence split


class CopiesFilter(_Filter):
    max_overlap: float = Field(0.8, gt=0.0, le=1.0)  # word-set overlap (Jaccard) from which a target is a copy


class CharactersFilter(_Filter):
    min_letters: float = Field(0.6, ge=0.0, le=1.0)  # share of letters among a side's non-space characters
    min_script: float = Field(0.9, ge=0.0, le=1.0)  # share of those letters in the language's script


class RepeatsFilter(_Filter):
    max_share: float = Field(0.5, gt=0.0, le=1.0)  # one word making up more of a side than this
    min_words: int = Field(5, ge=2)  # sides with fewer words are not checked


class NumbersFilter(_Filter):
    min_similarity: float = Field(0.5, ge=0.0, le=1.0)  # of the sides' non-zero digits, in order


class LanguageFilter(_Filter):
    min_words: int = Field(3, ge=1)  # a side with fewer words is too short to identify reliably: not judged


class LexicalFilter(_Filter):
    enabled: bool = False  # costs more than all other filters together (docs/training.md)
    recall: float = Field(0.85, gt=0.0, lt=1.0)  # share of randomly re-paired sample pairs it should drop
    # training pairs it learns from (uniform sample; held in memory, and Model 1 stops at 15M word pairs)
    sample_pairs: int = Field(100_000, ge=100, le=1_000_000)
    min_count: int = Field(3, ge=1)  # words seen fewer times in the sample are not scored


class ModelFilter(_Filter):
    """Pairs scored by translation models (data/model_filter.py): a forward (src→tgt) and/or a
    backward (tgt→src) tfm run, e.g. one imported with `tfm import`; with neither named, `tfm
    prepare` trains both itself on the corpus (training/filter_models.py)."""

    enabled: bool = False  # costs a forward pass of each model per pair (docs/training.md)
    forward: str | None = Field(None, min_length=1)  # run directory or checkpoint, this direction's languages
    backward: str | None = Field(None, min_length=1)  # run directory or checkpoint, the other way
    # With neither model named: each direction's model trains this many updates in
    # <run_dir>/filter_models/, on the pairs the other filters keep (d128 where model.size is auto),
    # and for at most train_time (training seconds, as train.max_time) if given. Updates, not
    # minutes: a busy or slow CPU trains the same models, later, where a time budget trains weaker
    # ones whose thresholds drop other pairs (docs/training.md).
    train_updates: int | None = Field(1000, ge=1)
    train_time: float | str | None = None
    recall: float = Field(0.95, gt=0.0, lt=1.0)  # share of re-paired sample pairs to drop (misaligned), at most
    partial_recall: float = Field(0.85, gt=0.0, lt=1.0)  # share of sample pairs with a side run on (partly aligned)
    # estimated share of good pairs each score may drop (0.25% each: what a corpus labels clean also
    # holds its own loose pairs, which the scores find; docs/training.md)
    clean_loss: float = Field(0.0025, gt=0.0, lt=1.0)
    max_share: float = Field(0.5, gt=0.0, le=1.0)  # never more of the sample dropped by either score
    # training pairs the thresholds are learned from: 2,000 scattered the thresholds from draw to draw
    sample_pairs: int = Field(8000, ge=100, le=100_000)
    batch_tokens: int = Field(500, ge=64)  # pieces per scoring batch (either side; small batches score fastest on a CPU)
    # what scores: CTranslate2 (the models converted beside their checkpoints, int8) where they convert, else tfm's engine
    engine: Literal["auto", "torch", "ctranslate2"] = "auto"

    @field_validator("train_time")
    @classmethod
    def _check_train_time(cls, value: float | str | None) -> float | str | None:
        if value is not None and not 0 < parse_duration(value) < math.inf:
            raise ValueError("must be a positive duration, e.g. 300 (seconds), '5m' or '1h'")
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> ModelFilter:
        if self.train_updates is None and self.train_time is None:
            raise ValueError("train_updates and train_time are both null: the filter's own models need a budget, "
                             "e.g. train_updates: 1000")
        return self


class DuplicatesFilter(_Filter):
    by: Literal["pair", "source"] = "pair"  # source: a second pair with the same source is dropped too


class FiltersConfig(_Section):
    """`tfm prepare`'s training-pair filters, in the order they run (data/filters.py)."""

    text: _Filter = Field(default_factory=_Filter)  # invalid UTF-8, NUL, control characters, U+FFFD
    length: LengthFilter = Field(default_factory=LengthFilter)
    copies: CopiesFilter = Field(default_factory=CopiesFilter)
    characters: CharactersFilter = Field(default_factory=CharactersFilter)
    repeats: RepeatsFilter = Field(default_factory=RepeatsFilter)
    numbers: NumbersFilter = Field(default_factory=NumbersFilter)
    language: LanguageFilter = Field(default_factory=LanguageFilter)  # each side identified as its language
    lexical: LexicalFilter = Field(default_factory=LexicalFilter)  # misaligned pairs
    model: ModelFilter = Field(default_factory=ModelFilter)  # misaligned and partly aligned pairs
    duplicates: DuplicatesFilter = Field(default_factory=DuplicatesFilter)
    warn_share: float = Field(0.5, gt=0.0, le=1.0)  # a filter dropping more of a direction than this warns


class AugmentConfig(_Section):
    """Training pairs as people type them (data/augment.py), drawn afresh each epoch: each rate is
    the share of an epoch's pairs changed so. At most one casing per pair."""

    # ALL CAPS as tfm's engines read it (decode.casing lowers such a line: ß comes as ss), the target as written
    upper: float = Field(0.0, ge=0.0, le=1.0)
    title: float = Field(0.0, ge=0.0, le=1.0)  # Title Case, both sides
    lower: float = Field(0.0, ge=0.0, le=1.0)  # lower case source; the target keeps its casing
    typos: float = Field(0.0, ge=0.0, le=1.0)  # pairs whose source gets typos
    typo_words: float = Field(0.125, gt=0.0, le=1.0)  # ... each of its words mistyped at this rate (one at least)
    end_punctuation: float = Field(0.0, ge=0.0, le=1.0)  # the source's final punctuation removed (decode.end_punctuation)
    # epoch: each epoch draws which pairs change and how; once: each pair's change is drawn once and
    # kept every epoch (fixed copies, as a corpus augmented before training): docs/training.md#augmentation
    draws: Literal["epoch", "once"] = "epoch"

    @model_validator(mode="after")
    def _one_casing(self) -> AugmentConfig:
        if self.upper + self.title + self.lower > 1.0 + 1e-9:
            raise _rule("upper", f"upper + title + lower is {self.upper + self.title + self.lower:g}: a pair gets at "
                        "most one casing, so their rates add up to 1 at most")
        return self

    @property
    def enabled(self) -> bool:
        return any((self.upper, self.title, self.lower, self.typos, self.end_punctuation))


class DataConfig(_Section):
    src_lang: str = Field("de", min_length=1)
    tgt_lang: str = Field("en", min_length=1)
    # File prefixes: `<prefix>.<lang>` or `<prefix>.<lang>.gz`. `train` may list several corpora
    # (e.g. real and back-translated pairs), read one after the other as one training set.
    train: list[Annotated[str, Field(min_length=1)]] = Field(["data/multi30k/train"], min_length=1)
    valid: str = Field("data/multi30k/val", min_length=1)
    test: str = Field("data/multi30k/test_2016_flickr", min_length=1)
    max_len: int = Field(128, ge=1)  # training pairs longer than this (in tokens, either side) are dropped
    max_len_ratio: float = Field(3.0, ge=1.0)  # ... and pairs whose length ratio exceeds this
    filters: FiltersConfig = Field(default_factory=FiltersConfig)  # training-pair cleaning (data/filters.py)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)  # case and noise, drawn each epoch (data/augment.py)
    train_limit: int | None = Field(None, ge=1)  # use only the first N training pairs (smoke runs; per direction)
    # A multilingual run: its directions, e.g. [en-de, de-en, en-fr, fr-en] (experiment/directions.py). Each reads
    # `<prefix>.<src>` and `<prefix>.<tgt>` of the train/valid/test prefixes above; every source gets
    # its target-language tag >>tgt<<, one piece of a joint vocabulary. src_lang/tgt_lang are then
    # the first direction's. None: the one direction src_lang-tgt_lang, untagged.
    # An entry may be a mapping with corpora of its own: {direction: en-fr, train: data/europarl/train,
    # valid: …, test: …} (each prefix left out: the one above).
    directions: list[DirectionData] | None = Field(None, min_length=1)
    # Directions are drawn (and the vocabulary's sentences sampled) at rates ∝ (size share)^(1/T):
    # 1 = as the data is; larger lifts small directions (5, as M2M-100 and mBART-50 train).
    temperature: float = Field(5.0, ge=1.0, le=1000.0)

    @field_validator("train", mode="before")
    @classmethod
    def _one_or_several(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("directions", mode="before")
    @classmethod
    def _names_are_entries(cls, value: Any) -> Any:
        """`en-de` is short for {direction: en-de}: the data section's corpora ("en-de,de-en", as
        `--set data.directions=en-de,de-en` gives it, lists two)."""
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",")]
        if isinstance(value, (list, tuple)):
            return [{"direction": entry} if isinstance(entry, str) else entry for entry in value]
        return value

    @field_validator("directions")
    @classmethod
    def _check_directions(cls, value: list[DirectionData] | None) -> list[DirectionData] | None:
        names = [entry.direction for entry in value or []]
        repeated = [name for i, name in enumerate(names) if name in names[:i]]
        if repeated:
            raise ValueError(f"{repeated[0]} is listed twice")
        return value

    @field_serializer("directions")
    def _entries_as_written(self, value: list[DirectionData] | None) -> list | None:
        """An entry without corpora of its own is written back as its name."""
        if value is None:
            return None
        return [entry.direction if entry.model_fields_set <= {"direction"} else entry.model_dump(exclude_none=True)
                for entry in value]

    @model_validator(mode="after")
    def _languages_of_directions(self) -> DataConfig:
        if self.directions is None:
            return self
        first = self.pairs[0]
        for key, value in (("src_lang", first.src), ("tgt_lang", first.tgt)):
            if key in self.model_fields_set and getattr(self, key) != value:
                raise _rule(key, f"{getattr(self, key)} differs from the first of data.directions ({first.name}): "
                            "with directions, leave src_lang and tgt_lang out")
            object.__setattr__(self, key, value)  # no re-validation (validate_assignment would recurse)
        return self

    @property
    def pairs(self) -> list[Direction]:
        """The run's directions (a bilingual run: src_lang-tgt_lang)."""
        if self.directions is None:
            return [Direction(self.src_lang, self.tgt_lang)]
        return [parse_direction(entry.direction) for entry in self.directions]

    def prefixes(self, direction: Direction, split: str) -> list[str]:
        """The corpus prefixes of a direction's split: its own entry's, else this section's (a
        direction not listed, e.g. zero-shot, reads this section's too)."""
        for entry in self.directions or []:
            if entry.direction == direction.name:
                own = getattr(entry, split)
                if own is not None:
                    return own if split == "train" else [own]
        return self.train if split == "train" else [getattr(self, split)]

    @property
    def multilingual(self) -> bool:
        return self.directions is not None


class VocabConfig(_Section):
    joint: bool = True
    size: int = Field(8000, ge=8)
    model_type: Literal["bpe", "unigram"] = "bpe"
    character_coverage: float = Field(1.0, gt=0.0, le=1.0)
    # Sentences each sentencepiece model trains on: a uniform random sample of the training pairs
    # drawn in one streaming pass (a joint vocabulary takes half from each side); 0 = all of them.
    input_sentence_size: int = Field(2_000_000, ge=0)
    # Fine-tuning: take the sentencepiece model(s) of this run directory as they are (no new
    # vocabulary is trained; size and joint must be the parent's), so its checkpoints fit this run.
    from_run: str | None = Field(None, min_length=1)


class PrepareConfig(_Section):
    # Encoding processes (None = all cores for corpora of 50k pairs or more, else 1). The output
    # does not depend on it, so it is not part of the data fingerprint.
    workers: int | None = Field(None, ge=1)
    chunk_lines: int = Field(20_000, ge=1)  # pairs per encoding task (memory per worker ~ this × line size)


class ModelConfig(_Section):
    # A named shape (experiment/shapes.py) fills the shape keys not given; `auto`: `tfm train` times
    # the named shapes on this machine and trains the one its measured curves promise most for the
    # budget (training/shape_choice.py); a shape key given beside `auto` pins the shape. `student`:
    # a distilled student's shape, from its teacher's (the run vocab.from_run names) when tfm train
    # starts (experiment/shapes.py student_of); a shape key given beside it overrides that key.
    size: str | None = None
    # The shape keys (model/shape.py `Shape`: its defaults, the paper's base model)
    d_model: int = Field(Shape.d_model, ge=1)
    n_heads: int = Field(Shape.n_heads, ge=1)
    enc_layers: int = Field(Shape.enc_layers, ge=1)
    dec_layers: int = Field(Shape.dec_layers, ge=1)
    d_ff: int = Field(Shape.d_ff, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Dropout on the FFN's hidden activations (fairseq's activation_dropout); None: `dropout`. The
    # paper drops out only sub-layer outputs and the embedding sums, i.e. 0.0 here.
    activation_dropout: float | None = Field(None, ge=0.0, lt=1.0)
    activation: Literal["relu", "gelu", "swish"] = "relu"
    norm_position: Literal["post", "pre"] = "post"
    # sinusoidal: the paper's (sin and cos interleaved); sinusoidal_split: all sines, then all
    # cosines (Marian/OPUS-MT models); learned: a trained table
    positional: Literal["sinusoidal", "sinusoidal_split", "learned"] = "sinusoidal"
    max_positions: int = Field(1024, ge=4)  # <bos>/<eos> and at least one token each way
    share_embeddings: bool = True  # source/target embeddings shared (needs a joint vocab)
    tie_output: bool = True  # output projection tied to the target embedding
    output_bias: bool = False  # a bias on the output projection (imported Marian models have one)


    @model_validator(mode="before")
    @classmethod
    def _named_shape(cls, data: Any) -> Any:
        return fill_shape(data) if isinstance(data, dict) else data

    @field_validator("size")
    @classmethod
    def _known_size(cls, value: str | None) -> str | None:
        if value is not None and value not in (AUTO, STUDENT) and value not in SHAPES:
            close = difflib.get_close_matches(value, [AUTO, STUDENT, *SHAPES], n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown size {value!r}{hint}: one of {shape_names()}, or null for the shape keys as given")
        return value

    @model_validator(mode="after")
    def _heads_divide_d_model(self) -> ModelConfig:
        if self.d_model % self.n_heads and self.size != STUDENT:  # (a student's: when its teacher's shape is read)
            raise _rule("n_heads", f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        return self


class TrainConfig(_Section):
    seed: int = Field(1, ge=0, lt=2**63)
    # Fine-tuning: start from this checkpoint's weights (a .pt file, or a run directory: the
    # checkpoint its --config would pick) with a fresh optimizer, schedule, step count and data
    # order; the run must share its vocabulary (vocab.from_run). --resume continues this run instead.
    init_from: str | None = Field(None, min_length=1)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto = bf16 autocast on CUDA, AMX CPUs and CPUs whose bf16 matmuls measure >= 1.5x fp32; else fp32
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    compile: bool = False
    # Collate the next update's batches on a background thread while this one trains (into pinned
    # memory on CUDA). None: on CUDA, where the host must stay ahead of the GPU; off on CPU, whose
    # cores all compute.
    prefetch: bool | None = None
    threads: int | None = Field(None, ge=1, le=4096)  # torch intra-op threads on CPU (None = torch default)
    # `tfm train`'s malloc: auto = mimalloc where the cmeel-mimalloc package is installed (Linux),
    # else the C library's; less memory and faster CPU steps than glibc's (runtime/allocator.py)
    allocator: Literal["auto", "mimalloc", "system"] = "auto"
    max_tokens: int = Field(4096, ge=1)  # tokens per batch, padding included
    # With model.size auto: where the budget would make fewer updates than this at max_tokens, the
    # batches shrink (to no fewer than 1,000 tokens) until it makes them; None: max_tokens as given.
    min_updates: int | None = Field(None, ge=1, le=10_000_000)
    accum_steps: int = Field(1, ge=1)
    max_steps: int = Field(100_000, ge=1)
    max_epochs: int | None = Field(None, ge=1)
    max_time: float | str | None = None  # seconds, or "90s" / "30m" / "2h"
    # budget: linear warm-up to `lr`, then cosine decay that reaches `lr_min` exactly when the run's
    # budget ends (max_time, measured in training seconds, or max_steps; whichever ends first).
    lr_schedule: Literal["noam", "inverse_sqrt", "constant", "budget"] = "noam"
    lr_min: float = Field(0.0, ge=0.0)
    lr_factor: float = Field(1.0, gt=0.0)  # noam: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    # Peak lr for inverse_sqrt / constant / budget. Left out, a named model.size (or auto's choice)
    # takes its shape's (experiment/shapes.py); shapes given by their keys take this default.
    lr: float = Field(1e-3, gt=0.0)
    warmup: int = Field(4000, ge=0)
    # Warm-up ends after `warmup` steps or after this fraction of the run's budget (max_time or
    # max_steps), whichever comes first: on a slow CPU a 400-step warm-up can be a whole 10-minute run.
    warmup_ratio: float | None = Field(None, gt=0.0, le=1.0)
    adam_betas: tuple[float, float] = (0.9, 0.98)  # each in [0, 1)
    adam_eps: float = Field(1e-9, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    clip_norm: float = Field(0.0, ge=0.0)  # 0 disables gradient-norm clipping
    log_every: int = Field(50, ge=1)
    eval_every: int = Field(1000, ge=1)
    eval_bleu_sentences: int = Field(200, ge=1)  # valid sentences greedy-decoded for BLEU at each evaluation
    best_metric: Literal["bleu", "loss"] = "bleu"
    patience: int | None = Field(None, ge=1)  # evaluations without improvement before stopping
    keep_last: int = Field(3, ge=1)  # step checkpoints kept (of the last evaluations); ≥ average_last
    # checkpoint_last.pt is written at every evaluation and, if set, every save_every steps:
    # what a kill -9 or a lost machine can cost is at most this many steps.
    save_every: int | None = Field(None, ge=1)
    # A step whose loss or gradient is NaN/Inf is skipped (weights and optimizer untouched); this
    # many in a row stop training with exit status 3.
    max_bad_steps: int = Field(10, ge=1)
    # At the end, also write checkpoint_avg.pt averaging the last N evaluations (0 or 1: none).
    average_last: int = Field(0, ge=0)
    # ... taken only from the final part of the run (this fraction of its steps): averaging an
    # early, much worse checkpoint into the final ones makes the average worse than either.
    average_window: float = Field(0.2, gt=0.0, le=1.0)
    # TensorBoard event files under <run_dir>/tensorboard/ (needs the `tensorboard` extra).
    tensorboard: bool = False
    # An exponential moving average of the weights, updated after every step (training/ema.py): at the end of
    # the run it is validated and written as checkpoint_ema.pt. None = off; 0.999 spans ~1,000 steps.
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)

    @field_validator("max_time")
    @classmethod
    def _check_time(cls, value: float | str | None) -> float | str | None:
        if value is not None and not 0 < parse_duration(value) < math.inf:
            raise ValueError("must be a positive duration, e.g. 90 (seconds), '30m' or '2h'")
        return value

    @field_validator("adam_betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError("each beta must be in [0, 1)")
        return value

    @model_validator(mode="after")
    def _check_rules(self) -> TrainConfig:
        if self.average_last > 1 and self.keep_last < self.average_last:
            raise _rule("keep_last", f"{self.keep_last} step checkpoints cannot hold the average_last="
                        f"{self.average_last} that checkpoint_avg.pt averages: raise keep_last to {self.average_last}")
        if self.lr_schedule == "budget" and self.lr_min > self.lr:
            raise _rule("lr_min", f"{self.lr_min} is above the peak lr {self.lr}: the budget schedule decays "
                        "from lr to lr_min")
        return self


class DecodeConfig(_Section):
    beam: int = Field(5, ge=1)
    # GNMT alpha: score / ((5 + len) / 6) ** alpha. Useful values lie in [0, 2]; at 10 a 1,000-token
    # hypothesis is already divided by 1e22 (and past ~140 the penalty overflows a float).
    length_penalty: float = Field(0.6, ge=0.0, le=10.0)
    # max output tokens = a * src_len + b (src_len counts </s>), and never more than the model's
    # positions hold (model.max_positions - 1): any larger a or b decodes as that cap.
    max_len_a: float = Field(1.5, ge=0.0)
    max_len_b: int = Field(10, ge=0)
    batch_size: int = Field(64, ge=1)  # sentences per batch
    batch_tokens: int | None = Field(None, ge=1)  # if set, also cap source tokens per batch
    # length: batches of similar source length (least padding; the default). balanced: as many
    # batches, each dealt long and short sentences in turn from the length order and decoded as a
    # task of its own, so that batches decoded in parallel finish together (`tfm serve` uses it,
    # with a batch per decoding process). The batches decide which sentences decode together:
    # bf16 output may change with them.
    batching: Literal["length", "balanced"] = "length"
    nbest: int = Field(1, ge=1)  # hypotheses printed per line (≤ beam): `tfm translate --nbest`'s default
    # The target language of a model that translates into several: its tag >>xx<< goes before every
    # line without one (data/language_tags.py). A bilingual model accepts only its own target language.
    tgt_lang: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[^\s<>]+$")
    # Weights and activations while translating: auto = bf16 where train.precision's auto picks
    # it (CUDA, AMX, measured bf16 speed-up); on other CPUs int8, else fp32 (a torch that cannot
    # quantize): faster at equal BLEU there (docs/translation.md). int8 = dynamic int8 quantization
    # of the Linear layers (CPU only).
    precision: Literal["auto", "fp32", "bf16", "int8"] = "auto"
    # Which engine translates (translate, evaluate, serve): auto = CTranslate2 wherever the package
    # is installed, the model converts and every setting is one it has (its int8 search is 1.3–2x
    # tfm's on CPU: docs/performance.md), the conversion cached beside the checkpoint; else tfm's
    # own (ensembles, alignments, sampling, a precision setting), with the reason on stderr.
    # torch = tfm's own; ctranslate2 = CTranslate2 or an error saying why not.
    engine: Literal["auto", "torch", "ctranslate2"] = "auto"
    # CTranslate2's weights and arithmetic: auto = int8 on CPU, float16 on CUDA (bfloat16, then
    # float32, where the GPU lacks it); default = as converted (float32). `decode.precision` is tfm's.
    compute_type: Literal["auto", "default", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                          "float16", "bfloat16", "float32"] = "auto"
    # CPU: batches decoded at once by forked processes of one thread each (auto = one per core):
    # faster than one process with all threads (docs/performance.md). 1 = in this process, with
    # all threads (lowest latency for a single batch). GPU: always 1.
    workers: int | str = "auto"
    # Model files translating together as an ensemble (the mean of their log-probabilities per
    # step); empty: the run's best checkpoint. `tfm translate --checkpoint A --checkpoint B` sets it.
    checkpoints: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    # Sampling instead of search (back-translation): draw each token from the model's distribution
    # at `temperature`, cut to the `top_k` most probable (0: all) and the nucleus of mass `top_p`;
    # `seed` makes it reproducible. nbest = samples per sentence. A vanishing top_p or temperature
    # draws the most probable token (greedy). The four settings do nothing without `sample`: set
    # otherwise, they are an error.
    sample: bool = False
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    temperature: float = Field(1.0, gt=0.0)
    seed: int = Field(0, ge=0, lt=2**63)
    # Word alignments (source word i - target word j, Pharaoh format) from the encoder–decoder
    # attention, averaged over heads and decoder layers, or of decoder layer `alignment_layer` (1-based).
    alignment: bool = False
    alignment_layer: int | None = Field(None, ge=1)
    # Memory one decoding call may take (bytes, or e.g. "512MB", "8GB"): `tfm translate` refuses
    # settings whose bound (decoding/budget.py: caches and logits of beams × lines × output length) is
    # larger, naming the setting, instead of growing until the kernel kills it. None = half of the
    # memory available when the command starts (the GPU's free memory on CUDA).
    max_memory: int | str | None = None
    # Work one decoding call may take: the estimated floating-point operations of its searches
    # (decoding/budget.py: lines × beams or samples × output length × the decoder's cost per token,
    # times the constraints' candidates). `tfm serve` refuses a request over it before decoding,
    # naming the setting; file commands search a chunk over it a part at a time, each within it
    # (decoding/budget.py: parts_within_work), refusing a single line over it. 1e13 is minutes on a
    # laptop's cores.
    max_work: float = Field(1e13, gt=0)
    # Compute each translation's score (length-normalised log-probability) even for one hypothesis:
    # CTranslate2 skips it otherwise (it costs ~4% of greedy's time). `tfm distill` sets it.
    scores: bool = False
    # CTranslate2's vocabulary map: each batch's output is restricted to the target pieces the run's
    # lexical shortlist (`tfm shortlist`, <run_dir>/shortlist.txt) lists for its source pieces, plus
    # the most frequent ones. Faster where the output layer is a large share of the decoder's work.
    shortlist: bool = False
    # follow: a line in ALL CAPS or in Title Case (three words or more; data/augment.py: shouted,
    # titled) is translated in lower case and its translation written as it came, in capitals or Title
    # Case (an 8k vocabulary learned on sentence case spells capitals letter by letter: 4x the pieces).
    # model: as the model writes it. A line with terms (prefix, constraints, avoided) is the model's.
    casing: Literal["follow", "model"] = "follow"
    # follow: a translation of a line without final punctuation (. ! ? and the like) ends without it
    # too, as the line came; model: as the model writes it. A line with terms is the model's.
    end_punctuation: Literal["follow", "model"] = "follow"

    @field_validator("max_memory")
    @classmethod
    def _check_size(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_size(value)  # a ValueError names what is wrong
        return value

    @model_validator(mode="after")
    def _check_rules(self) -> DecodeConfig:
        if self.max_len_b == 0 and self.max_len_a < 1:  # a · 1 + b < 1, without the sum (b may be 10**400)
            raise _rule("max_len_b", f"max_len_a={self.max_len_a} and max_len_b={self.max_len_b} allow no output "
                        "token: give max_len_b ≥ 1 or max_len_a > 0")
        if self.nbest > self.beam and not self.sample:
            raise _rule("nbest", f"{self.nbest} hypotheses need a beam at least as large (beam is {self.beam})")
        if not self.sample:
            for key, default in SAMPLING_DEFAULTS.items():
                if getattr(self, key) != default:
                    raise _rule(key, f"{getattr(self, key)} does nothing without sampling: add --sample (decode.sample: "
                                f"true), or leave {key} out (its default is {default})")
        return self

    def updated(self, **changes: Any) -> DecodeConfig:
        """These settings with `changes` (a command's flags, a request's fields, a stage's needs:
        `beam=1` for validation), validated as a config is: every decode setting travels as one
        DecodeConfig, and each rule across its keys (nbest ≤ beam, sampling's keys) is checked here,
        where the settings are built. A rule broken → `DecodeSettingsError` naming the keys."""
        try:
            return DecodeConfig.model_validate({**self.model_dump(), **changes})
        except ValidationError as err:
            raise DecodeSettingsError(err) from None

    @field_validator("workers", mode="before")
    @classmethod
    def _check_workers(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())) \
                or int(value) < 1:
            raise ValueError("must be auto or a whole number of processes ≥ 1")
        return int(value)


class DecodeSettingsError(ValueError):
    """Decode settings that break a rule (`DecodeConfig.updated`): each problem as (key, message)."""

    def __init__(self, err: ValidationError):
        self.problems = []
        for e in err.errors():
            key, text = ".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, ")
            if e["type"] == "value_error" and re.match(r"[\w.]+: ", text):  # a rule across keys names its key
                key, _, text = text.partition(": ")
            self.problems.append((key, text))
        super().__init__("; ".join(f"{key}: {text}" for key, text in self.problems))

    def naming(self, flags: dict[str, str]) -> str:
        """The problems, each key named as the user gave it (`flags` maps keys to options: nbest →
        --nbest 3) and as a config names it (key 'decode.nbest')."""
        return "; ".join(f"{flags[key] + ' (' if key in flags else ''}key 'decode.{key}'{')' if key in flags else ''}: "
                         f"{text}" for key, text in self.problems)


# The settings that only sampling reads, and their defaults (which mean "no effect").
SAMPLING_DEFAULTS = {"top_k": 0, "top_p": 1.0, "temperature": 1.0, "seed": 0}


class DistillConfig(_Section):
    """`tfm distill`: a teacher translates the run's prepared training source (sequence-level
    knowledge distillation, Kim & Rush 2016) into a corpus a student is prepared from."""

    # Where the distilled corpus goes: <output>/train.<src_lang>, train.<tgt_lang>, distill.json.
    # None: <run_dir>/distilled.
    output: str | None = Field(None, min_length=1)
    beam: int | None = Field(None, ge=1, le=64)  # the teacher's beam; None: decode.beam
    # Percent of the pairs whose teacher output scores worst, left out of the corpus (Bergamot drops
    # the worst 5% by a cross-entropy score); 0 keeps them all.
    drop_worst: float = Field(0.0, ge=0.0, lt=100.0)
    # What "worst" means: logprob = the teacher's length-normalised log-probability of its output;
    # chrf = sentence chrF of the output against the reference target.
    score: Literal["logprob", "chrf"] = "logprob"
    # Lines translated between two saves of the progress: a kill loses at most this many.
    chunk_lines: int = Field(4096, ge=1, le=1_000_000)


class ShortlistConfig(_Section):
    """`tfm shortlist`: the lexical shortlist of a run, learned from its prepared training pairs."""

    top: int = Field(50, ge=1, le=10_000)  # target pieces per source piece (by IBM Model 1's p(t|s))
    frequent: int = Field(100, ge=0, le=100_000)  # most frequent target pieces, always candidates
    sample_pairs: int = Field(1_000_000, ge=100, le=10_000_000)  # training pairs Model 1 learns from


class ExperimentConfig(_Section):
    run_dir: str = "runs/experiment"
    data: DataConfig = DataConfig()
    vocab: VocabConfig = VocabConfig()
    prepare: PrepareConfig = PrepareConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    decode: DecodeConfig = DecodeConfig()
    distill: DistillConfig = DistillConfig()
    shortlist: ShortlistConfig = ShortlistConfig()

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def run(self) -> RunDirectory:
        """The run directory: where each of its files lies (experiment/rundir.py)."""
        return RunDirectory(self.run_dir)

    @property
    def parent_run(self) -> RunDirectory | None:
        """The run vocab.from_run names: whose vocabulary this one takes (a fine-tuned model's parent, a
        distilled student's teacher)."""
        return None if self.vocab.from_run is None else RunDirectory(self.vocab.from_run)

    def vocab_mismatch(self, manifest: Manifest) -> str:
        """How the vocab settings differ from those run_dir was prepared with, as a sentence naming
        the key ("" when they agree)."""
        if any(size != self.vocab.size for size in manifest.vocab_size.values()):
            return (f"key 'vocab.size': {self.vocab.size} in the config, but {self.run_dir} was prepared with "
                    f"{sorted(set(manifest.vocab_size.values()))[0]}")
        if manifest.joint != self.vocab.joint:
            return (f"key 'vocab.joint': {self.vocab.joint} in the config, but {self.run_dir} was prepared with "
                    f"joint={manifest.joint}")
        return ""

    @model_validator(mode="after")
    def _multilingual_vocab(self) -> ExperimentConfig:
        if self.data.multilingual and not self.vocab.joint:
            raise _rule("vocab.joint", "false: data.directions needs one joint vocabulary over every language "
                             "(a language is a source in one direction and a target in another)")
        return self


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """4096 → 4096 bytes; '512MB' / '512M' / '512MiB' → 512 · 2^20; '8GB' → 8 · 2^30 (powers of
    1024 throughout, as `free` and `ulimit` count). ValueError unless a positive, finite size."""
    if isinstance(value, bool):
        raise ValueError("must be a size in bytes or e.g. '512MB', '8GB'")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"not a size: {value!r} (use bytes or e.g. '512MB', '8GB')")
        size = int(float(match.group(1)) * 1024 ** " kmgtp".index(match.group(2).lower() or " "))
    if not 0 < size < 2**63:
        raise ValueError("must be a positive size below 8 EB, e.g. '512MB' or '8GB'")
    return size


def parse_duration(value: float | int | str) -> float:
    """'90' / 90 / '90s' → 90.0, '30m' → 1800.0, '2h' → 7200.0."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"not a duration: {value!r} (use seconds or e.g. '30m', '2h')")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


# --------------------------------------------------------------------------- loading


def _section_fields(path: tuple[str | int, ...]) -> list[str]:
    """Valid key names at a dotted location (for 'did you mean')."""
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            break
    return list(model.model_fields)


def _format_validation_error(err: ValidationError, source: str) -> str:
    messages = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            candidates = _section_fields(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), candidates, n=1, cutoff=0.5)
            hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)" if close else ""
            messages.append(f"unknown key '{key}'{hint}")
        elif e["type"] == "value_error" and re.match(r"Value error, [\w.]+: ", e["msg"]):  # a rule across keys
            field, _, text = e["msg"].removeprefix("Value error, ").partition(": ")
            messages.append(f"key '{'.'.join([*map(str, loc), field])}': {text}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {shortened(repr(got))})"  # a whole section says nothing
            messages.append(f"key '{key}': {e['msg'].removeprefix('Value error, ')}{shown}")
    return f"{source}: " + "; ".join(messages)


def shortened(text: str, limit: int = 80) -> str:
    """`text` as a message shows it: at most `limit` characters, and how many there were."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (so 200 is an int)."""
    if "=" not in assignment:
        raise TfmError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.max_steps=200")
    key, _, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise TfmError(f"--set {assignment!r}: empty key")
    try:
        value = read_yaml(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise TfmError(f"--set {assignment!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def fixed_by_checkpoint(assignment: str) -> bool:
    """Whether a `--set key=value` edits what a trained model's checkpoint fixes (model.*, vocab.*)."""
    return assignment.partition("=")[0].strip().split(".")[0] in ("model", "vocab")


def check_inference_overrides(overrides: list[str] | tuple[str, ...], trained: ExperimentConfig | None = None) -> None:
    """A trained model's architecture and vocabulary are those of its checkpoint: `--set model.*` or
    `vocab.*` cannot change them while translating. One that repeats the value the model was trained
    with (`trained`: its config; the same --set options given to train and to translate) is accepted;
    any other, or any at all when `trained` is unknown, is an error naming the key."""
    for assignment in filter(fixed_by_checkpoint, overrides):
        key = assignment.partition("=")[0].strip()
        section = key.split(".")[0]
        rule = (f"a trained model's {section}.* settings are fixed by its checkpoint (translating and "
                "evaluating take decode.* settings)")
        if trained is None:
            raise TfmError(f"--set {key}: {rule}")
        raw = trained.model_dump(mode="json")
        was = raw
        for part in key.split("."):
            was = was.get(part) if isinstance(was, dict) else None  # read before the override edits raw
        apply_override(raw, assignment)
        if getattr(config_from_dict(raw, "command line"), section) != getattr(trained, section):
            raise TfmError(f"--set {key}: the model was trained with {key}={json.dumps(was)}; {rule}")


def _mean_own_run_directory(raw: dict[str, Any], path: Path) -> None:
    """A run directory's own config.yaml (beside its prepare.json) means that directory, whatever
    run_dir its text names: a copied or moved run (or one trained from another working directory)
    is self-contained and never writes into the run it came from. `--set run_dir=…` still wins."""
    if path.name == CONFIG_NAME and (path.parent / MANIFEST_NAME).is_file():
        named = raw.get("run_dir")
        if not isinstance(named, str) or Path(named).resolve() != path.parent.resolve():
            raw["run_dir"] = str(path.parent)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read a YAML config (or defaults when `path` is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.exists():
            raise TfmError(f"config file not found: {path}")
        if not path.is_file():  # a directory, /dev/null, a FIFO: nothing a config is read from (a FIFO would block)
            what = "a directory" if path.is_dir() else "not a regular file"
            raise TfmError(f"config {path}: {what}; give a YAML file (e.g. --config configs/de-en.yaml)")
        try:
            loaded = read_yaml(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise TfmError(f"{path}:{where} invalid YAML: {getattr(exc, 'problem', exc)}") from None
        except UnicodeDecodeError as exc:
            raise TfmError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if not isinstance(loaded, dict) and loaded is not None:
            raise TfmError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        if not loaded:  # every default: a run in runs/experiment on data/train, surely not what was meant
            raise TfmError(f"{path}: no settings in it (empty, or comments only): a config gives at least its run_dir "
                           "and data section (see configs/de-en.yaml)")
        raw = loaded
        _mean_own_run_directory(raw, path)
    for assignment in overrides:
        apply_override(raw, assignment)
        source = f"{source} (with --set)" if "--set" not in source else source
    return config_from_dict(raw, source)


def config_from_dict(raw: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise TfmError(_format_validation_error(err, source)) from None


def config_to_yaml(config: ExperimentConfig) -> str:
    """The config as YAML that means the same read back: `model.size: auto` without the shape keys
    (the fallback's, filled in until the probe chooses: read back beside auto they would pin that
    shape), `student` without those it was not given (its teacher's shape fills them)."""
    raw = config.model_dump(mode="json")
    if config.model.size in (AUTO, STUDENT):
        given = config.model.model_fields_set if config.model.size == STUDENT else set()
        for key in SHAPE_KEYS:
            if key not in given:
                del raw["model"][key]
    return yaml.safe_dump(raw, sort_keys=False)
