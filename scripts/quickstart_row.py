"""The README's main job measured on this machine, as one row of docs/performance.md's quickstart
table: run `scripts/quickstart.sh` into a new run directory, then print the CPU (its name and
whether it has bf16 instructions), the date, the shape trained (and what `model.size auto` measured
to choose it), the steps made, the best valid BLEU and test2016 beam-5 BLEU / chrF.

    python scripts/quickstart_row.py                          # 10 minutes, model.size auto
    python scripts/quickstart_row.py --time 30m               # the 30-minute budget
    python scripts/quickstart_row.py --size d256              # a pinned shape, for comparison
    python scripts/quickstart_row.py --read runs/quickstart   # the row of a finished run, no training (its
                                                              # conditions as recorded when this script made it)
    python scripts/quickstart_row.py --isa-cap avx512         # as on a CPU of a lower class (below)
    python scripts/quickstart_row.py --busy 90                # other work on every core for its first 90 s

`--isa-cap` stands in for a CPU class that is not at hand: every library's kernels are capped to an
instruction set (torch's ATen, oneDNN, MKL, FBGEMM, CTranslate2), so training and decoding run as on
a CPU with AVX-512 but no bf16 (`avx512`: Intel Skylake / Cascade Lake) or with AVX2 only (`avx2`:
Zen 3, Haswell…), and `precision: auto` measures bf16 as such a CPU runs it. The row names the cap.
The caches, clocks and cores stay this CPU's: a capped Zen 4 is not a Skylake Xeon.

`--busy SECONDS` is a machine that is not idle when the run starts: one process per usable core
spins for the first SECONDS of the quickstart (its data copy, prepare, the shape probe and the first
minute of training), then stops. The row names it.

No figure is typed by hand: each is read from the run (shape_choice.json, metrics.jsonl, the
translations the quickstart wrote) or from the machine (/proc/cpuinfo).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.experiment.rundir import RunDirectory, ShapeChoice  # noqa: E402
from transformer_cli.runtime.cpu import cpu_flags, cpu_model_name, usable_cores  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import atomic_write_text, check_output, read_json_object  # noqa: E402

BF16_FLAGS = ("avx512_bf16", "amx_bf16")

# The environment that caps every library tfm uses to one instruction set (--isa-cap).
ISA_CAPS = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512", "CT2_FORCE_CPU_ISA": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2"},
}
ISA_FLAG = {"avx512": "avx512f", "avx2": "avx2"}  # the /proc/cpuinfo flag a CPU needs for each cap


def cpu() -> tuple[str, str]:
    """The CPU's model name and its bf16-relevant instruction sets ("avx2" … "amx_bf16")."""
    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", *BF16_FLAGS) if f in flags]
    return cpu_model_name(), " ".join(shown) or "no AVX2"


def read_row(run: Path, command: str, isa_cap: str | None = None) -> str:
    """The table row of a finished quickstart run."""
    from sacrebleu.metrics import BLEU, CHRF

    metrics_file, hyp, ref = run / "metrics.jsonl", run / "test_2016_flickr.hyp.en", run / "test_2016_flickr.ref.en"
    for needed in (metrics_file, hyp, ref, run / "config.yaml"):
        if not needed.is_file():
            raise TfmError(f"{needed} not found: {run} is not a finished quickstart run")
    records = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a torn line (a kill during an append), or a blank one: readers skip it
    records = [r for r in records if isinstance(r, dict)]
    valid = [r for r in records if r.get("kind") == "valid" and "bleu" in r]
    steps = max((r.get("step", 0) for r in records), default=0)
    best = max(valid, key=lambda r: r["bleu"]) if valid else None
    hyps, refs = hyp.read_text(encoding="utf-8").splitlines(), ref.read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(refs):
        raise TfmError(f"{hyp}: {len(hyps)} lines, but {ref} has {len(refs)}")
    bleu, chrf = BLEU().corpus_score(hyps, [refs]).score, CHRF().corpus_score(hyps, [refs]).score
    import yaml

    try:
        trained = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        trained["model"], trained["train"]["max_tokens"]  # noqa: B018 (what the row reads)
    except (yaml.YAMLError, TypeError, KeyError):
        raise TfmError(f"{run / 'config.yaml'}: torn or not a run's config") from None
    model, batch, lr = trained.get("model", {}), trained.get("train", {}).get("max_tokens"), trained.get("train", {}).get("lr")
    shape = f"{model.get('size') or 'pinned'} (d_model {model.get('d_model')}, {model.get('enc_layers')}+" \
            f"{model.get('dec_layers')}, FFN {model.get('d_ff')}), {batch:,}-token batches, peak lr {lr:g}"
    choice = RunDirectory(run).shape_choice(strict=True)
    if choice is not None:
        first = choice
        if choice.replanned and choice.replanned.get("first"):
            first = ShapeChoice.from_json(choice.replanned["first"])
        shape += f"; auto: {len(first.shapes)} shapes timed in {first.probe_seconds:.0f} s"
        if first.busy >= 0.2:
            shape += f" on a busy machine (other work {first.busy:.0%})"
        predicted = [s.get("updates") for s in choice.shapes if s.get("name") == choice.chosen]
        shape += f", predicted {predicted[0]:,} updates" if predicted and isinstance(predicted[0], int) else ""
        if choice.replanned:
            shape += (f"; re-planned after {choice.replanned.get('after_seconds', 0):.0f} s "
                      f"(first {first.chosen}: {choice.replanned.get('why')})")
        elif choice.check:
            shape += f"; plan checked after {choice.check.get('after_seconds', 0):.0f} s: held"
    name, flags = cpu()
    if isa_cap:
        flags += f"; capped to {isa_cap}: " + " ".join(f"{k}={v}" for k, v in ISA_CAPS[isa_cap].items())
    best_text = f"{best['bleu']:.2f} (step {best['step']:,})" if best else "n/a"
    return (f"| {name} ({flags}) | {datetime.date.today().isoformat()} | `{command}` | {shape} | {steps:,} | "
            f"{best_text} | **{bleu:.2f} / {chrf:.2f}** |")


def conditions_file(run: Path) -> Path:
    """Beside the run (not in it: the run directory holds what tfm wrote): how this script made it."""
    return run.parent / f"{run.name}.row.json"


def read_conditions(run: Path, args, command: str) -> tuple[str, str | None]:
    """The command and ISA cap a finished run was made with: as this script recorded them when it made
    the run, else (a run of scripts/quickstart.sh itself) uncapped. --isa-cap and --busy describe a run
    to make, so beside --read they are refused: the row names what the run's record says."""
    if args.isa_cap or args.busy:
        flag = "--isa-cap" if args.isa_cap else "--busy"
        raise TfmError(f"{flag} with --read: the row of a finished run names the conditions it was made "
                       f"under ({conditions_file(run).name} beside it), not the ones given")
    record_path = conditions_file(run)
    if not record_path.is_file():
        return command, None
    record = read_json_object(record_path)
    if not isinstance(record.get("command"), str) or record.get("isa_cap") not in (None, *ISA_CAPS):
        raise TfmError(f"{record_path}: torn or not written by scripts/quickstart_row.py")
    return record["command"], record["isa_cap"]


HEADER = ("| CPU (flags) | date | command | shape | steps | best valid BLEU (greedy) | test2016 beam 5 BLEU / chrF |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", default="10m", help="training budget, as TIME of quickstart.sh (default 10m)")
    parser.add_argument("--size", default=None, help="a named shape (SIZE of quickstart.sh); default: auto")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the run goes (must not exist; default runs/quickstart-<time>-<size>)")
    parser.add_argument("--read", type=Path, default=None, help="print the row of this finished run; train nothing")
    parser.add_argument("--isa-cap", choices=sorted(ISA_CAPS), default=None,
                        help="run as on a CPU of a lower class: every library capped to AVX-512 without bf16 or to AVX2")
    parser.add_argument("--busy", type=float, default=0.0, metavar="SECONDS",
                        help="other work on every usable core for the first SECONDS of the run (default none)")
    args = parser.parse_args()
    if not 0 <= args.busy <= 3600:
        raise TfmError(f"--busy {args.busy:g}: expected 0 to 3600 seconds")
    size = f" --size {args.size}" if args.size else ""
    busy = f" --busy {args.busy:g}" if args.busy else ""
    if args.isa_cap:  # the command that made the row: the caps live in this script
        command = f"python scripts/quickstart_row.py --isa-cap {args.isa_cap} --time {args.time}{size}{busy}"
        flags = cpu()[1]
        if ISA_FLAG[args.isa_cap] not in flags.split():
            raise TfmError(f"--isa-cap {args.isa_cap}: this CPU does not have it ({flags}): a cap only lowers what a CPU has")
    else:
        command = f"TIME={args.time} " + (f"SIZE={args.size} " if args.size else "") + "scripts/quickstart.sh"
        if args.busy:
            command = f"python scripts/quickstart_row.py --time {args.time}{size}{busy}"
    if args.read is not None:
        command, isa_cap = read_conditions(args.read, args, command)
        print(HEADER)
        print(read_row(args.read, command, isa_cap))
        return
    cap = (f"-{args.isa_cap}" if args.isa_cap else "") + (f"-busy{args.busy:g}" if args.busy else "")
    # quickstart.sh runs from the project root: a relative --run-dir means this working directory's
    run = (args.run_dir or ROOT / "runs" / f"quickstart-{args.time}-{args.size or 'auto'}{cap}").absolute()
    if run.exists():
        raise TfmError(f"{run} exists: the row is of a fresh run (give another --run-dir, or --read {run})")
    check_output(run, flag="--run-dir", directory=True)  # never the working directory, a run's own folder, …
    log = run.parent / f"{run.name}.log"
    if log.exists():
        raise TfmError(f"{log} exists: the quickstart's log would replace it (give another --run-dir)")
    env = {**os.environ, **ISA_CAPS.get(args.isa_cap or "", {}), "TIME": args.time, "RUN_DIR": str(run)}
    run.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(conditions_file(run), json.dumps({"command": command, "isa_cap": args.isa_cap}) + "\n")
    if args.size:
        env["SIZE"] = args.size
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())
               if args.busy]
    try:
        with open(log, "w", encoding="utf-8") as out:
            quickstart = subprocess.Popen(["bash", str(ROOT / "scripts" / "quickstart.sh")], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                quickstart.wait(timeout=args.busy or None)
            except subprocess.TimeoutExpired:
                pass
            for burner in burners:
                burner.kill()
            done = quickstart.wait()
    finally:
        for burner in burners:
            burner.kill()
    if done != 0:
        raise TfmError(f"scripts/quickstart.sh exited {done}: see {log}")
    print(HEADER)
    print(read_row(run, command, args.isa_cap))


if __name__ == "__main__":
    run_script(main)
