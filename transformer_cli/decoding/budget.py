"""What a decoding call may cost, bounded before it starts.

A search holds, per decoder layer, the keys and values of every output position of every row
(sentences × beams, or × samples), the source's cross-attention keys and values, and at each step
a row of logits over the target vocabulary per row. Those grow with the settings multiplied
together: `--beam 1000000` on one line, or 64 samples of 32 long lines, asked the kernel for more
memory than the machine has, and the out-of-memory killer ended the process without a word.
`check_decoding_budget` computes an upper bound of those tensors from the settings and the input's
shape, and refuses, naming the setting that raises it, when it is over the limit: half of the
memory available when the command starts, or `decode.max_memory`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ..experiment.config import DecodeConfig, parse_size
from ..model.lengths import output_length_limit, output_token_cap, source_token_limit
from ..runtime.errors import TfmError


class ModelSizes(Protocol):
    """The sizes the bound is computed from: a `model.TransformerConfig`, or what a CTranslate2
    model directory shows of them (`interop.ct2.ExportedSizes`; this module imports no torch)."""

    d_model: int
    n_heads: int
    d_ff: int
    dec_layers: int
    tgt_vocab_size: int
    max_positions: int

FLOAT = 4  # bytes: fp32 bounds bf16 caches too, and int8 decoding keeps fp32 activations
INDEX = 8  # bytes of a token id (int64)
WORKSPACE = 32 * 2**20  # bytes a search takes whatever its size: kernels' scratch space, allocator slack
# Peak memory measured over what is counted below: fp32 search and greedy stayed under 1x; bf16 beam
# search on CPU ran to 0.9–1.7x, varying from run to run (its caches grow 8 positions at a time, with
# kernels built for each new length, and decoding's heap keeps what is freed: cpu.keep_freed_memory).
SLACK = 2.0
GREEDY_TASK_BATCHES = 8  # translate.CONTINUOUS_BATCHES: batches a greedy task decodes together


@dataclass(frozen=True)
class DecodingShape:
    """The sizes one decoding process works with at a time, from the settings and the input."""

    lines: int  # sentences in the batch it decodes
    batches: int  # batches the call makes
    source: int  # source positions of the longest line, </s> included
    output: int  # output positions it may run to (max_len_a · source + max_len_b, capped by positions)
    beams: int  # hypotheses kept per sentence (1: greedy or sampling)
    samples: int  # samples drawn per sentence (1 unless sampling)
    sampling: bool
    processes: int  # processes decoding a batch each at the same time
    terms: int = 0  # the most constraints a line has (the constrained beam's candidates grow with them)
    term_pieces: int = 0  # the longest constraint's target pieces


def decoding_shape(model_cfg: ModelSizes, decode: DecodeConfig, n_lines: int, longest_source_tokens: int,
                   processes: int = 1, longest_prefix: int = 0, constraints: tuple[int, int] = (0, 0)) -> DecodingShape:
    """The largest batch `n_lines` lines whose longest has `longest_source_tokens` tokens (</s>
    excluded) make under `decode` (its beam and nbest); a target
    prefix (or constraints) of `longest_prefix` tokens raises the output limit to leave room after
    it; `constraints`: the most terms a line has, and the most pieces a term has."""
    source = min(max(longest_source_tokens, 0), source_token_limit(model_cfg.max_positions)) + 1  # decoding cuts longer lines
    lines = max(min(n_lines, decode.batch_size), 1)
    if decode.batch_tokens is not None:  # length_sorted_batches: width × sentences ≤ batch_tokens
        lines = max(min(lines, decode.batch_tokens // source), 1)
    batches = -(-max(n_lines, 1) // lines)
    return DecodingShape(
        lines=lines, batches=batches, source=source,
        output=min(max(output_length_limit(source, decode.max_len_a, decode.max_len_b, model_cfg.max_positions),
                       longest_prefix + 1), output_token_cap(model_cfg.max_positions)),
        beams=1 if decode.sample else decode.beam, samples=decode.nbest if decode.sample else 1,
        sampling=decode.sample, processes=max(min(processes, batches), 1), terms=constraints[0],
        term_pieces=constraints[1])


def model_bytes(cfg: ModelSizes, shape: DecodingShape) -> int:
    """An upper bound of the memory one model's search over one batch of `shape` allocates, every
    sentence running to its length limit."""
    d, heads, ff, vocab = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.tgt_vocab_size
    rows = shape.lines * shape.beams * shape.samples  # decoding rows
    greedy = shape.beams == 1 and not shape.sampling
    # Greedy decodes a task of batches with continuous batching: the next one is encoded while the
    # rows still hold the current one, and the output ids of all of them are kept.
    task = min(GREEDY_TASK_BATCHES, shape.batches) if greedy else 1
    # Sources encoded at once: sampling repeats each per sample.
    encoded = shape.lines * shape.samples * min(task, 2)
    room = -(-shape.output // 8) * 8  # cache positions (beam caches grow 8 at a time)
    # Self-attention keys and values of every layer; a reorder or a growth copies them before the old ones go.
    self_cache = 2 * cfg.dec_layers * rows * room * d * FLOAT * 2
    # bf16 beam search on CPU masks each row over its sentence's beams × positions (fp32), per layer.
    beam_mask = cfg.dec_layers * rows * shape.beams * room * FLOAT * 2 if shape.beams > 1 else 0
    cross_cache = 2 * cfg.dec_layers * encoded * shape.source * d * FLOAT
    memory = encoded * shape.source * d * FLOAT
    ids = (rows * 2 + task * shape.lines) * shape.output * INDEX  # beam histories (copied each step); greedy's outputs
    # The largest transient: an encoder layer over the batch (torch's attention kernels go through
    # the scores a block at a time: no source × source term), or one decoding step: logits (sampling
    # sorts, sums and scatters them), the feed-forward layer, and attention scores, their masked sum
    # and softmax over the keys (a bf16 beam row's: all its sentence's beams' slots).
    encoder_step = encoded * shape.source * (8 * d + ff) * FLOAT
    logits = (8 if shape.sampling else 3) * vocab
    attention = 4 * heads * (room * shape.beams + shape.source)
    decoder_step = rows * (logits + ff + 6 * d + attention) * FLOAT
    # The constrained beam compares each of its candidates (2K best, K per term, K own best) with
    # every piece of every term (booleans), and keeps a state per candidate and term.
    candidates = shape.lines * shape.beams * (3 + shape.terms) if shape.terms else 0
    constrained = candidates * shape.terms * (shape.term_pieces + 6 * INDEX)
    tensors = self_cache + beam_mask + cross_cache + memory + ids + max(encoder_step, decoder_step) + constrained
    return WORKSPACE + int(SLACK * tensors)


def decoding_bytes(model_cfg: ModelSizes | Sequence[ModelSizes], shape: DecodingShape) -> int:
    """The bound for all processes decoding at once; an ensemble's members each keep their own caches."""
    members = list(model_cfg) if isinstance(model_cfg, Sequence) else [model_cfg]
    return shape.processes * sum(model_bytes(cfg, shape) for cfg in members)


def check_decoding_budget(model_cfg: ModelSizes | Sequence[ModelSizes], decode: DecodeConfig,
                          n_lines: int, longest_source_tokens: int, limit_bytes: int | None, *, processes: int = 1,
                          longest_prefix: int = 0, constraints: tuple[int, int] = (0, 0)) -> None:
    """Refuse (TfmError, one line naming the limit and the setting that raises the cost most) a
    decoding call of `n_lines` lines, the longest `longest_source_tokens` tokens, whose bound is
    over `limit_bytes` (None: no limit). `processes`: decoding
    processes that each take a batch at the same time (decode.workers); `longest_prefix`: target
    prefix tokens the output is forced through; `constraints`: as `decoding_shape`'s."""
    if limit_bytes is None:
        return
    members = list(model_cfg) if isinstance(model_cfg, Sequence) else [model_cfg]
    first = members[0]
    shape = decoding_shape(first, decode, n_lines, longest_source_tokens, processes, longest_prefix, constraints)
    need = decoding_bytes(members, shape)
    if need <= limit_bytes:
        return
    what = (f"{shape.samples} sample(s)" if decode.sample else f"beam {shape.beams}" if shape.beams > 1 else "greedy")
    raise TfmError(f"decoding {shape.lines} line(s) of up to {shape.source - 1} token(s) at once ({what}, up to "
                   f"{shape.output} output tokens, {shape.processes} process(es)) could need {format_size(need)} of "
                   f"memory, more than the limit of {format_size(limit_bytes)} (decode.max_memory; by default half "
                   f"the memory available): {remedy(members, shape)}")


def decoding_work(members: Sequence[ModelSizes], shape: DecodingShape) -> float:
    """The floating-point operations a decoding call of `shape` is estimated to take, every
    sentence running to its length limit: per decoding row and step, each member's decoder layers
    (self- and cross-attention projections, the feed-forward layer, attention over the positions
    so far) and its output layer; a constrained beam does that work for each of its banks (one per
    constraint, plus its own)."""
    lines = shape.lines * shape.batches
    rows = lines * shape.beams * shape.samples
    per_row_step = sum(2 * (cfg.dec_layers * (8 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff
                                              + 2 * cfg.d_model * (shape.output + shape.source))
                            + cfg.d_model * cfg.tgt_vocab_size) for cfg in members)
    return float(rows) * shape.output * per_row_step * (1 + shape.terms)


def parts_within_work(model_cfg: ModelSizes | Sequence[ModelSizes], decode: DecodeConfig, lengths: Sequence[int], *,
                      longest_prefix: int = 0, constraints: tuple[int, int] = (0, 0)) -> list[list[int]]:
    """The lines of one decoding call (`lengths`: their source tokens) as parts each within
    decode.max_work (`decoding_work`), longest lines first: a file's chunk of a large model at a wide
    beam is searched a part at a time instead of being refused. One part (all lines, in order) when
    they fit together; a line over the budget alone makes a part of its own, which the search refuses."""
    members = list(model_cfg) if isinstance(model_cfg, Sequence) else [model_cfg]

    def work(n_lines: int, longest: int) -> float:
        return decoding_work(members, decoding_shape(members[0], decode, n_lines, longest, 1, longest_prefix,
                                                     constraints))

    if not lengths or work(len(lengths), max(lengths)) <= decode.max_work:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts, start = [], 0
    while start < len(order):
        longest, low, high = lengths[order[start]], 1, len(order) - start
        while low < high:  # the most lines (work grows with them) whose search stays within the budget
            middle = (low + high + 1) // 2
            low, high = (middle, high) if work(middle, longest) <= decode.max_work else (low, middle - 1)
        parts.append(order[start:start + low])
        start += low
    return parts


def check_decoding_work(model_cfg: ModelSizes | Sequence[ModelSizes], decode: DecodeConfig, n_lines: int,
                        longest_source_tokens: int, *, longest_prefix: int = 0, constraints: tuple[int, int] = (0, 0)) -> None:
    """Refuse (TfmError, one line) a decoding call whose estimated work (`decoding_work`) is over
    decode.max_work: time is budgeted like memory, before the work starts."""
    members = list(model_cfg) if isinstance(model_cfg, Sequence) else [model_cfg]
    shape = decoding_shape(members[0], decode, n_lines, longest_source_tokens, 1, longest_prefix, constraints)
    need = decoding_work(members, shape)
    if need <= decode.max_work:
        return
    what = (f"{shape.samples} sample(s)" if decode.sample else f"beam {shape.beams}" if shape.beams > 1 else "greedy")
    terms = f", {shape.terms} constraint(s) a line" if shape.terms else ""
    raise TfmError(f"translating {n_lines} line(s) of up to {shape.source - 1} token(s) ({what}, up to {shape.output} "
                   f"output tokens{terms}) is estimated at {need:.2g} floating-point operations, more than "
                   f"decode.max_work ({decode.max_work:.2g}): {'send fewer lines, ' if n_lines > 1 else ''}lower the beam"
                   f"{', the samples' if decode.sample else ''}{' or the constraints' if shape.terms else ''}, "
                   "or raise decode.max_work")


def remedy(members: list[ModelSizes], shape: DecodingShape) -> str:
    """What to lower: of the settings that multiply the bound, the one whose smallest value cuts it
    most; the lines' length only where no setting multiplies it."""
    choices = [
        (shape.beams, replace(shape, beams=1), f"lower --beam (decode.beam, now {shape.beams})"),
        (shape.samples, replace(shape, samples=1), f"lower --nbest (samples per line, now {shape.samples})"),
        (shape.lines, replace(shape, lines=1),
         f"decode fewer lines at once (--batch-size/--batch-tokens: now {shape.lines} a batch)"),
        (shape.processes, replace(shape, processes=1), f"lower --workers (decode.workers, now {shape.processes})"),
    ]
    smaller = [(decoding_bytes(members, cut), advice) for now, cut, advice in choices if now > 1]
    if not smaller:
        return (f"translate shorter lines, or lower decode.max_len_a/max_len_b (now up to {shape.output} output "
                "tokens), or raise decode.max_memory")
    return f"{min(smaller)[1]}, or raise decode.max_memory"


# --------------------------------------------------------------------------- the limit


def available_memory() -> int | None:
    """Bytes this process could still allocate without swapping: the kernel's MemAvailable, or
    less where a cgroup (a container) limits memory; None where the system does not say (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    found.extend(cgroup_headroom())
    return min(found) if found else None


def cgroup_headroom() -> list[int]:
    """Limit minus usage of this process's memory cgroup (v2, else v1), where one is set."""
    pairs = (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")):
        for limit_name, usage_name in pairs:
            try:
                limit, usage = ((root / name).read_text().strip() for name in (limit_name, usage_name))
                if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                    return [max(int(limit) - int(usage), 0)]
            except (OSError, ValueError):
                continue
    return []


def decoding_memory_limit(decode: DecodeConfig, device: Any = None) -> int | None:
    """The bytes a decoding call may take: decode.max_memory, else half of what is available now
    (the GPU's free memory on CUDA); None when that cannot be known."""
    if decode.max_memory is not None:
        return parse_size(decode.max_memory)
    if getattr(device, "type", device) == "cuda":  # a torch.device, or "cuda" (CTranslate2's engine)
        import torch

        if not torch.cuda.is_available():  # CTranslate2 sees the GPU, this torch build does not
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    available = available_memory()
    return None if available is None else available // 2


_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB")


def format_size(n: float) -> str:
    """Bytes → '1.5 GB' (powers of 1024, as `free -h` counts)."""
    exponent = min(int(math.log(max(n, 1), 1024)), len(_UNITS) - 1)
    value = n / 1024**exponent
    return f"{value:.0f} {_UNITS[exponent]}" if exponent == 0 else f"{value:.1f} {_UNITS[exponent]}"



# --------------------------------------------------------------------------- time

_deadline: float | None = None  # time.monotonic() by which the searches of this process must end
_stopped = False  # every search of this process stops at its next step (a server shutting down)


class DeadlinePassed(TfmError):
    """A search ran past its deadline (`tfm serve --request-timeout`, or the server stopping) and
    was stopped between two decoding steps: the request gets 504, and the engine is free again."""


@contextlib.contextmanager
def searches_end_by(deadline: float | None) -> Iterator[None]:
    """Within this block every search step checks the clock (`check_deadline`): past `deadline`
    (a time.monotonic() value, the same clock in every process of the machine, so a decoding
    process keeps its parent's deadline) the search raises DeadlinePassed. None: no deadline."""
    global _deadline
    before, _deadline = _deadline, deadline
    try:
        yield
    finally:
        _deadline = before


class SearchesStopped(TfmError):
    """The searches were stopped from outside (`tfm serve` shutting down after its grace period)."""


def stop_searches() -> None:
    """Every search of this process stops at its next step with SearchesStopped; callable from any
    thread (a plain flag: the search reads it between steps)."""
    global _stopped
    _stopped = True


def check_deadline() -> None:
    """Called once per decoding step: cheap (one clock read) when a deadline is set, nothing otherwise."""
    if _stopped:
        raise SearchesStopped("the server is stopping: decoding was stopped")
    if _deadline is not None and time.monotonic() > _deadline:
        raise DeadlinePassed("decoding ran past its deadline and was stopped")
