"""The tests' `tfm` processes forked from a warm process (tests/warm_processes.py) are started as
cold ones: what the kernel and the command show of them is the same either way; so are scripts' runs."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_processes
from tests.conftest import ROOT, tfm_in_process, tiny_run
from tests.warm_processes import preexec


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def observe(checkpoint: Path, cwd: Path) -> dict:
    """Start `tfm translate`; once it waits for its input, read what /proc shows of it; then give it
    a line and take its output and exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_cli.cli", "translate", "--checkpoint", str(checkpoint), "--engine", "torch",
         "--set", "decode.precision=fp32"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        env={**os.environ, "TFM_SOMETHING_ELSE": "1"}, start_new_session=True,
        preexec_fn=preexec(default_signals=(signal.SIGHUP,), limits=((resource.RLIMIT_FSIZE, 10**6),)))
    main_thread = Path(f"/proc/{proc.pid}/task/{proc.pid}/syscall")
    deadline = time.monotonic() + 120
    while main_thread.read_text().split()[:2] != ["0", "0x0"]:  # read() on standard input
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    status = proc_status(proc.pid)
    stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    seen = {
        "signals": {k: status[k] for k in ("SigBlk", "SigIgn", "SigCgt")},
        "new session": int(stat[3]) == proc.pid,  # the session id (field 6) is its own PID
        "file size limit": [line.split()[3:5] for line in Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
                            if line.startswith("Max file size")],
        "cwd": os.readlink(f"/proc/{proc.pid}/cwd"),
        "fds": sorted(os.listdir(f"/proc/{proc.pid}/fd")),
        "child of this process": int(stat[1]) == os.getpid(),
    }
    out, err = proc.communicate("3 1 4 1 5\n", timeout=120)
    return {**seen, "exit": proc.returncode, "out": out, "err": err.split(" in ")[0]}


@pytest.mark.slow
def test_a_warm_tfm_process_is_what_a_cold_one_is(tiny_prepared, tmp_path, monkeypatch):
    """Signal dispositions, blocked and caught signals, a new session, a resource limit set by
    preexec(), the working directory, the open file descriptors, the output and the exit status.
    (Not the count of threads: numpy's OpenBLAS starts its idle pool at import in a cold process, in
    a forked one at its first use.)"""
    if warm_processes._coverage_running():
        pytest.skip("coverage.py measures this run: every command starts cold")
    config = tiny_run(tiny_prepared, tmp_path, max_steps=2, eval_every=2)
    assert tfm_in_process("train", "--config", config).exit_code == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_last.pt"
    monkeypatch.setenv("TFM_TEST_WARM", "0")
    cold = observe(checkpoint, tmp_path)
    monkeypatch.setenv("TFM_TEST_WARM", "1")
    warm = observe(checkpoint, tmp_path)
    assert cold.pop("child of this process") and not warm.pop("child of this process")  # forked elsewhere
    assert warm == cold and cold["exit"] == 0 and cold["out"].strip(), (warm, cold)


@pytest.mark.slow
def test_a_command_whose_warm_process_has_gone_starts_cold(monkeypatch, tmp_path):
    """Kill -9 of the warm process: the next command starts cold (a child of this process) and
    works; a working directory that does not exist is Popen's own error, as for a cold start."""
    if warm_processes._coverage_running():
        pytest.skip("coverage.py measures this run: every command starts cold")
    monkeypatch.setattr(warm_processes, "_WARM", {})  # a warm process of this test's own
    log = tmp_path / "warm.jsonl"
    monkeypatch.setenv("TFM_TEST_WARM_LOG", str(log))
    version = [sys.executable, "-m", "transformer_cli.cli", "--version"]
    warm = subprocess.run(version, capture_output=True, text=True)
    process = warm_processes._WARM["system"].process
    process.kill()
    process.wait()
    shutil.rmtree(Path(warm_processes._WARM["system"].address).parent)  # its socket's folder
    cold = subprocess.run(version, capture_output=True, text=True)
    assert warm.returncode == cold.returncode == 0 and warm.stdout == cold.stdout != ""
    assert [json.loads(line)[0] for line in log.read_text().splitlines()] == ["warm: system",
                                                                              "cold: the warm process has gone"]
    assert warm_processes._WARM["system"].failed
    with pytest.raises(FileNotFoundError):
        subprocess.run(version, cwd=tmp_path / "missing")


@pytest.mark.slow
def test_a_script_of_scripts_runs_warm_as_python_runs_it_cold(monkeypatch, tmp_path):
    """`python scripts/<name>.py` forked warm: the script runs as `__main__` with its own folder first
    on sys.path (bench_train.py imports bench_common from there), its output, one-line errors and
    exit status as a cold start's; a script from anywhere else starts cold."""
    if warm_processes._coverage_running():
        pytest.skip("coverage.py measures this run: every command starts cold")
    log = tmp_path / "warm.jsonl"
    monkeypatch.setenv("TFM_TEST_WARM_LOG", str(log))
    runs = {}
    for how in ("0", "1"):
        monkeypatch.setenv("TFM_TEST_WARM", how)
        runs[how] = [subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
                     for args in (["scripts/bench_train.py", "--help"],
                                  [str(ROOT / "scripts" / "quickstart_row.py"), "--isa-cap", "avx9"])]
    (cold_help, cold_error), (warm_help, warm_error) = runs["0"], runs["1"]
    assert cold_help.returncode == warm_help.returncode == 0 and "--synthetic" in warm_help.stdout
    assert warm_help.stdout == cold_help.stdout and warm_help.stderr == cold_help.stderr
    assert cold_error.returncode == warm_error.returncode == 2 and warm_error.stderr.startswith("error: ")
    assert warm_error.stderr == cold_error.stderr and warm_error.stdout == cold_error.stdout
    elsewhere = tmp_path / "bench_train.py"
    elsewhere.write_text("import sys\nprint(sys.path[0])\n")
    assert subprocess.run([sys.executable, str(elsewhere)], capture_output=True, text=True).stdout.strip() == str(tmp_path)
    assert [json.loads(line)[0] for line in log.read_text().splitlines()] == ["warm: system"] * 2


def test_the_cpu_report_adds_each_forked_command_to_the_test_that_started_it(tmp_path, monkeypatch):
    """tests/cpu_per_test.py: a test's seconds are its own plus those of the commands a warm process
    forked for it (recorded there, as no child of the test); files and tests ranked by their sum."""
    from tests import cpu_per_test

    monkeypatch.setenv(cpu_per_test.FOLDER, str(tmp_path))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    forked = usage.ru_utime + usage.ru_stime
    warm_processes._record_cpu(["tests/test_b.py::test_two (call)", "transformer_cli", "train", "--config", "c.yaml"],
                               usage)
    rows = [["tests/test_a.py::test_one", 2.0, 2.5], ["tests/test_b.py::test_two", 0.5, 1.0]]
    (tmp_path / "tests-gw0.json").write_text(json.dumps(rows))

    lines: list[str] = []

    class Terminal:  # what the plugin writes with: pytest's terminal reporter's write_line
        def write_line(self, line: str) -> None:
            lines.append(line)

    class Config:
        _tfm_cpu_report = True

    cpu_per_test.pytest_terminal_summary(Terminal(), Config())
    shown = {line.split()[-1]: float(line.split()[0]) for line in lines[1:] if "::" in line or ".py" in line}
    assert shown["tests/test_b.py::test_two"] == pytest.approx(0.5 + forked, abs=0.05)  # (shown to 0.1 s)
    assert shown["tests/test_a.py"] == 2.0 and shown["tests/test_b.py"] == pytest.approx(0.5 + forked, abs=0.05)
    assert lines[0].startswith(f"CPU seconds in tests: {2.5 + forked:.0f} ({forked:.0f} of them in forked")
