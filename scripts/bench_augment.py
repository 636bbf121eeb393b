"""A run's BLEU on its test and valid sets as written and as people type them, as the Markdown table
docs/performance.md keeps (target: every variant at 90% or more of the clean score).

    python scripts/bench_augment.py --run runs/quickstart [--split test --split valid] [--engine auto]

Each split's sources are translated as `tfm evaluate --config RUN/config.yaml --augment all` translates
them (the run's best checkpoint, its decode settings, the default engine): ALL CAPS, Title Case and
lower case scored without case, typos (one word in eight) and no final punctuation (both sides)
with it, and a mix of them line by line; each cell is the variant's BLEU and its share of the clean
split's, scored the same way. The CPU (its name and whether it has bf16) and the date head the table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402


def cpu_line() -> str:
    from transformer_cli.runtime.cpu import cpu_flags, cpu_model_name

    flags = cpu_flags()
    isa = ("AVX512_BF16" if "avx512_bf16" in flags else "AVX-512, no bf16" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{cpu_model_name()} ({isa}{', AMX' if 'amx_tile' in flags else ''})"


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a trained run directory (its config.yaml)")
    parser.add_argument("--split", action="append", choices=["test", "valid"], help="default: test and valid")
    parser.add_argument("--engine", default=None, choices=["auto", "torch", "ctranslate2"])
    args = parser.parse_args()
    from transformer_cli.data.augment import VARIANTS
    from transformer_cli.decoding.engine import model_files
    from transformer_cli.evaluate import evaluate_augmented
    from transformer_cli.experiment.config import load_config
    from transformer_cli.runtime.errors import TfmError

    config_path = args.run / "config.yaml"
    if not config_path.is_file():
        raise TfmError(f"--run {args.run}: no config.yaml there (a run that `tfm train` wrote)")
    config = load_config(config_path)
    header = "| split | clean | " + " | ".join(VARIANTS) + " | ALL CAPS answered in capitals |"
    rows = [header, "|" + " --- |" * (len(VARIANTS) + 3)]
    engine = None
    for split in args.split or ["test", "valid"]:
        result = evaluate_augmented(config, model_files(config), split, ["bleu"], list(VARIANTS), engine=args.engine)
        engine = result.extra["engine"]
        cells = [f"{result.scores['bleu'].score:.2f}"]
        for name in VARIANTS:
            row = result.extra["variants"][name]
            share = row["share"]["bleu"]
            cells.append(f"{row['scores']['bleu']['score']:.2f} ({100 * share:.0f}%)" if share is not None else
                         f"{row['scores']['bleu']['score']:.2f}")
        caps = result.extra["variants"]["upper"]["in_capitals"]
        rows.append(f"| {split} | " + " | ".join(cells) + f" | {100 * caps:.1f}% |")
    print(f"{cpu_line()}, {time.strftime('%Y-%m-%d')}, {engine}; "
          f"`python scripts/bench_augment.py --run {args.run}`")
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    run_script(main)
