"""A distilled student against its teacher: BLEU, size on disk and decoding speed, each model with
its shipped settings and at equal settings, on one core and on all cores.

    python scripts/bench_distill.py --teacher runs/de-en/checkpoints/checkpoint_avg.pt \
        --student runs/student-tiny/checkpoints/checkpoint_avg.pt \
        --baseline runs/student-tiny-refs/checkpoints/checkpoint_avg.pt \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz

Targets: the student keeps ≥ 97% of the teacher's BLEU, decodes ≥ 5x faster (sentences/s and
words/s, shipped settings: teacher beam 5, student as its config decodes), is ≤ 1/4 of the teacher's
size on disk (student int8 against the teacher's float32 export; the teacher's int8 export is
printed too), and scores ≥ 1.0 BLEU above `--baseline` (the same student trained on the original
references for the same time). Each model is exported (`tfm export`, the student with
`--quantization int8` and its run's shortlist if it has one) and translated by `tfm translate
--model DIR` as a user would, `--repeats` times, the median decoding time taken from its own report
(start-up excluded), on the source `--times` times over; one core = `taskset -c 0` and `--workers
1`, all cores = `--workers auto`. Peak memory: the most the command's processes (it and its decoding
workers) held resident at once, sampled every 50 ms, the largest of the repeats.
words/s counts the source's words (whitespace-separated), as Bergamot's figures do.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import tree_rss  # noqa: E402

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

TFM = [sys.executable, "-m", "transformer_cli.cli"]
REPORT = re.compile(r"translated (\d+) sentences in ([\d.]+)s")


def export(checkpoint: Path, out: Path, quantization: str) -> Path:
    run = subprocess.run([*TFM, "export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantization",
                          quantization], capture_output=True, text=True)
    if run.returncode != 0:
        raise TfmError(f"tfm export {checkpoint}: {run.stderr.strip()}")
    return out


def translate(model: Path, src: Path, out: Path, beam: int, cores: str, shortlist: bool) -> tuple[float, int]:
    """Seconds `tfm translate` reports decoding took, and the peak resident bytes of its processes."""
    command = [*TFM, "translate", "--model", str(model), "-i", str(src), "-o", str(out), "--beam", str(beam),
               "--set", f"decode.shortlist={str(shortlist).lower()}"]
    if cores == "1":
        command = ["taskset", "-c", "0", *command, "--workers", "1"]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True,
                                   env={**os.environ, **({"OMP_NUM_THREADS": "1"} if cores == "1" else {})})
        peak = 0
        while process.poll() is None:
            peak = max(peak, tree_rss(process.pid))
            time.sleep(0.05)
        log.seek(0)
        stderr = log.read()
    found = REPORT.search(stderr)
    if process.returncode != 0 or not found:
        raise TfmError(f"tfm translate --model {model}: {stderr.strip()[-300:]}")
    return max(float(found.group(2)), 0.05), peak  # tenths of a second: 0.0 means under 0.05 s (raise --times)


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, help="The student's shape trained on the original references.")
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--teacher-beam", type=int, default=5)
    parser.add_argument("--student-beam", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--times", type=int, default=5, help="The source translated this many times over in each "
                        "timed run (tfm reports tenths of a second: 1,000 lines of a fast model take a few); BLEU "
                        "is scored on the first copy.")
    args = parser.parse_args()
    import sacrebleu

    from transformer_cli.runtime.files import read_lines

    refs = read_lines(args.ref)
    words = sum(len(line.split()) for line in read_lines(args.src))
    tmp = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    try:
        src = tmp / "src.txt"
        src.write_text("\n".join(read_lines(args.src) * args.times) + "\n", encoding="utf-8")
        models = {"teacher": export(args.teacher, tmp / "teacher", "float32"),
                  "teacher-int8": export(args.teacher, tmp / "teacher-int8", "int8"),
                  "student": export(args.student, tmp / "student", "int8")}
        if args.baseline:
            models["baseline"] = export(args.baseline, tmp / "baseline", "int8")
        sizes = {name: (d / "model.bin").stat().st_size for name, d in models.items()}
        has_shortlist = (models["student"] / "vmap.txt").is_file()
        arms = [("teacher", "teacher", args.teacher_beam, False), ("student", "student", args.student_beam, False),
                ("student at the teacher's beam", "student", args.teacher_beam, False),
                ("teacher at the student's beam", "teacher", args.student_beam, False)]
        if has_shortlist:
            arms.append(("student + shortlist", "student", args.student_beam, True))
        if args.baseline:
            arms.append(("baseline (references)", "baseline", args.student_beam, False))
        print(f"{'model':<32} {'beam':>4} {'BLEU':>6} {'1 core s/s':>10} {'words/s':>8} {'2 cores s/s':>11} "
              f"{'words/s':>8} {'peak MB 1 core':>14} {'2 cores':>8}")
        results = {}
        for label, model, beam, shortlist in arms:
            out = tmp / f"{label}.txt"
            speeds, peaks = {}, {}
            for cores in ("1", "all"):
                runs = [translate(models[model], src, out, beam, cores, shortlist) for _ in range(args.repeats)]
                speeds[cores] = len(refs) * args.times / statistics.median(seconds for seconds, _ in runs)
                peaks[cores] = max(peak for _, peak in runs) / 1e6
            bleu = sacrebleu.corpus_bleu(read_lines(out)[:len(refs)], [refs]).score
            results[label] = (bleu, speeds)
            print(f"{label:<32} {beam:>4} {bleu:>6.2f} {speeds['1']:>10.1f} {speeds['1'] * words / len(refs):>8.0f} "
                  f"{speeds['all']:>11.1f} {speeds['all'] * words / len(refs):>8.0f} {peaks['1']:>14.0f} "
                  f"{peaks['all']:>8.0f}", flush=True)
        # The shipped pairing: the student with its shortlist where its run has one (its config decodes so).
        shipped_label = "student + shortlist" if has_shortlist else "student"
        teacher, student, shipped = results["teacher"], results["student"], results[shipped_label]
        print(f"\n{shipped_label} keeps {100 * shipped[0] / teacher[0]:.1f}% of the teacher's BLEU (target ≥ 97%)")
        for cores in ("1", "all"):
            print(f"speed-up ({'one core' if cores == '1' else 'all cores'}), shipped settings ({shipped_label}): "
                  f"{shipped[1][cores] / teacher[1][cores]:.1f}x; equal beam {args.teacher_beam}: "
                  f"{results['student at the teacher' + chr(39) + 's beam'][1][cores] / teacher[1][cores]:.1f}x; "
                  f"equal beam {args.student_beam}: "
                  f"{student[1][cores] / results['teacher at the student' + chr(39) + 's beam'][1][cores]:.1f}x "
                  "(target ≥ 5x shipped)")
        print(f"size: student int8 {sizes['student'] / 1e6:.1f} MB = {sizes['student'] / sizes['teacher']:.2f} of the "
              f"teacher's float32 {sizes['teacher'] / 1e6:.1f} MB (target ≤ 0.25), "
              f"{sizes['student'] / sizes['teacher-int8']:.2f} of its int8 {sizes['teacher-int8'] / 1e6:.1f} MB")
        if args.baseline:
            print(f"distillation gain: {student[0] - results['baseline (references)'][0]:+.2f} BLEU (target ≥ +1.0)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run_script(main)
