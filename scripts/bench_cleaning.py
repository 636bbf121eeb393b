"""Corpus cleaning measured on injected noise: the labelled noisy corpus of scripts/make_noisy.py
through `tfm prepare`'s filters, and the filters' throughput.

    python scripts/bench_cleaning.py                              # Multi30k de-en + 50% noise
    python scripts/bench_cleaning.py --variants default lexical --noise 0.5 --seed 1

For each variant (`default`: data.filters as a new config has them; `lexical`: the defaults plus the
lexical filter for misaligned pairs; `model`: the defaults plus the model filter with the runs given
as `--forward` (de→en) and/or `--backward` (en→de), or without them the models `tfm prepare` trains
itself on the noisy corpus, `data.filters.model.train_updates` each; `--busy S`: with a CPU burner
on every core for their first S seconds) it runs `tfm prepare --dropped` on the noisy
corpus and prints, for each kind of noise, the share of those pairs dropped (target: at least 95% of
each kind; 80% of the misaligned pairs with the lexical filter on; with the model filter 95% of the
misaligned and 80% of the partly aligned pairs, and at most 1% of clean pairs) and the share of clean
pairs dropped (target: at most 2%). Of equal pairs one must be kept and the others dropped, whichever is labelled clean.
Then the filters' throughput on the same pairs, in one process (pairs/s): without language
identification, the defaults, and the defaults with the lexical filter.
"""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import read_lines, scratch_directory  # noqa: E402

TARGET_NOISE, TARGET_MISALIGNED, TARGET_CLEAN = 0.95, 0.80, 0.02
# The model filter's: misaligned and partly aligned pairs, at most 1% of clean ones.
MODEL_TARGETS = {"misaligned": 0.95, "partly_aligned": 0.80, "clean": 0.01}
# Pairs whose target translates the source and goes on: only the model filter is meant to see them
# (the lexical score averages over the words, most of which do translate); shown, not judged.
UNJUDGED = ("partly_aligned",)
VARIANTS = {"default": [], "lexical": ["data.filters.lexical.enabled=true"],
            "no-language": ["data.filters.language.enabled=false"], "model": ["data.filters.model.enabled=true"]}


def drop_rates(labels: list[str], src: list[str], tgt: list[str], dropped: list[dict]) -> dict[str, dict]:
    """Per label: pairs, dropped, share dropped and the reasons. Among equal pairs the drops count
    against the pairs labelled noise first: which copy of a duplicated pair comes first, and so is
    kept, is chance."""
    reason_of = {d["line"]: d["reason"] for d in dropped}
    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for line, pair in enumerate(zip(src, tgt), start=1):
        groups[pair].append(line)
    out: dict[str, dict] = {label: {"pairs": 0, "dropped": 0, "reasons": collections.Counter()}
                            for label in dict.fromkeys(labels)}
    for lines in groups.values():
        drops = [reason_of[line] for line in lines if line in reason_of]
        member_labels = sorted((labels[line - 1] for line in lines), key=lambda label: label == "clean")  # noise first
        for i, label in enumerate(member_labels):
            out[label]["pairs"] += 1
            if i < len(drops):
                out[label]["dropped"] += 1
                out[label]["reasons"][drops[i]] += 1
    for row in out.values():
        row["share"] = row["dropped"] / row["pairs"] if row["pairs"] else 0.0
    return out


def target_of(label: str, variant: str) -> tuple[str, bool]:
    """(target text, whether it is one this variant must meet)."""
    if variant == "model" and label in MODEL_TARGETS:
        return f"{'<=' if label == 'clean' else '>='} {MODEL_TARGETS[label]:.0%}", True
    if label == "clean":
        return f"<= {TARGET_CLEAN:.0%}", True
    if label == "misaligned":
        return f">= {TARGET_MISALIGNED:.0%} with lexical", variant == "lexical"
    if label in UNJUDGED:
        return "none yet", False
    return f">= {TARGET_NOISE:.0%}", True


def meets(label: str, share: float, variant: str = "default") -> bool:
    if variant == "model" and label in MODEL_TARGETS:
        return share <= MODEL_TARGETS[label] if label == "clean" else share >= MODEL_TARGETS[label]
    if label == "clean":
        return share <= TARGET_CLEAN
    return share >= (TARGET_MISALIGNED if label == "misaligned" else TARGET_NOISE)


def make_corpus(data: Path, out: Path, noise: float, seed: int) -> None:
    """The noisy corpus, written once per setting: written again (new file times), it would make the
    model filter's own models train again."""
    made = out / "made.json"
    wanted = json.dumps({"data": str(data.resolve()), "noise": noise, "seed": seed})
    if made.is_file() and made.read_text() == wanted:
        return
    made.unlink(missing_ok=True)  # a corpus half rewritten with other settings is no corpus of the old ones
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_noisy.py"), "--data", str(data), "--noise",
                    str(noise), "--seed", str(seed), "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    made.write_text(wanted)


@contextlib.contextmanager
def busy_for(seconds: float):
    """A burner process on every usable core for the first `seconds` of the block (none for 0); yields them."""
    from transformer_cli.runtime.cpu import usable_cores

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())
               if seconds > 0]
    stop = threading.Timer(seconds, lambda: [burner.kill() for burner in burners])
    stop.start()
    try:
        yield burners
    finally:
        stop.cancel()
        for burner in burners:
            burner.kill()
            burner.wait()


def run_variant(data: Path, noisy: Path, workdir: Path, variant: str, vocab_size: int,
                models: list[str], busy: float = 0.0, own_models: bool = True) -> tuple[dict, float]:
    """prepare with the variant's filters (`models`: the model filter's settings and --set's);
    returns (drop rates per label, seconds). `own_models`: no model named, the filter's own are
    trained first; `busy`: seconds of CPU burners as they start training."""
    from transformer_cli.data.prepare import prepare
    from transformer_cli.experiment.config import load_config

    sets = [f"run_dir={workdir / ('run-' + variant)}", f"data.train={noisy}/train", f"data.valid={data}/val",
            f"data.test={data}/test_2016_flickr", f"vocab.size={vocab_size}", *VARIANTS[variant],
            *(models if variant == "model" else [])]
    config = load_config(ROOT / "configs" / "de-en.yaml", sets)
    dropped_file = workdir / f"dropped-{variant}.jsonl"
    if variant == "model" and own_models:  # the filter's own models, as `tfm prepare` trains them
        from transformer_cli.training.filter_models import train_filter_models

        started = time.perf_counter()
        if busy:
            print(f"busy: a CPU burner on every core for the models' first {busy:g} s")
        with busy_for(busy):
            train_filter_models(config, progress=False)
        print(f"the model filter's own models: {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    prepare(config, force=True, progress=False, dropped=dropped_file)
    seconds = time.perf_counter() - started
    dropped = [json.loads(line) for line in dropped_file.read_text(encoding="utf-8").splitlines()]
    labels = (noisy / "train.labels").read_text().split()
    return drop_rates(labels, read_lines(noisy / "train.de.gz"), read_lines(noisy / "train.en.gz"), dropped), seconds


def throughput(noisy: Path, data: Path, forward: str | None, backward: str | None) -> list[tuple[str, float]]:
    """The filters' pairs/s on the noisy pairs in this process (no encoding): what each costs; the
    model filter's (its thresholds learned first, not timed) where its models are given."""
    from transformer_cli.data.cleaning import COMMON_WORDS_PAIRS
    from transformer_cli.data.filters import DirectionFilters
    from transformer_cli.data.lexical import learn_lexical_model
    from transformer_cli.data.model_filter import learn_model_filter
    from transformer_cli.experiment.config import FiltersConfig
    from transformer_cli.experiment.rundir import checkpoint_at

    src, tgt = read_lines(noisy / "train.de.gz"), read_lines(noisy / "train.en.gz")
    rows = []
    variants = [("no language id", False, False), ("default", True, False), ("default + lexical", True, True)]
    if forward or backward:
        variants.append(("default + model", True, False))
    for name, language, lexical in variants:
        settings = FiltersConfig(language={"enabled": language}, lexical={"enabled": lexical},
                                 model={"enabled": name == "default + model"})
        model = learn_lexical_model(src, tgt, settings.lexical.recall, 1) if lexical else None
        filters = DirectionFilters(settings, "de", "en", model)
        if settings.model.enabled:
            rule = FiltersConfig().model
            models = [(forward and checkpoint_at(forward), backward and checkpoint_at(backward))]
            filters.scorer, _ = learn_model_filter(rule, models, src[:rule.sample_pairs], tgt[:rule.sample_pairs], 1)
        if language:
            filters.learn_common_words(src[:COMMON_WORDS_PAIRS], tgt[:COMMON_WORDS_PAIRS])
        started = time.perf_counter()
        filters.reasons(src, tgt)
        rows.append((name, len(src) / (time.perf_counter() - started)))
    return rows


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="folder with Multi30k's train/val/test_2016_flickr .{de,en,fr,cs}.gz "
                        "(default: found or fetched by scripts/get_data.sh into the workdir)")
    parser.add_argument("--noise", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=["default", "lexical"], choices=sorted(VARIANTS))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tfm_bench_cleaning"))
    parser.add_argument("--forward", help="the model filter's forward model (a de→en run or checkpoint)")
    parser.add_argument("--backward", help="the model filter's backward model (an en→de run or checkpoint)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--busy", type=float, default=0.0, metavar="SECONDS",
                        help="a CPU burner on every core for the first SECONDS of the model filter's own models")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                        help="a config setting of the model variant, e.g. data.filters.model.train_time=5m")
    args = parser.parse_args()
    if not 0 <= args.busy < float("inf"):
        raise TfmError(f"--busy {args.busy}: expected seconds, 0 or more")
    models = [f"data.filters.model.{way}={path}" for way, path in (("forward", args.forward),
                                                                  ("backward", args.backward)) if path] + args.sets
    from bench_common import machine_line

    print(machine_line())
    scratch_directory(args.workdir, {"--data": [args.data]})
    data = args.data
    if data is None:
        data = args.workdir / "multi30k"
        subprocess.run(["bash", str(ROOT / "scripts" / "get_data.sh"), "multi30k", "--dest", str(data)], check=True,
                       stdout=subprocess.DEVNULL)
    if not (data / "train.de.gz").is_file():
        raise TfmError(f"--data {data}: no train.de.gz there")
    noisy = args.workdir / "noisy"
    make_corpus(data, noisy, args.noise, args.seed)
    for variant in args.variants:
        rates, seconds = run_variant(data, noisy, args.workdir, variant, args.vocab_size, models, args.busy,
                                     own_models=not (args.forward or args.backward))
        print(f"\nfilters: {variant} (tfm prepare {seconds:.1f} s)")
        print(f"{'pairs':<16}{'count':>8}{'dropped':>9}{'share':>8}  {'target':<20}{'met':<5} reasons")
        for label, row in rates.items():
            target, applies = target_of(label, variant)
            met = ("yes" if meets(label, row["share"], variant) else "NO") if applies else "-"
            reasons = ", ".join(f"{r} {n}" for r, n in row["reasons"].most_common(3))
            print(f"{label:<16}{row['pairs']:>8,}{row['dropped']:>9,}{row['share']:>8.1%}  {target:<20}{met:<5} {reasons}")
    if not args.no_throughput:
        print("\nfilters alone, one process (pairs/s):")
        for name, rate in throughput(noisy, data, args.forward, args.backward):
            print(f"  {name:<20}{rate:>10,.0f}")


if __name__ == "__main__":
    run_script(main)
