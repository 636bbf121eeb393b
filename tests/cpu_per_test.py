"""Where a test run's CPU goes: `python -m pytest -p tests.cpu_per_test` prints, after the run, the
CPU seconds (user + system) of each test file and of the costliest tests. A test's seconds are its
own (its process's, all threads) and those of the processes it started and waited for, and of the
`tfm` and script processes forked for it from a warm process (tests/warm_processes.py), which are
not its children. What happens between tests (collection, a module's fixtures finishing) is left
out, and a fixture's cost goes to the first test that needs it. docs/testing.md's figures of where
the CPU goes come from it."""

from __future__ import annotations

import collections
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import pytest

FOLDER = "TFM_TEST_CPU_DIR"  # the run's rows: one file per test process, one per warm process
SHOWN = 25


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config) -> None:
    if FOLDER not in os.environ:  # the controlling process (or the only one): xdist's workers inherit it
        os.environ[FOLDER] = tempfile.mkdtemp(prefix="tfm-cpu-")
        config._tfm_cpu_report = True
    config._tfm_cpu_rows = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, wall = _cpu(), time.perf_counter()
    yield
    item.config._tfm_cpu_rows.append([item.nodeid, _cpu() - started, time.perf_counter() - wall])


def pytest_sessionfinish(session) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(os.environ[FOLDER], f"tests-{worker}.json").write_text(json.dumps(session.config._tfm_cpu_rows))


def pytest_terminal_summary(terminalreporter, config) -> None:
    if not getattr(config, "_tfm_cpu_report", False):
        return
    folder = Path(os.environ[FOLDER])
    per_test: collections.Counter = collections.Counter()
    for path in folder.glob("tests-*.json"):
        for nodeid, seconds, _ in json.loads(path.read_text()):
            per_test[nodeid] += seconds
    forked = 0.0
    for path in folder.glob("warm-*.jsonl"):  # written by the warm processes, which end with their test process
        for line in path.read_text().splitlines():
            test, _, _, seconds = json.loads(line)
            per_test[test.rsplit(" (", 1)[0]] += seconds
            forked += seconds
    per_file: collections.Counter = collections.Counter()
    for nodeid, seconds in per_test.items():
        per_file[nodeid.split("::")[0]] += seconds
    write = terminalreporter.write_line
    write(f"CPU seconds in tests: {sum(per_test.values()):.0f} ({forked:.0f} of them in forked tfm and script "
          f"processes); rows in {folder}")
    for name, seconds in per_file.most_common(SHOWN):
        write(f"{seconds:8.1f}  {name}")
    write(f"the {SHOWN} costliest tests:")
    for name, seconds in per_test.most_common(SHOWN):
        write(f"{seconds:8.1f}  {name}")
