"""Terminology on a real test set: positive constraints by the protocol of Post & Vilar (2018),
avoided terms, target prefixes and (with --glossary) a glossary, each through tfm's engine at
beam 5, against the same lines translated without them.

    python scripts/bench_constraints.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz \
        [--glossary glossary.tsv]

Prints, as markdown rows:
- constraints (1–2 reference phrases of 1–3 words per sentence, `tfm sample-constraints`, seeded):
  term-use rate of the constraints (target: 100%), BLEU and chrF with and without them (expected: a
  clear gain), and speed: constrained / unconstrained beam-5 sentences/s on the same batches
  (target ≥ 0.5x; the median of --rounds paired rounds, each running both in alternating order);
- avoided terms (the 20 words of 4 or more letters the plain translations use most, every line): occurrences left
  (target: 0), BLEU;
- prefixes (each reference's first two words): share of outputs starting with theirs (target: 100%);
- glossary: of the lines where a source term occurs, the share whose translation has its target term.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sacrebleu  # noqa: E402
from bench_common import machine_line  # noqa: E402

from transformer_cli.decoding.glossary import sample_constraints  # noqa: E402
from transformer_cli.decoding.terms import Glossary, LineTerms, split_constraints_line
from transformer_cli.decoding.torch_engine import Translator  # noqa: E402
from transformer_cli.decoding.translation import translate_texts  # noqa: E402
from transformer_cli.evaluate import term_use  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402


def scores(hyps: list[str], refs: list[str]) -> tuple[float, float]:
    return sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score


def timed(translator: Translator, src: list[str], beam: int, terms: list[LineTerms] | None) -> tuple[list[str], float]:
    started = time.perf_counter()
    hyps = translate_texts(translator, src, beam, terms)
    return hyps, len(src) / (time.perf_counter() - started)


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--glossary", help="source term<TAB>target term lines (tfm glossary)")
    parser.add_argument("--set", action="append", default=[], help="decode.KEY=VALUE overrides")
    args = parser.parse_args()

    src, refs = read_lines(args.src), read_lines(args.ref)
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu", overrides=args.set)
    print(machine_line(), f"— {translator.describe()}, beam {args.beam}, {len(src)} sentences")
    rows = [split_constraints_line(line, f"line {n}")[1]
            for n, line in enumerate(sample_constraints(src, refs, args.seed), start=1)]
    plain_rates, constrained_rates, ratios = [], [], []
    plain: list[str] = []
    constrained: list[str] = []
    for number in range(args.rounds):
        runs: list[list[LineTerms] | None] = [None, rows]
        for terms in runs if number % 2 == 0 else runs[::-1]:
            hyps, rate = timed(translator, src, args.beam, terms)
            if terms is None:
                plain = hyps
                plain_rates.append(rate)
            else:
                constrained = hyps
                constrained_rates.append(rate)
        ratios.append(constrained_rates[-1] / plain_rates[-1])
    use = term_use(constrained, rows)
    wanted, met = use["constraints"], use["met"]
    print("\n| run | terms | term use | BLEU | chrF | sentences/s |\n|---|---|---|---|---|---|")
    print(f"| beam {args.beam} | — | — | {scores(plain, refs)[0]:.2f} | {scores(plain, refs)[1]:.2f} | "
          f"{max(plain_rates):.1f} |")
    print(f"| + constraints (Post & Vilar sample, seed {args.seed}) | {wanted} | {met}/{wanted} = "
          f"{100 * met / wanted:.2f}% | {scores(constrained, refs)[0]:.2f} | {scores(constrained, refs)[1]:.2f} | "
          f"{max(constrained_rates):.1f} |")

    counts = collections.Counter(w.strip(".,") for h in plain for w in h.split())
    common = [w for w, _ in counts.most_common(100) if len(w) >= 4 and w.isalpha()][:20]
    avoid = [LineTerms(avoid=tuple(common))] * len(src)
    avoided, avoid_rate = timed(translator, src, args.beam, avoid)
    before, after = term_use(plain, avoid)["avoided_present"], term_use(avoided, avoid)["avoided_present"]
    print(f"| + avoid the {len(common)} most used words of 4+ letters ({', '.join(common[:6])}, …) | {before} in the plain output | "
          f"{after} left | {scores(avoided, refs)[0]:.2f} | {scores(avoided, refs)[1]:.2f} | {avoid_rate:.1f} |")

    prefixes = [LineTerms(prefix=" ".join(r.split()[:2])) for r in refs]
    prefixed, prefix_rate = timed(translator, src, args.beam, prefixes)
    starts = sum(h.startswith(t.prefix) for h, t in zip(prefixed, prefixes))
    print(f"| + prefix (the reference's first 2 words) | {len(src)} | {starts}/{len(src)} start with it | "
          f"{scores(prefixed, refs)[0]:.2f} | {scores(prefixed, refs)[1]:.2f} | {prefix_rate:.1f} |")

    if args.glossary:
        glossary = Glossary.read(Path(args.glossary))
        terms = [glossary.apply(s, LineTerms()) for s in src]
        fired = [i for i, t in enumerate(terms) if t.glossary]
        used, gloss_rate = timed(translator, src, args.beam, terms)
        entries = sum(len(terms[i].glossary) for i in fired)
        hit = term_use([used[i] for i in fired], [terms[i] for i in fired])["met"]
        plain_hit = term_use([plain[i] for i in fired], [terms[i] for i in fired])["met"]
        print(f"| + glossary ({len(glossary.entries)} entries; fired {entries} times on {len(fired)} lines) | "
              f"{entries} | {hit}/{entries} = {100 * hit / max(entries, 1):.2f}% (plain: {plain_hit}) | "
              f"{scores(used, refs)[0]:.2f} | {scores(used, refs)[1]:.2f} | {gloss_rate:.1f} |")

    print(f"\nconstrained / unconstrained beam {args.beam}: {statistics.median(ratios):.2f}x, median of "
          f"{len(ratios)} rounds ({', '.join(f'{r:.2f}' for r in ratios)}), target ≥ 0.5x")
    translator.close()


if __name__ == "__main__":
    run_script(main)
