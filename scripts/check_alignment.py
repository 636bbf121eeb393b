"""How well `tfm translate --alignment` aligns, per decoder layer, against a statistical aligner.

    pip install eflomal
    python scripts/check_alignment.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --train data/multi30k/train --test data/multi30k/test_2016_flickr --src-lang de --tgt-lang en

No gold word alignment for this language pair ships in a registry package, so the reference is
eflomal (Östling & Tiedemann, 2016; on PyPI), trained on the training corpus plus the test source
beside tfm's own translations: its forward ∩ reverse links are the sure links S, forward ∪
reverse the possible links P. Printed for the default (attention averaged over decoder layers) and
for each decoder layer alone: alignment error rate
AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|) (Och & Ney, 2003), precision against P and recall of S;
and, for scale, the same for a diagonal baseline (target word j ↔ source word j·m/n). Lowercased,
whitespace words, as tfm prints them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import machine_line  # noqa: E402

from transformer_cli.decoding.torch_engine import Translator  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402

Links = set[tuple[int, int]]


def parse(alignment: str) -> Links:
    return {tuple(map(int, pair.split("-"))) for pair in alignment.split()}


def eflomal_links(src: list[str], tgt: list[str], test: int) -> tuple[list[Links], list[Links]]:
    """Sure (forward ∩ reverse) and possible (∪) links of the last `test` sentence pairs."""
    import eflomal

    with tempfile.TemporaryDirectory() as folder:
        forward, reverse = Path(folder) / "fwd", Path(folder) / "rev"
        eflomal.Aligner().align([s.lower() for s in src], [t.lower() for t in tgt],
                                links_filename_fwd=str(forward), links_filename_rev=str(reverse))
        fwd = [parse(line) for line in forward.read_text().splitlines()][-test:]
        rev = [parse(line) for line in reverse.read_text().splitlines()][-test:]
    return [f & r for f, r in zip(fwd, rev)], [f | r for f, r in zip(fwd, rev)]


def scores(found: list[Links], sure: list[Links], possible: list[Links]) -> str:
    a = sum(len(x) for x in found)
    a_s = sum(len(x & s) for x, s in zip(found, sure))
    a_p = sum(len(x & p) for x, p in zip(found, possible))
    s = sum(len(x) for x in sure)
    return f"AER {100 * (1 - (a_s + a_p) / (a + s)):.1f} | precision {100 * a_p / a:.1f} | recall {100 * a_s / s:.1f}"


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--train", required=True, help="Training corpus prefix (<prefix>.<lang>[.gz]).")
    parser.add_argument("--test", required=True, help="Test corpus prefix: its source is translated.")
    parser.add_argument("--src-lang", default="de")
    parser.add_argument("--tgt-lang", default="en")
    parser.add_argument("--beam", type=int, default=1)
    args = parser.parse_args()
    print(machine_line())

    def lines(prefix: str, lang: str) -> list[str]:
        path = Path(f"{prefix}.{lang}.gz")
        return read_lines(path if path.exists() else Path(f"{prefix}.{lang}"))

    source = lines(args.test, args.src_lang)
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu")
    layers = translator.model.cfg.dec_layers
    results = {}
    for layer in [None, *range(1, layers + 1)]:  # None: the mean over layers (the default)
        translator.decode = translator.decode.model_copy(update={"alignment": True, "alignment_layer": layer})
        results[layer] = translator.translate(source, decode=translator.settings(beam=args.beam))
    translations = [t[0].text for t in results[None]]
    keep = [i for i, t in enumerate(translations) if source[i].strip() and t.strip()]
    sure, possible = eflomal_links(lines(args.train, args.src_lang) + [source[i] for i in keep],
                                   lines(args.train, args.tgt_lang) + [translations[i] for i in keep], len(keep))
    print(f"{len(keep)} sentences of {args.test}, beam {args.beam}; reference: eflomal on "
          f"{args.train} + these pairs (|S| = {sum(map(len, sure))}, |P| = {sum(map(len, possible))} links)")
    for layer in [None, *range(1, layers + 1)]:
        found = [parse(results[layer][i][0].alignment) for i in keep]
        name = "mean of all decoder layers (default)" if layer is None else f"decoder layer {layer}"
        print(f"| {name} | {scores(found, sure, possible)} |")
    diagonal = []
    for i in keep:
        m, n = len(source[i].split()), len(translations[i].split())
        diagonal.append({(min(m - 1, round(j * m / n)), j) for j in range(n)})
    print(f"| diagonal baseline | {scores(diagonal, sure, possible)} |")


if __name__ == "__main__":
    run_script(main)
