"""A noisy parallel corpus with labels, for measuring corpus cleaning: the clean training pairs of a
corpus plus noise in the kinds a raw web crawl has, each noisy pair labelled with its kind.

    python scripts/make_noisy.py --data data/multi30k --src de --tgt en -o data/noisy-multi30k

reads `<data>/train.<src>.gz` and `train.<tgt>.gz` (and, for wrong-language lines, the other
languages' `train.*.gz` beside them, e.g. Multi30k's fr and cs) and writes `<out>/train.<src>.gz`,
`train.<tgt>.gz` and `train.labels` (one label a line: clean, or the kind of noise). `--noise 0.5`
adds half as many noisy pairs as there are clean ones, in equal shares of the kinds:

- misaligned: a source and the target of another pair;
- partly_aligned: a pair whose target goes on with another pair's target (a sentence split that
  failed on one side, merged segments);
- wrong_language: one side replaced by another language's line (a swapped or mislabelled file);
- copy: the target is the source, untranslated (or the source the target);
- fragment: a word or two of each side (menus, buttons, broken segmentation);
- duplicate: a clean pair again;
- overlong: several pairs joined into one line on each side (a failed sentence split);
- garbage: markup, URLs, numbers and symbols on both sides.

The pairs are shuffled; everything is seeded (`--seed`). The input files are never written:
`-o` must be another directory.
"""

from __future__ import annotations

import gzip
import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import atomic_write_bytes, check_output, read_lines  # noqa: E402

KINDS = ("misaligned", "partly_aligned", "wrong_language", "copy", "fragment", "duplicate", "overlong", "garbage")


def garbage_line(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 12)):
        parts.append(rng.choice([
            f"<div class=\"{''.join(rng.choices(string.ascii_lowercase, k=5))}\">",
            f"https://www.{''.join(rng.choices(string.ascii_lowercase, k=8))}.com/{rng.randint(0, 99999)}",
            str(rng.randint(0, 10**9)), "&nbsp;", "|", "»", "###", "© 2019", "{{ item.title }}",
            "".join(rng.choices(string.punctuation, k=rng.randint(2, 8))),
        ]))
    return " ".join(parts)


def noisy_pair(kind: str, clean: list[tuple[str, str]], others: list[list[str]], rng: random.Random) -> tuple[str, str]:
    """One noisy pair of `kind`, made from the clean pairs (and other languages' lines)."""
    i = rng.randrange(len(clean))
    src, tgt = clean[i]
    if kind == "misaligned":
        j = rng.randrange(len(clean) - 1)
        return src, clean[j + (j >= i)][1]
    if kind == "partly_aligned":
        j = rng.randrange(len(clean) - 1)
        return src, f"{tgt} {clean[j + (j >= i)][1]}"
    if kind == "wrong_language":
        line = rng.choice(rng.choice(others))
        return (line, tgt) if rng.random() < 0.5 else (src, line)
    if kind == "copy":
        return (src, src) if rng.random() < 0.5 else (tgt, tgt)
    if kind == "fragment":
        return " ".join(src.split()[: rng.randint(1, 2)]), " ".join(tgt.split()[: rng.randint(1, 2)])
    if kind == "duplicate":
        return src, tgt
    if kind == "overlong":
        joined = [clean[rng.randrange(len(clean))] for _ in range(rng.randint(6, 12))]
        return " ".join(s for s, _ in joined), " ".join(t for _, t in joined)
    if kind == "garbage":
        return garbage_line(rng), garbage_line(rng)
    raise ValueError(kind)


def make_noisy(sources: list[str], targets: list[str], others: list[list[str]], noise: float,
               seed: int) -> list[tuple[str, str, str]]:
    """(source, target, label) for every clean pair and round(noise · pairs) noisy ones, shuffled."""
    rng = random.Random(seed)
    clean = list(zip(sources, targets))
    count = round(noise * len(clean))
    kinds = [KINDS[n % len(KINDS)] for n in range(count)]  # equal shares
    if not others:
        kinds = [k if k != "wrong_language" else "misaligned" for k in kinds]
    rows = [(s, t, "clean") for s, t in clean]
    rows += [(*noisy_pair(kind, clean, others, rng), kind) for kind in kinds]
    rng.shuffle(rows)
    return rows


def write_gzip(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, type=Path, help="folder with train.<lang>.gz files")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--noise", type=float, default=0.5, help="noisy pairs per clean pair (0 to 10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("-o", "--output", required=True, type=Path, help="folder to write (not --data)")
    args = parser.parse_args()
    if not 0 <= args.noise <= 10:
        raise TfmError(f"--noise {args.noise}: give 0 to 10 noisy pairs per clean pair")
    files = {lang: args.data / f"train.{lang}.gz" for lang in (args.src, args.tgt)}
    written = [files[args.src].name, files[args.tgt].name, "train.labels"]
    check_output(args.output, {"--data": [args.data, *files.values()]}, directory=True, names=written,
                 ours=lambda folder: (folder / "train.labels").is_file())  # an earlier noisy corpus: replaced
    sources, targets = read_lines(files[args.src]), read_lines(files[args.tgt])
    if len(sources) != len(targets) or not sources:
        raise TfmError(f"{files[args.src]} and {files[args.tgt]}: {len(sources)} and {len(targets)} lines; "
                       "give two non-empty parallel files")
    others = [read_lines(path) for path in sorted(args.data.glob("train.*.gz"))
              if path not in files.values() and path.name.count(".") == 2]
    rows = make_noisy(sources, targets, others, args.noise, args.seed)
    args.output.mkdir(parents=True, exist_ok=True)
    write_gzip(args.output / f"train.{args.src}.gz", [s for s, _, _ in rows])
    write_gzip(args.output / f"train.{args.tgt}.gz", [t for _, t, _ in rows])
    atomic_write_bytes(args.output / "train.labels", ("\n".join(label for _, _, label in rows) + "\n").encode())
    noisy = sum(label != "clean" for _, _, label in rows)
    print(f"{len(rows)} pairs ({len(sources)} clean, {noisy} noisy: {', '.join(KINDS)}) → {args.output}")


if __name__ == "__main__":
    run_script(main)
