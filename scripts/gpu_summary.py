"""The final table of scripts/gpu_checks.sh: its sections' logs read back, figures against targets.

    python scripts/gpu_summary.py DIR        # DIR: sections.tsv and <section>.log, as gpu_checks.sh leaves them

Prints two Markdown tables: each section's exit status and time, then the figures the issue's
targets are stated in (MFU and tfm/HF of bench_train.py on the WMT14 shapes, test BLEU after a
150-second `tfm train`, the CUDA DDP test) with the target and whether it is met. A section that
did not run or printed no figure says so; nothing is guessed.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402

NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def number(text: str) -> float:
    return float(text.replace(",", ""))


def find(pattern: str, text: str) -> float | None:
    """The number of the last line matching `pattern` (one group), or None."""
    matches = re.findall(pattern, text, flags=re.MULTILINE)
    return number(matches[-1]) if matches else None


def bench_figures(log: str) -> dict[str, float | None]:
    """What scripts/bench_train.py prints: target tokens/s of each toolkit, their ratio, tfm's
    steps back to back, MFU (6·N·tokens/s) of each, and peak GPU memory of each trained alone."""
    return {
        "tfm": find(rf"^tfm\s+{NUMBER} target tokens/s", log),
        "hf": find(rf"^HF MarianMT\s+{NUMBER} target tokens/s", log),
        "ratio": find(rf"^ratio tfm/HF\s+{NUMBER}x", log),
        "back_to_back": find(rf"^tfm back to back.*?: {NUMBER} target tokens/s", log),
        "ratio_back_to_back": find(rf"^HF back to back: .*ratio back to back tfm/HF {NUMBER}x", log),
        "mfu_back_to_back": find(rf"^MFU tfm back to back 6·N·tokens/s =\s*{NUMBER}%", log),
        "train_loop": find(rf"^tfm train's own loop \(batches collated ahead.*back to back: {NUMBER} target tokens/s", log),
        "train_loop_inline": find(rf"^tfm train's own loop \(batches collated in the loop.*back to back: {NUMBER} target "
                                  "tokens/s", log),
        "first_tfm": find(rf"^first pass over the timed batches .*: tfm {NUMBER}, HF", log),
        "first_hf": find(rf"^first pass over the timed batches .*, HF {NUMBER} target tokens/s", log),
        "mfu_tfm": find(rf"^MFU tfm\s+6·N·tokens/s =\s*{NUMBER}%", log),
        "mfu_hf": find(rf"^MFU hf\s+6·N·tokens/s =\s*{NUMBER}%", log),
        "memory_tfm": find(rf"^peak tfm: .*peak GPU memory {NUMBER} GiB", log),
        "memory_hf": find(rf"^peak hf: .*peak GPU memory {NUMBER} GiB", log),
    }


def attention_kernels(log: str) -> str | None:
    """bench_train.py's count of the attention kernels one tfm step ran (flash, efficient, math…)."""
    found = re.findall(r"^attention kernels in one tfm step: (.*)$", log, flags=re.MULTILINE)
    return found[-1] if found else None


def loss_figures(log: str) -> dict[str, float | None]:
    """What scripts/bench_loss.py prints: ms per forward and backward of each, and their ratio."""
    return {"eager": find(rf"^eager +{NUMBER} ms", log), "compiled": find(rf"^compiled +{NUMBER} ms", log),
            "ratio": find(rf"^ratio eager/compiled {NUMBER}x", log)}


def profile_line(log: str, toolkit: str) -> str | None:
    """bench_train.py --profile for one toolkit in one line: the device's busy share of the wall
    clock and its time per step by kernel group, largest first."""
    head = re.findall(rf"^profile {toolkit}: .*? time ([0-9.]+) ms per step over ([0-9.]+) ms .*busy ([0-9]+)%$",
                      log, flags=re.MULTILINE)
    if not head:
        return None
    device_ms, wall_ms, busy = head[-1]
    groups = re.findall(rf"^profile {toolkit}   (\S.*?)\s+([0-9.]+)%\s+([0-9.]+) ms/step$", log, flags=re.MULTILINE)
    parts = ", ".join(f"{name} {share}%" for name, share, _ in groups)
    return f"busy {busy}% ({device_ms} of {wall_ms} ms per step); {parts}"


def scores(log: str) -> dict[str, float | None]:
    """What `tfm evaluate` printed last in `log`: BLEU, its brevity penalty, chrF."""
    return {"bleu": find(rf"^BLEU = {NUMBER}", log), "bp": find(rf"^BLEU = .*\(BP = {NUMBER}", log),
            "chrf": find(rf"^chrF2 = {NUMBER}", log)}


def evaluations(log: str) -> dict[str, dict[str, float | None]]:
    """gpu_checks.sh's `evaluate_at` runs in a log, in order: {label: scores}, the label as its line
    "evaluate: LABEL" gave it (e.g. "test, length penalty 0.6")."""
    parts = re.split(r"^evaluate: (.*)$", log, flags=re.MULTILINE)
    return {label: scores(body) for label, body in zip(parts[1::2], parts[2::2])}


def train_figures(log: str) -> dict[str, float | None]:
    """`tfm train` then `tfm evaluate`: steps, the median of the logged tokens/s (the first log
    line left out: it holds the start), the best valid score, and test BLEU / chrF / brevity
    penalty: of the first `evaluate_at` (test at the config's length penalty), or, in a log without
    those lines, of the last evaluation."""
    rates = [number(r) for r in re.findall(rf"^step \d+: .* {NUMBER} tok/s", log, flags=re.MULTILINE)]
    evaluated = list(evaluations(log).values())
    return {
        "steps": find(rf"^done \(.*?\): {NUMBER} steps", log),
        "tokens_per_s": statistics.median(rates[1:] or rates) if rates else None,
        "first_window": rates[0] if rates else None,
        "best_valid": find(rf"^done .* best valid \w+ {NUMBER}", log),
        **(evaluated[0] if evaluated else scores(log)),
    }


# NVML's clock-event reasons (nvmlClocksEventReason*), the bits of clocks_event_reasons.active
CLOCK_EVENTS = {0x1: "GPU idle", 0x2: "applications clocks setting", 0x4: "software power cap", 0x8: "hardware slowdown",
                0x10: "sync boost", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                0x80: "hardware power brake", 0x100: "display clock setting"}


def clock_line(samples: str) -> str | None:
    """gpu_clocks' CSV (timestamp, SM clock, its maximum, power, temperature[, event reasons]) in one
    line: the SM clock's median and lowest against the GPU's most, power, temperature, and how many
    samples name each reason the clock was held down; None without a sample."""
    rows = [[field.strip() for field in line.split(",")] for line in samples.splitlines()
            if re.match(r"^[^,]+, [0-9]+ MHz, [0-9]+ MHz, [0-9.]+ W, [0-9]+(, 0x[0-9a-fA-F]+)?$", line.strip())]
    if not rows:
        return None
    clock = [number(row[1].split()[0]) for row in rows]
    power = [number(row[3].split()[0]) for row in rows]
    reasons: dict[str, int] = {}
    for row in rows:
        for bit, name in CLOCK_EVENTS.items():
            if len(row) > 5 and int(row[5], 16) & bit:
                reasons[name] = reasons.get(name, 0) + 1
    held = ", ".join(f"{name} in {count}" for name, count in reasons.items()) or "nothing named"
    return (f"SM clock median {statistics.median(clock):,.0f} MHz, lowest {min(clock):,.0f} (the GPU's most "
            f"{rows[0][2]}); power median {statistics.median(power):,.0f} W; hottest "
            f"{max(number(row[4]) for row in rows):.0f} °C; {len(rows)} samples every 5 s; clock held down by: {held}")


def trained_result(figures: dict[str, float | None]) -> str:
    """A 150-s training's test BLEU and what explains it, as its rows show them."""
    return (f"{shown(figures['bleu'], '', 2)} (chrF {shown(figures['chrf'], '', 2)}; brevity penalty "
            f"{shown(figures['bp'], '', 3)}; {shown(figures['steps'])} steps, best valid {shown(figures['best_valid'], '', 2)}")


def train_rows(sections: dict[str, Section]) -> list[tuple[str, str, str, str]]:
    """The 150-s `tfm train` of configs/de-en-gpu.yaml (target: test BLEU >= 41), the GPU's clocks
    meanwhile, its scores at the other length penalty, and the budget-schedule variant's."""
    log = sections["train"].log if "train" in sections else ""
    train, evaluated = train_figures(log), evaluations(log)
    stopped = re.findall(r"^done \((.*?)\)", log, flags=re.MULTILINE)
    rows = [(f"configs/de-en-gpu.yaml, `tfm train` ({stopped[-1] if stopped else 'did not finish'}): "
             "test2016 BLEU (beam 5)",
             f"{trained_result(train)}; median logged {shown(train['tokens_per_s'])} target tokens/s, the first "
             f"log window {shown(train['first_window'])})", "≥ 41", verdict(train["bleu"], 41.0))]
    clocks = clock_line(sections["train"].clocks) if "train" in sections else None
    if clocks:
        rows.append(("the GPU while `tfm train` ran", clocks, "", ""))
    if len(evaluated) > 1:
        rows.append(("the same model, beam 5 at each length penalty (BLEU, brevity penalty)",
                     "; ".join(f"{label}: {shown(got['bleu'], '', 2)} ({shown(got['bp'], '', 3)})"
                               for label, got in evaluated.items()), "", ""))
    if "train_budget" in sections and sections["train_budget"].ran:
        variant_log = sections["train_budget"].log
        valid = [got for label, got in evaluations(variant_log).items() if label.startswith("valid")]
        rows.append(("the same with `--set train.lr_schedule=budget`: test2016 BLEU (beam 5)",
                     f"{trained_result(train_figures(variant_log))}; valid beam 5 "
                     f"{shown(valid[0]['bleu'] if valid else None, '', 2)})", "", ""))
    return rows


def pytest_counts(log: str) -> dict[str, float | None]:
    """pytest's last line: passed / failed / skipped counts (0 where absent, None without a line)."""
    last = [line for line in log.splitlines() if re.search(r"\b(passed|failed|skipped|error)", line)]
    if not last:
        return {"passed": None, "failed": None, "skipped": None}
    counts = {kind: find(rf"{NUMBER} {kind}", last[-1]) or 0.0 for kind in ("passed", "failed", "skipped")}
    counts["failed"] += find(rf"{NUMBER} errors?", last[-1]) or 0.0
    return counts


@dataclass
class Section:
    name: str
    status: str  # the exit status, "skipped" or "no data"
    seconds: str
    limit: str
    log: str
    clocks: str = ""  # gpu_checks.sh's gpu_clocks samples while the section trained (train, train_budget)

    @property
    def ran(self) -> bool:
        return self.status not in ("skipped", "no data")


def read_sections(folder: Path) -> dict[str, Section]:
    sections = {}
    table = folder / "sections.tsv"
    for line in table.read_text().splitlines() if table.exists() else []:
        name, status, seconds, limit = (line.split("\t") + ["", "", "", ""])[:4]
        log, clocks = folder / f"{name}.log", folder / f"{name}.clocks"
        sections[name] = Section(name, status, seconds, limit, log.read_text(errors="replace") if log.exists() else "",
                                 clocks.read_text(errors="replace") if clocks.exists() else "")
    return sections


def shown(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def verdict(value: float | None, target: float) -> str:
    return "not measured" if value is None else ("met" if value >= target else "**not met**")


def figure_rows(sections: dict[str, Section]) -> list[tuple[str, str, str, str]]:
    """(check, result, target, verdict) rows for the figures the targets are stated in."""
    rows = []
    for name, what, mfu_target in (("bench_wmt_big", "big shape (WMT14 lengths)", 30.0),
                                   ("bench_wmt_base", "base shape (WMT14 lengths)", 15.0)):
        bench = bench_figures(sections[name].log) if name in sections else bench_figures("")
        rows.append((f"{what}: MFU tfm (6·N·tokens/s)", f"{shown(bench['mfu_tfm'], '%', 1)} "
                     f"(HF {shown(bench['mfu_hf'], '%', 1)}; tfm back to back {shown(bench['mfu_back_to_back'], '%', 1)})",
                     f"≥ {mfu_target:.0f}%", verdict(bench["mfu_tfm"], mfu_target)))
        rows.append((f"{what}: tfm / HF MarianMT", f"{shown(bench['ratio'], 'x', 2)} ({shown(bench['tfm'])} vs "
                     f"{shown(bench['hf'])} target tokens/s; back to back {shown(bench['back_to_back'])}, "
                     f"{shown(bench['ratio_back_to_back'], 'x', 2)} HF's; first pass over new shapes "
                     f"{shown(bench['first_tfm'])} vs {shown(bench['first_hf'])}; peak GPU memory "
                     f"{shown(bench['memory_tfm'], ' GiB', 2)} vs {shown(bench['memory_hf'], ' GiB', 2)})",
                     "≥ 1.3x", verdict(bench["ratio"], 1.3)))
        if name in sections and attention_kernels(sections[name].log):
            rows.append((f"{what}: attention kernels, one tfm step", str(attention_kernels(sections[name].log)), "", ""))
        for toolkit in ("tfm", "hf"):
            found = profile_line(sections[name].log, toolkit) if name in sections else None
            if found:
                rows.append((f"{what}: GPU time of a {toolkit} step (profiled)", found, "", ""))
    if "bench_loss" in sections and sections["bench_loss"].ran:
        loss = loss_figures(sections["bench_loss"].log)
        shape = re.findall(r"^output loss: (.*?);", sections["bench_loss"].log, flags=re.MULTILINE)
        rows.append((f"output loss ({shape[-1] if shape else '—'}), forward and backward: chunks fused by "
                     "torch.compile vs eager", f"{shown(loss['ratio'], 'x', 2)} ({shown(loss['compiled'], ' ms', 2)} "
                     f"vs {shown(loss['eager'], ' ms', 2)})", "", ""))
    rows += train_rows(sections)
    for name, what in (("eager_big", "big shape (WMT14 lengths), tfm eager (no torch.compile)"),
                       ("eager_base", "base shape (WMT14 lengths), tfm eager (no torch.compile)"),
                       ("big_no_flash", "big shape (WMT14 lengths), SDPA without flash attention"),
                       ("big_bf16_weights", "big shape (WMT14 lengths), tfm bf16 weights with fp32 masters"),
                       ("bench_base", "base shape, Multi30k lengths"),
                       ("bench_base_cudnn", "base shape, Multi30k lengths, SDPA allowed cuDNN"),
                       ("bench_small", "small shape (configs/de-en.yaml)")):
        if name in sections and sections[name].ran:
            bench = bench_figures(sections[name].log)
            rows.append((f"{what}: tfm / HF", f"{shown(bench['ratio'], 'x', 2)} ({shown(bench['tfm'])} vs "
                         f"{shown(bench['hf'])} target tokens/s; MFU {shown(bench['mfu_tfm'], '%', 1)}; back to back "
                         f"{shown(bench['back_to_back'])} (MFU {shown(bench['mfu_back_to_back'], '%', 1)}); `tfm train`'s loop {shown(bench['train_loop'])} collating ahead, "
                         f"{shown(bench['train_loop_inline'])} not; first pass over new shapes {shown(bench['first_tfm'])} vs "
                         f"{shown(bench['first_hf'])})", "", ""))
            found = profile_line(sections[name].log, "tfm")
            if found:
                rows.append((f"{what}: GPU time of a tfm step (profiled)", found, "", ""))
    if "tests" in sections and sections["tests"].ran:
        counts = pytest_counts(sections["tests"].log)
        ok = counts["passed"] is not None and counts["passed"] > 0 and not counts["failed"]
        rows.append(("CUDA DDP test (torchrun, nccl)", f"{shown(counts['passed'])} passed, {shown(counts['failed'])} failed, "
                     f"{shown(counts['skipped'])} skipped", "passes", "met" if ok else "**not met**"))
    return rows


def summary(folder: Path) -> str:
    sections = read_sections(folder)
    lines = ["| section | exit | seconds (limit) |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} ({s.limit}) |" for s in sections.values()]
    env = sections.get("env")
    if env and env.log.strip():
        lines += ["", "Machine: " + "; ".join(line.strip() for line in env.log.strip().splitlines()[:4])]
    lines += ["", "| check | result | target | |", "| --- | --- | --- | --- |"]
    lines += [f"| {check} | {result} | {target} | {mark} |" for check, result, target, mark in figure_rows(sections)]
    return "\n".join(lines)


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, metavar="DIR",
                        help="the folder scripts/gpu_checks.sh wrote: sections.tsv and <section>.log")
    args = parser.parse_args()
    if not args.dir.is_dir():
        raise TfmError(f"{args.dir}: no such folder (give the one scripts/gpu_checks.sh wrote its logs into)")
    if not (args.dir / "sections.tsv").is_file():
        raise TfmError(f"{args.dir}: no sections.tsv in it (not a folder scripts/gpu_checks.sh wrote)")
    print(summary(args.dir))


if __name__ == "__main__":
    run_script(main)
