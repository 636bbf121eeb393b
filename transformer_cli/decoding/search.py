"""Search: greedy, sampling and beam decoding over the model's incremental API (encode once,
cached steps). What a search is asked for travels as one `SearchSettings`; greedy and sampling are
one loop (`greedy_search_continuous`) that differs only in how it picks each token (`PickRule`)."""

from __future__ import annotations

import functools
import gc
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from ..experiment.scoring import finished_needed, gnmt_length_penalty
from ..model.decoder_state import SearchModel, SearchState
from ..model.lengths import output_token_cap
from .budget import check_deadline
from .constraints import AvoidedSequences, ConstrainedBeams, recent_tokens
from .hypothesis import Hypothesis
from .top_k import top_k, top_k_in_chunks

if TYPE_CHECKING:
    from ..experiment.config import DecodeConfig
    from .terms import TermIds


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of search (back-translation): each token is drawn from the model's
    distribution at `temperature`, restricted to the `top_k` most probable tokens (0: all) and to
    the smallest set whose probability reaches `top_p` (nucleus sampling, Holtzman et al., 2020)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class SearchSettings:
    """What one search is asked for, built once from the decode settings (`from_decode`) and handed
    unchanged to every worker and batch."""

    beam: int = 1  # 1: greedy (or sampling)
    nbest: int = 1  # hypotheses per sentence (samples, when sampling)
    length_penalty: float = 0.6  # GNMT alpha (beam search)
    max_len_a: float = 1.5  # output tokens at most a · source length + b
    max_len_b: int = 10
    min_len: int = 0  # output tokens at least (benchmarks that force lengths)
    sampling: Sampling | None = None  # draw tokens instead of searching
    deadline: float | None = None  # time.monotonic() by which the search must end (budget.searches_end_by)
    word_continuations: tuple[int, ...] = ()  # target pieces that continue a word (constraints: whole words)

    @classmethod
    def from_decode(cls, decode: DecodeConfig, min_len: int = 0, max_len: int | None = None,
                    deadline: float | None = None) -> SearchSettings:
        """`decode`'s settings; `max_len` forces the length limit to a constant."""
        a, b = (0.0, max_len) if max_len is not None else (decode.max_len_a, decode.max_len_b)
        sampling = Sampling(decode.temperature, decode.top_k, decode.top_p, decode.seed) if decode.sample else None
        return cls(decode.beam, decode.nbest, decode.length_penalty, a, b, min_len, sampling, deadline)

    @property
    def continuous(self) -> bool:
        """Greedy: a task's batches decode together, with continuous batching."""
        return self.beam <= 1 and self.sampling is None


Search = TypeVar("Search", bound=Callable)


def without_cyclic_gc(search: Search) -> Search:
    """Run `search` with Python's cyclic garbage collector paused (its previous state restored).

    A decoding step creates a few hundred tensor objects, so the collector's young generation fills
    and is scanned about once a step, finding nothing: a search makes no reference cycles, and
    reference counting frees every tensor as before (docs/performance.md has the measurement).
    """

    @functools.wraps(search)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return search(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused  # type: ignore[return-value]


def beam_top_k(logprobs: torch.Tensor, beam_scores: torch.Tensor, k: int,
               chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best continuations of each sentence's beams: logprobs (N·B, V) of B beams per sentence,
    beam_scores (N, B) → values beam_score + log-prob (N, k) and their indices into the sentence's
    B·V candidates, exactly what top_k(logprobs + beam_scores per row, viewed (N, B·V)) gives.

    On CPU with V a multiple of `chunk`, the sum is not written over the whole vocabulary (a pass
    over B·V floats per sentence): each chunk lies within one beam, so its maximum plus that beam's
    score is the maximum of its sums (x ↦ x + s rounds monotonically), the k best chunks are
    picked from those, and only their values get the beam score added.
    """
    n, beams = beam_scores.shape
    vocab = logprobs.size(-1)
    if logprobs.device.type != "cpu" or vocab % chunk or beams * vocab < 8 * k * chunk:
        return top_k(logprobs.add_(beam_scores.view(-1, 1)).view(n, beams * vocab), k)
    per_beam = vocab // chunk
    chunk_best = logprobs.view(n, beams, per_beam, chunk).amax(dim=3).add_(beam_scores[:, :, None])  # (N, B, C)
    best_chunks = chunk_best.view(n, -1).topk(k, dim=1).indices  # (N, k) among the B·C chunks
    return top_k_in_chunks(logprobs.view(n, beams * vocab), best_chunks, k, chunk,
                           added=beam_scores.gather(1, best_chunks // per_beam))


def log_probs(logits: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 log-softmax of (R, V) logits, written over one fp32 buffer: at beam sizes each (R, V)
    tensor is megabytes, and every fresh one glibc hands out as new pages (mmap) whose page faults
    cost more than the arithmetic.

    bf16 logits are widened into `buffer` (1-D fp32, at least R·V elements) when given: a search
    passes the same one every step, so the copy writes memory that is already mapped and cached
    (the widening copy of 126 × 8,000 logits: ~0.1 ms into it, ~0.4 ms into a fresh tensor)."""
    if logits.dtype == torch.float32:
        out = logits  # nothing else reads them
    elif buffer is not None and buffer.numel() >= logits.numel() and buffer.device == logits.device:
        out = buffer[: logits.numel()].view(logits.shape).copy_(logits)
    else:
        out = logits.float()
    return torch.log_softmax(out, dim=-1, out=out)


def logits_buffer(rows: int, logits: torch.Tensor) -> torch.Tensor | None:
    """The fp32 buffer log_probs widens a search's (up to `rows`, V) logits into (None for fp32)."""
    return None if logits.dtype == torch.float32 else logits.new_empty(rows * logits.size(-1), dtype=torch.float32)


def max_output_lengths(src: torch.Tensor, pad_id: int, a: float, b: int, min_len: int,
                       max_positions: int) -> torch.Tensor:
    """Per sentence its own limit: a · src_len + b target tokens (src_len counts the source's <eos>),
    at least `min_len` and at most what the position table holds. Each row's limit depends on its
    own length only, never on the other rows of its batch."""
    src_len = (src != pad_id).sum(dim=1)
    cap = output_token_cap(max_positions)
    # a and b above the cap give the cap (src_len ≥ 1): cut them first, so that no product or sum
    # overflows a float or an int64 on the way (max_len_a 1e308, max_len_b 1e20).
    a, b = min(a, float(cap)), min(b, cap)
    return ((a * src_len.float()).long() + b).clamp(min=min_len).clamp(min=1, max=cap)


class PickRule(Protocol):
    """How a one-token-a-step search picks: log-probabilities (A, V) of the live rows, the sentence
    (row of the whole input) each decodes and the output position it decodes (A,) → the picked
    tokens' log-probabilities (A,) and the tokens (A,)."""

    def __call__(self, logprobs: torch.Tensor, sentences: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def most_probable(logprobs: torch.Tensor, sentences: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy search's pick rule: the arg-max."""
    best, tokens = top_k(logprobs, 1)
    return best.squeeze(1), tokens.squeeze(1)


def prefix_table(prefixes: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sentence its forced target ids, padded with -1 (N, max length ≥ 1), and their lengths (N,)."""
    width = max(max(map(len, prefixes), default=0), 1)
    table = torch.full((len(prefixes), width), -1, dtype=torch.long)
    for row, ids in enumerate(prefixes):
        table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return table.to(device), torch.tensor([len(p) for p in prefixes], device=device)


class PrefixPick:
    """A pick rule that takes each sentence's prefix token while the sentence is within its prefix,
    and `inner`'s pick after it (target prefixes: interactive translation, autocompletion)."""

    def __init__(self, inner: PickRule, prefixes: list[list[int]], device: torch.device):
        self.inner = inner
        self.table, self.lengths = prefix_table(prefixes, device)

    def __call__(self, logprobs: torch.Tensor, sentences: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, tokens = self.inner(logprobs, sentences, positions)
        forced = positions < self.lengths.index_select(0, sentences)  # (A,)
        if bool(forced.any()):
            column = positions.clamp(max=self.table.size(1) - 1)
            tokens = torch.where(forced, self.table[sentences, column], tokens)
            best = torch.where(forced, logprobs.gather(1, tokens[:, None]).squeeze(1), best)
        return best, tokens


def with_room(limits: torch.Tensor, terms: list[TermIds] | None, max_positions: int) -> torch.Tensor:
    """Per-sentence output limits (N,) raised to leave room for each sentence's prefix and
    constraints (`TermIds.room`), capped by positions."""
    if not terms:
        return limits
    room = torch.tensor([t.room() for t in terms], device=limits.device)
    return torch.maximum(limits, room).clamp(max=output_token_cap(max_positions))


def apply_terms(terms: list[TermIds] | None, limits: torch.Tensor, max_positions: int
                ) -> tuple[torch.Tensor, list[list[int]] | None, AvoidedSequences | None]:
    """What the sentences' terms make of a search: their output limits (N,) raised to leave them
    room (`with_room`), their forced target ids (None where none has a prefix) and the sequences
    their outputs must not contain (None where none avoids any)."""
    prefixes = [t.prefix for t in terms] if terms and any(t.prefix for t in terms) else None
    avoided = AvoidedSequences([t.avoid for t in terms], limits.device) if terms and any(t.avoid for t in terms) else None
    return with_room(limits, terms, max_positions), prefixes, avoided


def recent_outputs(outputs: torch.Tensor, sentences: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` tokens each row output before `positions` (A,), from `outputs` (sentences, steps)
    → (A, width); -2 before the start (what `AvoidedSequences.ban` reads)."""
    columns = positions[:, None] - torch.arange(width, 0, -1, device=positions.device)  # (A, width)
    recent = outputs[sentences[:, None], columns.clamp(min=0)]
    return recent.masked_fill_(columns < 0, -2)


def greedy_search(
    model: SearchModel, src: torch.Tensor, bos: int, eos: int,
    max_len_a: float = 1.5, max_len_b: int = 10, min_len: int = 0, terms: list[TermIds] | None = None,
) -> list[Hypothesis]:
    """Arg-max decoding of a (B, S) source batch; finished rows leave the batch."""
    return greedy_search_continuous(model, [src], bos, eos, max_len_a, max_len_b, min_len, terms=terms)[0]


@without_cyclic_gc
@torch.inference_mode()
def greedy_search_continuous(
    model: SearchModel, batches: list[torch.Tensor], bos: int, eos: int,
    max_len_a: float = 1.5, max_len_b: int = 10, min_len: int = 0, pick: PickRule = most_probable,
    terms: list[TermIds] | None = None,
) -> list[list[Hypothesis]]:
    """greedy_search over several (B_i, S_i) source batches with continuous batching: up to B_0 rows
    decode at once, and a row whose sentence is done takes the next waiting sentence at the next
    step instead of leaving the batch → per batch, its sentences' hypotheses.

    Within one batch, output lengths vary, so a batch decoded alone runs its last steps on a few
    rows, which cost nearly as much as full ones on CPU (each step's fixed cost: ~3.3 ms of ops,
    weights streamed through the caches, against a small cost per row).
    Here rows stay full until the last batch's sentences. The next batch is encoded when its first
    sentence is needed; batches should come longest first (`length_sorted_batches`), so a joining
    sentence's source fits the rows' (it is padded; a longer one widens them all).
    Results equal greedy_search's per batch up to rounding: a row that joined later attends over
    the cache slots written before it with an additive −inf mask. `pick` chooses each token: the
    arg-max, or a draw (`SamplingPick`: sampling is this loop with another rule). `terms`: per
    sentence of all the batches, the target ids it must start with (`PrefixPick`) and the
    sequences it must not contain (their last token is barred where the rest precedes it);
    positive constraints need beam search.
    """
    pad = model.cfg.pad_id
    device = batches[0].device
    counts = [b.size(0) for b in batches]
    if terms and any(t.constraints for t in terms):
        raise ValueError("positive constraints need beam search (beam ≥ 2)")
    limits_all, prefixes, avoided = apply_terms(terms, torch.cat(
        [max_output_lengths(b, pad, max_len_a, max_len_b, min_len, model.cfg.max_positions) for b in batches]),
        model.cfg.max_positions)
    if prefixes:
        pick = PrefixPick(pick, prefixes, device)
    # each source's length up to its last real token: the positions after it are padding
    source_lengths = torch.cat([((b != pad) * torch.arange(1, b.size(1) + 1, device=device)).amax(dim=1)
                                for b in batches])
    total, steps = len(limits_all), int(limits_all.max())
    outputs = torch.full((total, steps), eos, dtype=torch.long, device=device)  # (all sentences, steps)
    scores = torch.zeros(total, device=device)
    waiting = WaitingBatches(model, batches)
    state = waiting.encode(0, steps)
    state.positions = torch.zeros(counts[0], dtype=torch.long, device=device)
    sentence = torch.arange(counts[0], device=device)  # the sentence number each row decodes
    limits = limits_all[: counts[0]].clone()
    tokens = torch.full((counts[0],), bos, dtype=torch.long, device=device)
    buffer = None
    while True:
        check_deadline()
        logits = model.decode_step(tokens, state)  # (A, V)
        if buffer is None:
            buffer = logits_buffer(counts[0], logits)
        logprobs = log_probs(logits, buffer)
        positions = state.positions - 1  # the position each row just decoded
        if min_len:
            logprobs[:, eos].masked_fill_(positions < min_len, float("-inf"))
        if avoided is not None:
            avoided.ban(logprobs, sentence, recent_outputs(outputs, sentence, positions, avoided.width))
        best, tokens = pick(logprobs, sentence, positions)
        outputs.index_put_((sentence, positions), tokens)
        scores.index_add_(0, sentence, best)
        finished = (tokens == eos) | (positions + 1 >= limits)
        if not bool(finished.any()):
            continue
        free = finished.nonzero().squeeze(1)
        while free.numel() and waiting.any():  # done rows take waiting sentences
            rows, numbers = waiting.admit(free, state)
            sentence.index_copy_(0, rows, numbers)
            limits.index_copy_(0, rows, limits_all.index_select(0, numbers))
            tokens.index_fill_(0, rows, bos)
            free = free[len(rows):]
        if free.numel():  # no sentence waits: these rows leave the batch
            keep = torch.ones_like(finished).index_fill_(0, free, False).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            sentence, limits, tokens = sentence[keep], limits[keep], tokens[keep]
            state = state.reorder(keep, keep)
        compact(state, int(source_lengths.index_select(0, sentence).max()))
    hyps = [Hypothesis(row[: row.index(eos) if eos in row else len(row)], score)
            for row, score in zip(outputs.tolist(), scores.tolist())]
    return [hyps[first : first + count] for first, count in zip(waiting.firsts, counts)]


class WaitingBatches:
    """Continuous batching's queue: the batches whose sentences have not all started, each encoded
    when its first sentence is needed (batch 0 starts the search)."""

    def __init__(self, model: SearchModel, batches: list[torch.Tensor]):
        self.model, self.batches = model, batches
        self.counts = [b.size(0) for b in batches]
        self.firsts = [sum(self.counts[:i]) for i in range(len(batches))]  # each batch's first sentence number
        self.queue = list(range(1, len(batches)))  # batches not yet started
        # the batch sentences are taken from: its number, its encoded state, its sentences taken
        self.batch, self.state, self.taken = 0, None, 0

    def encode(self, i: int, capacity: int) -> SearchState:
        memory, src_mask = self.model.encode(self.batches[i])
        return self.model.init_state(memory, src_mask, max_len=capacity)

    def any(self) -> bool:
        return self.state is not None or bool(self.queue)

    def admit(self, free: torch.Tensor, state: SearchState) -> tuple[torch.Tensor, torch.Tensor]:
        """The next waiting sentences into the free rows (the first of `free`, as many as the current
        batch has left) of `state` → those rows and the sentence number each now decodes."""
        if self.state is None:
            self.batch = self.queue.pop(0)
            self.state, self.taken = self.encode(self.batch, 1), 0
        rows = free[: self.counts[self.batch] - self.taken]
        joining = torch.arange(self.taken, self.taken + len(rows), device=free.device)
        state.admit(rows, self.state, joining)
        self.taken += len(rows)
        if self.taken == self.counts[self.batch]:
            self.state = None
        return rows, joining + self.firsts[self.batch]


def compact(state: SearchState, longest_source: int) -> None:
    """Continuous batching: shrink what the rows' caches no longer need. Batches come longest first
    and later sentences take the rows of finished ones, padded to the widest source so far: narrow
    the sources again once every row's (`longest_source`) fits in 3/4 of them; drop the cache slots
    before the first one any row attends to, once they are half the cache."""
    if longest_source <= state.source_width * 3 // 4:
        state.narrow_sources(longest_source)
    if state.self_mask is None:  # no row has joined: every row attends from slot 0
        return
    oldest = state.length - int(state.positions.max())  # the first cache slot any row attends to
    if oldest >= 16 and 2 * oldest >= state.length:
        state.drop_front(oldest)


def finish_eos_choices(eos_in_top_k: torch.Tensor, top_scores: torch.Tensor, top_beams: torch.Tensor,
                       history: torch.Tensor, alive: list[int], k: int, lp: float,
                       finished: list[list[Hypothesis]], best_finished: list[float]) -> None:
    """Beam search: the candidates among each sentence's top K that chose <eos> (N, K) become finished
    hypotheses (score / lp), in place. An -inf <eos> (barred by min_len) can rank there only when
    fewer than 2K candidates are finite: it is skipped."""
    rows, cols = eos_in_top_k.nonzero(as_tuple=True)
    for r, c in zip(rows.tolist(), cols.tolist()):
        score = float(top_scores[r, c])
        if score == float("-inf"):
            continue
        sent = alive[r]
        finished[sent].append(Hypothesis(history[r * k + int(top_beams[r, c])].tolist(), score / lp))
        best_finished[sent] = max(best_finished[sent], finished[sent][-1].score)


def done_sentences(beam_scores: torch.Tensor, history: torch.Tensor, alive: list[int], at_limit: list[bool],
                   k: int, lp: float, finished: list[list[Hypothesis]], best_finished: list[float],
                   min_finished: list[int], complete: torch.Tensor | None = None) -> list[bool]:
    """Beam search: per live sentence, whether it is done. At its length limit its live beams
    (`beam_scores` (N, K)) finish too, those that are `complete` (N, K) (every constraint placed;
    None: all); otherwise it is done once `min_finished[sentence]` hypotheses have finished and the best of
    them beats its best live beam ended now."""
    best_alive = [score / lp for score in beam_scores.amax(dim=1).tolist()]
    done = []
    for r, sent in enumerate(alive):
        if at_limit[r]:
            for b in range(k):
                score = float(beam_scores[r, b])
                if score != float("-inf") and (complete is None or bool(complete[r, b])):
                    finished[sent].append(Hypothesis(history[r * k + b].tolist(), score / lp))
        done.append(at_limit[r] or (len(finished[sent]) >= min_finished[sent] and best_finished[sent] >= best_alive[r]))
    return done


def bar_tokens(logprobs: torch.Tensor, step: int, eos: int, min_len: int, forced: torch.Tensor | None,
               avoided: AvoidedSequences | None, alive: torch.Tensor, history: torch.Tensor, k: int,
               constrained: ConstrainedBeams | None = None, word_continuations: torch.Tensor | None = None) -> None:
    """In place, beam search's -inf before the candidates are chosen: <eos> before `min_len`;
    while a sentence is in its prefix (`forced` (N, P) target ids, -1 after it), every token but
    the prefix's (its beams hold the prefix, then spread); the last token of an avoided sequence
    whose other tokens a row's `history` ends with; after a term's last token, the pieces that
    would continue its word (`word_continuations`)."""
    rows_per_sentence = 1 if step == 0 else k
    if constrained is not None and word_continuations is not None and step:
        constrained.bar_word_continuations(logprobs, word_continuations)
    if step < min_len:
        logprobs[:, eos] = float("-inf")
    if forced is not None and step < forced.size(1):
        force_prefix(logprobs, forced[alive, step], rows_per_sentence)
    if avoided is not None:
        avoided.ban(logprobs, alive.repeat_interleave(rows_per_sentence),
                    recent_tokens(history[::k] if step == 0 else history, avoided.width))


def beam_candidates(logprobs: torch.Tensor, beam_scores: torch.Tensor, step: int, k: int, eos: int,
                    alive: torch.Tensor, constrained: ConstrainedBeams | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search's candidates for the next step, in the order the beam is filled: the 2K best of
    each sentence's K·V continuations (first step: of beam 0's V) → scores (N, M) and ids (beam · V +
    token); with constraints, also each beam's constraint tokens and best token, across the banks
    (`ConstrainedBeams.arrange`; <eos> barred where a term is still to place)."""
    n, vocab = beam_scores.size(0), logprobs.size(-1)
    extra = None
    if constrained is not None:
        constrained.bar_unfinished_ends(logprobs, eos, 1 if step == 0 else k)
        extra = constrained.extra_candidates(logprobs, beam_scores, alive, 1 if step == 0 else k)
    if step == 0:  # only beam 0 exists; -inf for the others where the vocabulary is under 2K
        candidates = logprobs if vocab >= 2 * k else torch.cat(
            [logprobs, logprobs.new_full((n, (k - 1) * vocab), float("-inf"))], dim=1)
        top_scores, top_ids = top_k(candidates, 2 * k)  # (N, 2K)
    else:
        top_scores, top_ids = beam_top_k(logprobs, beam_scores, 2 * k)  # (N, 2K)
    if constrained is not None and extra is not None:
        return constrained.arrange(top_scores, top_ids, extra, alive, vocab)
    return top_scores, top_ids


def force_prefix(logprobs: torch.Tensor, tokens: torch.Tensor, rows_per_sentence: int) -> None:
    """In place: the rows (sentence × beam) of each sentence whose prefix token at this step is
    `tokens[sentence]` (≥ 0; -1: past its prefix) keep only that token's log-probability."""
    per_row = tokens.repeat_interleave(rows_per_sentence)
    rows = (per_row >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    kept = logprobs[rows, per_row[rows]]
    logprobs[rows] = float("-inf")
    logprobs[rows, per_row[rows]] = kept


@without_cyclic_gc
@torch.inference_mode()
def beam_search(
    model: SearchModel, src: torch.Tensor, bos: int, eos: int, beam: int = 5,
    alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10, nbest: int = 1, min_len: int = 0,
    terms: list[TermIds] | None = None, word_continuations: torch.Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search with GNMT length penalty; returns the `nbest` best hypotheses per sentence.

    Each step scores all K·V continuations of the K live beams and keeps the 2K best: those ending
    in <eos> among the top K are finished (score / lp(len)); the K best others stay alive, so the
    beam never fills with finished hypotheses. A sentence is done when it reaches its length limit,
    or when the best finished hypothesis scores at least as well as the best live beam would if it
    ended now, and `nbest` hypotheses (K with a length penalty, alpha > 0) have finished. With
    alpha = 0 this is exact: live scores only fall. Stopping at K finished hypotheses alone
    (fairseq's rule) loses the best translation of a confident model, whose K finished hypotheses
    can all be improbable early <eos> picks made while the one good beam is still running.
    Done sentences leave the batch, so no compute is spent on them. `terms`: per sentence, target
    ids every hypothesis starts with (`bar_tokens`), sequences none may contain, and terms each must
    contain (`beam_candidates`; whole words: none of `word_continuations` (V,) follows a term's
    last token); a sentence whose terms cannot all be placed within its length limit gets no
    hypothesis ([]).
    """
    device, n_sent, k = src.device, src.size(0), beam
    memory, src_mask = model.encode(src)
    # Decoding rows: row = sent * K + beam; the K beams of a sentence share its cross-attention K/V.
    limit_tensor, prefixes, avoided = apply_terms(
        terms, max_output_lengths(src, model.cfg.pad_id, max_len_a, max_len_b, min_len, model.cfg.max_positions),
        model.cfg.max_positions)
    limits = limit_tensor.tolist()
    forced = prefix_table(prefixes, device)[0] if prefixes else None
    state = model.init_state(memory, src_mask, beams=k, max_len=max(limits))
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    best_finished = [float("-inf")] * n_sent  # best finished score per sentence
    min_finished = finished_needed([bool(terms and terms[s].constraints) for s in range(n_sent)], nbest, k, alpha)
    live = LiveBeams.start(n_sent, k, bos, device)
    constrained = (ConstrainedBeams([t.constraints for t in terms], live.alive, k)
                   if terms and any(t.constraints for t in terms) else None)
    buffer = None

    for step in range(max(limits)):
        check_deadline()
        logits = model.decode_step(live.tokens, state)  # (N*K, V); the first step (N, V)
        if buffer is None:
            buffer = logits_buffer(n_sent * k, logits)
        logprobs = log_probs(logits, buffer)
        vocab = logprobs.size(-1)
        bar_tokens(logprobs, step, eos, min_len, forced, avoided, live.alive, live.history, k, constrained,
                   word_continuations)
        top_scores, top_ids = beam_candidates(logprobs, live.scores, step, k, eos, live.alive, constrained)
        top_beams, top_tokens = top_ids // vocab, top_ids % vocab
        is_eos = top_tokens == eos
        at_limit = [step + 1 >= limits[s] for s in live.alive_list]
        lp = gnmt_length_penalty(step + 1, alpha)
        # 1) Finish hypotheses that chose <eos> within the top K (rare: handled in Python).
        finish_eos_choices(is_eos[:, :k], top_scores, top_beams, live.history, live.alive_list, k, lp, finished,
                           best_finished)
        # 2) The K best non-<eos> candidates stay alive.
        source_rows = live.advance(top_scores, top_tokens, top_beams, is_eos, constrained)
        # 3) Sentences at their length limit finish their live beams; a sentence whose best finished
        #    hypothesis beats its best live beam ended now is done.
        done = done_sentences(live.scores, live.history, live.alive_list, at_limit, k, lp, finished, best_finished,
                              min_finished, constrained.complete() if constrained is not None else None)
        if all(done):
            break
        if any(done):
            keep_rows, keep_sent = live.keep([r for r, d in enumerate(done) if not d], constrained)
            state = state.reorder(source_rows.index_select(0, keep_rows), keep_sent)
        else:
            state = state.reorder(source_rows)  # beams move only within their sentence
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


@dataclass
class LiveBeams:
    """Beam search's live sentences and their K beams each (row = sentence · K + beam)."""

    k: int
    alive: torch.Tensor  # (N,) the input sentence each live sentence is
    alive_list: list[int]  # the same, as a list (read every step)
    scores: torch.Tensor  # (N, K) each beam's cumulative log-probability
    history: torch.Tensor  # (N·K, steps) each beam's tokens so far
    tokens: torch.Tensor  # the tokens decoded next: (N,) at the first step, (N·K,) after it
    first_row: torch.Tensor  # (N, 1) each sentence's first row

    @classmethod
    def start(cls, n_sent: int, k: int, bos: int, device: torch.device) -> LiveBeams:
        """All K beams of a sentence start identical: the first step decodes one row per sentence
        (the caches store its keys/values for all K beams), later steps K rows."""
        alive = torch.arange(n_sent, device=device)
        return cls(k, alive, alive.tolist(), torch.zeros(n_sent, k, device=device),
                   torch.full((n_sent * k, 0), bos, dtype=torch.long, device=device),
                   torch.full((n_sent,), bos, dtype=torch.long, device=device), alive[:, None] * k)

    def advance(self, top_scores: torch.Tensor, top_tokens: torch.Tensor, top_beams: torch.Tensor,
                is_eos: torch.Tensor, constrained: ConstrainedBeams | None) -> torch.Tensor:
        """The K best non-<eos> candidates (N, 2K) stay alive: a stable sort of the <eos> flags puts
        the others first, in score order (constrained: in the banks' filling order) → the row each
        new beam continues (N·K,), for the caches to follow."""
        pick = is_eos.to(torch.uint8).argsort(dim=1, stable=True)[:, : self.k]  # (N, K) among the candidates
        self.scores = top_scores.gather(1, pick)
        next_tokens = top_tokens.gather(1, pick)
        if constrained is not None:
            constrained.select(pick)
        if self.first_row.size(0) != len(self.alive_list):
            self.first_row = torch.arange(len(self.alive_list), device=self.scores.device)[:, None] * self.k
        source_rows = (top_beams.gather(1, pick) + self.first_row).view(-1)
        self.history = torch.cat([self.history.index_select(0, source_rows), next_tokens.view(-1, 1)], dim=1)
        self.tokens = next_tokens.view(-1)
        return source_rows

    def keep(self, kept: list[int], constrained: ConstrainedBeams | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the live sentences `kept` (their positions among the live ones) go on: done
        sentences leave the batch, so no compute is spent on them → their rows (M·K,) and positions (M,)."""
        keep_sent = torch.tensor(kept, device=self.scores.device)
        keep_rows = (keep_sent[:, None] * self.k + torch.arange(self.k, device=keep_sent.device)).view(-1)
        self.alive_list = [self.alive_list[r] for r in kept]
        self.alive = self.alive.index_select(0, keep_sent)
        self.scores = self.scores.index_select(0, keep_sent)
        self.history, self.tokens = self.history.index_select(0, keep_rows), self.tokens.index_select(0, keep_rows)
        if constrained is not None:
            constrained.keep(keep_rows)
        return keep_rows, keep_sent


# --------------------------------------------------------------------------- sampling


def sampling_generators(src: torch.Tensor, pad_id: int, seed: int, samples: int) -> list[torch.Generator]:
    """One random generator per decoding row (sentence × sample), seeded by the seed, the sample's
    number and the sentence's own ids: a sentence draws the same sample whatever batch it is in,
    wherever it stands in the input and however many workers decode (and so do repeated lines)."""
    generators = []
    for ids in src.tolist():
        ids = [t for t in ids if t != pad_id]
        for number in range(samples):
            digest = hashlib.blake2b(repr((seed, number, ids)).encode(), digest_size=8).digest()
            generator = torch.Generator(device=src.device)
            generator.manual_seed(int.from_bytes(digest, "little") >> 1)
            generators.append(generator)
    return generators


def sampling_distribution(logprobs: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probabilities (R, V) → the probabilities (R, V) tokens are drawn from: tempered, then cut
    to the top k, then to the nucleus of mass top_p (the most probable token always stays).

    As temperature or top_p vanish this becomes greedy: only the most probable token is left. The
    tempering divides each row's distance from its best log-probability (≤ 0) by a temperature of
    at least the dtype's smallest normal number: the best stays 0 and the rest go to -inf, where
    1e-300, rounded to 0 in fp32, made 0 / 0 = NaN and drew the last token of the vocabulary."""
    best = logprobs.amax(dim=-1, keepdim=True)
    logits = (logprobs - best) / max(sampling.temperature, torch.finfo(logprobs.dtype).tiny)
    if 0 < sampling.top_k < logits.size(-1):
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]  # (R, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = (ordered.cumsum(dim=-1) - ordered) >= sampling.top_p  # the mass before it already reaches p
        # The first token has no mass before it; a top_p that rounds to 0 in the probabilities' dtype
        # (1e-300 in fp32) would cut it as well and leave nothing to draw from.
        outside[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill_(outside, 0.0))
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` (R, V), row r drawing its uniform from generators[r] only:
    inverse transform sampling, the first token whose cumulative probability exceeds u · total."""
    uniform = torch.stack([torch.rand((), generator=g, device=probs.device) for g in generators])
    cdf = probs.cumsum(dim=-1)
    targets = (uniform * cdf[:, -1]).unsqueeze(1).to(cdf.dtype)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.size(-1) - 1)


class SamplingPick:
    """Sampling's pick rule: each row draws from `sampling_distribution`, with its sentence's own
    generator (`sampling_generators`, one per row of the whole input)."""

    def __init__(self, sampling: Sampling, generators: list[torch.Generator]):
        self.sampling, self.generators = sampling, generators

    def __call__(self, logprobs: torch.Tensor, sentences: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = draw(sampling_distribution(logprobs, self.sampling), [self.generators[s] for s in sentences.tolist()])
        return logprobs.gather(1, tokens[:, None]).squeeze(1), tokens  # scored untempered


def sample_search(
    model: SearchModel, src: torch.Tensor, bos: int, eos: int, sampling: Sampling, samples: int = 1,
    max_len_a: float = 1.5, max_len_b: int = 10, min_len: int = 0, terms: list[TermIds] | None = None,
) -> list[list[Hypothesis]]:
    """`samples` random translations per sentence of a (B, S) source batch (see `Sampling`), in the
    order drawn; each scored by the model's own log-probability of its tokens (untempered, unnormalised).
    The greedy loop, each row drawing its token instead of taking the arg-max."""
    rows = src.repeat_interleave(samples, dim=0)  # row = sentence * samples + sample
    pick = SamplingPick(sampling, sampling_generators(src, model.cfg.pad_id, sampling.seed, samples))
    per_row = [t for t in terms for _ in range(samples)] if terms else None
    [drawn] = greedy_search_continuous(model, [rows], bos, eos, max_len_a, max_len_b, min_len, pick=pick,
                                       terms=per_row)
    return [drawn[first : first + samples] for first in range(0, len(drawn), samples)]
