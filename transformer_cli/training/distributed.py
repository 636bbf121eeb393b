"""Multi-process training with torchrun + DistributedDataParallel (PyTorch's own engine).

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and the rendezvous address); a plain `tfm train`
has none of them and runs as a world of one, with every helper below a no-op.
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.console import warn
from ..runtime.errors import TfmError

MAX_WORLD = 1 << 16  # processes: beyond any run's (torch counts ranks in 32-bit ints)
START_TIMEOUT = 300.0  # seconds the processes of a run have to meet (TFM_START_TIMEOUT)


@dataclass(frozen=True)
class World:
    rank: int = 0  # global rank: 0 prints, logs and writes checkpoints
    local_rank: int = 0  # rank on this machine: which GPU
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1


def world_from_environment() -> World:
    """The world torchrun describes in the environment, checked: a variable that is not a whole
    number in range, or a world of several processes without a rendezvous address, is a TfmError
    naming it (not a traceback from int() or from the process group)."""
    env = os.environ
    size = _whole_number("WORLD_SIZE", env.get("WORLD_SIZE", "1"), low=1, below=MAX_WORLD + 1)
    rank = _whole_number("RANK", env.get("RANK", "0"), low=0, below=size)
    local_rank = _whole_number("LOCAL_RANK", env.get("LOCAL_RANK", "0"), low=0, below=size)
    if size > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name, "").strip()]
        if missing:
            raise TfmError(f"WORLD_SIZE={size} without {' and '.join(missing)}: start several processes with "
                           "torchrun, which sets them (docs/scaling.md)")
        _whole_number("MASTER_PORT", env["MASTER_PORT"], low=1, below=65536)
    return World(rank, local_rank, size)


def _whole_number(name: str, text: str, low: int, below: int | None = None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TfmError(f"environment variable {name}={text!r}: not a whole number (torchrun sets it)") from None
    if value < low or (below is not None and value >= below):
        bound = f"{low} to {below - 1}" if below is not None else f"at least {low}"
        raise TfmError(f"environment variable {name}={value}: must be {bound}")
    return value


def start_timeout() -> float:
    """Seconds the processes of a run have to meet: START_TIMEOUT, or TFM_START_TIMEOUT where set."""
    text = os.environ.get("TFM_START_TIMEOUT", "").strip()
    if not text:
        return START_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 86_400:
        raise TfmError(f"environment variable TFM_START_TIMEOUT={text!r}: seconds, more than 0 and at most 86400")
    return seconds


def join(world: World, device: torch.device) -> torch.device:
    """Join the process group (nccl on CUDA, gloo on CPU); each rank gets its local GPU. A process
    whose others do not come within start_timeout() seconds (a rank never started, a wrong
    MASTER_ADDR) ends with one line and exit 2: torch's own wait is 30 minutes, then a C++ trace."""
    if not world.enabled:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        seconds = start_timeout()

        def give_up() -> None:  # on a timer thread, while the main thread waits inside torch
            warn(f"error: torchrun rank {world.rank} of {world.size}: the other processes did not meet at "
                 f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {seconds:g} s (is every "
                 "rank started, with the same MASTER_ADDR/MASTER_PORT? TFM_START_TIMEOUT sets the wait)")
            os._exit(2)

        watchdog = threading.Timer(seconds, give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                                    world_size=world.size)
        finally:
            watchdog.cancel()
    return device


def leave(world: World, finished: bool) -> None:
    """Leave the process group; after a normal finish, all ranks leave together.

    (A rank that tears down while another still uses the group can lose the rendezvous store
    when that store's host exits, and abort. After an error, waiting could hang: no barrier.)
    """
    if world.enabled and dist.is_initialized():
        if finished:
            dist.barrier()
        # DistributedDataParallel's hooks form reference cycles, so the wrapped model, its reducer
        # and their pending gloo work can outlive train() until the interpreter's final clean-up,
        # where freeing them aborted a rank ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def all_max(value: int, world: World, device: torch.device) -> int:
    """The largest of every rank's `value` (a stop request anywhere stops all ranks together)."""
    if not world.enabled:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


class StopVote:
    """Every rank's stop request (0 go on, 1 stop, 2 save and stop), agreed on without the training
    step waiting for anything: each step's request goes out in a background all-reduce (MAX) of a
    CPU tensor over a gloo group of its own, so no device stream is involved (on CUDA an NCCL
    all-reduce read back with `.item()` waits for the step's whole backward), and the agreed value
    is read one step later, long arrived. Every rank reads the same step's vote, so all stop after
    the same update: the one after the request."""

    def __init__(self, world: World):
        self.world = world
        self.group = dist.new_group(backend="gloo") if world.enabled else None
        self.pending: tuple[dist.Work, torch.Tensor] | None = None

    def agree(self, request: int) -> int:
        """The agreed request of the previous step (a world of one: this one's, at once)."""
        if not self.world.enabled:
            return request
        vote = torch.tensor([request], dtype=torch.int64)
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self.pending = self.pending, (work, vote)
        return 0 if previous is None else self._read(previous)

    def close(self) -> None:
        """The last vote collected (every rank sent it): after the run's last step."""
        if self.pending is not None:
            self._read(self.pending)
            self.pending = None

    @staticmethod
    def _read(pending: tuple[dist.Work, torch.Tensor]) -> int:
        work, vote = pending
        work.wait()
        return int(vote.numpy()[0])


def all_sum(values: list[float], world: World, device: torch.device) -> list[float]:
    if not world.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_rng_states(world: World) -> list[torch.Tensor]:
    """Every rank's CPU RNG state (dropout masks differ per rank), gathered on all ranks."""
    state = torch.get_rng_state()
    if not world.enabled:
        return [state]
    states: list = [None] * world.size
    dist.all_gather_object(states, state)
    return states
