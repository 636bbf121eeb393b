"""A run directory is what it says it is, and outputs never destroy what they should not.

- Run identity: a run's own config.yaml means the directory it is in (a copied run never writes into
  its origin); `prepare` never rebuilds a trained run's vocabulary and data under its checkpoints;
  `train --resume` refuses checkpoints made on another vocabulary or other encoded data.
- Outputs: a run's checkpoints and inputs are written only by the process holding its lock; a FIFO
  given as `-o` is written into, not replaced.
- Temporaries name their writer: whoever writes into a directory next removes a dead writer's
  leftovers there, never a live writer's (a real `kill -9`, and made-up dead writers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import TFM, tiny_run
from tests.conftest import tfm_in_process as tfm
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.runlock import RunLock
from transformer_cli.runtime import files
from transformer_cli.runtime.files import atomic_write_text, remove_stale_temps, staging_directory, writer_tag


@pytest.fixture(scope="module")
def trained(tiny_prepared, tmp_path_factory) -> Path:
    """A tiny run trained for 4 steps (step_2.pt, step_4.pt, checkpoint_last.pt …); copy it before use."""
    root = tmp_path_factory.mktemp("trained")
    proc = tfm("train", "--config", tiny_run(tiny_prepared, root, max_steps=4, eval_every=2, keep_last=3))
    assert proc.exit_code == 0, proc.stderr
    return root / "run"


def copy_of(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too; not the lock, which names its last holder) by
    relative path: compare before and after."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".tfm.lock"}


def one_error(proc) -> str:
    assert proc.exit_code == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


# --------------------------------------------------------------------------- run identity


def test_a_run_directorys_own_config_means_that_directory(tmp_path):
    run = tmp_path / "copied"
    run.mkdir()
    (run / "prepare.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path / "origin")}))
    assert load_config(run / "config.yaml").run_path == run
    assert load_config(run / "config.yaml", ["run_dir=elsewhere"]).run_dir == "elsewhere"  # an explicit --set wins
    (run / "prepare.json").unlink()  # a config file beside no run is read as written
    assert load_config(run / "config.yaml").run_path == tmp_path / "origin"


@pytest.mark.slow
def test_a_copied_run_trains_and_prepares_itself_never_its_origin(trained, tmp_path):
    origin = copy_of(trained, tmp_path / "a")
    copy = copy_of(origin, tmp_path / "b")  # cp -r a b: b/config.yaml still names a's directory
    assert load_config(copy / "config.yaml").run_path == copy
    before = contents(origin)

    resumed = tfm("train", "--config", copy / "config.yaml", "--resume", "--set", "train.max_steps=6")
    assert resumed.exit_code == 0, resumed.stderr
    assert load_checkpoint(copy / "checkpoints/checkpoint_last.pt")["progress"]["step"] == 6
    assert contents(origin) == before

    refused = tfm("prepare", "--config", copy / "config.yaml", "--force")
    assert "--discard-checkpoints" in one_error(refused) and f"{copy} holds a trained model" in refused.stderr
    assert (copy / "checkpoints/checkpoint_last.pt").is_file()

    rebuilt = tfm("prepare", "--config", copy / "config.yaml", "--force", "--discard-checkpoints")
    assert rebuilt.exit_code == 0, rebuilt.stderr
    [aside] = copy.glob("discarded-*")
    assert (aside / "checkpoints/checkpoint_last.pt").is_file() and (aside / "metrics.jsonl").is_file()
    assert not (copy / "checkpoints").exists() and "moved the earlier training" in rebuilt.stderr
    assert contents(origin) == before


def test_prepare_with_changed_settings_does_not_rebuild_a_trained_run(trained, tmp_path):
    """Not only --force: settings or inputs that changed make prepare rebuild, silently before."""
    run = copy_of(trained, tmp_path / "run")
    before = contents(run)
    refused = tfm("prepare", "--config", run / "config.yaml", "--set", "data.max_len=6")
    assert "settings or inputs changed" in one_error(refused)
    assert contents(run) == before


@pytest.mark.parametrize(("changed", "message"), [
    ("data.train_limit=300", "was trained with another source vocabulary"),  # learnt from fewer sentences
    ("data.max_len=6", "was trained on other encoded data"),  # the same vocabulary, fewer training pairs
])
@pytest.mark.slow
def test_resume_refuses_a_run_prepared_again_since(trained, tmp_path, changed, message):
    """The run is prepared again with other settings while its checkpoints are away (as an older tfm
    did under them); put back, they must not go on training with ids that now mean other pieces."""
    run = copy_of(trained, tmp_path / "run")
    shutil.move(run / "checkpoints", tmp_path / "away")
    again = tfm("prepare", "--config", run / "config.yaml", "--force", "--set", changed)
    assert again.exit_code == 0, again.stderr
    shutil.move(tmp_path / "away", run / "checkpoints")
    last = run / "checkpoints/checkpoint_last.pt"
    before = last.read_bytes()
    refused = tfm("train", "--config", run / "config.yaml", "--resume", "--set", "train.max_steps=6")
    assert message in one_error(refused)
    assert last.read_bytes() == before


def test_resume_from_a_weights_only_checkpoint_last_is_one_line(trained, tmp_path):
    """What an older `tfm average -o RUN/checkpoints/checkpoint_last.pt` left: a KeyError traceback."""
    run = copy_of(trained, tmp_path / "run")
    ckpts = run / "checkpoints"
    averaged = tfm("average", ckpts / "step_2.pt", ckpts / "step_4.pt", "-o", tmp_path / "avg.pt")
    assert averaged.exit_code == 0, averaged.stderr
    shutil.copy(tmp_path / "avg.pt", ckpts / "checkpoint_last.pt")
    assert "holds no training state" in one_error(tfm("train", "--config", run / "config.yaml", "--resume"))


# --------------------------------------------------------------------------- outputs


def test_average_never_replaces_training_state_and_writes_into_checkpoints_only_with_force(trained, tmp_path):
    run = copy_of(trained, tmp_path / "run")
    ckpts = run / "checkpoints"
    inputs = [ckpts / "step_2.pt", ckpts / "step_4.pt"]
    before = contents(run)
    for output, force, message in [
        (ckpts / "checkpoint_last.pt", False, "is what --resume continues"),
        (ckpts / "checkpoint_last.pt", True, "is what --resume continues"),
        (ckpts / "step_6.pt", True, "pruned and averaged by training"),
        (ckpts / "checkpoint_avg.pt", False, "pass --force"),
        (run / "spm.model", True, "own files (its data, vocabulary or settings)"),
        (run / "data/train.src.tokens.npy", True, "own files"),
    ]:
        refused = tfm("average", *inputs, "-o", output, *(["--force"] if force else []))
        assert message in one_error(refused), (output, refused.stderr)
    assert contents(run) == before
    (ckpts / "scores.json").write_text('{"metric": "bleu", "checkpoint_best.pt": 1.0, "checkpoint_avg.pt": 9.0}')
    written = tfm("average", *inputs, "-o", ckpts / "checkpoint_avg.pt", "--force")
    assert written.exit_code == 0, written.stderr
    assert load_checkpoint(ckpts / "checkpoint_avg.pt")["averaged"] == [str(p) for p in inputs]
    assert "checkpoint_avg.pt" not in (ckpts / "scores.json").read_text()  # the old average's score is gone
    with RunLock(run, "tfm train"):  # a run that trains takes nothing from another command
        assert "is in use by" in one_error(tfm("average", *inputs, "-o", ckpts / "other.pt", "--force"))


def test_other_commands_do_not_write_into_a_runs_checkpoints(trained, tmp_path):
    """The rule is in the writer itself (atomic_path): translate -o gets it without a check of its own."""
    run = copy_of(trained, tmp_path / "run")
    refused = tfm("translate", "--checkpoint", run / "checkpoints/step_4.pt", "-o", run / "checkpoints/hyp.txt",
                  input="wa wb\n")
    assert "own files" in one_error(refused)
    assert not (run / "checkpoints/hyp.txt").exists()


def test_average_into_a_fifo_writes_into_it(trained, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with open(tmp_path / "received.pt", "wb") as received:
        reader = subprocess.Popen(["cat", str(fifo)], stdout=received)
    try:
        ckpts = trained / "checkpoints"
        proc = tfm("average", ckpts / "step_2.pt", ckpts / "step_4.pt", "-o", fifo)
        assert proc.exit_code == 0, proc.stderr
        assert reader.wait(timeout=30) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
    assert fifo.is_fifo()  # not replaced by a file
    assert load_checkpoint(tmp_path / "received.pt")["averaged"] == [str(ckpts / "step_2.pt"), str(ckpts / "step_4.pt")]


# --------------------------------------------------------------------------- dead writers' leftovers


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_next_writer_removes_dead_writers_temporaries_and_never_a_live_ones(tmp_path):
    host, pid = files._HOST, dead_pid()
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    dead = tmp_path / f".out.txt.tfm-{host}-{pid}-123.abcd1234.tmp"
    live = tmp_path / f".out.txt.{writer_tag()}.efgh5678.tmp"
    elsewhere = tmp_path / f".out.txt.tfm-{other_host}-{pid}-123.ijkl9012.tmp"  # a shared disk's other machine
    users = tmp_path / ".notes.tmp"  # not a tfm temporary
    dead_staging = tmp_path / f".export.tfm-{host}-{pid}-123.mnop3456.staging"
    put_back = tmp_path / f".model.tfm-{host}-{pid}-123.qrst7890.staging.old"  # a directory moved aside to replace it
    for path in (dead, live, elsewhere, users):
        path.write_text("half")
    for folder in (dead_staging, put_back):
        folder.mkdir()
        (folder / "model.bin").write_text("weights")
    start = files._process_start(os.getpid())
    reused = tmp_path / f".out.txt.tfm-{host}-{os.getpid()}-{(start or 0) + 1}.uvwx1234.tmp"  # same PID, later process
    reused.write_text("half")

    atomic_write_text(tmp_path / "out.txt", "new")

    assert (tmp_path / "out.txt").read_text() == "new"
    assert not dead.exists() and not dead_staging.exists()
    assert (tmp_path / "model/model.bin").read_text() == "weights" and not put_back.exists()
    assert live.exists() and elsewhere.exists() and users.exists()
    assert reused.exists() == (start is None)  # where start times are known (Linux), a reused PID is no alibi
    # the staging helper cleans up the same way, and names its own directory after this process
    (tmp_path / f".x.tfm-{host}-{pid}-123.abcd1234.tmp").write_text("half")
    staging = staging_directory(tmp_path / "export")
    assert staging.is_dir() and writer_tag() in staging.name and not (tmp_path / f".x.tfm-{host}-{pid}-123.abcd1234.tmp").exists()
    # a run's lock holder also removes old-style temporaries (no writer in the name), never a live writer's
    run = tmp_path / "run"
    run.mkdir()
    old_style, live_in_run = run / ".checkpoint_last.pt.abc123.tmp", run / f".hyp.txt.{writer_tag()}.abcd1234.tmp"
    old_style.write_text("half")
    live_in_run.write_text("half")
    with RunLock(run, "tfm train"):
        assert remove_stale_temps(run) == [old_style]
    assert live_in_run.exists()


@pytest.mark.slow
def test_a_kill_9_mid_write_leaves_a_temporary_that_the_next_command_removes(trained, tmp_path):
    """A real `tfm translate -o` killed while it writes (its input, a FIFO, still open)."""
    fifo, out = tmp_path / "source", tmp_path / "out/hyp.txt"
    os.mkfifo(fifo)
    checkpoint = trained / "checkpoints/step_4.pt"
    proc = subprocess.Popen([*TFM, "translate", "--checkpoint", str(checkpoint), "-i", str(fifo), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with open(fifo, "w") as source:  # returns once tfm has opened its input
            source.write("wa wb\n")
            source.flush()
            deadline = time.monotonic() + 60
            while not list(out.parent.glob(".hyp.txt.*.tmp")) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    [left] = out.parent.glob(".hyp.txt.*.tmp")
    assert f"-{proc.pid}-" in left.name and not out.exists()

    again = tfm("translate", "--checkpoint", checkpoint, "-o", out, input="wa wb\n")
    assert again.exit_code == 0, again.stderr
    assert out.read_text().count("\n") == 1 and list(out.parent.glob(".*.tmp")) == []


def test_where_the_filesystem_has_no_flock_the_lock_holders_pid_decides(tmp_path, monkeypatch):
    """Some network mounts refuse flock (ENOLCK): the PID the holder wrote into the lock file is
    checked instead: a live other process keeps the run, a dead one's lock is taken over."""
    import errno

    from transformer_cli.experiment import runlock

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (run / runlock.LOCK_NAME).write_text(f"PID {sleeper.pid} (tfm train)\n")
        with pytest.raises(runlock.TfmError) as refused:
            with RunLock(run, "tfm prepare"):
                pass
        assert str(refused.value) == f"{run} is in use by PID {sleeper.pid} (tfm train) (lock {run / runlock.LOCK_NAME})"
    finally:
        sleeper.kill()
        sleeper.wait()
    (run / runlock.LOCK_NAME).write_text(f"PID {dead_pid()} (tfm train)\n")  # its holder died: taken over
    with RunLock(run, "tfm prepare"):
        assert (run / runlock.LOCK_NAME).read_text() == f"PID {os.getpid()} (tfm prepare)\n"
        with RunLock(run, "tfm train"):  # the PID is this process's own: no other holder to wait for
            pass


def test_files_tfm_cannot_read_as_text_are_named_with_their_fix(tmp_path):
    latin1 = tmp_path / "corpus.de"
    latin1.write_bytes("Grüße aus Köln\n".encode("latin-1") * 3)
    assert files.text_file_problem(latin1) == ("it is not UTF-8 (byte 2: invalid start byte); Latin-1 or "
                                               "Windows-1252? convert it: iconv -f WINDOWS-1252 -t UTF-8")
    cut = tmp_path / "cut.de"
    cut.write_bytes("Grüße".encode()[:3])  # a character cut in two at the end of what was read: not a finding
    assert files.text_file_problem(cut) is None
    assert files.text_file_problem(tmp_path / "missing.de") is None  # the caller says "not found" itself
    assert files._process_start(dead_pid()) is None


def test_a_digest_file_that_cannot_be_read_is_one_line_with_the_remedy(tmp_path):
    shortlist = tmp_path / "shortlist.txt"
    files.write_with_digest(shortlist, "a b\n")
    assert files.check_digest(shortlist, "make it again") == files.digest_file(shortlist).read_text().split()[0]
    files.digest_file(shortlist).write_text("")
    with pytest.raises(files.TfmError) as empty:
        files.check_digest(shortlist, "make it again")
    assert str(empty.value) == f"{files.digest_file(shortlist)}: cannot be read (IndexError): make it again"


def test_a_staged_directory_that_cannot_be_moved_into_place_puts_the_previous_one_back(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "model.bin").write_text("previous")
    gone = staging_directory(target)
    gone.rmdir()  # the move fails (as on a full or vanished mount): the error names the target
    with pytest.raises(OSError) as failed:
        files.replace_with_staged(gone, target)
    assert failed.value.filename == str(target)
    assert (target / "model.bin").read_text() == "previous" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
