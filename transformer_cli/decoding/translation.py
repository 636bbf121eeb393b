"""Stage 4, prediction, whatever the engine: raw lines in, translations out; batched,
order-preserving, streaming.

Two engines translate: tfm's own (`torch_engine.Translator`, torch) and CTranslate2
(`ct2_engine.CT2Translator`). Both are a `TranslationEngine`: they tokenize, search and detokenize in their
own way, and share everything around that here: empty lines, over-long lines, the n-best record,
chunked streaming. Nothing here imports torch: a CTranslate2 translation starts without it
(importing torch takes longer than translating a test set through CTranslate2).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..data.augment import as_read, ends_with_punctuation, shouted, title, titled, upper, without_end_punctuation
from ..data.language_tags import LINE_TAG, TargetLanguages, known_languages
from ..experiment.config import DecodeConfig
from ..experiment.scoring import total_log_prob
from ..runtime.console import warn, write_fully
from ..runtime.errors import TfmError
from .budget import check_decoding_budget, check_decoding_work, parts_within_work
from .hypothesis import Hypothesis
from .terms import LineTerms, TermIds, avoided_present, conflicts, missing_constraints, spellings


@dataclass
class Translation:
    text: str
    score: float  # the search's score: length-normalised log-probability (greedy: the plain sum); NaN where not
    # computed (CTranslate2 with one hypothesis: nothing prints it, and it costs 4% of greedy's time)
    n_tokens: int
    alignment: str | None = None  # "i-j i-j …" source word i ~ target word j (0-based), when asked for
    unmet: tuple[str, ...] = ()  # the line's constraints it lacks (they did not fit its length limit)


MAX_CONSTRAINTS = 32  # terms one line may have to contain
MAX_TERM_PIECES = 64  # target pieces of one such term (the search compares every candidate with every piece)
MAX_AVOIDED_CHARS = 256  # characters of a term to avoid: finding its spellings grows with its length


class TranslationEngine:
    """Raw text in, detokenized text out. An engine provides `tokenize`, `search` and `detokenize`,
    its `decode` settings and `max_source_tokens`; `translate` is the same for every engine."""

    name: str  # "torch" (tfm's own) or "ctranslate2"
    device: Any  # a torch.device (tfm's engine) or "cpu"/"cuda" (CTranslate2's)
    decode: DecodeConfig
    max_source_tokens: int  # per line, </s> excluded: longer lines are cut, with a warning
    decoding_processes: int = 1  # processes that have decoded so far
    # Bytes a search may take (decoding/budget.py); None: no check. `tfm translate` and `tfm serve` set it.
    memory_limit: int | None = None
    decodes_in_background = False  # `search_later` returns before the search is done (CTranslate2)
    lexical_constraints = False  # terms a translation must contain or avoid (tfm's engine); prefixes: every engine
    stops_at_deadline = False  # the search ends itself between two steps at `search`'s deadline (tfm's engine)
    own_language: str | None = None  # the target language of the config the model was trained with
    own_source_language: str | None = None  # ... and its source language
    source_languages: tuple[str, ...] = ()  # every source language it was trained on (a multilingual run's several)
    src_sp: Any  # the source sentencepiece model (its pieces hold the target-language tags)
    tgt_sp: Any  # the target sentencepiece model

    def describe(self) -> str:
        """The engine and what it computes in, for the line commands print (`tfm translate`'s last)."""
        raise NotImplementedError

    def target_languages(self) -> TargetLanguages:
        """The languages this model translates into: its source vocabulary's >>xx<< tags, or its own
        target language alone."""
        if "_languages" not in self.__dict__:
            sp = self.src_sp
            self._languages = TargetLanguages(known_languages(sp.id_to_piece(i) for i in range(sp.get_piece_size())),
                                              self.own_language)
        return self._languages

    def first_chunk_lines(self) -> int:
        """Lines of a stream's first chunk: one batch. (tfm's engine keeps one whatever decode.workers
        is, so that every workers setting batches the same lines together.)"""
        return self.decode.batch_size

    def unsupported(self, decode: DecodeConfig) -> str | None:
        """Why this engine cannot decode with `decode` (a request's settings); None: it can."""
        return None

    @property
    def member_configs(self) -> list:
        """The sizes of the model, or of each of an ensemble's (budget.ModelSizes); empty: unknown."""
        return []

    def budget_processes(self) -> int:
        """Searches that run at once, each over a batch of its own (decode.workers)."""
        return 1

    def check_search_budget(self, sources: list[list], decode: DecodeConfig, terms: list[TermIds] | None = None) -> None:
        """A TfmError, naming the setting, where searching `sources` (with `terms`, which may raise
        the output length) could take more work than decode.max_work or more memory than
        `memory_limit` (decoding/budget.py)."""
        if not self.member_configs:
            return
        longest = max(map(len, sources), default=0)
        prefix, constraints = term_room(terms)
        check_decoding_work(self.member_configs, decode, len(sources), longest, longest_prefix=prefix,
                            constraints=constraints)
        if self.memory_limit is not None:
            check_decoding_budget(self.member_configs, decode, len(sources), longest, self.memory_limit,
                                  processes=self.budget_processes(), longest_prefix=prefix, constraints=constraints)

    def check_budget(self, lines: list[str], decode: DecodeConfig, terms: list[LineTerms] | None = None) -> None:
        """`check_search_budget` for `translate(lines, decode=decode, terms=terms)`, before the call
        joins a batch (`tfm serve`)."""
        if self.member_configs:
            sources = self.tokenize([line for line in lines if line.strip()])
            room = [TermIds(self.tokenize_target([t.prefix])[0] if t.prefix else [],
                            self.tokenize_target(list(t.constraints)) if t.constraints else [])
                    for t in terms or [] if not t.empty]
            self.check_search_budget(sources, decode, room)

    def tokenize(self, lines: list[str]) -> list[list]:
        raise NotImplementedError

    def tokenize_target(self, texts: list[str]) -> list[list]:
        """Target-language text (a prefix the output must start with) → tokens as the search outputs them."""
        raise NotImplementedError

    def unknown_in_target(self, text: str) -> bool:
        """Whether the target vocabulary cannot spell `text` (a piece would be <unk>)."""
        raise NotImplementedError

    def prefix_tokens(self, text: str) -> list:
        """The tokens a translation starting with `text` starts with; a TfmError where the model's
        target vocabulary cannot spell it (the output would start with ' ⁇ ', not with `text`)."""
        if self.unknown_in_target(text):
            raise TfmError(f"prefix {text!r}: the model's target vocabulary cannot spell it (a character it has "
                           "never seen would decode as ' ⁇ ')")
        return self.tokenize_target([text])[0]

    def target_pieces(self) -> dict[str, int]:
        """The target vocabulary's pieces → ids (`terms.spellings` of avoided terms)."""
        raise NotImplementedError

    def term_ids(self, terms: LineTerms, line: int, warn_unspellable: bool = True) -> TermIds:
        """A line's terms as the search takes them. A prefix the vocabulary cannot spell is a
        TfmError; such a constraint is dropped with a warning naming input line `line` (the line
        is translated without it), an avoided term that cannot be spelled needs no barring."""
        problem = conflicts(terms)
        if problem:
            raise TfmError(f"input line {line}: {problem}")
        if len(terms.constraints) > MAX_CONSTRAINTS:
            raise TfmError(f"input line {line}: {len(terms.constraints)} constraints, more than {MAX_CONSTRAINTS} "
                           "a line")
        constraints = []
        for term in terms.constraints:
            pieces = self.tokenize_target([term])[0]
            why = ("cannot be spelled by the model's target vocabulary" if self.unknown_in_target(term) else
                   f"has {len(pieces)} pieces, more than {MAX_TERM_PIECES}" if len(pieces) > MAX_TERM_PIECES else None)
            if why is None:
                constraints.append(pieces)
            elif warn_unspellable:
                warn(f"warning: input line {line}: the constraint {term!r} {why}: translated without it")
        return TermIds(self.prefix_tokens(terms.prefix) if terms.prefix else [], constraints,
                       self.avoided_spellings(terms.avoid))

    def avoided_spellings(self, avoid: tuple[str, ...]) -> list[list]:
        """Every spelling of every term of `avoid`; one list object per list of terms, so that the
        lines of an `--avoid` file share it (the search builds its trie once)."""
        if not avoid:
            return []
        cache = self.__dict__.setdefault("_avoided", {})
        if avoid not in cache:
            if len(cache) > 256:
                cache.clear()
            cache[avoid] = [spelling for term in avoid for spelling in self.spellings_of(term)]
        return cache[avoid]

    def spellings_of(self, term: str) -> list[list]:
        """Every way the target vocabulary writes `term`, as a word of its own or inside one
        (`terms.spellings`); remembered, since every line of a file shares its avoided terms."""
        if len(term) > MAX_AVOIDED_CHARS:
            raise TfmError(f"the avoided term {term[:24]!r}… has {len(term)} characters, more than {MAX_AVOIDED_CHARS} "
                           "(a term to avoid is a word or a few)")
        cache = self.__dict__.setdefault("_spellings", {})
        if term not in cache:
            if len(cache) > 10_000:  # a server's clients send ever new terms
                cache.clear()
            if "_pieces" not in self.__dict__:
                self._pieces = self.target_pieces()
            cache[term] = [ways for text in ("\u2581" + term.replace(" ", "\u2581"), term.replace(" ", "\u2581"))
                           for ways in spellings(text, self._pieces)]
        return cache[term]

    def check_terms(self, terms: list[LineTerms] | None, decode: DecodeConfig) -> None:
        """A TfmError where this engine or these settings cannot apply `terms`."""
        if terms:
            self.check_lexical(any(t.constraints for t in terms), any(t.avoid for t in terms), decode)

    def check_lexical(self, constraints: bool, avoid: bool, decode: DecodeConfig) -> None:
        """A TfmError where this engine or these settings cannot apply constraints or avoided terms."""
        if not self.lexical_constraints and (constraints or avoid):
            raise TfmError("constraints, glossaries and avoided terms are applied by tfm's own engine: use --engine "
                           "torch (CTranslate2 offers target prefixes only)")
        if constraints:
            if decode.sample:
                raise TfmError("constraints (--constraints, --glossary) need beam search, not --sample")
            if decode.beam < 2:
                raise TfmError(f"constraints (--constraints, --glossary) need beam search: beam {decode.beam} is greedy; "
                               "use --beam 2 or more (decode.beam)")

    def search(self, sources: list[list], decode: DecodeConfig, terms: list[TermIds] | None = None,
               deadline: float | None = None) -> list[list[Hypothesis]]:
        """Tokenized sources → per sentence its n-best hypotheses (tokens as `tokenize` gives them),
        under `decode`'s settings (beam, nbest, sampling, length limits); each with its sentence's `terms`
        (prefix, constraints, avoided sequences: `TermIds`). `deadline`: the time.monotonic() by
        which the search must end; an engine that can stop between steps (tfm's) raises
        `budget.DeadlinePassed` there, one that cannot (CTranslate2) ignores it."""
        raise NotImplementedError

    def align(self, lines: list[str], sources: list[list], hyps: list[list[Hypothesis]],
              decode: DecodeConfig) -> list[list[str]]:
        """Per sentence, per hypothesis its word alignment in Pharaoh format ("i-j …")."""
        raise TfmError("word alignments (--alignment) come from tfm's own engine: use --engine torch")

    def total_log_prob(self, score: float, length: int, decode: DecodeConfig) -> float:
        """The plain sum of log-probabilities behind a search's `score` for an output of `length`
        tokens (</s> included): each engine's length normalisation undone (tfm's: GNMT's, scoring.py)."""
        return total_log_prob(score, length, decode.length_penalty, decode.beam, "gnmt")

    def confidence(self, translation: Translation, decode: DecodeConfig) -> float | None:
        """The model's mean log-probability per output token (</s> included) of a translation: a
        length-normalised model score, not a quality estimate. None where the search kept no score."""
        if not math.isfinite(translation.score) or not translation.text:
            return None
        length = translation.n_tokens + 1
        return self.total_log_prob(translation.score, length, decode) / length

    def detokenize(self, tokens: list) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine started (worker processes, threads); it also ends at exit."""

    def search_later(self, sources: list[list], decode: DecodeConfig, terms: list[TermIds] | None = None,
                     deadline: float | None = None) -> Callable[[], list[list[Hypothesis]]]:
        """`search`, started now and collected by calling what it returns. An engine that decodes
        in the background (CTranslate2) returns at once, so that the next chunk can be started
        before this one is collected; tfm's engine searches here."""
        hyps = self.search(sources, decode, terms, deadline=deadline)
        return lambda: hyps

    def search_within_work(self, sources: list[list], decode: DecodeConfig, terms: list[TermIds] | None = None,
                           deadline: float | None = None) -> Callable[[], list[list[Hypothesis]]]:
        """`search_later` a part at a time where `sources` together are over decode.max_work
        (`budget.parts_within_work`): each search stays bounded, and the lines come back in order."""
        parts = [list(range(len(sources)))]
        if self.member_configs:
            prefix, constraints = term_room(terms)
            parts = parts_within_work(self.member_configs, decode, [len(s) for s in sources], longest_prefix=prefix,
                                      constraints=constraints)
        if len(parts) == 1:
            return self.search_later(sources, decode, terms, deadline=deadline)
        started = [(part, self.search_later([sources[i] for i in part], decode,
                                            [terms[i] for i in part] if terms else None, deadline=deadline))
                   for part in parts]

        def collect() -> list[list[Hypothesis]]:
            hyps: list[list[Hypothesis]] = [[] for _ in sources]
            for part, results in started:
                for i, found in zip(part, results()):
                    hyps[i] = found
            return hyps

        return collect

    def settings(self, **changes: Any) -> DecodeConfig:
        """The engine's decode settings with `changes` (beam=4, nbest=2…), checked as a config is
        (`DecodeConfig.updated`): what `translate` and the other calls take as `decode`."""
        return self.decode.updated(**changes)

    def translate(self, lines: list[str], decode: DecodeConfig | None = None, first_line: int = 1,
                  warn_long: bool = True, terms: list[LineTerms] | None = None) -> list[list[Translation]]:
        """Per input line its decode.nbest best translations (samples with decode.sample); empty (or
        blank) lines give empty output. `decode`: the settings of this call (`settings(beam=…)`);
        None: the engine's own.

        A line longer than the model's positions is cut with a warning naming it (`first_line` is
        the number of `lines[0]` in the user's input; `warn_long=False`: silently, as a server does,
        whose log one client must not flood). `terms`: per line, the text its translations start with
        (the search is forced through its tokens, then goes on: interactive translation,
        autocompletion), terms they must contain and terms they must not (`LineTerms`). A translation
        that lacks a constraint (it did not fit the length limit) names it in `unmet`, with a warning
        unless `warn_long` is False.
        """
        return self.translate_later(lines, decode, first_line, warn_long, terms)()

    def translate_later(self, lines: list[str], decode: DecodeConfig | None = None, first_line: int = 1,
                        warn_long: bool = True,
                        terms: list[LineTerms] | None = None, deadline: float | None = None,
                        align_only: Collection[int] | None = None) -> Callable[[], list[list[Translation]]]:
        """`translate`, started now (`search_later`) and finished by calling what it returns;
        `deadline`: see `search`. `align_only`: with decode.alignment, the lines (0-based) that get
        word alignments (the forced pass costs time); the others come back with none (None: all)."""
        decode = self.decode if decode is None else decode
        lines = self.target_languages().tag_lines(lines, decode.tgt_lang, first_line)
        lines, endings = follow_input(lines, decode, terms)
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        sources = self.tokenize([lines[i] for i in nonempty]) if nonempty else []
        if warn_long:
            warn_long_lines(nonempty, sources, self.max_source_tokens, first_line)
        steering = None
        if terms is not None and any(not terms[i].empty for i in nonempty):
            line_terms = [terms[i] for i in nonempty]
            self.check_terms(line_terms, decode)
            steering = [self.term_ids(t, first_line + i, warn_long) for i, t in zip(nonempty, line_terms)]
        collect = (self.search_within_work(sources, decode, steering, deadline=deadline)
                   if sources else list)

        def linked(i: int) -> bool:  # whether line i gets word alignments
            return decode.alignment and (align_only is None or i in align_only)

        def finish() -> list[list[Translation]]:
            hyps = collect()
            alignments: list[list[str | None]] = [[None] * len(h) for h in hyps]
            wanted = [k for k, i in enumerate(nonempty) if linked(i)]
            if wanted:
                found = self.align([lines[nonempty[k]] for k in wanted], [sources[k] for k in wanted],
                                   [hyps[k] for k in wanted], decode)
                for k, pairs in zip(wanted, found):
                    alignments[k] = list(pairs)
            out: list[list[Translation]] = [[Translation("", 0.0, 0, "" if linked(i) else None)
                                             for _ in range(decode.nbest)] for i in range(len(lines))]
            for i, h, a in zip(nonempty, hyps, alignments):
                out[i] = [finished(Translation(self.detokenize(x.tokens), x.score, len(x.tokens), pairs), endings.get(i))
                          for x, pairs in zip(h, a)]
            if terms is not None:
                for i, line_terms in enumerate(terms):
                    if line_terms.constraints or line_terms.avoid:
                        check_translations(out[i], line_terms, first_line + i, warn_long)
            return out

        return finish


def follow_input(lines: list[str], decode: DecodeConfig, terms: list[LineTerms] | None
                 ) -> tuple[list[str], dict[int, Callable[[str], str]]]:
    """What decode.casing and decode.end_punctuation (`follow`) change: the lines in ALL CAPS or
    Title Case (after any target-language tag) in lower case, and for each line so read or without
    final punctuation (0-based) how its translation is finished: cased back, its final punctuation
    off. A line with terms is translated and finished as the model writes it."""
    finish: dict[int, Callable[[str], str]] = {}
    out = list(lines)
    for i, line in enumerate(lines):
        if (terms is not None and not terms[i].empty) or not line.strip():
            continue
        tag = LINE_TAG.match(line)
        start = tag.end() if tag else 0
        text = line[start:]
        steps = []
        casing = (upper if shouted(text) else title if titled(text) else None) if decode.casing == "follow" else None
        if casing is not None:
            steps.append(casing)
            out[i] = line[:start] + as_read(text)
        if decode.end_punctuation == "follow" and not ends_with_punctuation(text):
            steps.append(without_end_punctuation)
        if steps:
            finish[i] = functools.reduce(lambda f, g: lambda t: g(f(t)), steps)
    return out, finish


def finished(translation: Translation, finish: Callable[[str], str] | None) -> Translation:
    """The translation with its text finished as its line came (`follow_input`); a word alignment
    keeps the pairs of the words left (a final punctuation mark taken off may have been a word)."""
    if finish is None:
        return translation
    text = finish(translation.text)
    alignment = translation.alignment
    if alignment and len(text.split()) < len(translation.text.split()):
        words = len(text.split())
        alignment = " ".join(p for p in alignment.split() if int(p.split("-")[1]) < words)
    return dataclasses.replace(translation, text=text, alignment=alignment)


def term_room(terms: list[TermIds] | None) -> tuple[int, tuple[int, int]]:
    """What the budget's output length and constrained beam allow for: the longest target prefix
    (tokens), and the most constraints a line has with the longest constraint's pieces."""
    prefix = max((t.room() - 1 for t in terms or []), default=0)
    return prefix, (max((len(t.constraints) for t in terms or []), default=0),
                    max((len(c) for t in terms or [] for c in t.constraints), default=0))


def check_translations(translations: list[Translation], terms: LineTerms, line: int, warnings: bool) -> None:
    """In place: each translation's `unmet` constraints; a warning naming the line for the best
    translation's, and for an avoided term in it (a spelling the search could not bar)."""
    for rank, translation in enumerate(translations):
        translation.unmet = tuple(missing_constraints(translation.text, terms))
        if rank or not warnings:
            continue
        if translation.unmet:
            warn(f"warning: input line {line}: the translation lacks {', '.join(map(repr, translation.unmet))}: "
                 "the constraints did not fit its length limit, so it is the best translation without them")
        present = avoided_present(translation.text, terms)
        if present:
            warn(f"warning: input line {line}: the translation contains the avoided {', '.join(map(repr, present))}")


def warn_long_lines(numbers: list[int], encoded: list[list], limit: int, first_line: int) -> None:
    """A warning for each input line with more than `limit` tokens (decoding keeps the first `limit`)."""
    for i, tokens in zip(numbers, encoded):
        if len(tokens) > limit:
            warn(f"warning: input line {first_line + i} has {len(tokens)} tokens, more than the model's "
                 f"{limit}: only the first {limit} are translated")


def length_sorted_batches(lengths: list[int], batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), capped by sentences and tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest in batch comes first
        too_many_tokens = batch_tokens is not None and current and width * (len(current) + 1) > batch_tokens
        if current and (len(current) >= batch_size or too_many_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def balanced_batches(batches: list[list[int]], batch_tokens: int | None, lengths: list[int]) -> list[list[int]]:
    """As many batches as `batches`, each dealt every len(batches)-th sentence of their length order
    (longest first), so that each holds long and short ones alike and batches decoded in parallel
    take about as long. `batches` as they are where that would break the token cap."""
    order = [i for batch in batches for i in batch]
    dealt = [order[j :: len(batches)] for j in range(len(batches))]
    if batch_tokens is not None and any(lengths[b[0]] * len(b) > batch_tokens for b in dealt):
        return batches
    return dealt


# --------------------------------------------------------------------------- streaming


def read_decoded_lines(stream: IO[bytes], warnings: IO[str], name: str = "standard input",
                       strict: bool = False) -> Iterator[str]:
    """Lines of a byte stream as text; invalid UTF-8 is replaced (U+FFFD) with a warning, never a
    crash, or with `strict` (terms must match what the user wrote) a TfmError naming the line.
    UTF-16 (a byte-order mark at the start) is refused: read as UTF-8 it would be garbage."""
    for number, raw in enumerate(stream, start=1):
        if number == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise TfmError(f"{name} is UTF-16 text (it starts with a UTF-16 byte-order mark): tfm reads UTF-8; "
                           f"convert it first, e.g. iconv -f UTF-16 -t UTF-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if strict:
                raise TfmError(f"{name}: line {number} is not valid UTF-8 ({exc.reason})") from None
            text = raw.decode("utf-8", errors="replace")
            warn(f"warning: input line {number} is not valid UTF-8 ({exc.reason}); "
                 "invalid bytes replaced with U+FFFD", warnings)
        if number == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a UTF-8 byte-order mark (Windows editors) is not part of the text
        yield text.rstrip("\r\n")


def chunks(lines: Iterable[str], first: int, rest: int) -> Iterator[list[str]]:
    """The first chunk small (output starts early), later ones larger (better length sorting)."""
    chunk: list[str] = []
    size = first
    for line in lines:
        chunk.append(line)
        if len(chunk) >= size:
            yield chunk
            chunk, size = [], rest
    if chunk:
        yield chunk


@dataclass
class StreamStats:
    sentences: int = 0
    tokens: int = 0
    seconds: float = 0.0


def with_alignment(translation: Translation) -> str:
    """The translation, and after a tab its word alignment when there is one."""
    return translation.text if translation.alignment is None else f"{translation.text}\t{translation.alignment}"


def format_nbest(index: int, translations: list[Translation]) -> list[str]:
    """n-best format: `<0-based input line>\\t<rank>\\t<score>\\t<translation>[\\t<alignment>]`, one
    hypothesis a line."""
    return [f"{index}\t{rank}\t{t.score:.4f}\t{with_alignment(t)}" for rank, t in enumerate(translations, start=1)]


CHUNK_LINES = 1000  # lines translated together (length-sorted into batches) after the first batch


def input_chunks(engine: TranslationEngine, lines: Iterable[str]) -> Iterator[list[str]]:
    """The chunks every command translates a text in: the first one small (`first_chunk_lines`:
    output starts early), then CHUNK_LINES lines. Batching depends on this, and bf16 results on
    batching: `translate` and `evaluate` take the same chunks, so they give the same translations."""
    return chunks(lines, min(CHUNK_LINES, engine.first_chunk_lines()), CHUNK_LINES)


def translated_chunks(engine: TranslationEngine, lines: Iterable[str], decode: DecodeConfig | None = None,
                      read_ahead: bool = False,
                      terms: Callable[[list[str], int], tuple[list[str], list[LineTerms] | None]] | None = None,
                      align_only: Collection[int] | None = None,
                      ) -> Iterator[tuple[list[str], list[LineTerms] | None, list[list[Translation]]]]:
    """Each chunk of `lines` (`input_chunks`) → its sources, their terms and translations, in order.

    `read_ahead`: the next chunk is read and started before this one is collected, so that an engine
    decoding in the background (CTranslate2) never waits at the end of a chunk for its last batch.
    Only for input that is all there already (a file, a list): from a pipe, reading ahead would hold
    back each chunk's output until the next chunk has arrived. Where starting a chunk fails, the chunk
    before it still comes out first. `terms(chunk, first line number)` → the chunk's source lines
    and their terms (`--constraints` input lines hold both; a prefix, `--avoid`, `--glossary`);
    `decode`: the settings (None: the engine's); `align_only`: the lines (0-based, over all of `lines`)
    that get word alignments (`translate_later`)."""
    pending: tuple[list[str], list[LineTerms] | None, Callable[[], list[list[Translation]]]] | None = None
    read = 0
    ordered = sorted(align_only) if align_only is not None else []
    for chunk in input_chunks(engine, lines):
        try:
            sources, line_terms = terms(chunk, read + 1) if terms is not None else (chunk, None)
            in_chunk = None if align_only is None else {
                i - read for i in ordered[bisect.bisect_left(ordered, read):bisect.bisect_left(ordered, read + len(chunk))]}
            started = (sources, line_terms, engine.translate_later(sources, decode, first_line=read + 1,
                                                                   terms=line_terms, align_only=in_chunk))
        except BaseException:
            if pending is not None:  # what was translated before the failure comes out first
                yield pending[0], pending[1], pending[2]()
            raise
        read += len(chunk)
        if pending is not None:
            yield pending[0], pending[1], pending[2]()
        pending = started
        if not read_ahead:
            yield pending[0], pending[1], pending[2]()
            pending = None
    if pending is not None:
        yield pending[0], pending[1], pending[2]()


def translate_stream(engine: TranslationEngine, lines: Iterable[str], output: IO[str],
                     decode: DecodeConfig | None = None, progress: bool = False, read_ahead: bool = False,
                     terms: Callable[[list[str], int], tuple[list[str], list[LineTerms] | None]] | None = None,
                     as_json: bool = False) -> StreamStats:
    """Translate an (endless) stream of lines chunk by chunk (`translated_chunks`, `terms` as
    there), writing and flushing after each: plain, n-best records (decode.nbest > 1), or JSON Lines
    (`as_json`)."""
    decode = engine.decode if decode is None else decode
    stats = StreamStats()
    started = time.perf_counter()
    # (A disabled tqdm still starts its monitor thread, which costs every short run a tenth of a second at exit.)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="translate", unit="sent", file=sys.stderr)
    for chunk, line_terms, results in translated_chunks(engine, lines, decode, read_ahead, terms):
        texts = []
        for offset, translations in enumerate(results):
            if as_json:
                texts.append(json_record(stats.sentences + offset, translations,
                                         line_terms[offset] if line_terms else None))
            elif decode.nbest > 1:
                texts.extend(format_nbest(stats.sentences + offset, translations))
            else:
                texts.append(with_alignment(translations[0]))
            stats.tokens += translations[0].n_tokens
        write_fully(output, "\n".join(texts) + "\n")  # a full disk: an OSError naming the file
        stats.sentences += len(chunk)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    stats.seconds = time.perf_counter() - started
    return stats


def translate_texts(engine: TranslationEngine, lines: list[str], decode: DecodeConfig | None = None,
                    terms: list[LineTerms] | None = None) -> list[str]:
    """The best translation of each line (with its `terms`), in the chunks `translate_stream` takes
    (reading ahead)."""
    chunk_terms = None
    if terms is not None:
        def chunk_terms(chunk: list[str], first: int) -> tuple[list[str], list[LineTerms] | None]:
            return chunk, terms[first - 1 : first - 1 + len(chunk)]

    return [t[0].text for _, _, results in translated_chunks(engine, lines, decode, read_ahead=True, terms=chunk_terms)
            for t in results]


def json_record(index: int, translations: list[Translation], terms: LineTerms | None) -> str:
    """One input line's JSON Lines record: its translations (best first) and, where it has terms,
    the constraints each lacks and the glossary entries that fired on it."""
    import json
    import math

    def hypothesis(t: Translation) -> dict:
        record: dict[str, Any] = {"text": t.text, "score": t.score if math.isfinite(t.score) else None}
        if t.alignment is not None:
            record["alignment"] = t.alignment
        if terms is not None and terms.constraints:
            record["unmet"] = list(t.unmet)
        return record

    record: dict[str, Any] = {"line": index, "translations": [hypothesis(t) for t in translations]}
    if terms is not None and not terms.empty:
        record["constraints"] = list(terms.constraints)
        if terms.prefix:
            record["prefix"] = terms.prefix
        if terms.avoid:
            record["avoid"] = list(terms.avoid)
    if terms is not None and terms.glossary:
        record["glossary"] = [{"source": s, "target": t} for s, t in terms.glossary]
    return json.dumps(record, ensure_ascii=False)


def trained_source_languages(data: dict | None) -> tuple[str, ...]:
    """The source languages of a run's `data` section (as a dict): its src_lang, or its directions'."""
    if not isinstance(data, dict):
        return ()
    if data.get("src_lang"):
        return (data["src_lang"],)
    names = [d.get("direction") if isinstance(d, dict) else d for d in data.get("directions") or []]
    return tuple(sorted({name.split("-")[0] for name in names if isinstance(name, str) and "-" in name}))
