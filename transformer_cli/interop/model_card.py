"""The model card (README.md) of an exported model: the Hub's YAML front matter (languages, tags,
datasets, metrics and their values) and what a user of the model needs to know, all read from the
run that trained it — its data and cleaning report, shape, training time and test scores as
`tfm evaluate` wrote them, with sacreBLEU's signatures. A model without a test score gets no card:
a shared model's first line of evidence is its score on data it never saw."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from ..experiment.config import ExperimentConfig
from ..experiment.rundir import RunDirectory, run_of
from ..model.transformer import TransformerConfig
from ..runtime.errors import TfmError
from ..runtime.files import file_sha256


def test_scores(checkpoint: Path) -> list[dict[str, Any]]:
    """What `tfm evaluate --split test` wrote for `checkpoint` alone in its run's eval/ (each beam it
    was scored with), best beam first; a TfmError naming the command that makes one where there is none."""
    run = run_of(checkpoint)
    hint = (f"score it first: tfm evaluate --config {run.config_file} --split test --checkpoint {checkpoint}"
            if run is not None else "export a checkpoint of a run that tfm evaluate has scored on its test set")
    results, other_weights = [], 0
    digest = file_sha256(checkpoint) if run is not None else ""
    for path, beam in run.test_score_files(checkpoint) if run is not None else []:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            scores = result["scores"]
            if not math.isfinite(float(scores["bleu"]["score"])):
                raise ValueError("not a number")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise TfmError(f"{path}: not a score file tfm evaluate wrote (no BLEU in it); {hint}") from None
        if result.get("checkpoint_sha256") != [digest]:  # another checkpoint of that name (training went on), or unknown
            other_weights += 1
            continue
        results.append({**result, "file": path.name, "beam": beam})
    if not results:
        also = (f" ({other_weights} score file(s) of {checkpoint.name} are of other weights: it changed since they "
                "were made, or they do not say)") if other_weights else ""
        raise TfmError(f"{checkpoint}: no test score of these weights (the model card reports one){also}; {hint}")
    return sorted(results, key=lambda r: -r["scores"]["bleu"]["score"])


def scored_test_set(result: dict[str, Any], config: ExperimentConfig) -> str:
    """The test set a score was measured on, as its file says (`--set data.test=other` scored another
    than the config's), without the language suffix."""
    source = result.get("source")
    if isinstance(source, str) and source:
        return re.sub(r"\.[a-z]{2,3}(\.gz)?$", "", Path(source).name)
    return Path(config.data.test or "test").name


def _datasets(config: ExperimentConfig) -> list[str]:
    """The training corpora's names: the folder of each `data.train` prefix (data/multi30k/train → multi30k)."""
    names = []
    for prefix in config.data.train:
        folder = Path(prefix).parent.name or Path(prefix).name
        if folder not in names:
            names.append(folder)
    return names


def by_direction(config: ExperimentConfig, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A score file's scores per direction: a multilingual run's each direction's own (`tfm evaluate`
    on its directions), a bilingual run's its one direction."""
    if config.data.directions is None:
        return {config.data.pairs[0].name: result["scores"]}
    directions = result.get("directions")
    if not isinstance(directions, dict) or not all(isinstance(r, dict) and "bleu" in r.get("scores", {})
                                                   for r in directions.values()):
        raise TfmError(f"{result.get('file', 'a score file')}: not one score per direction; a multilingual "
                       "model's card reports each direction's (tfm evaluate --split test on its run writes them)")
    return {f"{name} (zero-shot)" if r.get("zero_shot") else name: r["scores"] for name, r in directions.items()}


def languages(config: ExperimentConfig) -> list[str]:
    """The run's languages in the order its directions name them."""
    return list(dict.fromkeys(lang for d in config.data.pairs for lang in (d.src, d.tgt)))


def _front_matter(config: ExperimentConfig, scores: list[dict[str, Any]], name: str) -> str:
    best = scores[0]
    test_name = scored_test_set(best, config)
    results = []
    for direction, direction_scores in by_direction(config, best).items():
        metrics = [{"type": metric, "value": round(float(direction_scores[metric]["score"]), 2),
                    "name": f"{metric.upper() if metric == 'bleu' else 'chrF'} (test, beam {best['beam']})",
                    "args": direction_scores[metric]["signature"]}
                   for metric in ("bleu", "chrf") if metric in direction_scores]
        results.append({"task": {"type": "translation", "name": f"Translation {direction}"},
                        "dataset": {"type": test_name, "name": test_name}, "metrics": metrics})
    front = {
        "language": languages(config),
        "tags": ["translation", "tfm"] + (["multilingual"] if config.data.directions is not None else []),
        "datasets": _datasets(config),
        "metrics": [m["type"] for m in results[0]["metrics"]],
        "pipeline_tag": "translation",
        "library_name": "transformers",
        "model-index": [{"name": name, "results": results}],
    }
    text = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    # The license is the user's to give: theirs depends on the data's licenses, which tfm cannot know.
    return f"---\n# license: (set this: the licenses of the training data bind the model)\n{text}---\n"


def _cleaning(run: RunDirectory | None) -> list[str]:
    totals = run.cleaning_totals() if run is not None else None
    if totals is None:
        return ["No cleaning report was found beside the checkpoint."]
    dropped = sorted(((reason, count) for reason, count in totals.dropped.items() if count), key=lambda kv: -kv[1])
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in dropped)
    return [f"`tfm prepare` read {totals.pairs_read:,} training pairs and kept {totals.pairs_kept:,}"
            + (f"; dropped: {reasons}." if reasons else ".")]


def _training(progress: dict[str, Any], run: RunDirectory | None) -> list[str]:
    lines = []
    step, elapsed = progress.get("step"), progress.get("elapsed")
    if isinstance(step, int):
        minutes = f" in {elapsed / 60:.1f} minutes of training" if isinstance(elapsed, (int, float)) else ""
        lines.append(f"{step:,} updates{minutes}.")
    machines = progress.get("machines") or []
    lines.append(f"Trained on: {'; then '.join(map(str, machines))}." if machines
                 else "The hardware it trained on is not recorded in its checkpoint.")
    chosen = run.shape_choice(strict=True) if run is not None else None
    if chosen is not None:
        budget, steps = chosen.budget_seconds, chosen.max_steps
        limit = (f"a {budget / 60:.0f}-minute budget" if isinstance(budget, (int, float)) else
                 f"{steps:,} updates" if isinstance(steps, int) else "its budget")
        lines.append(f"Shape chosen by `model.size: auto` for {limit} on that machine: {chosen.chosen}.")
    return lines


def model_card(checkpoint: Path, config: ExperimentConfig, cfg: TransformerConfig, architecture: str,
               parameters: int, progress: dict[str, Any], scores: list[dict[str, Any]], output: Path) -> str:
    """README.md of the export in `output`, from the run of `checkpoint`."""
    run = run_of(checkpoint)
    src, tgt = config.data.src_lang, config.data.tgt_lang
    multilingual = config.data.directions is not None
    if multilingual:  # scores of a run's lines without their tags (tfm evaluate --hyp) say nothing per direction
        scores = [r for r in scores if "directions" in r] or [scores[0]]  # none: by_direction says so
    name = f"tfm-{'-'.join(languages(config))}" if multilingual else f"tfm-{src}-{tgt}"
    what = ", ".join(f"{d.src}→{d.tgt}" for d in config.data.pairs)
    score_rows = [f"| {direction} | {r['beam']} | {s['bleu']['score']:.2f} | "
                  f"{s.get('chrf', {}).get('score', float('nan')):.2f} | {r.get('engine', '')} | "
                  f"`{s['bleu']['signature']}` |" for r in scores for direction, s in by_direction(config, r).items()]
    # A multilingual model reads its target language from the source's first piece, the tag >>xx<<.
    example = f">>{tgt}<< …" if multilingual else "…"
    tags = ", ".join(f"`>>{lang}<<`" for lang in dict.fromkeys(d.tgt for d in config.data.pairs))
    vocabulary = ("one joint sentencepiece vocabulary" if cfg.share_embeddings and cfg.src_vocab_size == cfg.tgt_vocab_size
                  else "separate source and target sentencepiece vocabularies")
    card = [
        _front_matter(config, scores, name),
        f"# {name}: {what} translation, trained with tfm",
        "",
        f"A Transformer ({cfg.norm_position}-norm) trained with tfm from the corpora "
        f"{', '.join(config.data.train)}; exported from `{checkpoint.name}` as a `transformers` {architecture} "
        "(no custom code).",
        "",
        "## Data",
        "",
        *_cleaning(run),
        "",
        "## Model",
        "",
        f"- d_model {cfg.d_model}, {cfg.enc_layers} encoder and {cfg.dec_layers} decoder layers, {cfg.n_heads} heads, "
        f"feed-forward {cfg.d_ff}, {cfg.activation}; {parameters:,} parameters",
        f"- {vocabulary}: {cfg.src_vocab_size:,} source and {cfg.tgt_vocab_size:,} target ids",
        f"- at most {cfg.max_positions - 2:,} source tokens a sentence",
        "",
        "## Training",
        "",
        *_training(progress, run),
        "",
        f"## Test scores ({scored_test_set(scores[0], config)}, sacreBLEU)",
        "",
        "| direction | beam | BLEU | chrF | engine | BLEU signature |",
        "| --- | --- | --- | --- | --- | --- |",
        *score_rows,
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{output.name}")',
        f'model = AutoModelForSeq2SeqLM.from_pretrained("{output.name}")',
        f'batch = tokenizer(["{example}"], return_tensors="pt", padding=True)',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
        "```",
        "",
        *([f"Each source begins with the tag of the language to translate into ({tags}), as "
           "`tfm translate --tgt-lang` adds it.", ""] if multilingual else []),
        'With transformers 4: `pipeline("translation", model=…)` (transformers 5 removed that pipeline). '
        "The generation settings (beam, length penalty) are the run's, in generation_config.json.",
        "",
        "With tfm (the checkpoint this was exported from): "
        f"`tfm translate --checkpoint {checkpoint.name}{f' --tgt-lang {tgt}' if multilingual else ''} < input.{src}`.",
        "",
    ]
    return "\n".join(card)
