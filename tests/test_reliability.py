"""Faults injected into real `tfm` processes: kill -9, NaN, full disks, unwritable dirs, locks, OOM.

Each test starts the real command line (subprocess) or the real training loop and checks what a
user would see: the exit status, a one-line message without a traceback, and what is on disk.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    TFM,
    get_corpus_slice,
    multi30k_config,
    tfm_in_process,
    tiny_run,
    wait_until_training,
)
from tests.warm_processes import preexec
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import load_config
from transformer_cli.runtime.devices import split_on_out_of_memory
from transformer_cli.runtime.errors import Diverged
from transformer_cli.runtime.signals import StopRequest, Terminated, _exit_at_once, terminate_like_ctrl_c
from transformer_cli.training.train import train


def one_line_error(proc) -> str:
    """The one `error:` line of a finished command (a subprocess, or tfm_in_process's result)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def temp_files(run_dir: Path) -> list[Path]:
    return [p for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir() for p in folder.glob(".*.tmp")]


# --------------------------------------------------------------------------- kill -9


def wait_for_new_checkpoint(path: Path, written_before: int | None, proc: subprocess.Popen,
                            timeout: float = 60.0) -> None:
    """Return once `proc` has written `path` (its mtime differs from `written_before`)."""
    started = time.monotonic()
    while not (path.exists() and path.stat().st_mtime_ns != written_before):
        assert proc.poll() is None, f"training ended before writing a checkpoint: {proc.communicate()[1]}"
        assert time.monotonic() - started < timeout, f"no checkpoint written {timeout:.0f} s after start"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("kills_wanted", [4, pytest.param(12, marks=pytest.mark.sweep)])
def test_kill_9_at_random_moments_always_resumes(tiny_prepared, tmp_path, kills_wanted):
    """SIGKILLs at random moments of a run that checkpoints every step: every restart resumes. Half
    land in the start-up, half while it trains; 12 in the sweep."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=100_000, save_every=1, eval_every=25, keep_last=2)
    last = tmp_path / "run/checkpoints/checkpoint_last.pt"
    rng = random.Random(0)
    kills, steps_seen, stale_seen = 0, [], 0
    deadline = time.monotonic() + 30 * kills_wanted
    while kills < kills_wanted and time.monotonic() < deadline:
        args = [*TFM, "train", "--config", str(config)] + (["--resume"] if last.exists() else [])
        written_before = last.stat().st_mtime_ns if last.exists() else None
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills % 2 == 0:  # start-up takes 2–5 s, by CPU: these kills land before, during or after it
            time.sleep(rng.uniform(0.5, 4.0))
        else:  # and these while it trains and writes a checkpoint every step, however slow the start
            wait_for_new_checkpoint(last, written_before, proc)
            time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        _, stderr = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, stderr  # it was still running: nothing ended it early
        kills += 1
        stale_seen += bool(temp_files(tmp_path / "run"))
        if last.exists():  # whatever moment the kill hit, the last checkpoint is whole
            steps_seen.append(load_checkpoint(last)["progress"]["step"])
    assert kills == kills_wanted, f"only {kills} kills in the time limit"
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] > 0, steps_seen
    final = steps_seen[-1] + 20
    done = tfm_in_process("train", "--config", config, "--resume", "--set", f"train.max_steps={final}")
    assert done.exit_code == 0, done.stderr
    assert f"resuming from {last} at step {steps_seen[-1]}" in done.stderr
    assert load_checkpoint(last)["progress"]["step"] == final
    assert temp_files(tmp_path / "run") == []  # killed writes' temp files were cleaned up
    print(f"{kills} kills, checkpoints at steps {steps_seen}, {stale_seen} kills left a temp file")


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.005, 0.2])
def test_a_second_signal_while_stopping_corrupts_nothing(tiny_prepared, tmp_path, delay):
    """SIGTERM, then another SIGTERM soon after: during the first one's save, or while the process
    is already leaving (where it once met the default handler and died by the signal, -15)."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=100_000, save_every=20)
    last = tmp_path / "run/checkpoints/checkpoint_last.pt"
    proc = subprocess.Popen([*TFM, "train", "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not last.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (130, 143) and "Traceback" not in stderr, stderr
    step = load_checkpoint(last)["progress"]["step"]  # whole, whichever write the second signal hit
    assert step >= 10  # the first evaluation's checkpoint, or a later one
    resumed = tfm_in_process("train", "--config", config, "--resume", "--set", f"train.max_steps={step + 3}")
    assert resumed.exit_code == 0, resumed.stderr
    assert temp_files(tmp_path / "run") == []  # an abandoned temp file, if any, was cleaned up


@pytest.mark.parametrize("ignored", ["SIGINT", "SIGHUP"])
def test_a_signal_the_process_started_with_ignored_stays_ignored(ignored):
    """`tfm train &` in a script, or under nohup: the shell ignores SIGINT in the job so that Ctrl-C
    on the script leaves it running, nohup ignores SIGHUP so that closing the terminal does; training
    must not take the signal back (SIGTERM still stops it)."""
    if not hasattr(signal, ignored):
        pytest.skip(f"no {ignored} on this platform")
    ignored = getattr(signal, ignored)
    previous = {signum: signal.getsignal(signum) for signum in (ignored, signal.SIGTERM)}
    signal.signal(ignored, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with StopRequest() as stop:
            assert signal.getsignal(ignored) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            os.kill(os.getpid(), ignored)
            time.sleep(0.05)  # Python runs handlers between bytecodes of the main thread
            assert stop.signum is None
        assert signal.getsignal(ignored) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored: no stop was requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_sigterm_outside_the_training_loop_raises_and_a_stops_repeat_handler_survives_it():
    """Commands take SIGTERM like Ctrl-C (an exception, so `finally` clauses run); training's own
    handler nests inside, and once a training stop has begun, leaving the outer block must not bring
    the default handler back (a repeat would then kill the process by the signal, not its code)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Terminated) as raised, terminate_like_ctrl_c():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # interrupted by the exception
        assert raised.value.exit_code == 143
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # undone

        with terminate_like_ctrl_c():
            with StopRequest() as stop:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                assert stop.signum == signal.SIGTERM  # recorded, not raised: the loop saves first
            assert signal.getsignal(signal.SIGTERM) is _exit_at_once
        assert signal.getsignal(signal.SIGTERM) is _exit_at_once  # still: not SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_stale_temp_files_are_removed_at_start(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=3)
    stale = tmp_path / "run/checkpoints/.checkpoint_last.pt.abc123.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a checkpoint")
    metrics = tmp_path / "run/metrics.jsonl"
    metrics.write_text('{"kind": "train", "step": 1, "lo')  # an append cut by a kill
    result = tfm_in_process("train", "--config", config)  # the command line's start-up, in this process
    assert result.exit_code == 0, result.stderr
    assert not stale.exists() and "removed .checkpoint_last.pt.abc123.tmp" in result.stderr
    lines = metrics.read_text().splitlines()
    assert lines[0] == '{"kind": "train", "step": 1, "lo' and all(json.loads(line) for line in lines[1:])


# --------------------------------------------------------------------------- divergence


@pytest.mark.slow
def test_divergence_stops_with_exit_3_and_keeps_the_last_checkpoint(tiny_prepared, tmp_path):
    """An absurd learning rate makes every loss NaN after the first update: exit 3, no traceback."""
    config = tiny_run(tiny_prepared, tmp_path, lr=1e30, save_every=1, max_bad_steps=4, clip_norm=0.0)
    result = tfm_in_process("train", "--config", config)  # the command line's exit status, in this process
    assert result.exit_code == 3, result.stderr
    assert "training diverged: 4 consecutive steps" in one_line_error(result)
    assert result.stderr.count("update(s) skipped") == 4  # read at each of the four checkpoints
    assert load_checkpoint(tmp_path / "run/checkpoints/checkpoint_last.pt")["progress"]["step"] >= 1


def poison(model: torch.nn.Module, forwards: int, seen: list[dict]) -> None:
    """Make the model's next `forwards` outputs NaN (a real forward hook), recording the weights each time."""
    state = {"left": forwards}

    def hook(module, inputs, output):
        if state["left"] == 0:
            return output
        state["left"] -= 1
        seen.append({k: v.detach().clone() for k, v in module.state_dict().items()})
        return output * float("nan")

    model.register_forward_hook(hook)


@pytest.mark.slow
def test_a_nan_step_is_skipped_without_touching_the_weights(tiny_prepared, tmp_path, capsys):
    """Skipped on the device (fused Adam's found_inf), counted and reported at the next log point."""
    config_path = tiny_run(tiny_prepared, tmp_path, max_steps=12, max_bad_steps=3, log_every=5)
    config = load_config(config_path)
    seen: list[dict] = []
    steps: list[int] = []

    def on_step(step: int, model: torch.nn.Module) -> None:
        steps.append(step)
        if step == 4:
            poison(model, 1, seen)

    summary = train(config, progress_bar=False, on_step=on_step)
    assert summary.steps == 12 and steps == list(range(1, 13))  # updates tried, the skipped one among them
    assert "non-finite loss/gradient: 1 update(s) skipped up to step 5, the last at step 5" in capsys.readouterr().err
    progress = load_checkpoint(tmp_path / "run/checkpoints/checkpoint_last.pt")["progress"]
    assert progress["skipped_steps"] == 1 and progress["bad_steps"] == 0
    weights = load_checkpoint(tmp_path / "run/checkpoints/checkpoint_last.pt")["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_consecutive_nan_steps_leave_weights_untouched_then_stop(tiny_prepared, tmp_path):
    """Poisoned from step 3: the run of skips is read at the log point of step 5, where it is 3 long."""
    config = load_config(tiny_run(tiny_prepared, tmp_path, max_steps=50, max_bad_steps=3, log_every=5))
    seen: list[dict] = []
    on_step = lambda step, model: poison(model, 10, seen) if step == 2 else None  # noqa: E731
    with pytest.raises(Diverged, match="3 consecutive steps"):
        train(config, progress_bar=False, on_step=on_step)
    assert len(seen) == 3  # three poisoned forwards, three skipped updates
    for later in seen[1:]:  # the weights seen by each poisoned forward: unchanged by the skipped updates
        assert all(torch.equal(later[k], seen[0][k]) for k in seen[0])


# --------------------------------------------------------------------------- disks


def limit_file_size(max_bytes: int):
    return preexec(limits=((resource.RLIMIT_FSIZE, max_bytes),))


@pytest.mark.slow
def test_failed_checkpoint_write_is_one_line_and_keeps_the_previous_one(tiny_prepared, tmp_path):
    """A file-size limit (as a full disk would) makes the next checkpoint write fail: EFBIG, exit 2."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=10)
    train(load_config(config), progress_bar=False)  # in this process: the faults below hit real ones
    last = tmp_path / "run/checkpoints/checkpoint_last.pt"
    before = last.read_bytes()
    proc = subprocess.run([*TFM, "train", "--config", str(config), "--resume", "--set", "train.max_steps=20"],
                          capture_output=True, text=True, preexec_fn=limit_file_size(100_000))
    assert proc.returncode == 2, proc.stderr
    message = one_line_error(proc)
    assert "File too large (EFBIG)" in message and str(tmp_path / "run" / "checkpoints") in message
    assert last.read_bytes() == before and temp_files(tmp_path / "run") == []
    train(load_config(config, ["train.max_steps=20"]), resume=True, progress_bar=False)
    assert load_checkpoint(last)["progress"]["step"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("console", ["/dev/full", "closed pipe"])
def test_a_console_that_takes_no_more_output_does_not_stop_training(tiny_prepared, tmp_path, console):
    """`tfm train 2> train.log` on a disk that fills up (/dev/full: every write fails, ENOSPC), or
    into a pipe whose reader quit (`2>&1 | head`: EPIPE). The console is only a view of the run:
    training goes on, metrics.jsonl says why the console went quiet, SIGTERM still stops it with a
    save (143), and a resumed run ends normally (0). Before: the first line that could not be
    written ended the run with nothing saved (exit 1 with a traceback nobody could see; exit 0 for
    the pipe)."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=100_000, eval_every=10_000, log_every=1)
    run = tmp_path / "run"
    args = [*TFM, "train", "--config", str(config)]

    def start(extra: list[str] = []) -> subprocess.Popen:  # noqa: B006
        if console == "/dev/full":
            with open("/dev/full", "w") as full:
                return subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=full)
        proc = subprocess.Popen([*args, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr.readline()  # it wrote to the pipe while it could; then the reader quits
        proc.stderr.close()
        return proc

    def records() -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    proc = start()
    wait_until_training(run, records=40)
    lost = [i for i, r in enumerate(records()) if r["kind"] == "console_lost"]
    assert len(lost) == 1, records()[:3]
    expected = "stderr: No space left on device (ENOSPC)" if console == "/dev/full" else "stderr: Broken pipe (EPIPE)"
    assert records()[lost[0]]["error"] == expected
    assert sum(r["kind"] == "train" for r in records()[lost[0]:]) >= 20  # it went on training
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    step = load_checkpoint(run / "checkpoints/checkpoint_last.pt")["progress"]["step"]
    assert step >= 40
    resumed = start(["--resume", "--set", f"train.max_steps={step + 5}"])
    assert resumed.wait(timeout=120) == 0
    assert load_checkpoint(run / "checkpoints/checkpoint_last.pt")["progress"]["step"] == step + 5


@pytest.mark.slow
def test_output_into_a_full_disk_is_one_line_and_a_dead_stderr_keeps_the_exit_status(tmp_path):
    """stdout on a full disk (/dev/full: every write fails with ENOSPC) for a command's result, for
    --version and for --help: one line naming standard output, exit 2. Before: `error: No space left on
    device (ENOSPC)` naming nothing (evaluate), a traceback and exit 1 (--version, --help). And a BLEU
    gate whose stderr is on a full disk still exits 1 (fail) or 0 (pass): before, 2 with a traceback."""
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a small dog runs\nthe cat sleeps on the sofa\n")
    ref.write_text("a small dog runs\nthe cat sleeps on a sofa\n")
    score = ["evaluate", "--hyp", str(hyp), "--ref", str(ref)]
    for args in (score, [*score, "--json"], ["--version"], ["--help"], ["evaluate", "--help"]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([*TFM, *args], stdout=full, stderr=subprocess.PIPE, text=True)
        assert (proc.returncode, proc.stderr) == (2, "error: standard output: No space left on device (ENOSPC)\n"), args
    for gate, status in (("99", 1), ("10", 0)):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([*TFM, *score, "--min-bleu", gate], stdout=subprocess.PIPE, stderr=full, text=True)
        assert proc.returncode == status and proc.stdout.startswith("BLEU = "), (gate, proc.stdout)


@pytest.fixture(scope="module")
def multi30k_8k(tmp_path_factory) -> Path:
    return get_corpus_slice(tmp_path_factory.mktemp("multi30k_8k"), 8000)


@pytest.mark.slow
@pytest.mark.parametrize("max_bytes, fails_on", [(100_000, "spm.model"), (300_000, "data/train.src.tokens.npy")])
def test_failed_prepare_write_is_one_line_and_leaves_nothing_half_written(multi30k_8k, tmp_path, max_bytes, fails_on):
    """A full disk (a file-size limit here) while `tfm prepare` writes the vocabulary (~254 kB) or the
    encoded training data (~348 kB a side): exit 2 naming that file, nothing truncated left behind,
    and the next prepare works. (sentencepiece's own writer ignored the failed write and left a
    truncated spm.model, which a later load turned into a traceback.)"""
    raw = multi30k_config(multi30k_8k, tmp_path / "run")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(raw))
    proc = subprocess.run([*TFM, "prepare", "--config", str(config)], capture_output=True, text=True,
                          preexec_fn=limit_file_size(max_bytes))
    assert proc.returncode == 2, proc.stderr
    assert one_line_error(proc) == f"error: {tmp_path / 'run' / fails_on}: File too large (EFBIG)"
    run = tmp_path / "run"
    assert not (run / fails_on).exists() and not (run / "prepare.json").exists()
    assert [p for p in run.rglob("*") if p.name.endswith(".tmp")] == []
    done = tfm_in_process("prepare", "--config", config)  # no limit now: in this process
    assert done.exit_code == 0, done.stderr
    assert (run / fails_on).stat().st_size > max_bytes  # it did need more than the limit


def without_permission_override():
    """Root ignores file permissions; drop that privilege in the child so a read-only dir is one
    (CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, for good: warm_processes.preexec)."""
    return preexec(drop_capabilities=(1, 2)) if os.geteuid() == 0 else None


@pytest.mark.slow
def test_read_only_run_dir_is_a_one_line_error(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=3)
    train(load_config(config), progress_bar=False)  # a checkpoint to resume and evaluate below
    run = tmp_path / "run"
    try:
        for path in [run, *run.rglob("*")]:
            if path.is_dir():
                path.chmod(0o555)
        for args in (["prepare", "--config", config, "--force", "--discard-checkpoints"], ["train", "--config", config, "--resume", "--set", "train.max_steps=5"],
                     ["evaluate", "--config", config, "--checkpoint", run / "checkpoints/checkpoint_last.pt"]):
            proc = subprocess.run([*TFM, *map(str, args)], capture_output=True, text=True,
                                  preexec_fn=without_permission_override())
            assert proc.returncode == 2, (args, proc.stderr)
            message = one_line_error(proc)
            assert "Permission denied (EACCES)" in message and str(run) in message, message
    finally:
        for path in [run, *run.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)


# --------------------------------------------------------------------------- concurrent use


@pytest.mark.slow
def test_second_training_on_a_run_dir_is_refused_and_a_dead_holders_lock_is_taken_over(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=100_000, save_every=50)
    first = subprocess.Popen([*TFM, "train", "--config", str(config)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    last = tmp_path / "run/checkpoints/checkpoint_last.pt"
    deadline = time.monotonic() + 120
    while not last.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # The commands that come second run in this process: the lock is the run directory's, whoever asks.
    second = tfm_in_process("train", "--config", config, "--resume")
    assert second.exit_code == 2
    assert f"in use by PID {first.pid} (tfm train)" in one_line_error(second)
    assert tfm_in_process("prepare", "--config", config, "--force").exit_code == 2  # prepare waits its turn too
    first.kill()  # kill -9: the lock file stays behind, naming a dead process
    first.communicate()
    assert (tmp_path / "run/.tfm.lock").exists()
    step = load_checkpoint(last)["progress"]["step"]
    resumed = tfm_in_process("train", "--config", config, "--resume", "--set", f"train.max_steps={step + 5}")
    assert resumed.exit_code == 0, resumed.stderr
    assert load_checkpoint(last)["progress"]["step"] == step + 5


# --------------------------------------------------------------------------- memory


@pytest.mark.slow
def test_out_of_memory_while_training_names_max_tokens(tiny_prepared, tmp_path):
    """An allocation that cannot succeed (address-space limit in the child): a message naming the knob."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=2)

    proc = subprocess.run([*TFM, "train", "--config", str(config), "--set", f"model.d_ff={2**27}"],
                          capture_output=True, text=True, preexec_fn=preexec(limits=((resource.RLIMIT_AS, 8 * 2**30),)))
    assert proc.returncode == 2, proc.stderr
    message = one_line_error(proc)
    assert "out of memory while training" in message and "train.max_tokens (now 1500)" in message


def test_translation_batches_that_run_out_of_memory_are_halved():
    """`split_on_out_of_memory` with a decoder that cannot fit more than 3 sentences at once."""
    calls: list[int] = []

    def decode(batch: list[int]) -> list[int]:
        calls.append(len(batch))
        if len(batch) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [x * 10 for x in batch]

    splits: list[int] = []
    assert split_on_out_of_memory(decode, list(range(10)), splits.append) == [x * 10 for x in range(10)]
    assert splits == [10, 5, 5] and max(c for c in calls if c <= 3) == 3

    def hopeless(batch: list[int]) -> list[int]:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(RuntimeError, match="can't allocate"):
        split_on_out_of_memory(hopeless, [1, 2])
    with pytest.raises(ValueError):  # other errors are not retried
        split_on_out_of_memory(lambda b: (_ for _ in ()).throw(ValueError("bug")), [1, 2])


# --------------------------------------------------------------------------- writers keep modes and links


def test_a_file_written_through_a_link_replaces_the_links_target_and_the_link_stays(tmp_path):
    """`tfm api-key --api-keys LINK` replaced the link by a regular file: the server's real key file
    never got the key (exit 0)."""
    from transformer_cli.runtime.files import atomic_write_text

    real = tmp_path / "real" / "keys.txt"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "keys-link.txt"
    link.symlink_to(real)
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"
    assert sorted(p.name for p in real.parent.iterdir()) == ["keys.txt"]  # no temporary left


def test_a_directory_built_onto_a_link_fills_its_target_and_follows_the_umask(tmp_path):
    """`tfm export -o LINK_TO_EMPTY_FOLDER` replaced the link, left `.…staging.old` and said "Cannot
    call rmtree on a symbolic link" after succeeding; every directory export and import made was 0700."""
    from transformer_cli.runtime.files import replace_with_staged, staging_directory

    previous = os.umask(0o022)
    try:
        folder = tmp_path / "exports" / "model"
        folder.mkdir(parents=True)
        link = tmp_path / "model-link"
        link.symlink_to(folder, target_is_directory=True)
        staging = staging_directory(link)
        (staging / "model.bin").write_bytes(b"weights")
        replace_with_staged(staging, link)
        assert link.is_symlink() and (folder / "model.bin").read_bytes() == b"weights"
        assert sorted(p.name for p in folder.parent.iterdir()) == ["model"]  # no staging left beside it
        assert folder.stat().st_mode & 0o777 == 0o755  # another account may read an export
    finally:
        os.umask(previous)


def test_a_run_nested_in_a_prepared_runs_own_folder_is_written_by_its_own_writer(tmp_path):
    """The model filter could not train its own models in a run prepared before: its sub-run's
    spm.model (filter_models/half1/, no prepare.json of its own yet) counted as the outer run's own
    file, and the outer run was not this process's to write."""
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.runtime.files import atomic_write_text, claim_directory, release_directory

    outer = tmp_path / "run"
    half = outer / "filter_models" / "half1"
    half.mkdir(parents=True)
    (outer / "prepare.json").write_text("{}")
    with pytest.raises(TfmError, match="own files"):
        atomic_write_text(half / "spm.model", "x")  # nobody's writer: refused, as before
    claim_directory(half)
    try:
        atomic_write_text(half / "spm.model", "x")  # the sub-run's writer writes it
        with pytest.raises(TfmError, match="own files"):
            atomic_write_text(outer / "spm.model", "x")  # ...but not the outer run's own files
    finally:
        release_directory(half)
    assert (half / "spm.model").read_text() == "x" and not (outer / "spm.model").exists()


def test_a_key_file_saved_with_a_byte_order_mark_reads_as_without_one(tmp_path):
    """A BOM an editor put at the start: "line 1: not 'sha256:…'" for a good key."""
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.serve.access import ApiKeys

    line = "sha256:" + "ab" * 32 + " ops"
    keys = ApiKeys.parse("\ufeff" + line + "\n", tmp_path / "keys.txt")
    assert keys.hashes == ApiKeys.parse(line + "\n", tmp_path / "keys.txt").hashes
    with pytest.raises(TfmError, match="line 2: not 'sha256"):
        ApiKeys.parse("\ufeff" + line + "\nsha256:zz\n", tmp_path / "keys.txt")


@pytest.mark.parametrize("kind", ["directory", "dev-null", "fifo"])
def test_a_config_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind):
    """A directory, /dev/null or a FIFO as --config: "config file not found" (a FIFO: read forever)."""
    from transformer_cli.runtime.errors import TfmError

    path = {"directory": tmp_path, "dev-null": Path("/dev/null"), "fifo": tmp_path / "fifo"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(TfmError, match="a directory" if kind == "directory" else "not a regular file"):
        load_config(path)


@pytest.mark.parametrize("manifest", ['{"vocab": {"src": "spm.mo', '["not", "a", "manifest"]', '{"files": {}}',
                                      '{"vocab": {"src": "spm.model"}, "vocab_size": {"src": "many"}}'])
def test_a_torn_or_foreign_prepare_json_is_one_line_naming_it_for_every_command_that_reads_it(tiny_prepared, tmp_path,
                                                                                             manifest):
    """A kill cannot tear prepare.json (written atomically), but an edit or another program can: train,
    shortlist and distill read it back as a record (each key's type checked), and say which file is
    wrong, writing nothing."""
    config = tiny_run(tiny_prepared, tmp_path, max_steps=3)
    (tmp_path / "run" / "prepare.json").write_text(manifest)
    for command in ("train", "shortlist", "distill"):
        result = tfm_in_process(command, "--config", config)
        assert result.exit_code == 2, (command, result.stderr)
        assert result.stderr.count("\n") == 1 and "prepare.json" in result.stderr and "tfm prepare" in result.stderr, \
            (command, result.stderr)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "shortlist.txt").exists()
