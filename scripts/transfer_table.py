"""`model.size: auto` against each named shape on one corpus, one finished run per arm: the table of
docs/training.md's "On other corpora", read from the runs (config.yaml, shape_choice.json,
metrics.jsonl, prepare.json and the `tfm evaluate --split test` scores), beside what the curves
(measured on Multi30k de→en, experiment/shapes.py) predicted.

    python scripts/transfer_table.py runs/tr-fren-auto runs/tr-fren-d128 runs/tr-fren-d192 runs/tr-fren-d256

Each run is trained as `configs/<direction>.yaml --set train.lr_schedule=inverse_sqrt --set train.max_time=10m
--set model.size=ARM` (the quickstart's recipe; a third of a corpus: `--set data.train=PREFIX`)
and evaluated with `tfm evaluate --config RUN/config.yaml --split test`. Target: auto's test BLEU
within 0.5 of the best named shape's, or better. "curve" is the valid greedy BLEU the shape's
curve gives for the updates the run made at its batch; against the run's best valid BLEU it says
how far the curves carry to this corpus. "passes": updates × batch tokens over the corpus's
target tokens (the unit of a shape's overfitting point, experiment/shapes.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.experiment.config import load_config  # noqa: E402
from transformer_cli.experiment.rundir import RunDirectory  # noqa: E402
from transformer_cli.experiment.shapes import SHAPES  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

TARGET = 0.5  # BLEU: auto at most this far below the best named shape


def records(run: RunDirectory) -> list[dict]:
    """metrics.jsonl's records (a torn line skipped, as every reader of it does)."""
    out = []
    for line in run.metrics.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def test_bleu(run: RunDirectory) -> float:
    """The beam-5 test score `tfm evaluate --config RUN/config.yaml --split test` wrote."""
    checkpoint = run.default_checkpoint()
    for path, beam in run.test_score_files(checkpoint):
        if beam == 5:
            return float(json.loads(path.read_text(encoding="utf-8"))["scores"]["bleu"]["score"])
    raise TfmError(f"{run.root}: no beam-5 test score of {checkpoint.name}: run `tfm evaluate --config "
                   f"{run.config_file} --split test`")


def arm(path: Path) -> dict:
    run = RunDirectory(path)
    for needed in (run.config_file, run.metrics, run.manifest_file):
        if not needed.is_file():
            raise TfmError(f"{needed} not found: {path} is not a finished run")
    config, choice = load_config(run.config_file), run.shape_choice(strict=True)
    size, batch = config.model.size, config.train.max_tokens
    if size not in SHAPES:
        raise TfmError(f"{run.config_file}: model.size {size!r} is not a named shape (auto writes the one it chose)")
    logged = records(run)
    valid = [r["bleu"] for r in logged if r.get("kind") == "valid" and isinstance(r.get("bleu"), (int, float))]
    updates = max((r.get("step", 0) for r in logged), default=0)
    corpus_tokens = run.load_manifest().stats.get("train", {}).get("tgt", {}).get("tokens") or 0
    predicted = None
    if choice is not None:
        predicted = next((s.get("updates") for s in choice.shapes if s.get("name") == choice.chosen), None)
    return {"name": f"`auto` → {size}" if choice is not None else size, "auto": choice is not None,
            "batch": batch, "lr": config.train.lr, "dropout": config.model.dropout, "updates": updates,
            "predicted": predicted, "passes": updates * batch / corpus_tokens if corpus_tokens else 0.0,
            "valid": max(valid, default=float("nan")), "curve": SHAPES[size].predicted_bleu(updates, batch),
            "test": test_bleu(run)}


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="finished runs: the auto arm and the named shapes")
    args = parser.parse_args()
    arms = [arm(path) for path in args.runs]
    print("| arm | batch, peak lr, dropout | updates | passes | best valid BLEU (greedy) | curve | test2016 BLEU (beam 5) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for a in arms:
        updates = f"{a['updates']:,}" + (f" (predicted {a['predicted']:,})" if a["predicted"] else "")
        print(f"| {a['name']} | {a['batch']:,}, {a['lr']:g}, {a['dropout']:g} | {updates} | {a['passes']:.1f} | "
              f"{a['valid']:.2f} | {a['curve']:.2f} | {a['test']:.2f} |")
    automatic, named = [a for a in arms if a["auto"]], [a for a in arms if not a["auto"]]
    if automatic and named:
        best = max(named, key=lambda a: a["test"])
        gap = automatic[0]["test"] - best["test"]
        print(f"\nauto {automatic[0]['test']:.2f} against the best named shape ({best['name']}) {best['test']:.2f}: "
              f"{gap:+.2f} (target ≥ {-TARGET}: {'met' if gap >= -TARGET else 'not met'})")


if __name__ == "__main__":
    run_script(main)
