"""The model card (README.md) of an exported model: the Hub's YAML front matter (languages, tags,
datasets, metrics and their values) and what a user of the model needs to know, all read from the
run that trained it — its data and cleaning report, shape, training time and test scores as
`tfm evaluate` wrote them, with sacreBLEU's signatures. A model without a test score gets no card:
a shared model's first line of evidence is its score on data it never saw."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from ..experiment.config import ExperimentConfig
from ..model.transformer import TransformerConfig
from ..runtime.errors import TfmError
from ..runtime.files import run_owning

SCORE_FILE = re.compile(r"^test\.(?P<checkpoints>[^.]+)\.beam(?P<beam>\d+)(?:\.directions)?\.json$")


def test_scores(checkpoint: Path) -> list[dict[str, Any]]:
    """What `tfm evaluate --split test` wrote for `checkpoint` alone in its run's eval/ (each beam it
    was scored with), best beam first; a TfmError naming the command that makes one where there is none."""
    run = run_owning(checkpoint)
    hint = (f"score it first: tfm evaluate --config {run / 'config.yaml'} --split test --checkpoint {checkpoint}"
            if run is not None else "export a checkpoint of a run that tfm evaluate has scored on its test set")
    results = []
    for path in sorted((run / "eval").glob("test.*.json")) if run is not None else []:
        found = SCORE_FILE.match(path.name)
        if found is None or found["checkpoints"] != checkpoint.stem:  # constrained runs, ensembles
            continue
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            scores = result["scores"]
            float(scores["bleu"]["score"])
        except (OSError, ValueError, KeyError, TypeError):
            raise TfmError(f"{path}: not a score file tfm evaluate wrote (no BLEU in it); {hint}") from None
        results.append({**result, "file": path.name, "beam": int(found["beam"])})
    if not results:
        raise TfmError(f"{checkpoint}: no test score (the model card reports one); {hint}")
    return sorted(results, key=lambda r: -r["scores"]["bleu"]["score"])


def _datasets(config: ExperimentConfig) -> list[str]:
    """The training corpora's names: the folder of each `data.train` prefix (data/multi30k/train → multi30k)."""
    names = []
    for prefix in config.data.train:
        folder = Path(prefix).parent.name or Path(prefix).name
        if folder not in names:
            names.append(folder)
    return names


def _front_matter(config: ExperimentConfig, scores: list[dict[str, Any]], name: str) -> str:
    best = scores[0]
    metrics = [{"type": metric, "value": round(float(best["scores"][metric]["score"]), 2),
                "name": f"{metric.upper() if metric == 'bleu' else 'chrF'} (test, beam {best['beam']})",
                "args": best["scores"][metric]["signature"]}
               for metric in ("bleu", "chrf") if metric in best["scores"]]
    test_name = Path(config.data.test or "test").name
    front = {
        "language": [config.data.src_lang, config.data.tgt_lang],
        "tags": ["translation", "tfm"],
        "datasets": _datasets(config),
        "metrics": [m["type"] for m in metrics],
        "pipeline_tag": "translation",
        "library_name": "transformers",
        "model-index": [{"name": name, "results": [{
            "task": {"type": "translation", "name": f"Translation {config.data.src_lang}-{config.data.tgt_lang}"},
            "dataset": {"type": test_name, "name": test_name},
            "metrics": metrics}]}],
    }
    text = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    # The license is the user's to give: theirs depends on the data's licenses, which tfm cannot know.
    return f"---\n# license: (set this: the licenses of the training data bind the model)\n{text}---\n"


def _cleaning(run: Path | None) -> list[str]:
    report_file = run / "prepare_report.json" if run is not None else None
    if report_file is None or not report_file.is_file():
        return ["No cleaning report was found beside the checkpoint."]
    report = json.loads(report_file.read_text(encoding="utf-8"))
    dropped = {reason: count for reason, count in report.get("dropped", {}).items() if count}
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(dropped.items(), key=lambda kv: -kv[1]))
    return [f"`tfm prepare` read {report.get('pairs_read', 0):,} training pairs and kept "
            f"{report.get('pairs_kept', 0):,}" + (f"; dropped: {reasons}." if reasons else ".")]


def _training(progress: dict[str, Any], run: Path | None) -> list[str]:
    lines = []
    step, elapsed = progress.get("step"), progress.get("elapsed")
    if step is not None:
        minutes = f" in {elapsed / 60:.1f} minutes of training" if isinstance(elapsed, (int, float)) else ""
        lines.append(f"{step:,} updates{minutes}.")
    machines = progress.get("machines") or []
    lines.append(f"Trained on: {'; then '.join(machines)}." if machines
                 else "The hardware it trained on is not recorded in its checkpoint.")
    choice = run / "shape_choice.json" if run is not None else None
    if choice is not None and choice.is_file():
        chosen = json.loads(choice.read_text(encoding="utf-8"))
        lines.append(f"Shape chosen by `model.size: auto` for a {chosen.get('budget_seconds', 0) / 60:.0f}-minute "
                     f"budget on that machine: {chosen.get('chosen')}.")
    return lines


def model_card(checkpoint: Path, config: ExperimentConfig, cfg: TransformerConfig, architecture: str,
               parameters: int, progress: dict[str, Any], scores: list[dict[str, Any]], output: Path) -> str:
    """README.md of the export in `output`, from the run of `checkpoint`."""
    run = run_owning(checkpoint)
    src, tgt = config.data.src_lang, config.data.tgt_lang
    name = f"tfm-{src}-{tgt}"
    score_rows = [f"| {r['beam']} | {r['scores']['bleu']['score']:.2f} | "
                  f"{r['scores'].get('chrf', {}).get('score', float('nan')):.2f} | {r.get('engine', '')} | "
                  f"`{r['scores']['bleu']['signature']}` |" for r in scores]
    vocabulary = ("one joint sentencepiece vocabulary" if cfg.share_embeddings and cfg.src_vocab_size == cfg.tgt_vocab_size
                  else "separate source and target sentencepiece vocabularies")
    card = [
        _front_matter(config, scores, name),
        f"# {name}: {src}→{tgt} translation, trained with tfm",
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
        f"## Test scores ({Path(config.data.test or 'test').name}, sacreBLEU)",
        "",
        "| beam | BLEU | chrF | engine | BLEU signature |",
        "| --- | --- | --- | --- | --- |",
        *score_rows,
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{output.name}")',
        f'model = AutoModelForSeq2SeqLM.from_pretrained("{output.name}")',
        'batch = tokenizer(["…"], return_tensors="pt", padding=True)',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
        "```",
        "",
        'With transformers 4: `pipeline("translation", model=…)` (transformers 5 removed that pipeline). '
        "The generation settings (beam, length penalty) are the run's, in generation_config.json.",
        "",
        "With tfm (the checkpoint this was exported from): "
        f"`tfm translate --checkpoint {checkpoint.name} < input.{src}`.",
        "",
    ]
    return "\n".join(card)
