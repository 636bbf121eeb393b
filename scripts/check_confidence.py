"""How well `tfm serve`'s per-line score follows translation quality: its rank correlation with
sentence chrF on a test set.

    python scripts/check_confidence.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz

Translates the source with the default engine and the checkpoint's decode settings (as `tfm
serve` does), takes each line's score as the server answers it (the model's mean log-probability
per output token, `TranslationEngine.confidence`) and the search's own score (length-normalised as
the engine's length penalty does), and prints each one's Spearman rank correlation with the line's
chrF against its reference (sacreBLEU), and the Pearson correlation of exp(score), a 0–1 value, with
chrF / 100. No target: the figure is reported beside the score's definition (docs/translation.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402


def ranks(values):
    import numpy as np

    order = np.argsort(values, kind="stable")
    result = np.empty(len(values))
    result[order] = np.arange(len(values))
    return result


def spearman(a, b) -> float:
    import numpy as np

    return float(np.corrcoef(ranks(np.asarray(a)), ranks(np.asarray(b)))[0, 1])


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    args = parser.parse_args()
    import numpy as np
    from sacrebleu.metrics import CHRF

    from transformer_cli.decoding.engine import open_engine
    from transformer_cli.runtime.files import read_lines

    sources, refs = read_lines(args.src), read_lines(args.ref)
    engine = open_engine(None, [], [args.checkpoint], "cpu", scores=True)
    decode = engine.decode
    results = [t[0] for t in engine.translate(sources)]
    chrf = CHRF()
    quality = [chrf.sentence_score(t.text, [r]).score for t, r in zip(results, refs)]
    mean = [engine.confidence(t, decode) for t in results]
    kept = [i for i, m in enumerate(mean) if m is not None]
    mean_kept = [mean[i] for i in kept]
    quality_kept = [quality[i] for i in kept]
    print(f"{engine.describe()}, beam {decode.beam}, {len(kept)} of {len(sources)} lines scored")
    print(f"Spearman(mean log-probability per token, sentence chrF) = {spearman(mean_kept, quality_kept):.3f}")
    print(f"Spearman(search score, sentence chrF) = {spearman([results[i].score for i in kept], quality_kept):.3f}")
    pearson = float(np.corrcoef(np.exp(mean_kept), np.asarray(quality_kept) / 100)[0, 1])
    print(f"Pearson(exp(mean log-probability), chrF / 100) = {pearson:.3f}")


if __name__ == "__main__":
    run_script(main)
