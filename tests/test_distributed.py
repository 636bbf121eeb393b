"""torchrun / DistributedDataParallel on CPU (gloo), with real processes on this machine.

Each test launches real training processes (torch.multiprocessing or torchrun) on the tiny
Multi30k config, fp32 and dropout 0 so that runs can be compared number for number.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.training.train import train

from .conftest import TFM, assert_same_final_weights, multi30k_config, wait_until_training
from .warm_processes import preexec

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_config(data_dir: Path, run_dir: Path, steps: int, **train_overrides) -> dict:
    raw = multi30k_config(data_dir, run_dir, model={"dropout": 0.0},
                          train={"max_steps": steps, "eval_every": 1000, "eval_bleu_sentences": 5, "log_every": 2,
                                 "precision": "fp32", "max_tokens": 600, **train_overrides})
    prepare(config_from_dict(raw), progress=False)
    return raw


def weights_digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def assert_same_weights(a: dict, b: dict) -> None:
    """Equal to float tolerance, except the key projection's bias, which is compared loosely.

    Softmax is invariant to a key bias, so its true gradient is 0 and what it gets is rounding
    noise that depends on the summation order; Adam divides by the noise's own magnitude and turns
    it into lr-sized steps (measured: the key biases differ by up to 2.3e-4; that noise, carried
    through the keys' rounding, leaves every other tensor within 3e-6 — 1e-9 before Q, K, V were
    fused). A real difference in the gradient moves Adam's weights by ~lr = 3e-3 per step.
    """
    for name, tensor in a.items():
        other = b[name]
        if name.endswith(("qkv_proj.bias", "kv_proj.bias")):  # rows Q|K|V (self) or K|V (cross)
            d_model = tensor.numel() // (3 if name.endswith("qkv_proj.bias") else 2)
            key = slice(d_model, 2 * d_model) if name.endswith("qkv_proj.bias") else slice(0, d_model)
            exact = torch.ones(tensor.numel(), dtype=torch.bool)
            exact[key] = False
            torch.testing.assert_close(other[exact], tensor[exact], rtol=0, atol=1e-5, msg=name)
            assert (other[key] - tensor[key]).abs().max() < 6 * 3e-3, name  # ≤ steps x peak lr
        else:
            torch.testing.assert_close(other, tensor, rtol=0, atol=1e-5, msg=name)


def _rank_main(rank: int, world_size: int, port: int, raw: dict, log_dir: str) -> None:
    """One rank, forked by start_ranks: the environment torchrun would set, then train()."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    digests = []
    train(config_from_dict(raw), progress_bar=False, on_step=lambda step, model: digests.append(weights_digest(model)))
    Path(log_dir, f"rank{rank}.json").write_text(json.dumps(digests))


def start_ranks(rank_main, *args) -> None:
    """Two ranks running `rank_main(rank, 2, port, *args)`, joined; an exception in a rank is raised
    here. They fork from multiprocessing's fork server, which imported this module (torch, tfm's
    training) and torch's compiler (which the optimizer and torch.distributed's calls import at first
    use) once per test process: a spawned rank spent ~2.5 s of CPU importing them. (Not forked
    from the test process itself: objects of earlier tests there, a CTranslate2 translator whose
    threads a fork does not copy, hung a rank that freed one.)"""
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__, "torch._dynamo"])
    mp.start_processes(rank_main, args=(2, free_port(), *args), nprocs=2, join=True, start_method="forkserver")


def torchrun(args: list[str], config: dict, tmp_path: Path, name: str, extra: list[str] = (), **popen):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "transformer_cli", "train",
           "--config", str(path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **popen)


def test_two_ranks_stay_identical_and_equal_one_process_with_their_union(multi30k_2k, tmp_path):
    raw = ddp_config(multi30k_2k, tmp_path / "ddp", steps=6)
    start_ranks(_rank_main, raw, str(tmp_path))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert len(rank0) == 6 and rank0 == rank1  # bit-identical weights after every step
    assert len(set(rank0)) == 6  # ... and they do change

    # One process with accum_steps=2 sees, per update, the union of the two ranks' batches.
    single = ddp_config(multi30k_2k, tmp_path / "single", steps=6, accum_steps=2)
    train(config_from_dict(single), progress_bar=False)
    ddp_ckpt = load_checkpoint(tmp_path / "ddp/checkpoints/checkpoint_last.pt")
    one_ckpt = load_checkpoint(tmp_path / "single/checkpoints/checkpoint_last.pt")
    assert ddp_ckpt["progress"]["batch_in_epoch"] == one_ckpt["progress"]["batch_in_epoch"] == 12
    assert ddp_ckpt["progress"]["target_tokens"] == one_ckpt["progress"]["target_tokens"]
    assert_same_weights(one_ckpt["model"], ddp_ckpt["model"])
    # The log reports the global loss and throughput (not rank 0's share).
    ddp_log = [json.loads(x) for x in (tmp_path / "ddp/metrics.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (tmp_path / "single/metrics.jsonl").read_text().splitlines()]
    ddp_train = [r for r in ddp_log if r["kind"] == "train"]
    one_train = [r for r in one_log if r["kind"] == "train"]
    assert [r["step"] for r in ddp_train] == [2, 4, 6]
    for a, b in zip(ddp_train, one_train):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["tokens_per_update"] == b["tokens_per_update"]


def _rank_recording_communication(rank: int, world_size: int, port: int, raw: dict, log_dir: str) -> None:
    """One rank whose DistributedDataParallel records, in order, each gradient as backward
    accumulates it and each bucket all-reduce DDP launches (a comm hook around its default one)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    import transformer_cli.training.train as training

    events: list[str] = []

    class RecordingDDP(DistributedDataParallel):
        def __init__(self, module, **kwargs):
            # Buckets of 0.1 MB: the tiny model spans several, as a real model spans several 25 MB ones.
            super().__init__(module, bucket_cap_mb=0.1, **kwargs)
            self.register_comm_hook(None, lambda state, bucket: events.append("allreduce") or allreduce_hook(state, bucket))
            for param in module.parameters():
                param.register_post_accumulate_grad_hook(lambda _: events.append("grad"))

    training.DistributedDataParallel = RecordingDDP
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(config_from_dict(raw), progress_bar=False)
    Path(log_dir, f"events{rank}.json").write_text(json.dumps(events))


def test_accumulation_all_reduces_once_per_update_and_overlaps_backward(multi30k_2k, tmp_path):
    """accum_steps 2 on 2 ranks: the first micro-batch's backward (under no_sync) launches no
    all-reduce; the second launches one per bucket, the first of them while gradients are still
    being computed (communication overlaps backward) once DDP has built its buckets in the order
    gradients arrive (after the first update)."""
    raw = ddp_config(multi30k_2k, tmp_path / "ddp", steps=3, accum_steps=2)
    start_ranks(_rank_recording_communication, raw, str(tmp_path))
    for rank in (0, 1):
        events = json.loads((tmp_path / f"events{rank}.json").read_text())
        grads = events.count("grad")
        assert grads % 6 == 0  # 3 updates x 2 micro-batches, every parameter each time
        parameters = grads // 6
        backwards, current, seen = [], [], 0
        for event in events:  # split at each backward's first gradient
            if event == "grad" and seen % parameters == 0:
                current = []
                backwards.append(current)
            seen += event == "grad"
            current.append(event)
        assert len(backwards) == 6
        for i, events_of_backward in enumerate(backwards):
            reduces = events_of_backward.count("allreduce")
            if i % 2 == 0:
                assert reduces == 0, f"backward {i}: {reduces} all-reduces under no_sync"
            elif i == 1:  # the first update: DDP learns the order gradients arrive in, then rebuilds its buckets
                assert reduces >= 1
            else:
                assert reduces >= 2, f"backward {i}: {reduces} bucket all-reduces: {[b.count('allreduce') for b in backwards]}"
                last_grad = len(events_of_backward) - 1 - events_of_backward[::-1].index("grad")
                assert events_of_backward.index("allreduce") < last_grad, "no all-reduce before backward ended"


def _rank_counting_reads(rank: int, world_size: int, port: int, raw: dict, log_dir: str) -> None:
    """One rank under tests/test_host_sync.py's counter of tensor-value reads, with the stop decision
    counted as part of the step (it runs after every update)."""
    from tests.test_host_sync import STEP_METHODS, ScalarReads, mark_steps
    from transformer_cli.training.train import Trainer

    inside = [False]
    mark_steps(inside, (*STEP_METHODS, (Trainer, "stop_decision")))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with ScalarReads(inside) as mode:
        summary = train(config_from_dict(raw), progress_bar=False)
    Path(log_dir, f"reads{rank}.json").write_text(json.dumps({"steps": summary.steps, "reads": mode.reads}))


def test_several_processes_agree_on_stopping_without_a_step_reading_a_tensor(multi30k_2k, tmp_path):
    """Each step's stop vote (clock, signals) is all-reduced in the background on a CPU gloo group
    and read a step later (StopVote): no rank reads a tensor value inside a step, where an
    all-reduced device tensor read back would make every step wait for its own backward on a GPU.
    The reads at log points remain (the counter sees them)."""
    raw = ddp_config(multi30k_2k, tmp_path / "ddp", steps=6, log_every=3)
    start_ranks(_rank_counting_reads, raw, str(tmp_path))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"reads{rank}.json").read_text())
        assert record["steps"] == 6
        assert record["reads"], "the counter saw no reads at all"
        assert not any(record["reads"]), f"rank {rank}: {sum(record['reads'])} tensor value(s) read inside steps"


def test_max_time_stops_every_rank_after_the_same_update(multi30k_2k, tmp_path):
    """Each rank's clock says when max_time has passed, at different steps; the vote (read a step
    later) makes both stop after the same update, with identical weights, and say why."""
    raw = ddp_config(multi30k_2k, tmp_path / "ddp", steps=100_000, max_time="2s")  # ~60 updates on a Zen 4
    start_ranks(_rank_main, raw, str(tmp_path))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert 1 < len(rank0) < 100_000 and rank0 == rank1
    last = load_checkpoint(tmp_path / "ddp/checkpoints/checkpoint_last.pt")
    assert last["progress"]["step"] == len(rank0) and last["progress"]["finished"] == "max_time=2s"


def test_torchrun_resume_continues_exactly_even_with_another_process_count(multi30k_2k, tmp_path):
    # 2 ranks straight through 6 steps, and 2 ranks through 3 resumed by torchrun to 6 (the reference
    # and the first half forked here: torchrun's own part is the resume).
    straight = ddp_config(multi30k_2k, tmp_path / "straight", steps=6, eval_every=3)
    start_ranks(_rank_main, straight, str(tmp_path))

    split = ddp_config(multi30k_2k, tmp_path / "split", steps=3, eval_every=3)
    start_ranks(_rank_main, split, str(tmp_path))
    shutil.copytree(tmp_path / "split", tmp_path / "other")  # the 2-process run at step 3, resumed below
    split["train"]["max_steps"] = 6
    proc = torchrun(["--standalone", "--nproc-per-node", "2"], split, tmp_path, "split_b", ["--resume"])
    assert proc.returncode == 0, proc.stderr
    assert "effective batch: 2 process(es)" in proc.stderr and "resuming from" in proc.stderr, proc.stderr
    assert_same_final_weights(tmp_path / "straight/checkpoints/checkpoint_last.pt",
                              tmp_path / "split/checkpoints/checkpoint_last.pt", 6)

    # The data position is counted in global batches: one process with accum_steps=2 resumes the
    # 2-process run at step 3 and reaches the same weights (to float tolerance).
    other = {**split, "run_dir": str(tmp_path / "other"), "train": {**split["train"], "accum_steps": 2}}
    train(config_from_dict(other), resume=True, progress_bar=False)
    c = load_checkpoint(tmp_path / "other/checkpoints/checkpoint_last.pt")
    a = load_checkpoint(tmp_path / "straight/checkpoints/checkpoint_last.pt")
    assert_same_weights(a["model"], c["model"])


# SIGTERM (a scheduler's) every run; Ctrl-C and a hang-up take the same way through torchrun and the
# ranks' shared stop (and reach tfm's handler in the single-process signal tests), so they wait for -m sweep.
@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.sweep),
                                  pytest.param("SIGHUP", marks=pytest.mark.sweep)])
def test_a_signal_to_torchrun_stops_every_rank_after_the_same_step_and_saves(multi30k_2k, tmp_path, name):
    """A scheduler's SIGTERM (Ctrl-C, a hang-up) reaches torchrun, which forwards it to every worker:
    the ranks agree on one step (one that differs would leave a collective waiting forever) and rank 0
    saves it and says so, once. (torchrun itself then ends with its own SignalException traceback and
    exit 1.) After a hang-up the message goes nowhere: stderr here is a pipe, which tfm then leaves."""
    import signal

    raw = ddp_config(multi30k_2k, tmp_path / "run", steps=200, log_every=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    signum = getattr(signal, name)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "transformer_cli", "train", "--config", str(path)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec(default_signals=(signum,)))
    wait_until_training(tmp_path / "run")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    saved = load_checkpoint(tmp_path / "run/checkpoints/checkpoint_last.pt")["progress"]["step"]
    assert 5 <= saved < 200, stderr
    assert "Sending process" in stderr and f"closing signal {name}" in stderr, stderr  # torchrun forwarded it
    told = 0 if name == "SIGHUP" else 1
    assert stderr.count(f"{name}: saved step {saved} to ") == told, stderr
    assert stderr.count(f"{name}: stopping after the current step") == told, stderr


def test_two_node_rendezvous_on_localhost_writes_one_set_of_outputs(multi30k_2k, tmp_path):
    raw = ddp_config(multi30k_2k, tmp_path / "run", steps=4, eval_every=2)
    path = tmp_path / "two_node.yaml"
    path.write_text(yaml.safe_dump(raw))
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "tfm-test", "-m", "transformer_cli", "train", "--config", str(path)]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("effective batch: 2 process(es)") == 1  # only global rank 0 prints
    ckpts = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert ckpts == ["checkpoint_best.pt", "checkpoint_last.pt", "step_2.pt", "step_4.pt"]
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 2), ("valid", 2), ("train", 4), ("valid", 4)]
    assert len(load_checkpoint(tmp_path / "run/checkpoints/checkpoint_last.pt")["torch_rng_ranks"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nccl)")
def test_cuda_ddp_two_processes_one_gpu_each_or_shared(multi30k_2k, tmp_path):
    raw = ddp_config(multi30k_2k, tmp_path / "run", steps=4, eval_every=2, device="cuda")
    n = max(min(torch.cuda.device_count(), 2), 1)
    proc = torchrun(["--standalone", "--nproc-per-node", str(n)], raw, tmp_path, "cuda")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run/checkpoints/checkpoint_last.pt").is_file()


def test_torchrun_on_a_locked_run_directory_stops_every_rank_at_once(multi30k_2k, tmp_path):
    """A run directory held by another `tfm train`: rank 0 says so, and every rank leaves at once
    (rank 1 once waited for rank 0's process group until torchrun killed it, ~30 s later)."""
    import time

    from transformer_cli.experiment.runlock import RunLock

    raw = ddp_config(multi30k_2k, tmp_path / "run", steps=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    with RunLock(tmp_path / "run", "tfm train"):  # as a running training holds it
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "transformer_cli", "train", "--config", str(path)],
                              capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - started
    assert proc.returncode != 0
    assert proc.stderr.count("is in use by PID") == 1, proc.stderr  # rank 0's one line
    assert "SIGKILL" not in proc.stderr and seconds < 25, (seconds, proc.stderr)
    assert not (tmp_path / "run/checkpoints").exists()


@pytest.mark.parametrize("environment, says", [
    ({"RANK": "abc"}, "RANK='abc': not a whole number"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: must be 1 to 65536"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "without MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK=2: must be 0 to 1"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
    ({"WORLD_SIZE": "99999999999999999999"}, "WORLD_SIZE=99999999999999999999: must be 1 to 65536"),
])
def test_a_bad_distributed_environment_is_one_line_naming_the_variable(monkeypatch, environment, says):
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.training.distributed import world_from_environment

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TfmError, match=re.escape(says)):
        world_from_environment()


def test_torchruns_environment_is_read_as_it_is_set(monkeypatch):
    from transformer_cli.training.distributed import World, world_from_environment

    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert world_from_environment() == World(1, 1, 2)


def test_a_rank_whose_others_never_come_ends_with_one_line_within_tfms_timeout(multi30k_2k, tmp_path):
    """RANK=1 of 2 and no rank 0: torch would wait 30 minutes, then print C++ frames."""
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(ddp_config(multi30k_2k, tmp_path / "run", steps=2)))
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TFM_START_TIMEOUT": "3"}
    started = time.monotonic()
    proc = subprocess.run([*TFM, "train", "--config", str(config)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "did not meet at 127.0.0.1" in proc.stderr and "within 3 s" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and time.monotonic() - started < 60, proc.stderr
