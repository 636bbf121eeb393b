"""scripts/gpu_checks.sh, checked where there is no GPU: a GPU is lent for minutes at a time, so
the one call that measures everything must not fail on a typo, a missing file or its own budget.
Its plan (PLAN=1) is parsed by the scripts' own argument parsers, its orchestration runs for real
on the `env` section, and its final table (scripts/gpu_summary.py) reads real outputs."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import tfm_in_process, threads_per_test_process, tiny_run
from tests.warm_processes import tfm_in_scripts
from transformer_cli.experiment.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
THREADS = str(threads_per_test_process())  # the benchmarks' default, 2, beside the other test process: more threads than cores


def script_module(name: str):
    """A script of scripts/ imported as a module (its main() not run)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def run_checks(out: Path, *sections: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(out), *sections], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=300)


def planned(tmp_path: Path, **env: str) -> dict[str, tuple[int, int, str]]:
    """{section: (least seconds, most seconds, command)} as PLAN=1 prints them."""
    run = run_checks(tmp_path / "plan", PLAN="1", **env)
    assert run.returncode == 0, run.stderr
    plan = {}
    for name, least, most, command in re.findall(r"^== (\w+) \(at least (\d+)s, at most (\d+)s\)\n(.*?)(?=^== |\Z)",
                                                 run.stdout, flags=re.MULTILINE | re.DOTALL):
        plan[name] = (int(least), int(most), " ".join(command.split()))
    return plan


def test_every_planned_command_parses_and_names_files_that_exist(tmp_path):
    plan = planned(tmp_path)
    assert list(plan) == ["env", "bench_wmt_big", "bench_wmt_base", "train", "tests", "auto", "auto_base", "train_budget",
                          "big_bf16_weights",
                          "bench_loss", "eager_big", "eager_base", "bench_base", "bench_base_cudnn", "decode",
                          "big_no_flash", "bench_small"]
    parsers = {name: script_module(name).build_parser() for name in ("bench_train", "bench_engines", "bench_loss")}
    for name, (least, most, command) in plan.items():
        assert 0 < least <= most, name
        for config in re.findall(r"--config (\S+)", command):
            assert load_config(ROOT / config).model.d_model > 0, (name, config)
        # every override the section sets is a key the config takes, at a value it takes
        for config, overrides in re.findall(r"(?:tfm \w+|sampled_train \S+) --config (\S+)((?: --set \S+)+)", command):
            load_config(ROOT / config, overrides.split()[1::2])
        for length_penalty in re.findall(r"evaluate_at \S+ \S+ (?:test|valid) ([0-9.]+)", command):
            assert load_config(ROOT / "configs/de-en-gpu.yaml", [f"decode.length_penalty={length_penalty}"])
        for script, args in re.findall(r"python3 scripts/(\w+)\.py (.*?)(?:$|;|&&)", command):
            parsed = parsers[script].parse_args(shlex.split(args))  # an unknown option exits: the test fails
            assert parsed.device == "cuda", (name, args)
        for path in re.findall(r"\b(?:tests|scripts)/[\w/]+\.(?:py|sh)", command):
            assert (ROOT / path).exists(), (name, path)
    # The sections that measure the targets come first and fit the default budget together (train's
    # least is its training and its evaluations: skipped, not cut short).
    first = list(plan)[:list(plan).index("tests") + 1]
    assert first == ["env", "bench_wmt_big", "bench_wmt_base", "train", "tests"]
    assert sum(plan[name][0] for name in first) <= 520 and plan["train"][0] >= 220
    # The schedule variant trains what train trains, in a run of its own, one setting apart.
    train, variant = (re.search(r"sampled_train \S+ (.*?) &&", plan[name][2]).group(1) for name in ("train", "train_budget"))
    assert variant == train.replace("runs/gpu-checks/de-en-gpu ", "runs/gpu-checks/de-en-gpu-budget ") + \
        " --set train.lr_schedule=budget"
    # `auto` trains the shipped config as it is; auto_base the same with the paper's base shape pinned,
    # in a run of its own, and both train as long as TRAIN_TIME says (their limits follow it).
    auto, base = (re.search(r"^tfm train (.*?) &&", plan[name][2]).group(1) for name in ("auto", "auto_base"))
    assert auto == "--config configs/de-en.yaml --set run_dir=runs/gpu-checks/de-en-auto --set train.max_time=150s"
    pinned = load_config(ROOT / "configs/de-en.yaml", base.split("--set ")[1:])
    assert base.startswith(auto.replace("de-en-auto ", "de-en-auto-base ") + " --set model.d_model=512 ")
    assert (pinned.model.size, pinned.model.d_model, pinned.model.enc_layers, pinned.model.d_ff) == (None, 512, 6, 2048)
    longer = planned(tmp_path, TRAIN_TIME="5m")
    assert longer["auto"][:2] == (plan["auto"][0] + 150, plan["auto"][1] + 150) and "max_time=5m " in longer["auto"][2]
    # The WMT shapes run at their configs' batch size; the target sections as `tfm train` runs the
    # configs (their train.compile), the eager ones without torch.compile.
    for name, config in (("bench_wmt_big", "big"), ("bench_wmt_base", "base"), ("eager_big", "big"), ("eager_base", "base")):
        command = plan[name][2]
        assert f"--max-tokens {load_config(ROOT / f'configs/wmt14-en-de-{config}.yaml').train.max_tokens} " in command
        args = parsers["bench_train"].parse_args(shlex.split(command.split("bench_train.py ", 1)[1]))
        assert args.compile == ("off" if name.startswith("eager") else "config"), name
    # The comparisons of attention kernels run the same batches as their peers, one switch apart.
    assert plan["big_no_flash"][2] == plan["bench_wmt_big"][2] + " --no-flash-attention"
    assert plan["big_bf16_weights"][2] == plan["bench_wmt_big"][2] + " --bf16-weights"  # the same, weights apart
    assert plan["bench_base_cudnn"][2].endswith("--cudnn-attention") and "--cudnn-attention" not in plan["bench_base"][2]


def test_an_unknown_section_is_refused_before_anything_runs(tmp_path):
    run = run_checks(tmp_path / "out", "env", "bench_huge")
    assert run.returncode == 2 and "unknown section 'bench_huge'" in run.stderr
    assert not (tmp_path / "out").exists()
    run = run_checks(tmp_path / "out", "auto", TRAIN_TIME="1.5m")  # the sections' limits need whole seconds
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "gpu_checks.sh: TRAIN_TIME '1.5m' is not whole seconds (150s) or minutes (5m)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_section_runs_within_the_budget_and_the_run_ends_in_the_table(tmp_path):
    """On a machine without a GPU `env` still runs (nvidia-smi missing is its own finding); the
    run leaves the table, sections.tsv and every log in one archive, and says what it did not measure."""
    out = tmp_path / "out"
    run = run_checks(out, "env", BUDGET="120")
    assert run.returncode == 0, run.stderr
    assert (out / "summary.md").read_text().strip() in run.stdout
    row = (out / "sections.tsv").read_text().splitlines()
    assert len(row) == 1 and row[0].split("\t")[0] == "env" and row[0].split("\t")[1].isdigit()
    with tarfile.open(out / "logs.tar.gz") as archive:
        env_log = archive.extractfile("./env.log").read().decode()
    assert "torch" in env_log
    assert ("| big shape (WMT14 lengths): MFU tfm (6·N·tokens/s) | — (HF —; tfm back to back —) | ≥ 30% | not measured |"
            in run.stdout)
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "sections.tsv", "summary.md"]  # ≤ 8 files come back


def test_a_section_the_budget_cannot_hold_is_skipped_not_cut(tmp_path):
    out = tmp_path / "out"
    run = run_checks(out, "env", "bench_wmt_base", BUDGET="5")
    assert run.returncode == 0, run.stderr
    # (the wheel installs before the first section may take a second of the budget)
    assert re.search(r"^== env skipped: [45]s of the 5s budget left, it needs 10s$", run.stdout, flags=re.MULTILINE)
    assert [line.split("\t")[:2] for line in (out / "sections.tsv").read_text().splitlines()] == \
        [["env", "skipped"], ["bench_wmt_base", "skipped"]]


def script_function(name: str) -> str:
    """A shell function of gpu_checks.sh, as its text (to run it where the script's sections cannot)."""
    found = re.search(rf"^{name}\(\) \{{.*?^\}}$", SCRIPT.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert found, name
    return found.group(0)


@pytest.mark.slow
def test_the_table_reads_what_tfm_train_and_evaluate_print(tiny_prepared, tmp_path):
    """A real (tiny) `tfm train`, then the script's own `evaluate_at` at the config's length penalty
    and at another, their output as the train section's log: the table shows the step count and the
    first evaluation's BLEU (the config's, judged against 41), then every evaluation under its label."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=20, log_every=5)
    trained = tfm_in_process("train", "--config", config)  # what `tfm train` prints, without a process's start-up
    assert trained.exit_code == 0, trained.stderr
    shell = f"{script_function('evaluate_at')}\n"
    env = tfm_in_scripts(tmp_path / "bin")  # this Python's `tfm`, its commands forked from the warm processes
    evaluated = subprocess.run(["bash", "-c", shell + f"evaluate_at {config} {tmp_path / 'run'} test && "
                                f"evaluate_at {config} {tmp_path / 'run'} test 0.0"],
                               capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert evaluated.returncode == 0, evaluated.stderr
    bleus = [float(b) for b in re.findall(r"^BLEU = ([0-9.]+)", evaluated.stdout, flags=re.MULTILINE)]
    assert len(bleus) == 2
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train.log").write_text(trained.stdout + trained.stderr + evaluated.stdout + evaluated.stderr)
    (logs / "sections.tsv").write_text("train\t0\t12\t300\n")
    summary = script_module("gpu_summary")
    figures = summary.train_figures((logs / "train.log").read_text())
    assert figures["steps"] == 20 and figures["bleu"] == bleus[0] and figures["tokens_per_s"] > 0
    assert 0 < figures["bp"] <= 1
    rows = summary.figure_rows(summary.read_sections(logs))
    row = next(r for r in rows if "test2016 BLEU" in r[0])
    assert row[1].startswith(f"{bleus[0]:.2f} ") and row[3] == ("met" if bleus[0] >= 41 else "**not met**")
    assert "(max_steps=20)" in row[0]  # why the run stopped: the budget it ran under
    each = next(r for r in rows if r[0].startswith("the same model, beam 5 at each length penalty"))
    assert each[1].startswith(f"test, length penalty of the config: {bleus[0]:.2f} (")
    assert f"; test, length penalty 0.0: {bleus[1]:.2f} (" in each[1]
    # the schedule variant's section: its own row, its first (test) evaluation, no verdict of its own
    (logs / "train_budget.log").write_text(trained.stdout + trained.stderr + evaluated.stdout)
    (logs / "sections.tsv").write_text("train\t0\t12\t300\ntrain_budget\t0\t12\t250\n")
    variant = next(r for r in summary.figure_rows(summary.read_sections(logs)) if "lr_schedule=budget" in r[0])
    assert variant[1].startswith(f"{bleus[0]:.2f} (") and "20 steps" in variant[1] and variant[2:] == ("", "")
    # the penalty reaches the config: one it refuses fails the call, naming the key
    refused = subprocess.run(["bash", "-c", shell + f"evaluate_at {config} {tmp_path / 'run'} test 11"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert refused.returncode == 2 and "decode.length_penalty" in refused.stderr, refused.stderr


def test_the_table_judges_bench_figures_against_their_targets(tmp_path):
    """bench_train.py's lines (as it prints them) at, just under and above the targets."""
    summary = script_module("gpu_summary")

    def bench_log(mfu: float, ratio: float) -> str:
        return (f"tfm             235000 target tokens/s\nHF MarianMT     {235000 / ratio:.0f} target tokens/s\n"
                f"ratio tfm/HF      {ratio:.2f}x\nMFU tfm  6·N·tokens/s = {mfu:5.1f}% (N = 1)\n"
                f"MFU hf   6·N·tokens/s =  10.0% (N = 1)\npeak tfm: RSS 2.00 GiB, peak GPU memory 31.50 GiB\n"
                "first pass over the timed batches (shapes new to both, wall clock): tfm 21686, HF 20000 target tokens/s\n"
                "HF back to back: 200000 target tokens/s; ratio back to back tfm/HF 1.42x\n")

    (tmp_path / "sections.tsv").write_text("bench_wmt_big\t0\t80\t150\nbench_wmt_base\t0\t60\t120\n")
    for big, base, expected in (((30.0, 1.30), (15.0, 1.30), ["met"] * 4),
                                ((29.9, 1.31), (14.9, 1.29), ["**not met**", "met", "**not met**", "**not met**"])):
        (tmp_path / "bench_wmt_big.log").write_text(bench_log(*big))
        (tmp_path / "bench_wmt_base.log").write_text(bench_log(*base))
        rows = summary.figure_rows(summary.read_sections(tmp_path))
        assert [r[3] for r in rows[:4]] == expected
    assert "31.50 GiB" in rows[1][1] and "1.42x HF's; first pass over new shapes 21,686 vs 20,000" in rows[1][1]


@pytest.mark.slow
def test_bench_train_runs_synthetic_wmt_batches_and_the_table_reads_them():
    """`bench_train.py --synthetic wmt` needs no corpus: random ids at WMT14 en-de's lengths; the table
    reads its figures as it printed them. On configs/tiny.yaml (the base shape, which gpu_checks.sh
    times on a GPU, took 80 s of CPU here; test_config.py builds its model). Eager (compiled training
    has its own test in test_training_kernels.py)."""
    run = tiny_synthetic_bench("--precision", "fp32", "--no-memory", "--compile", "off")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ratio tfm/HF" in run.stdout and "6·N·tokens/s" in run.stdout and "vocab 1000" in run.stdout
    figures = script_module("gpu_summary").bench_figures(run.stdout)
    printed_ratio = float(re.search(r"^ratio tfm/HF\s+([0-9.]+)x", run.stdout, flags=re.MULTILINE).group(1))
    assert figures["ratio"] == printed_ratio and figures["tfm"] > 0 and figures["hf"] > 0
    assert figures["mfu_tfm"] is not None and figures["back_to_back"] > 0
    assert figures["ratio_back_to_back"] > 0 and figures["mfu_back_to_back"] is not None  # both, as training runs
    # fp32 on CPU: torch's fused attention, forward and backward, in every layer's attention
    kernels = script_module("gpu_summary").attention_kernels(run.stdout)
    assert kernels is not None and "scaled_dot_product" in kernels, kernels


def tiny_synthetic_bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """bench_train.py on CPU, configs/tiny.yaml at WMT lengths: two timed steps after one."""
    return subprocess.run([sys.executable, "scripts/bench_train.py", "--config", "configs/tiny.yaml", "--synthetic", "wmt",
                           "--device", "cpu", "--steps", "2", "--warmup", "1", "--max-tokens", "256", "--threads", THREADS, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_bench_train_measures_each_toolkit_alone_in_a_child():
    """`--only NAME`, what bench_train.py starts a child with for each toolkit's peak memory:
    that toolkit alone trains on the same batches and reports its peak resident memory."""
    run = tiny_synthetic_bench("--only", "tfm")
    assert run.returncode == 0, run.stderr[-2000:]
    peak = re.search(r"^peak tfm: RSS ([0-9.]+) GiB$", run.stdout, flags=re.MULTILINE)
    assert peak and 0.05 < float(peak.group(1)) < 8, run.stdout
    assert "target tokens/s" not in run.stdout  # a child only trains: no timing, no HF



@pytest.mark.slow
def test_bench_train_times_tfm_on_bf16_weights_with_fp32_masters():
    """`--bf16-weights` (the big_bf16_weights section): tfm's steps run on bf16 parameters with Adam on
    fp32 copies, HF as before; the table reads its figures."""
    # (A CPU without bf16 instructions emulates them: 350 s on an AVX2-only Zen 3, seconds elsewhere.)
    run = tiny_synthetic_bench("--no-memory", "--bf16-weights", timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tfm: bf16 weights, fp32 master copies, no autocast" in run.stdout
    figures = script_module("gpu_summary").bench_figures(run.stdout)
    assert figures["tfm"] > 0 and figures["hf"] > 0 and figures["mfu_tfm"] is not None


@pytest.mark.slow
def test_bench_train_runs_tfm_trains_own_loop_beside_its_steps(tiny_prepared, tmp_path):
    """On a prepared run bench_train.py also times `tfm train`'s own Trainer loop (collated ahead,
    clip, skip check, ledger) over the run's batches, in a temporary run directory: a run that has
    trained already is read, never written."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=4)
    trained = tfm_in_process("train", "--config", config)
    assert trained.exit_code == 0, trained.stderr
    run = tmp_path / "run"
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    bench = subprocess.run([sys.executable, "scripts/bench_train.py", "--config", str(config), "--device", "cpu",
                            "--steps", "3", "--warmup", "1", "--max-tokens", "256", "--threads", THREADS, "--precision", "fp32", "--no-memory",
                            "--steady-state"],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bench.returncode == 0, bench.stderr[-2000:]
    figures = script_module("gpu_summary").bench_figures(bench.stdout)
    assert figures["train_loop"] > 0 and figures["train_loop_inline"] > 0 and figures["back_to_back"] > 0
    assert figures["first_tfm"] > 0 and figures["first_hf"] > 0  # what a run pays for shapes new to it
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


@pytest.mark.slow
def test_the_gpu_clock_samples_of_a_training_reach_the_table(tmp_path):
    """gpu_clocks, the script's own function, against a stand-in nvidia-smi (none on CPU machines)
    whose driver does not know the clock-event field: it falls back to the fields every driver has,
    samples while sampled_train trains and stops with it (whose exit status it passes on), and the
    table reads what it wrote. A sample with the field is read too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in *clocks_event_reasons*) echo "Field is not a valid field to query." >&2; exit 2 ;; esac\n'
        'case "$*" in *-lms*) while :; do echo "2026/11/27 05:10:01.123, 1830 MHz, 1980 MHz, 690.10 W, 66"; '
        "sleep 0.1; done ;; esac\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    samples = tmp_path / "train.clocks"
    # sampled_train, as the train sections call it, around a stand-in training that fails after 1 s
    shell = (f"{script_function('gpu_clocks')}\n{script_function('sampled_train')}\n"
             'tfm() { sleep 1; echo "tfm $*"; return 3; }\n'
             f"sampled_train {samples} --config x.yaml; echo trained $?; sleep 0.3")
    run = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert run.returncode == 0 and run.stdout == "tfm train --config x.yaml\ntrained 3\n", run.stdout + run.stderr
    written = samples.read_text()
    assert written.count("\n") >= 3 and "not a valid field" not in written
    time.sleep(0.3)
    assert samples.read_text() == written  # killed: nothing samples on
    summary = script_module("gpu_summary")
    line = summary.clock_line(written)
    assert line.startswith("SM clock median 1,830 MHz, lowest 1,830 (the GPU's most 1980 MHz); power median 690 W")
    assert line.endswith("clock held down by: nothing named")
    held = summary.clock_line("2026/11/27 05:10:01.123, 1755 MHz, 1980 MHz, 699.80 W, 63, 0x0000000000000024\n")
    assert held.endswith("clock held down by: software power cap in 1, software thermal slowdown in 1")
    assert summary.clock_line("nvidia-smi: command not found\n") is None


@pytest.mark.slow
def test_bench_loss_times_the_output_loss_eager_and_compiled_and_the_table_reads_it(tmp_path):
    """scripts/bench_loss.py on CPU at a small shape, through torch's own compiler: both ways of
    computing the chunks are timed in one run, and the table shows their ratio as printed. (In fp32:
    the compiled graph is one test_train.py's compiled-loss test compiles, built once a run through
    inductor's cache.)"""
    run = subprocess.run([sys.executable, "scripts/bench_loss.py", "--rows", "300", "--d-model", "32", "--vocab", "500",
                          "--rounds", "2", "--threads", THREADS, "--precision", "fp32"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = script_module("gpu_summary").loss_figures(run.stdout)
    assert figures["eager"] > 0 and figures["compiled"] > 0
    assert figures["ratio"] == pytest.approx(figures["eager"] / figures["compiled"], rel=0.02)
    assert run.stdout.startswith("output loss: 300 rows, d_model 32, vocabulary 500, cpu, fp32;")
    (tmp_path / "bench_loss.log").write_text(run.stdout)
    (tmp_path / "sections.tsv").write_text("bench_loss\t0\t12\t60\n")
    summary = script_module("gpu_summary")
    row = next(r for r in summary.figure_rows(summary.read_sections(tmp_path)) if r[0].startswith("output loss"))
    assert "(300 rows, d_model 32, vocabulary 500, cpu, fp32)" in row[0] and row[1].startswith(f"{figures['ratio']:.2f}x (")
