"""What one `POST /translate` request may ask and how it is checked before it joins a batch: the
request model, its limits (lines, characters, terms), its decode settings and terms, the answer it
gets, and the one-line error (with its status) it gets otherwise."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..decoding.budget import DeadlinePassed, SearchesStopped
from ..decoding.engine import CheckpointReplaced
from ..decoding.terms import LineTerms, conflicts, unique
from ..decoding.translation import MAX_CONSTRAINTS, Translation, TranslationEngine
from ..decoding.workers import DecodingProcessDied
from ..experiment.config import DecodeConfig, refuse_booleans_as_numbers
from ..runtime.console import warn
from ..runtime.errors import TfmError


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    text: str | list[str]
    beam: int | None = Field(None, ge=1, le=64)
    nbest: int | None = Field(None, ge=1, le=64)
    alignment: bool | None = None
    sample: bool | None = None
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    temperature: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    # Text each translation starts with (target language): one for every line, or one per line ("": none).
    prefix: str | list[str] | None = None
    # Per line, the terms its translation must contain (beam search, tfm's engine).
    constraints: list[list[str]] | None = None
    # Terms no translation may contain: one list for every line, or one list per line.
    avoid: list[str] | list[list[str]] | None = None
    # The target language of a model that translates into several (its tag >>xx<< starts each line without one).
    tgt_lang: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[^\s<>]+$")
    # The source language: the model's, or auto (each line's language is identified and returned as src_lang).
    src_lang: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[^\s<>]+$")
    # A document format: each text is a document, split into sentences and rebuilt around their
    # translations (markup kept); its sentences count against the request's line limits.
    format: Literal["text", "html", "xml", "markdown", "srt", "vtt"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:  # {"beam": true} is no beam 1
        return refuse_booleans_as_numbers(cls, data)

    @field_validator("text", "prefix", "constraints", "avoid")
    @classmethod
    def _valid_unicode(cls, text: str | list | None) -> str | list | None:
        return valid_unicode(text)


def valid_unicode(text: str | list | None) -> str | list | None:
    """JSON may carry lone surrogates (`"\\ud800"`): no tokenizer takes them."""
    if text is None:
        return text
    for number, line in enumerate([text] if isinstance(text, str) else text, start=1):
        for item in [line] if isinstance(line, str) else line:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"line {number}: not valid Unicode ({exc.reason} at character {exc.start})") from None
    return text


class DetectRequest(BaseModel):
    """POST /detect: the language of each line."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[str]

    @field_validator("text")
    @classmethod
    def _valid_unicode(cls, text: str | list) -> str | list:
        return valid_unicode(text)


class RequestError(Exception):
    """A request that gets an error answer: `status` and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_status(exc: BaseException) -> int:
    """The HTTP status of a failed decode: the server's fault or the request's."""
    if isinstance(exc, RequestError):
        return exc.status
    if isinstance(exc, (DecodingProcessDied, SearchesStopped)):
        return 503  # the pool is forked anew for the next batch, or the server is stopping: try again
    if isinstance(exc, CheckpointReplaced):
        return 503  # the server's own state: the operator restarts it
    if isinstance(exc, DeadlinePassed):
        return 504
    return 422 if isinstance(exc, TfmError) else 500


# Per-request decode settings a client may choose; the rest (lengths, precision, batching) is the server's.
TERM_FIELDS = ("prefix", "constraints", "avoid")


REQUEST_SETTINGS = tuple(name for name in TranslateRequest.model_fields
                         if name not in ("text", "src_lang", "format", *TERM_FIELDS))


MAX_TERMS = MAX_CONSTRAINTS  # constraints, and avoided terms, a line may have


SAMPLING_SETTINGS = ("top_k", "top_p", "temperature", "seed")  # meaningful only with sample


def request_decode(base: DecodeConfig, request: TranslateRequest) -> DecodeConfig:
    """The server's decode settings with the request's choices; a rule across them broken → ValueError."""
    chosen = {name: getattr(request, name) for name in REQUEST_SETTINGS if getattr(request, name) is not None}
    reset = {}
    if chosen.get("sample") is False:  # the server's sampling settings go with its sampling
        reset = {name: DecodeConfig.model_fields[name].default for name in SAMPLING_SETTINGS}
    return base.updated(**reset, **chosen)  # a DecodeSettingsError (a ValueError) names the keys


def per_line(name: str, value: Any, lines: list[str], one_for_all: bool) -> list:
    """A request field given once for every line (`one_for_all`) or as a list as long as text."""
    values = [value] * len(lines) if one_for_all else value
    if len(values) != len(lines):
        raise RequestError(422, f"{name}: {len(values)} given for {len(lines)} lines of text (give "
                                f"{'one for every line, or ' if name != 'constraints' else ''}a list as long as text)")
    return values


def request_steering(engine: TranslationEngine, request: TranslateRequest, decode: DecodeConfig, lines: list[str],
                     max_chars: int) -> list[LineTerms] | None:
    """A request's target language checked against the model's tags (each line's too), and its
    terms (`request_terms`); a RequestError otherwise."""
    try:
        engine.target_languages().check(decode.tgt_lang, "tgt_lang")
        engine.target_languages().tag_lines(lines, decode.tgt_lang)
    except TfmError as exc:
        raise RequestError(422, str(exc)) from None
    return request_terms(request, lines, max_chars)


def request_terms(request: TranslateRequest, lines: list[str], max_chars: int) -> list[LineTerms] | None:
    """Each line's prefix, constraints and avoided terms from the request; a RequestError (422, or
    413 over the limits) naming the field and line otherwise."""
    if all(getattr(request, name) is None for name in TERM_FIELDS):
        return None
    prefixes = per_line("prefix", request.prefix or "", lines, not isinstance(request.prefix, list))
    constraints = per_line("constraints", request.constraints or [], lines, request.constraints is None)
    avoid = request.avoid or []
    avoids = per_line("avoid", avoid, lines, not avoid or all(isinstance(a, str) for a in avoid))
    found = []
    for number, (prefix, musts, avoided) in enumerate(zip(prefixes, constraints, avoids), start=1):
        if not isinstance(prefix, str) or not isinstance(musts, list) or not isinstance(avoided, list) \
                or not all(isinstance(t, str) for t in [*musts, *avoided]):
            raise RequestError(422, f"line {number}: avoid is a list of strings, or one such list per line")
        for name, texts in (("prefix", [prefix] if prefix else []), ("constraints", musts), ("avoid", avoided)):
            if len(texts) > MAX_TERMS:
                raise RequestError(413, f"{name} line {number}: {len(texts)} terms, more than the limit of {MAX_TERMS}")
            for text in texts:
                if len(text) > max_chars:
                    raise RequestError(413, f"{name} line {number}: {len(text)} characters, more than the limit of "
                                            f"{max_chars} (tfm serve --max-chars)")
                if "\n" in text or "\r" in text:
                    raise RequestError(422, f"{name} line {number}: a line break (a {name} term is one line)")
                if name != "prefix" and "\t" in text:
                    raise RequestError(422, f"{name} line {number}: a tab (a term is one line without tabs)")
                if name != "prefix" and not text.strip():
                    raise RequestError(422, f"{name} line {number}: an empty term")
        terms = LineTerms(prefix if prefix.strip() else "", unique(t.strip() for t in musts),
                          unique(t.strip() for t in avoided))
        problem = conflicts(terms)
        if problem:
            raise RequestError(422, f"line {number}: {problem}")
        found.append(terms)
    return found if any(not t.empty for t in found) else None


def response(results: list[list[Translation]], decode: DecodeConfig, terms: list[LineTerms] | None = None,
             engine: TranslationEngine | None = None) -> dict:
    body: dict = {"translations": [r[0].text for r in results]}
    if engine is not None:  # the model's mean log-probability per token: a score, not a quality estimate
        scores = [engine.confidence(r[0], decode) for r in results]
        body["scores"] = [None if x is None else round(x, 4) for x in scores]
    if terms is not None and any(t.constraints for t in terms):  # what did not fit a line's length limit
        body["unmet"] = [list(r[0].unmet) for r in results]
    if decode.alignment:
        body["alignments"] = [r[0].alignment for r in results]
    if decode.nbest > 1:
        body["nbest"] = [[{"text": t.text, "score": t.score, **({"alignment": t.alignment} if decode.alignment else {})}
                          for t in r] for r in results]
    return body


def check_lines(lines: list[str], max_lines: int, max_chars: int) -> None:
    """The limits of one request's text: RequestError (413, 422) naming the line."""
    if len(lines) > max_lines:
        raise RequestError(413, f"text: {len(lines)} lines, more than this server's limit of {max_lines} a "
                                "request (tfm serve --max-lines)")
    for number, line in enumerate(lines, start=1):
        if len(line) > max_chars:
            raise RequestError(413, f"text line {number}: {len(line)} characters, more than the limit of "
                                    f"{max_chars} (tfm serve --max-chars)")
        if "\n" in line or "\r" in line:
            raise RequestError(422, f"text line {number}: contains a line break (send one sentence per list item)")


def validation_message(errors: list[dict], limit: int = 300) -> str:
    """pydantic's errors in one short line, without the input (which may be megabytes)."""
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append("request body: not valid JSON")
            continue
        where = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "str", "list[str]"))
        message = str(e.get("msg", "invalid"))
        parts.append(f"{where}: {message.removeprefix('Value error, ')}" if where else message)
    text = "; ".join(dict.fromkeys(parts))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def within_budget(check: Callable[[list[str], DecodeConfig, list[LineTerms] | None], None] | None, lines: list[str],
                  decode: DecodeConfig, terms: list[LineTerms] | None) -> None:
    """RequestError 413 where `check` (the engine's work and memory budget) refuses the request."""
    if check is not None:
        try:
            check(lines, decode, terms)
        except TfmError as exc:
            raise RequestError(413, str(exc)) from None


def failure_message(status: int, exc: BaseException, request_timeout: float) -> str:
    """What a failed request is told: its own error, or what the server's trouble means for it."""
    if status == 504:
        return (f"the request's decoding ran past {request_timeout:g} s, this server's limit "
                "(tfm serve --request-timeout): send fewer lines or a smaller beam")
    if status < 500 or isinstance(exc, (DecodingProcessDied, SearchesStopped, CheckpointReplaced)):
        return str(exc)
    return f"internal error ({type(exc).__name__}); the server goes on"


def log_failure(status: int, exc: BaseException, debug: bool) -> None:
    """One line per failed request that is the server's concern (5xx); a traceback only with --debug."""
    if status < 500:
        return
    warn(f"tfm serve: {status}: {type(exc).__name__}: {str(exc)[:300]}")
    if debug:
        warn("".join(traceback.format_exception(exc)).rstrip())
