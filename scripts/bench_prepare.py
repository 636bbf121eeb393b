"""Benchmark `tfm prepare` on a synthetic corpus of N million pairs: throughput and peak memory.

The corpus is Multi30k de-en (found by scripts/get_data.sh) repeated with each line's word
order shuffled, so the vocabulary and line lengths are realistic but lines are not copies.
`tfm prepare` runs as a subprocess; its memory is sampled from /proc every 0.1 s as the sum of
the RSS of the whole process tree (main process + encoding workers), and the largest single
process's peak comes from getrusage(RUSAGE_CHILDREN).

    python scripts/bench_prepare.py --millions 1 5 10            # workers = all cores
    python scripts/bench_prepare.py --millions 1 --workers 1 2   # speed-up of 2 workers over 1
    python scripts/bench_prepare.py --millions 10 --filters off default   # the cost of cleaning

`--filters`: `default` (data.filters as a new config has them), `off` (every filter of data.filters
off: only empty, too-long and bad-ratio pairs dropped, as before cleaning existed), `no-language`
(the defaults without language identification), `lexical` (the defaults plus the lexical filter),
`model` (the defaults plus the model filter, scoring with a forward and a backward model of
configs/tiny.yaml's shape trained on Multi30k for 100 steps, once, in the work directory: what
is measured is the filter's streaming and cost per model pass, not a good model's drops; it scores
through CTranslate2 as `engine: auto` does), `model-torch` (the same scored by tfm's engine).
Targets: the default filters take at most 2x the time of `off` on 10M pairs; memory is flat in the
corpus: the process tree's peak grows by under 25% from the first size to the last
(`--millions 0.1 1 --filters default`, the flat-memory check; `--filters model` for the model
filter's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import tree_rss  # noqa: E402

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import scratch_directory  # noqa: E402


def make_corpus(folder: Path, pairs: int, seed: int = 0) -> Path:
    """`folder/train.{de,en}` with `pairs` lines (plus Multi30k's real val/test), built once."""
    prefix = folder / "train"
    if (folder / "done").is_file() and int((folder / "done").read_text()) == pairs:
        return prefix
    multi30k = folder / "multi30k"
    subprocess.run(["bash", str(ROOT / "scripts" / "get_data.sh"), "multi30k", "--dest", str(multi30k)], check=True)
    base = {lang: gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8").read().splitlines()
            for lang in ("de", "en")}
    rng = random.Random(seed)
    with open(f"{prefix}.de", "w", encoding="utf-8") as de, open(f"{prefix}.en", "w", encoding="utf-8") as en:
        for i in range(pairs):
            j = i % len(base["de"])
            for lang, out in (("de", de), ("en", en)):
                words = base[lang][j].split()
                if i >= len(base["de"]):  # the first copy is the real corpus, later ones shuffled
                    rng.shuffle(words)
                out.write(" ".join(words) + "\n")
    (folder / "done").write_text(str(pairs))
    return prefix


FILTER_KEYS = ("text", "length", "copies", "characters", "repeats", "numbers", "language", "lexical", "duplicates")
FILTER_SETS = {
    "default": [],
    "off": [f"data.filters.{key}.enabled=false" for key in FILTER_KEYS],
    "no-language": ["data.filters.language.enabled=false"],
    "lexical": ["data.filters.lexical.enabled=true"],
    "model": ["data.filters.model.enabled=true"],  # + the scoring models, filter_model_sets()
    "model-torch": ["data.filters.model.enabled=true", "data.filters.model.engine=torch"],
}


def failed(command: str, stderr: str) -> TfmError:
    """A failed `tfm` command as the benchmark's one-line error: its own error line."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")] or stderr.strip().splitlines()[-1:]
    return TfmError(f"tfm {command} failed: {errors[-1].removeprefix('error: ') if errors else 'no message'}")


def tfm(*args: str) -> None:
    """A `tfm` command in a subprocess; its failure ends the benchmark with its error."""
    proc = subprocess.run([sys.executable, "-m", "transformer_cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise failed(args[0], proc.stderr)


def filter_model_sets(workdir: Path, multi30k: Path) -> list[str]:
    """The --set lines naming a forward (de→en) and a backward (en→de) scoring model: tiny models
    trained on Multi30k once (kept in `workdir`; a model's size, not its quality, sets the cost)."""
    sets = []
    for key, (src, tgt) in (("forward", ("de", "en")), ("backward", ("en", "de"))):
        run = workdir / "filter_models" / f"{src}-{tgt}"
        config = ["--config", str(ROOT / "configs" / "tiny.yaml"), f"--set=run_dir={run}",
                  f"--set=data.src_lang={src}", f"--set=data.tgt_lang={tgt}", f"--set=data.train={multi30k}/train",
                  f"--set=data.valid={multi30k}/val", f"--set=data.test={multi30k}/test_2016_flickr"]
        if (run / "checkpoints" / "checkpoint_last.pt").is_file():
            tfm("train", *config, "--resume")  # a run killed part-way finishes; a finished one does nothing
        else:
            tfm("prepare", *config, "--force")
            tfm("train", *config)
        sets.append(f"data.filters.model.{key}={run}")
    return sets


def run_prepare(prefix: Path, run_dir: Path, workers: int | None, multi30k: Path, filters: str = "default",
                extra: tuple[str, ...] = ()) -> dict:
    sets = [f"run_dir={run_dir}", f"data.train={prefix}", f"data.valid={multi30k}/val",
            f"data.test={multi30k}/test_2016_flickr", "vocab.size=8000", *FILTER_SETS[filters], *extra]
    if filters.startswith("model"):
        sets += filter_model_sets(run_dir.parent, multi30k)
    if workers is not None:
        sets.append(f"prepare.workers={workers}")
    cmd = [sys.executable, "-m", "transformer_cli", "prepare", "--config", str(ROOT / "configs" / "de-en.yaml"),
           "--force", *[f"--set={s}" for s in sets]]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise failed("prepare", err)
    manifest = json.loads((run_dir / "prepare.json").read_text())
    return {"seconds": seconds, "peak_tree_rss": peak, "pairs": manifest["train_pairs_read"], "filters": filters,
            "kept": manifest["stats"]["train"]["src"]["lines"],
            "workers": manifest["workers"], "encode_seconds": manifest["seconds"] - manifest["seconds_vocab"],
            "vocab_seconds": manifest["seconds_vocab"]}


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--millions", type=float, nargs="+", default=[1, 5, 10])
    parser.add_argument("--workers", type=int, nargs="+", default=[None])
    parser.add_argument("--filters", nargs="+", default=["default"], choices=sorted(FILTER_SETS))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tfm_bench_prepare")
    args = parser.parse_args()
    from bench_common import machine_line

    print(machine_line())
    scratch_directory(args.workdir)
    print(f"{'pairs':>11} {'filters':>11} {'workers':>7} {'seconds':>8} {'pairs/s':>9} {'vocab s':>8} "
          f"{'encode pairs/s':>15} {'kept':>11} {'peak RSS (tree)':>16} {'max single proc':>16}", flush=True)
    results = []
    for millions in args.millions:
        pairs = int(millions * 1_000_000)
        folder = args.workdir / f"corpus_{pairs}"
        folder.mkdir(exist_ok=True)
        prefix = make_corpus(folder, pairs)
        for workers in args.workers:
            for filters in args.filters:
                r = run_prepare(prefix, args.workdir / "run", workers, folder / "multi30k", filters)
                single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # max so far
                results.append(r)
                print(f"{r['pairs']:>11,} {filters:>11} {r['workers']:>7} {r['seconds']:>8.1f} "
                      f"{r['pairs'] / r['seconds']:>9,.0f} {r['vocab_seconds']:>8.1f} "
                      f"{r['pairs'] / r['encode_seconds']:>15,.0f} {r['kept']:>11,} "
                      f"{r['peak_tree_rss'] / 2**30:>13.2f} GB {single / 2**30:>13.2f} GB", flush=True)
            off = [r for r in results if r["pairs"] == pairs and r["workers"] == results[-1]["workers"]
                   and r["filters"] == "off"]
            for r in results:
                if off and r["pairs"] == pairs and r["filters"] != "off" and r["workers"] == off[0]["workers"]:
                    print(f"{pairs:,} pairs: filters {r['filters']} / off: {r['seconds'] / off[0]['seconds']:.2f}x "
                          f"the time (target for default: <= 2x)", flush=True)
    by_workers = {r["workers"]: r for r in results if r["pairs"] == results[0]["pairs"] and r["filters"] == args.filters[0]}
    if 1 in by_workers and len(by_workers) > 1:
        for w, r in sorted(by_workers.items()):
            if w > 1:
                ratio = by_workers[1]["seconds"] / r["seconds"]
                encode = by_workers[1]["encode_seconds"] / r["encode_seconds"]
                print(f"throughput {w} workers / 1 worker: {ratio:.2f}x overall, {encode:.2f}x encoding")
    sizes = sorted({r["pairs"] for r in results})
    for filters in args.filters if len(sizes) > 1 else ():
        first, last = (next(r for r in results if r["pairs"] == n and r["filters"] == filters) for n in (sizes[0], sizes[-1]))
        growth = last["peak_tree_rss"] / first["peak_tree_rss"] - 1
        print(f"peak RSS growth, filters {filters}, {first['pairs']:,} → {last['pairs']:,} pairs: {100 * growth:+.1f}% "
              f"(target: under +25%: memory does not grow with the corpus)")
        if filters != "default" and "default" in args.filters:  # what the filter itself adds, at each size
            added = [r["peak_tree_rss"] - next(d["peak_tree_rss"] for d in results if d["pairs"] == r["pairs"]
                                               and d["filters"] == "default") for r in (first, last)]
            print(f"  its peak above the default filters': {added[0] / 2**30:.2f} GB at {first['pairs']:,} pairs, "
                  f"{added[1] / 2**30:.2f} GB at {last['pairs']:,} (target: no more at the larger size)")

if __name__ == "__main__":
    run_script(main)
