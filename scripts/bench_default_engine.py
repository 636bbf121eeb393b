"""`tfm translate` as a whole process against the shortest CTranslate2 script that does the same.

    python scripts/bench_default_engine.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz

Target: `tfm translate --checkpoint CKPT -i SRC -o OUT` (decode.engine auto, its CTranslate2
conversion already cached) takes at most 1/0.9 of the time of `scripts/ct2_reference.py` (load
CTranslate2 and sentencepiece, translate the file, write it) with the same model directory, beam,
length penalty, batch size and threads: ratio (reference seconds / tfm seconds) ≥ 0.9. Start to exit,
each run a fresh process; paired rounds in alternating order, the ratio the median of the per-round
ratios (this VM's speed drifts from minute to minute). Also prints how many lines the two outputs
share.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.interop.ct2_cache import cached_conversion  # noqa: E402
from transformer_cli.runtime.cpu import cpu_model_name  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True, help="source text (.gz read too)")
    parser.add_argument("--beam", type=int, help="default: the checkpoint's decode.beam")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-default-engine-"))
    source = work / "source.txt"
    opener = gzip.open if args.src.endswith(".gz") else open
    with opener(args.src, "rt", encoding="utf-8") as f:
        source.write_text(f.read(), encoding="utf-8")
    conversion = cached_conversion(args.checkpoint)  # converted once, as the first `tfm translate` would
    decode = json.loads((conversion.directory / "tfm_decode.json").read_text())["decode"]
    beam = args.beam or decode["beam"]
    tfm = [sys.executable, "-m", "transformer_cli.cli", "translate", "--checkpoint", args.checkpoint, "-i", str(source),
           "-o", str(work / "tfm.out"), "--beam", str(beam)]
    reference = [sys.executable, str(ROOT / "scripts" / "ct2_reference.py"), str(conversion.directory), str(source),
                 str(work / "reference.out"), "--beam", str(beam), "--batch-size", str(decode["batch_size"]),
                 "--length-penalty", str(decode["length_penalty"]), "--compute-type", "int8"]
    timed(tfm), timed(reference)  # untimed: files into the page cache
    seconds: dict[str, list[float]] = {"tfm": [], "reference": []}
    for round_ in range(args.rounds):
        order = ("tfm", "reference") if round_ % 2 == 0 else ("reference", "tfm")
        for name in order:
            seconds[name].append(timed(tfm if name == "tfm" else reference))
    ratios = [r / t for t, r in zip(seconds["tfm"], seconds["reference"])]
    lines = len(source.read_text(encoding="utf-8").splitlines())
    ours, theirs = ((work / f).read_text(encoding="utf-8").splitlines() for f in ("tfm.out", "reference.out"))
    print(f"{cpu_model_name()}; {lines} lines, beam {beam}, batch {decode['batch_size']}, CTranslate2 int8, "
          f"{args.rounds} paired rounds, start to exit")
    print("| process | median s | fastest s |\n|---|---|---|")
    for name, label in (("tfm", "tfm translate -i -o (auto, cached)"), ("reference", "scripts/ct2_reference.py")):
        print(f"| {label} | {statistics.median(seconds[name]):.2f} | {min(seconds[name]):.2f} |")
    print(f"reference / tfm: {statistics.median(ratios):.2f}x, median of {len(ratios)} rounds "
          f"({', '.join(f'{r:.2f}' for r in ratios)}), target ≥ 0.90x; "
          f"identical lines {sum(a == b for a, b in zip(ours, theirs))}/{lines}")


if __name__ == "__main__":
    run_script(main)
