"""Terminology in the search, as batched tensors: terms an output must contain (positive lexical
constraints, beam search with dynamic beam allocation) and token sequences it must not contain
(avoided terms, any search). The text side — files, spellings, checks — is decoding/terms.py.

Positive constraints follow Post & Vilar (2018), "Fast lexically constrained decoding with dynamic
beam allocation", vectorised in the spirit of Hu et al. (2019): every step, besides the best
continuations of the beam, each beam's next token of each unmet constraint and its own best token
are candidates; each candidate's progress (constraint tokens met) is its bank, and the beam is
filled across banks in turn (the best of each bank, most progress first, then the second of
each…), so that hypotheses that have placed a term are not crowded out by cheaper ones that have
not. Progress is tracked per decoding row and constraint by a KMP automaton (a term's state is the
longest prefix of it that the output ends with), so terms may share pieces, repeat pieces, or lie
inside one another. A hypothesis may end only when every term is in it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .top_k import top_k

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- avoided sequences


def recent_tokens(history: torch.Tensor, width: int) -> torch.Tensor:
    """The last `width` tokens of each row of `history` (R, T) → (R, width); -2 before the start."""
    if width == 0:
        return history.new_empty((history.size(0), 0))
    if history.size(1) >= width:
        return history[:, history.size(1) - width :]
    return F.pad(history, (width - history.size(1), 0), value=-2)


class AvoidedSequences:
    """Per sentence, token sequences no output may contain (every spelling of every avoided term).
    Before each pick, a row whose output ends with all but the last token of a sequence gets -inf
    for that last token.

    The sequences' contexts (all tokens but the last) are stored reversed in a trie, each node with
    the last tokens of the sequences whose context ends there. A step walks every row's output back
    from its newest token, one trie level per token (`width` levels at most: the longest context),
    and bars what each node it reaches lists: exact, with no state to carry through beam
    reordering or continuous batching, in a few small ops per level whatever the number of
    sequences, and memory in their total length (a forward automaton with full transitions took
    586 MB for 1,000 avoided words; a suffix test against every sequence, 2–6x the search's time
    with 20)."""

    def __init__(self, sequences: list[list[list[int]]], device: torch.device):
        by_identity: dict[int, tuple] = {}  # lines sharing one list (an --avoid file) share its object
        for seqs in sequences:
            if id(seqs) not in by_identity:
                by_identity[id(seqs)] = tuple(sorted(set(map(tuple, seqs))))
        keys = [by_identity[id(seqs)] for seqs in sequences]
        distinct = list(dict.fromkeys(keys))  # equal lists (one --avoid file for every line) share a trie
        tries = [reversed_trie(key) for key in distinct]
        bases = [0]
        for trie in tries:
            bases.append(bases[-1] + trie.counts.size(0))
        self.sink = bases[-1]  # where a walk that leaves the trie goes: bars nothing, has no edges
        self.width = max(trie.width for trie in tries)
        self.stride = max(max((trie.largest_token for trie in tries), default=0), 1) + 1
        edges = torch.cat([trie.parents + base for trie, base in zip(tries, bases)]) * self.stride + \
            torch.cat([trie.tokens for trie in tries])
        order = edges.argsort()
        self.edge_keys = edges[order].to(device)  # (E,) parent · stride + token, sorted
        self.edge_children = torch.cat([trie.children + base for trie, base in zip(tries, bases)])[order].to(device)
        # per node the tokens it bars, as one flat list (CSR): node n's are flat[starts[n] : starts[n] + counts[n]]
        counts = torch.cat([trie.counts for trie in tries] + [torch.zeros(1, dtype=torch.long)])  # the sink: none
        self.counts = counts.to(device)
        self.starts = (counts.cumsum(0) - counts).to(device)
        self.flat = torch.cat([trie.barred for trie in tries]).to(device)
        self.roots = torch.tensor([bases[distinct.index(k)] for k in keys], dtype=torch.long, device=device)

    def ban(self, logprobs: torch.Tensor, sentences: torch.Tensor, recent: torch.Tensor) -> None:
        """In place: logprobs (A, V) of rows decoding `sentences` (A,), whose outputs end with
        `recent` (A, width) tokens (`recent_tokens`; -2 before the start)."""
        node = self.roots.index_select(0, sentences)
        reached = [node]
        for j in range(1, self.width + 1):  # newest token first
            token = recent[:, recent.size(1) - j]
            key = node * self.stride + token.clamp(0, self.stride - 1)
            at = torch.searchsorted(self.edge_keys, key).clamp(max=self.edge_keys.numel() - 1)
            found = (self.edge_keys[at] == key) & (token >= 0) & (token < self.stride) & (node != self.sink)
            node = torch.where(found, self.edge_children[at], self.sink)
            reached.append(node)
        nodes = torch.stack(reached, dim=1).view(-1)  # (A · levels,) row-major
        counts = self.counts.index_select(0, nodes)
        total = int(counts.sum())
        if total == 0:
            return
        rows = torch.arange(nodes.numel(), device=nodes.device).div(len(reached), rounding_mode="floor")
        rows = rows.repeat_interleave(counts, output_size=total)
        within = torch.arange(total, device=nodes.device) - (counts.cumsum(0) - counts).repeat_interleave(
            counts, output_size=total)
        columns = self.flat[self.starts.index_select(0, nodes).repeat_interleave(counts, output_size=total) + within]
        logprobs.index_put_((rows, columns), torch.tensor(NEG_INF, dtype=logprobs.dtype, device=logprobs.device))


@dataclass(frozen=True)
class ReversedTrie:
    """The contexts of a list of avoided sequences, reversed, as a trie: edges parent → child by
    token (E,), and per node the tokens it bars: `counts` (nodes,) of them, one node's after the
    other in `barred`. Node 0 is the root."""

    parents: torch.Tensor
    tokens: torch.Tensor
    children: torch.Tensor
    counts: torch.Tensor
    barred: torch.Tensor
    width: int  # the longest context
    largest_token: int


@functools.lru_cache(maxsize=64)
def reversed_trie(sequences: tuple[tuple[int, ...], ...]) -> ReversedTrie:
    """Cached: a file of avoided terms builds its trie once, not once a batch."""
    edges: dict[tuple[int, int], int] = {}
    bars: list[set[int]] = [set()]
    for seq in sequences:
        node = 0
        for token in reversed(seq[:-1]):
            if (node, token) not in edges:
                edges[(node, token)] = len(bars)
                bars.append(set())
            node = edges[(node, token)]
        bars[node].add(seq[-1])
    pairs = list(edges)
    return ReversedTrie(torch.tensor([p for p, _ in pairs], dtype=torch.long),
                        torch.tensor([t for _, t in pairs], dtype=torch.long),
                        torch.tensor(list(edges.values()), dtype=torch.long),
                        torch.tensor([len(b) for b in bars], dtype=torch.long),
                        torch.tensor([t for b in bars for t in sorted(b)], dtype=torch.long),
                        max((len(seq) - 1 for seq in sequences), default=0),
                        max((t for seq in sequences for t in seq), default=0))


# --------------------------------------------------------------------------- positive constraints


def kmp_transitions(pattern: list[int]) -> list[list[int]]:
    """KMP automaton of `pattern` restricted to its own tokens: [state j][k] = the state after
    reading pattern[k] in state j (state: length of the longest prefix of `pattern` that the text
    read so far ends with; any token not in `pattern` leads to state 0)."""
    size = len(pattern)
    border = [0] * (size + 1)  # border[j]: longest proper prefix of pattern[:j] that is also its suffix
    for j in range(2, size + 1):
        b = border[j - 1]
        while b and pattern[b] != pattern[j - 1]:
            b = border[b]
        border[j] = b + 1 if pattern[b] == pattern[j - 1] else 0
    table = []
    for j in range(size + 1):
        row = []
        for token in pattern:
            m = j
            while m and (m == size or pattern[m] != token):
                m = border[m]
            row.append(m + 1 if pattern[m] == token else 0)
        table.append(row)
    return table


class ConstraintTable:
    """Per sentence its terms as token sequences (N, C, L) and their automata; the state of a row is
    `matched` (R, C), each term's automaton state, and `met` (R, C), the terms already placed."""

    def __init__(self, constraints: list[list[list[int]]], device: torch.device):
        n = len(constraints)
        self.count = max(max(map(len, constraints), default=0), 1)
        self.width = max(max((len(c) for cs in constraints for c in cs), default=1), 1)
        tokens = torch.full((n, self.count, self.width), -1, dtype=torch.long)
        lengths = torch.zeros((n, self.count), dtype=torch.long)
        goto = torch.zeros((n, self.count, (self.width + 1) * self.width), dtype=torch.long)
        for s, terms in enumerate(constraints):
            for c, term in enumerate(terms):
                tokens[s, c, : len(term)] = torch.tensor(term)
                lengths[s, c] = len(term)
                for j, row in enumerate(kmp_transitions(term)):
                    goto[s, c, j * self.width : j * self.width + len(row)] = torch.tensor(row)
        self.tokens, self.lengths, self.goto = tokens.to(device), lengths.to(device), goto.to(device)
        self.banks = int(lengths.sum(dim=1).max()) + 1  # progress 0 … the most constraint tokens a sentence has

    def initial(self, sentences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state of rows decoding `sentences` (R,) before any output: nothing matched, empty slots met."""
        matched = torch.zeros((len(sentences), self.count), dtype=torch.long, device=sentences.device)
        return matched, self.lengths.index_select(0, sentences) == 0

    def advance(self, sentences: torch.Tensor, matched: torch.Tensor, met: torch.Tensor,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after rows of `sentences` (N,) — one each, or M each (`tokens` (N, M),
        `matched`/`met` (N, M, C)) — output `tokens`. The terms are compared by broadcasting, never
        copied per candidate: (N, M, C, L) booleans are the largest tensor."""
        per_row = tokens.dim() == 1
        if per_row:
            tokens, matched, met = tokens[:, None], matched[:, None], met[:, None]
        terms = self.tokens.index_select(0, sentences)[:, None]  # (N, 1, C, L)
        equal = terms == tokens[:, :, None, None]  # (N, M, C, L)
        has = equal.any(dim=-1)  # (N, M, C) the token is in the term
        position = equal.to(torch.uint8).argmax(dim=-1)  # its first place there
        # goto[s, c, j · L + position], read from the flat table: no (N, M, C, (L+1)·L) copy
        cells = (self.width + 1) * self.width
        base = (sentences[:, None, None] * self.count + torch.arange(self.count, device=tokens.device)) * cells
        following = self.goto.view(-1)[base + matched * self.width + position]
        matched = torch.where(has, following, torch.zeros_like(following))
        met = met | (matched == self.lengths.index_select(0, sentences)[:, None])
        return (matched[:, 0], met[:, 0]) if per_row else (matched, met)

    def progress(self, sentences: torch.Tensor, matched: torch.Tensor, met: torch.Tensor) -> torch.Tensor:
        """Constraint tokens placed (*S): the met terms' lengths plus the longest partial match."""
        lengths = self.lengths[sentences]
        return (lengths * met).sum(dim=-1) + matched.masked_fill(met, 0).amax(dim=-1)

    def next_tokens(self, sentences: torch.Tensor, matched: torch.Tensor, met: torch.Tensor) -> torch.Tensor:
        """(R, C): per row, the token that advances each unmet term (its first after the part
        matched); -1 for met terms."""
        terms = self.tokens[sentences]  # (R, C, L)
        following = terms.gather(2, matched.clamp(max=self.width - 1)[:, :, None]).squeeze(2)
        return following.masked_fill(met | (matched >= self.lengths[sentences]), -1)


class ConstrainedBeams:
    """The constraint state of a beam search's rows (sentence × beam) and the candidate selection
    with dynamic beam allocation. Sentences without terms take the plain beam's choice."""

    def __init__(self, constraints: list[list[list[int]]], alive: torch.Tensor, k: int):
        self.table = ConstraintTable(constraints, alive.device)
        self.k = k
        self.matched, self.met = self.table.initial(alive.repeat_interleave(k))  # (N·K, C)
        self.just_met = torch.zeros(len(self.met), dtype=torch.bool, device=alive.device)  # (N·K,) a term ended here
        self.chosen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def unfinished(self) -> torch.Tensor:
        """(N·K,) rows with a term still to place."""
        return ~self.met.all(dim=1)

    def bar_unfinished_ends(self, logprobs: torch.Tensor, eos: int, rows_per_sentence: int) -> None:
        """In place: <eos> is -inf for rows with a term still to place."""
        unfinished = self.unfinished()[:: self.k] if rows_per_sentence == 1 else self.unfinished()
        logprobs[:, eos].masked_fill_(unfinished, NEG_INF)

    def bar_word_continuations(self, logprobs: torch.Tensor, continuations: torch.Tensor) -> None:
        """In place: a row whose last token ended a term may not go on with a piece that continues
        the word (`continuations` (V,) bool): a term is met as whole words ("Hund", not "Hundeeee")."""
        if bool(self.just_met.any()):
            logprobs.masked_fill_(self.just_met[:, None] & continuations[None, :], NEG_INF)

    def extra_candidates(self, logprobs: torch.Tensor, beam_scores: torch.Tensor, alive: torch.Tensor,
                         rows_per_sentence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sentence: each row's token advancing each unmet term, and each row's best token →
        scores (N, rows·(C+1)) and ids into the sentence's K·V candidates (beam · V + token). Read
        before the top-k, which may add the beam scores into `logprobs` in place."""
        rows, vocab = logprobs.shape
        n, step = rows // rows_per_sentence, self.k // rows_per_sentence
        matched, met = self.matched[::step], self.met[::step]  # the rows decoded this step
        sentences = alive.repeat_interleave(rows_per_sentence)
        advancing = self.table.next_tokens(sentences, matched, met)  # (R, C)
        base = beam_scores[:, :rows_per_sentence].reshape(-1, 1)  # (R, 1)
        advancing_scores = logprobs.gather(1, advancing.clamp(min=0)).masked_fill_(advancing < 0, NEG_INF) + base
        best_scores, best_tokens = (x.squeeze(1) for x in top_k(logprobs, 1))  # vectorised, unlike max(dim)
        beam = (torch.arange(rows, device=logprobs.device) % rows_per_sentence)[:, None] * vocab  # (R, 1)
        scores = torch.cat([advancing_scores, best_scores[:, None] + base], dim=1).view(n, -1)
        ids = torch.cat([advancing.clamp(min=0) + beam, best_tokens[:, None] + beam], dim=1).view(n, -1)
        return scores, ids

    def arrange(self, top_scores: torch.Tensor, top_ids: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor],
                alive: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All candidates (the top 2K and `extra`), duplicates dropped, in the order the beam is
        filled: the best of each bank (most progress first), then the second best of each, … →
        scores and ids (N, M); invalid (-inf) candidates last."""
        scores = torch.cat([top_scores, extra[0]], dim=1)
        ids = torch.cat([top_ids, extra[1]], dim=1)
        n, m = ids.shape
        ordered_ids, order = ids.sort(dim=1)
        repeated = torch.zeros_like(ordered_ids, dtype=torch.bool)
        repeated[:, 1:] = ordered_ids[:, 1:] == ordered_ids[:, :-1]
        scores = scores.masked_fill(torch.zeros_like(repeated).scatter_(1, order, repeated), NEG_INF)

        beams, tokens = ids // vocab, ids % vocab
        rows = torch.arange(n, device=ids.device)[:, None] * self.k + beams  # (N, M) the row each extends
        matched, met = self.table.advance(alive, self.matched[rows], self.met[rows], tokens)  # (N, M, C)
        just_met = (met & ~self.met[rows]).any(dim=-1)  # (N, M) the candidate's token ends a term
        bank = self.table.progress(alive[:, None].expand(n, m), matched, met)  # (N, M)

        by_score = scores.argsort(dim=1, descending=True, stable=True)
        bank_sorted = bank.gather(1, by_score)
        one_hot = F.one_hot(bank_sorted, self.table.banks)  # (N, M, banks)
        rank = (one_hot.cumsum(dim=1) * one_hot).sum(dim=2) - 1  # place within its bank, best first
        key = rank * self.table.banks + (self.table.banks - 1 - bank_sorted)
        key = key.masked_fill(scores.gather(1, by_score) == NEG_INF, m * self.table.banks)
        filled = by_score.gather(1, key.argsort(dim=1, stable=True))  # (N, M) positions, in filling order
        index = filled[:, :, None].expand(n, m, self.table.count)
        self.chosen = (matched.gather(1, index), met.gather(1, index), just_met.gather(1, filled))
        return scores.gather(1, filled), ids.gather(1, filled)

    def select(self, picked: torch.Tensor) -> None:
        """The live beams are the `picked` (N, K) positions of `arrange`'s order: their states."""
        assert self.chosen is not None
        index = picked[:, :, None].expand(*picked.shape, self.table.count)
        self.matched = self.chosen[0].gather(1, index).view(-1, self.table.count)
        self.met = self.chosen[1].gather(1, index).view(-1, self.table.count)
        self.just_met = self.chosen[2].gather(1, picked).view(-1)
        self.chosen = None

    def complete(self) -> torch.Tensor:
        """(N, K): live beams with every term placed."""
        return self.met.all(dim=1).view(-1, self.k)

    def keep(self, rows: torch.Tensor) -> None:
        self.matched, self.met = self.matched.index_select(0, rows), self.met.index_select(0, rows)
        self.just_met = self.just_met.index_select(0, rows)
