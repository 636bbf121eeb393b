"""The model filter's own models: with `data.filters.model` on and no model named, `tfm prepare`
first trains them on the corpus itself, then scores its pairs with them (data/model_filter.py).

A model trained on the corpus learns its noise too: the misaligned pairs it saw, it finds likely.
So the training pairs are split in two halves by a hash of each pair (`model_filter.fold_of`), each
half trains a forward (src→tgt) and a backward (tgt→src) model, and each pair is scored by the two
that never saw it. Each is an ordinary run in <run_dir>/filter_models/half<k>/: prepared with the
run's rule filters (the model filter off) and trained as the run's own config trains (d128 where
it says `model.size: auto`), for `data.filters.model.train_updates` (and at most `train_time`)
under the budget schedule, its best checkpoint chosen by valid loss (the filter scores
likelihoods, not translations). A budget of updates and a fixed shape make the same models on a
busy or slow machine as on an idle one: trained for minutes of wall clock, they were weaker there,
and the thresholds learned with them dropped other pairs.

The runs are kept: the next `tfm prepare` finds them prepared and trained and goes on at once; a
killed training resumes from its last checkpoint; a changed corpus writes the halves again, moves
the old training aside (prepare's --discard-checkpoints) and trains again. The models' checkpoints
are part of the run's fingerprint, as named models' are.
"""

from __future__ import annotations

import contextlib
import gzip
import json

from ..data.corpus import corpora_chunks, decode_or_none
from ..data.model_filter import FOLDS, fold_of, self_trained_runs
from ..data.prepare import direction_corpora, prepare
from ..experiment.config import ExperimentConfig, TrainConfig, config_from_dict
from ..experiment.runlock import RunLock
from ..experiment.shapes import AUTO, SHAPES
from ..model.shape import SHAPE_KEYS
from ..runtime.console import say
from ..runtime.errors import TfmError
from ..runtime.files import atomic_path, atomic_write_text
from .train import train

# The shape the filter's own models train where the run's config says `model.size: auto` and the
# budget is updates (auto times the machine against a time budget): the one auto chose for the
# models' 5 minutes on a 2-core Zen 4; the filter reads likelihoods, which a small model gives.
UPDATES_BUDGET_SHAPE = "d128"


def describe_budget(train_cfg: TrainConfig) -> str:
    """A filter model's budget in words: "1,000 updates", "5m" or "1,000 updates (at most 5m)"."""
    if train_cfg.max_time is None:
        return f"{train_cfg.max_steps:,} updates"
    if train_cfg.max_steps >= TrainConfig().max_steps:  # no limit of updates given
        return str(train_cfg.max_time)
    return f"{train_cfg.max_steps:,} updates (at most {train_cfg.max_time})"


def filter_model_config(config: ExperimentConfig, fold: int, backward: bool) -> ExperimentConfig:
    """The config of the run that trains one filter model on one half: the run's own settings (those
    it gives; the others default as they do for it), the languages swapped for the backward model,
    the model filter and augmentation off, the budget `train_updates` and/or `train_time` (or the
    run's max_steps, whichever ends first) under the budget schedule."""
    raw = config.model_dump(mode="json", exclude_unset=True)
    data, train_cfg = raw.setdefault("data", {}), raw.setdefault("train", {})
    src, tgt = config.data.src_lang, config.data.tgt_lang
    if backward:
        src, tgt = tgt, src
    data.update({"src_lang": src, "tgt_lang": tgt, "train": str(config.run.filter_model_half(fold) / "train")})
    data.pop("train_limit", None)  # applied when the halves were written
    data.pop("augment", None)  # they score pairs as the corpus writes them: trained on them as written
    data.setdefault("filters", {})["model"] = {"enabled": False}
    raw["run_dir"] = str(config.run.filter_model_half(fold) / f"{src}-{tgt}")
    rule = config.data.filters.model
    if config.model.size is not None:  # auto, or a name: its keys were filled in, not given
        raw["model"] = {key: value for key, value in raw.get("model", {}).items() if key not in SHAPE_KEYS}
        if config.model.size == AUTO and rule.train_time is None:  # a budget of updates: no machine to time
            raw["model"]["size"] = UPDATES_BUDGET_SHAPE  # at the peak learning rate auto gives it (unless train.lr)
            train_cfg.setdefault("lr", SHAPES[UPDATES_BUDGET_SHAPE].lr_for(config.train.max_tokens))
    raw.setdefault("vocab", {}).pop("from_run", None)  # its own vocabulary (a parent's would be the wrong way round)
    for key in ("init_from", "patience", "average_last", "ema_decay", "tensorboard"):
        train_cfg.pop(key, None)
    train_cfg.update({
        "max_time": rule.train_time, "lr_schedule": "budget", "best_metric": "loss",
        "max_steps": min(rule.train_updates or config.train.max_steps, config.train.max_steps),
        "warmup_ratio": config.train.warmup_ratio or 0.25, "keep_last": 1,
        "eval_bleu_sentences": min(config.train.eval_bleu_sentences, 100),  # BLEU is printed; the loss chooses
    })
    return config_from_dict(raw, f"{raw['run_dir']} (data.filters.model)")


def _inputs(config: ExperimentConfig) -> dict:
    """What the halves are written from: the training files (path, size, time) and the limit."""
    files = [[str(path), path.stat().st_size, int(path.stat().st_mtime)]
             for corpus in direction_corpora(config, "train", config.data.pairs[0]) for path in corpus]
    return {"files": files, "train_limit": config.data.train_limit}


def write_halves(config: ExperimentConfig) -> list[int]:
    """<half>/train.<lang>.gz of each half (unless written from these inputs already); pairs per half."""
    pair = config.data.pairs[0]
    stamp = config.run.halves_file
    inputs = _inputs(config)
    try:
        written = json.loads(stamp.read_text(encoding="utf-8"))
        if written["inputs"] == inputs:
            return [int(n) for n in written["pairs"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or not readable: written again
    counts = [0] * FOLDS
    with contextlib.ExitStack() as stack:
        paths = {(k, lang): stack.enter_context(atomic_path(config.run.filter_model_half(k) / f"train.{lang}.gz"))
                 for k in range(FOLDS) for lang in (pair.src, pair.tgt)}
        files = {key: stack.enter_context(gzip.open(path, "wt", encoding="utf-8", compresslevel=1))
                 for key, path in paths.items()}
        corpora = direction_corpora(config, "train", pair)
        for number, chunk in corpora_chunks(corpora, 100_000, config.data.train_limit):
            for i, (raw_src, raw_tgt) in enumerate(zip(chunk.src, chunk.tgt)):
                line = chunk.first_line + i
                src = decode_or_none(raw_src, str(corpora[number][0]), line, True)
                tgt = decode_or_none(raw_tgt, str(corpora[number][1]), line, True)
                if src is None or tgt is None or "\n" in src or "\n" in tgt:
                    continue  # not text: the text filter drops it from the training data too
                k = fold_of(src, tgt)
                files[k, pair.src].write(src + "\n")
                files[k, pair.tgt].write(tgt + "\n")
                counts[k] += 1
        for file in files.values():
            file.close()  # inside the atomic paths: renamed into place only when written whole
    atomic_write_text(stamp, json.dumps({"inputs": inputs, "pairs": counts}))
    return counts


def train_filter_models(config: ExperimentConfig, progress: bool = True) -> None:
    """Where the model filter is on and names no model: the models it scores with, trained here
    (or found trained by an earlier `tfm prepare`). Otherwise nothing."""
    rule = config.data.filters.model
    if not rule.enabled or rule.forward is not None or rule.backward is not None:
        return
    if len(config.data.pairs) != 1:
        raise TfmError("data.filters.model: trains its own models only for a run with one direction (data.src_lang → "
                       f"data.tgt_lang), not {len(config.data.pairs)}; name forward/backward models instead")
    with RunLock(config.run_path, "tfm prepare"):
        counts = write_halves(config)
    for fold, runs in enumerate(self_trained_runs(config.run, config.data.src_lang, config.data.tgt_lang)):
        if counts[fold] == 0:
            raise TfmError(f"data.filters.model: half {fold + 1} of the training pairs is empty: too few pairs "
                           "to train the filter's own models; name forward/backward models instead")
        for backward, run_path in enumerate(runs):
            sub = filter_model_config(config, fold, bool(backward))
            assert sub.run_path == run_path
            say(f"data.filters.model: {'backward' if backward else 'forward'} model {fold + 1} of {FOLDS} "
                f"({sub.data.src_lang}→{sub.data.tgt_lang}, {counts[fold]:,} pairs), trained for "
                f"{describe_budget(sub.train)}: {run_path}")
            prepare(sub, progress=progress, discard_checkpoints=True)  # up to date: nothing done
            train(sub, resume=sub.run.last_checkpoint.is_file(), progress_bar=progress)
