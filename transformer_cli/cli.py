"""`tfm` command line: parsing and printing only; the work happens in the stage modules."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from . import __version__
from .runtime.console import say, warn
from .runtime.entry import user_errors_in_one_line
from .runtime.errors import TfmError, describe_os_error
from .runtime.files import check_output


class OneValueOptions(TyperCommand):
    """A command whose single-valued options refuse a second value: click keeps the last one
    silently (`translate --checkpoint A --checkpoint B` translated with B alone)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        words = args[: args.index("--")] if "--" in args else args
        for param in self.params:
            if param.param_type_name == "option" and not param.multiple and not getattr(param, "count", False):
                given = sum(word in param.opts or any(word.startswith(f"{opt}=") for opt in param.opts
                                                      if opt.startswith("--")) for word in words)
                if given > 1:
                    raise typer.BadParameter(f"given {given} times; it takes one value", ctx=ctx, param=param)
        return super().parse_args(ctx, args)


UsageError = typer.BadParameter.__bases__[0]  # click's, which newer typer releases vendor


@contextlib.contextmanager
def usage_errors_in_one_line(group_ctx=None):
    """click's usage errors (an unknown option or command, a missing or invalid value) as one line
    on stderr and exit 2, like every other tfm error, instead of the usage text and a boxed message.
    `group_ctx`: the `tfm` context, naming the command when the error does not carry its own."""
    try:
        yield
    except UsageError as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # a bare `tfm`: click prints the help
            raise
        if err.ctx is not None:
            path = err.ctx.command_path
        elif group_ctx is not None:
            path = " ".join(filter(None, [group_ctx.command_path, group_ctx.invoked_subcommand]))
        else:
            path = "tfm"
        warn(f"error: {path}: {err.format_message().rstrip('.')} (see {path} --help)")
        raise typer.Exit(2) from None


class OneLineUsageErrors(TyperGroup):
    """The `tfm` group: its own usage errors and its commands' as one line (above)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with usage_errors_in_one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with usage_errors_in_one_line(ctx):  # a command's arguments are parsed in here
            return super().invoke(ctx)


app = typer.Typer(
    cls=OneLineUsageErrors,
    help="tfm: train and run Transformer translation models.\n\n"
    "Every command reads a YAML config (--config) and accepts dotted overrides "
    "(--set train.max_steps=200). Paths in configs are relative to the working directory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML experiment config.")
SetOpt = typer.Option(None, "--set", help="Override a config key, e.g. --set train.max_steps=200 (repeatable).")


def user_errors(fn):
    """Turn user errors into one line on stderr + exit 2; Ctrl-C into exit 130; no tracebacks
    (runtime/entry.py: the scripts end the same way)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with user_errors_in_one_line():
            return fn(*args, **kwargs)

    return wrapper


def _load(config: Optional[Path], overrides: Optional[list[str]]):
    from .experiment.config import load_config

    if config is None:
        raise TfmError("--config is required (e.g. --config configs/de-en.yaml)")
    return load_config(config, overrides or [])


def _load_for_inference(config: Path, overrides: Optional[list[str]], checkpoint: Optional[list[Path]]):
    """A config for translating/evaluating a trained model. `--set model.*`/`vocab.*` cannot change
    it: accepted only where they repeat what the config's run was trained with (its resolved
    config.yaml), when that run's checkpoint is the one translating."""
    from .experiment.config import check_inference_overrides, fixed_by_checkpoint, load_config

    cfg = _load(config, overrides)
    trained = None
    if any(map(fixed_by_checkpoint, overrides or [])) and not checkpoint and not cfg.decode.checkpoints:
        resolved = cfg.run.config_file
        trained = load_config(resolved) if resolved.is_file() else None
    check_inference_overrides(overrides or [], trained)
    return cfg


def open_input(path: Optional[Path]):
    """The bytes of `--input` (a file, a FIFO, `<(…)`), or standard input."""
    if path is None:
        return sys.stdin.buffer
    if not path.exists():
        raise TfmError(f"input file not found: {path}")
    if path.is_dir():
        raise TfmError(f"{path} is a directory, not an input file")
    return open(path, "rb")


def is_regular_file(stream) -> bool:
    """Input that is all there already (a file, stdin redirected from one), not a pipe or terminal."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def _version(value: bool) -> None:
    if value:
        say(f"tfm {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """tfm: train and run Transformer translation models."""


@app.command(cls=OneValueOptions)
@user_errors
def prepare(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    force: bool = typer.Option(False, "--force", help="Rebuild even if the run directory is up to date."),
    discard_checkpoints: bool = typer.Option(
        False, "--discard-checkpoints", help="Rebuild a run that has been trained: first move its checkpoints/, "
        "metrics.jsonl and tensorboard/ into a discarded-<time>/ folder of the run (without it, refused)."),
    dropped: Optional[Path] = typer.Option(
        None, "--dropped", help="Also write every training pair the filters drop, with its reason, to this file "
        "(JSON lines: reason, direction, file, line, src, tgt)."),
) -> None:
    """Train the sentencepiece vocabulary and binarise train/valid/test into the run directory,
    dropping the training pairs that data.filters finds noisy (a report says which and why)."""
    cfg = _load(config, set_)  # before importing torch (seconds on a slow CPU): config errors come at once
    check_output(dropped, {"--config": [config]}, flag="--dropped")
    from .data.prepare import check_corpus_files, check_dropped_file
    from .data.prepare import prepare as run_prepare
    from .training.filter_models import train_filter_models

    check_corpus_files(cfg)  # before the model filter's own models train on them
    if dropped is not None:
        check_dropped_file(cfg, dropped)
    train_filter_models(cfg, progress=sys.stderr.isatty())  # the model filter on, naming no model
    result = run_prepare(cfg, force=force, progress=sys.stderr.isatty(), discard_checkpoints=discard_checkpoints,
                         dropped=dropped)
    if result.discarded is not None:
        warn(f"moved the earlier training (checkpoints/, metrics) to {result.discarded}")
    m = result.manifest
    if result.reused:
        say(f"{result.run_dir}: up to date, reused existing vocab and data (--force to rebuild)")
    else:
        say(f"prepared {result.run_dir} in {m.seconds:.1f}s; vocab {m.vocab_size['src']} "
            f"({'joint' if cfg.vocab.joint else 'separate'}); report {cfg.run.cleaning_report}"
            + (f"; dropped pairs in {dropped}" if dropped is not None else ""))
        say(result.cleaning.table())
        for warning in result.cleaning.warnings():
            warn(f"WARNING: {warning}")
    for split, cut in m.truncated.items():
        warn(f"warning: data.{split}: {cut['count']} pair(s) longer than {cut['max_tokens']} tokens "
             f"(model.max_positions - 2) kept but truncated; line(s) {', '.join(map(str, cut['lines']))}"
             f"{' …' if cut['count'] > len(cut['lines']) else ''}")
    say(result.summary)


@app.command(cls=OneValueOptions)
@user_errors
def train(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from the run's checkpoint_last.pt."),
) -> None:
    """Train the model (warm-up LR, teacher forcing, label smoothing; GPU when present)."""
    cfg = _load(config, set_)  # before importing torch: config errors come at once
    if _RUN_AS_PROGRAM:  # not when a test or a program calls the command in its own process
        from .runtime.allocator import use_allocator

        # may start this program again, on mimalloc
        use_allocator(cfg.train.allocator, ["-m", "transformer_cli", *sys.argv[1:]])
    from .runtime.cpu import limit_training_kernel_cache

    limit_training_kernel_cache()  # before torch runs its first kernel
    from .training.train import train as run_train

    run_train(cfg, resume=resume, progress_bar=sys.stderr.isatty())


CheckpointOpt = typer.Option(
    None, "--checkpoint", help="Model file (default: decode.checkpoints, else the run's best-validated of "
    "checkpoint_avg/ema/best.pt). Repeat it to translate with an ensemble.")
BeamOpt = typer.Option(None, "--beam", min=1, help="Beam size (1 = greedy; default decode.beam).")
NbestOpt = typer.Option(None, "--nbest", help="Print the K best: 'line<TAB>rank<TAB>score<TAB>text' "
                        "(default decode.nbest, 1); with --sample, K samples.")
BatchSizeOpt = typer.Option(None, "--batch-size", help="Sentences per batch.")
BatchTokensOpt = typer.Option(None, "--batch-tokens", help="Source tokens per batch.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu or cuda.")
QuantizeOpt = typer.Option(None, "--quantize", help="int8: dynamic int8 Linear layers (CPU; same as --set "
                           "decode.precision=int8).")
SampleOpt = typer.Option(None, "--sample/--no-sample", help="Draw translations from the model's distribution "
                         "instead of searching (back-translation); --nbest N: N samples.")
TopKOpt = typer.Option(None, "--top-k", help="With --sample: only the K most probable tokens (0 = all).")
TopPOpt = typer.Option(None, "--top-p", help="With --sample: only the most probable tokens holding probability P "
                       "(nucleus sampling; 1 = all).")
TemperatureOpt = typer.Option(None, "--temperature", help="With --sample: divide log-probabilities by T "
                              "(< 1: closer to greedy).")
SeedOpt = typer.Option(None, "--seed", help="With --sample: the random seed (same seed, same samples).")
AlignmentOpt = typer.Option(None, "--alignment/--no-alignment", help="Also print word alignments: "
                            "'translation<TAB>i-j …' (Pharaoh format, 0-based whitespace words).")
TgtLangOpt = typer.Option(None, "--tgt-lang", help="The target language of a model that translates into "
                          "several: its tag >>xx<< starts every line that has none (decode.tgt_lang).")
ENGINES = ("auto", "torch", "ctranslate2")
EngineOpt = typer.Option(None, "--engine", help="auto (decode.engine's default: CTranslate2 where the model and "
                         "settings allow, its conversion cached beside the checkpoint; else tfm's own), torch "
                         "(tfm's own) or ctranslate2.")
ComputeTypeOpt = typer.Option(None, "--compute-type", help="CTranslate2's: auto (int8 on CPU, float16 on CUDA), "
                              "int8, float32, bfloat16… (decode.compute_type).")


@app.command(cls=OneValueOptions)
@user_errors
def translate(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    checkpoint: Optional[list[Path]] = CheckpointOpt,
    input_: Optional[Path] = typer.Option(None, "--input", "-i", help="Source text (default: stdin)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Translations (default: stdout)."),
    beam: Optional[int] = BeamOpt,
    nbest: Optional[int] = NbestOpt,
    batch_size: Optional[int] = BatchSizeOpt,
    batch_tokens: Optional[int] = BatchTokensOpt,
    device: str = DeviceOpt,
    quantize: Optional[str] = QuantizeOpt,
    engine: Optional[str] = EngineOpt,
    model_dir: Optional[Path] = typer.Option(None, "--model", help="A CTranslate2 directory from tfm export, "
                                             "instead of a checkpoint."),
    compute_type: Optional[str] = ComputeTypeOpt,
    workers: Optional[str] = typer.Option(None, "--workers", help="CPU: processes decoding batches at once, one "
                                          "thread each (auto = one per core; 1 = this process, all threads)."),
    sample: Optional[bool] = SampleOpt,
    top_k: Optional[int] = TopKOpt,
    top_p: Optional[float] = TopPOpt,
    temperature: Optional[float] = TemperatureOpt,
    seed: Optional[int] = SeedOpt,
    alignment: Optional[bool] = AlignmentOpt,
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Every translation starts with this text "
                                         "(target language): the search is forced through it, then goes on."),
    constraints: bool = typer.Option(False, "--constraints", help="Input lines are source<TAB>term<TAB>…: each "
                                     "term appears in the translation (^text: its prefix; !text: a term to avoid)."),
    avoid: Optional[Path] = typer.Option(None, "--avoid", help="A file of target words or phrases, one a line, that "
                                         "no translation contains."),
    glossary: Optional[Path] = typer.Option(None, "--glossary", help="A file of source term<TAB>target term lines: "
                                            "where a source term occurs in a line, its target term is a constraint."),
    as_json: bool = typer.Option(False, "--json", help="Write one JSON object a line: translations, scores, "
                                 "constraints not met, glossary entries used."),
    tgt_lang: Optional[str] = TgtLangOpt,
    doc_format: Optional[str] = typer.Option(None, "--format", help="lines (one sentence a line, streamed), or a "
                                             "document: text (paragraphs), html, xml, markdown, srt, vtt, docx; default: by -i's extension."),
) -> None:
    """Translate raw sentences, one per line (stdin → stdout by default), streaming; or a document
    (--format, or -i doc.html/.xml/.md/.srt/.vtt/.docx) with its paragraphs, markup or timings kept."""
    check_output(output, {"-i": [input_], "--config": [config], "--checkpoint": checkpoint or [], "--avoid": [avoid],
                          "--glossary": [glossary], "--model": [model_dir / name for name in ("model.bin", "vmap.txt")]
                          if model_dir is not None else []})
    fmt = _document_format(doc_format, input_, nbest, as_json, constraints or prefix or avoid or glossary)
    cfg = _load_for_inference(config, set_, checkpoint) if config is not None else None
    if engine is not None and engine not in ENGINES:
        raise TfmError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    if quantize not in (None, "int8"):
        raise TfmError(f"--quantize {quantize}: only int8 is supported")
    terminology = _terminology(constraints, prefix, avoid, glossary, input_)
    # Imports torch only where tfm's own engine translates: after the checks above.
    from .decoding.engine import open_engine
    from .decoding.translation import read_decoded_lines, translate_stream

    translator = open_engine(cfg, set_, checkpoint, device, quantize, engine=engine, compute_type=compute_type,
                             model_dir=model_dir, lexical=bool(constraints or avoid or glossary),
                             batch_size=batch_size, batch_tokens=batch_tokens, workers=workers, beam=beam, nbest=nbest,
                             sample=sample, top_k=top_k, top_p=top_p, temperature=temperature, seed=seed,
                             alignment=True if fmt in ("html", "xml", "markdown", "docx") else alignment, tgt_lang=tgt_lang)
    translator.target_languages().check(translator.decode.tgt_lang)  # before any input is read
    _check_search(translator, beam)
    if prefix is not None:
        translator.prefix_tokens(prefix)  # a prefix it cannot spell: refused before any input is read
    if constraints or avoid or glossary:  # settings that cannot apply them: refused before any input is read
        translator.check_lexical(constraints or glossary is not None, avoid is not None, translator.decode)
    from .decoding.budget import check_decoding_budget, decoding_memory_limit

    translator.memory_limit = decoding_memory_limit(translator.decode, translator.device)
    # Before reading any input: settings that even one line of one token cannot afford are refused at
    # once; each chunk of input is checked again with its own sizes before it is decoded.
    if translator.member_configs:
        check_decoding_budget(translator.member_configs, translator.decode, 1, 1, translator.memory_limit)
    source = open_input(input_)
    from .runtime.files import atomic_path

    def run(out_stream):
        if fmt != "lines":
            return _translate_document(translator, fmt, source, input_, out_stream)
        lines = read_decoded_lines(source, sys.stderr, str(input_) if input_ is not None else "standard input",
                                   strict=constraints)
        return translate_stream(translator, lines, out_stream, progress=sys.stderr.isatty(),
                                read_ahead=is_regular_file(source), terms=terminology if terminology.active else None,
                                as_json=as_json)

    if output is not None:
        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
            stats = run(f)
    else:
        stats = run(sys.stdout)
    rate = stats.sentences / stats.seconds if stats.seconds else 0.0
    processes = translator.decoding_processes
    warn(f"translated {stats.sentences} sentences in {stats.seconds:.1f}s: {rate:.1f} sentences/s, "
         f"{stats.tokens / max(stats.seconds, 1e-9):.0f} tokens/s; {translator.describe()}"
         f"{f'; {processes} decoding processes' if processes > 1 else ''}")


def _check_search(translator, beam: Optional[int]) -> None:
    """--beam beside --sample, and the decode settings against the engine, before any input is read
    (the rules between the settings, nbest ≤ beam among them, are checked where they are built:
    `DecodeConfig.updated`)."""
    if translator.decode.sample and beam is not None and beam > 1:
        raise TfmError(f"--beam {beam} does nothing with --sample (samples are drawn, not searched): drop --beam, "
                       "and give the samples per line with --nbest")
    unsupported = translator.unsupported(translator.decode)
    if unsupported:
        raise TfmError(unsupported)


def _document_format(given: Optional[str], input_: Optional[Path], nbest: Optional[int], as_json: bool,
                     terminology) -> str:
    """--format (or -i's extension); a document takes one translation per sentence, no terms."""
    from .documents.formats import document_format

    fmt = document_format(given, input_)
    if fmt != "lines" and ((nbest or 1) > 1 or as_json or terminology):
        raise TfmError(f"--format {fmt}: a document gets one translation per sentence: --nbest, --json, "
                       "--constraints, --prefix, --avoid and --glossary are for --format lines")
    return fmt


def _translate_document(translator, fmt: str, source, input_: Optional[Path], out_stream):
    """Read the whole document, translate it in its format, write it; the stream's statistics."""
    import time

    from .decoding.translation import StreamStats
    from .documents.formats import read_document, translate_document
    from .runtime.console import write_fully

    stats, started = StreamStats(), time.perf_counter()
    name = str(input_) if input_ is not None else "standard input"
    document = read_document(source, name, fmt=fmt)
    try:
        translated, stats.sentences, stats.tokens = translate_document(translator, document, fmt)
    except TfmError as exc:  # a document that cannot be read as its format: the message names the file
        raise (exc if str(exc).startswith(name) else TfmError(f"{name}: {exc}")) from None
    if isinstance(translated, bytes):  # a Word file
        out_stream.flush()
        out_stream.buffer.write(translated)
    else:
        write_fully(out_stream, translated)
    stats.seconds = time.perf_counter() - started
    return stats


def _terminology(constraints: bool, prefix: str | None, avoid: Path | None, glossary: Path | None,
                 input_: Path | None):
    """`tfm translate`'s terminology options, read and checked before a model loads."""
    from .decoding.terms import Glossary, Terminology, read_term_list

    if prefix is not None and (not prefix.strip() or "\n" in prefix or "\r" in prefix):
        raise TfmError("--prefix: give one line of text, not empty, that every translation starts with")
    return Terminology(constraints, prefix or "", read_term_list(avoid) if avoid is not None else (),
                       Glossary.read(glossary) if glossary is not None else None,
                       str(input_) if input_ is not None else "standard input")


AccessLogOpt = typer.Option(None, "--access-log", help="One JSON line per request (time, client, status, characters, "
                            "latency; never the text) to this file; - for stderr.")
ForwardedOpt = typer.Option(None, "--forwarded-allow-ips", help="Proxies (addresses or networks, comma-separated; "
                            "* for any) whose X-Forwarded-For names the client. Default: none (the connection's address).")


@app.command(cls=OneValueOptions)
@user_errors
def serve(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    checkpoint: Optional[list[Path]] = CheckpointOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: this machine only; "
                             "0.0.0.0: every interface, with a warning: the API has no authentication)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    beam: Optional[int] = BeamOpt,
    nbest: Optional[int] = typer.Option(None, "--nbest", help="Hypotheses per line unless a request says (default 1)."),
    batch_size: Optional[int] = BatchSizeOpt,
    batch_tokens: Optional[int] = BatchTokensOpt,
    device: str = DeviceOpt,
    quantize: Optional[str] = QuantizeOpt,
    engine: Optional[str] = EngineOpt,
    model_dir: Optional[Path] = typer.Option(None, "--model", help="A CTranslate2 directory from tfm export, "
                                             "instead of a checkpoint."),
    compute_type: Optional[str] = ComputeTypeOpt,
    workers: Optional[str] = typer.Option(None, "--workers", help="CPU: processes decoding at once, one thread "
                                          "each, forked at start (auto = one per core; 1 = the server process)."),
    sample: Optional[bool] = SampleOpt,
    top_k: Optional[int] = TopKOpt,
    top_p: Optional[float] = TopPOpt,
    temperature: Optional[float] = TemperatureOpt,
    seed: Optional[int] = SeedOpt,
    alignment: Optional[bool] = AlignmentOpt,
    max_lines: int = typer.Option(256, "--max-lines", min=1, help="Lines one request may send."),
    max_chars: int = typer.Option(10_000, "--max-chars", min=1, help="Characters one line may have."),
    max_wait_ms: float = typer.Option(5.0, "--max-wait-ms", min=0.0, max=10_000.0,
                                      help="How long a request waits for others to share its batch."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", min=1, max=1 << 30,
                                       help="Largest request body; a larger one gets 413 before it is read."),
    request_timeout: float = typer.Option(60.0, "--request-timeout", min=0.1, max=86_400.0,
                                          help="Seconds a request's decoding may take; past them it gets 504 and its "
                                          "decoding stops, so that the requests behind it are served."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.1, max=3_600.0,
                                         help="Seconds a connection may take to send a request's headers."),
    shutdown_grace: float = typer.Option(5.0, "--shutdown-grace", min=0.0, max=3_600.0, help="Seconds the requests "
                                         "in flight may take after SIGTERM, SIGINT or SIGHUP; then their decoding "
                                         "stops (503)."),
    debug: bool = typer.Option(False, "--debug", help="Log a traceback with each failed request (5xx)."),
    tgt_lang: Optional[str] = TgtLangOpt,
    api_keys: Optional[Path] = typer.Option(None, "--api-keys", help="A file of hashed API keys (tfm api-key): every "
                                            "endpoint but /health then needs 'Authorization: Bearer <key>'."),
    quota_chars: int = typer.Option(0, "--quota-chars", min=0, max=10**9, help="Characters of text each client "
                                    "(key, or address without keys) may send a minute; 0: no limit."),
    quota_concurrent: int = typer.Option(0, "--quota-concurrent", min=0, max=100_000, help="Requests each client may "
                                         "have in flight at once; 0: no limit."),
    access_log: Optional[Path] = AccessLogOpt,
    forwarded_allow_ips: Optional[str] = ForwardedOpt,
) -> None:
    """Serve translations over HTTP: POST /translate {"text": [...]} → {"translations": [...]}.

    GET /health; OpenAPI page at /docs. Concurrent requests are decoded together (dynamic
    batching). SIGTERM finishes the requests in flight, then exits; SIGUSR1 loads the model anew from
    the same files and swaps it in (a model that fails to load keeps the old one serving). Needs
    pip install -e '.\\[serve]'.
    """
    cfg = _load_for_inference(config, set_, checkpoint) if config is not None else None
    run_server, listening_address = _server_functions()
    from .serve.access import AccessLog, ApiKeys, Quotas, trusted_proxy_addresses

    keys = ApiKeys.load(api_keys) if api_keys is not None else None
    trusted_proxies = trusted_proxy_addresses(forwarded_allow_ips)
    _check_access_log(access_log, {"--config": [config], "--checkpoint": checkpoint or [], "--api-keys": [api_keys]})
    shown_host, loopback = listening_address(host)
    if engine is not None and engine not in ENGINES:
        raise TfmError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    from .decoding.budget import decoding_memory_limit
    from .decoding.engine import lexical_engine, open_engine

    settings = dict(batch_size=batch_size, batch_tokens=batch_tokens, beam=beam, nbest=nbest, sample=sample,
                    top_k=top_k, top_p=top_p, temperature=temperature, seed=seed, alignment=alignment, tgt_lang=tgt_lang)

    def load():  # at start, and again from the same files at each reload (SIGUSR1)
        # One engine for the whole server: a setting only tfm's engine has (an ensemble, alignments,
        # sampling) chooses it for every request, and auto says so at start.
        made = open_engine(cfg, set_, checkpoint, device, quantize, engine=engine, compute_type=compute_type,
                           model_dir=model_dir, workers=workers, **settings)
        made.target_languages().check(made.decode.tgt_lang)
        made.memory_limit = decoding_memory_limit(made.decode, made.device)
        made.decode = made.decode.model_copy(update={"scores": True})  # every answer carries its scores
        return made, lexical_engine(made, cfg, set_, checkpoint, device, engine, model_dir, **settings)

    translator, lexical = load()
    banner = _serve_banner(f"http://{shown_host}:{port}", translator.describe(), host, loopback, keys, api_keys)
    quotas = Quotas(quota_chars, quota_concurrent) if quota_chars or quota_concurrent else None
    model_name = str(model_dir or (checkpoint[0] if checkpoint else (cfg.run_dir if cfg else "")))
    log_stream = _open_access_log(access_log)  # opened last: every error before it leaves nothing open
    try:
        run_server(translator, host, port, max_lines=max_lines, max_chars=max_chars, max_wait=max_wait_ms / 1000,
                   max_body_bytes=max_body_bytes, debug=debug, ready=lambda: warn(banner), lexical_engine=lexical,
                   request_timeout=request_timeout, header_timeout=header_timeout, shutdown_grace=shutdown_grace,
                   keys=keys, quotas=quotas, access_log=AccessLog(log_stream) if log_stream is not None else None,
                   model_name=model_name,
                   reload=load, forwarded_allow_ips=trusted_proxies)
    finally:
        _close_access_log(log_stream)
    warn("tfm serve: stopped")


def _server_functions():
    """(serve.server.serve, serve.transport.listening_address), or a one-line error naming the extra."""
    try:
        import prometheus_client  # noqa: F401 (GET /metrics)

        from .serve.server import serve as run_server
        from .serve.transport import listening_address
    except ImportError as exc:
        raise TfmError(f"tfm serve needs FastAPI, uvicorn and prometheus-client: pip install -e '.[serve]' ({exc})") from None
    return run_server, listening_address


def _serve_banner(url: str, engine: str, host: str, loopback: bool, keys, api_keys: Optional[Path]) -> str:
    """tfm serve's first line: where, on what engine, with how many keys (or a warning without)."""
    banner = f"tfm serve: {url}/translate (docs: /docs); {engine}"
    if keys is not None:
        return banner + f"; {len(keys.hashes)} API key(s) from {api_keys}"
    if not loopback:
        banner += (f"\nwarning: --host {host} reaches beyond this machine and the API has no authentication: "
                   "anyone who can reach it can use it (give --api-keys, or keep it behind a firewall or a proxy "
                   "that checks)")
    return banner


def _close_access_log(stream) -> None:
    if stream is not None and stream is not sys.stderr:
        with contextlib.suppress(OSError):
            stream.close()


def _check_access_log(path: Optional[Path], inputs: dict[str, list[Path | None]]) -> None:
    """--access-log names a file to append to: never a directory, one of the inputs or a run's own file."""
    check_output(path, inputs, flag="--access-log")


def _open_access_log(path: Optional[Path]):
    """--access-log: stderr for -, else the file opened for appending."""
    if path is None:
        return None
    if str(path) == "-":
        return sys.stderr
    try:
        return open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (open for the server's life)
    except OSError as exc:
        raise TfmError(f"--access-log {path}: {describe_os_error(exc)}") from None


@app.command("api-key", cls=OneValueOptions)
@user_errors
def api_key(
    api_keys: Path = typer.Option(..., "--api-keys", help="The key file of tfm serve --api-keys (made if missing)."),
    name: Optional[str] = typer.Option(None, "--name", help="What logs and metrics call this key (one word)."),
) -> None:
    """Make an API key for tfm serve: its hash is added to the key file, the key printed once."""
    from .serve.access import new_api_key

    check_output(api_keys, flag="--api-keys")  # (the key file itself is read and written: its own output)
    say(new_api_key(api_keys, name))


@app.command(cls=OneValueOptions)
@user_errors
def evaluate(
    hyp: Optional[list[Path]] = typer.Option(None, "--hyp", help="Hypothesis file; twice for a paired comparison."),
    ref: Optional[Path] = typer.Option(None, "--ref", help="Reference file."),
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    checkpoint: Optional[list[Path]] = typer.Option(
        None, "--checkpoint", help="With --config: model (default: decode.checkpoints, else the best-validated of "
        "checkpoint_avg/ema/best.pt); repeat it for an ensemble."
    ),
    split: str = typer.Option("test", "--split", help="With --config: valid or test."),
    beam: Optional[int] = typer.Option(None, "--beam", min=1, help="With --config: beam size (default decode.beam)."),
    metrics: str = typer.Option("bleu,chrf", "--metrics", help="Comma-separated: bleu, chrf, ter."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    min_bleu: Optional[str] = typer.Option(None, "--min-bleu", help="Exit 1 when BLEU is below this (CI gate); "
                                           "a multilingual run: the average, or one direction's as en-de=30."),
    confidence: bool = typer.Option(False, "--confidence", help="Bootstrap 95% confidence intervals."),
    engine: Optional[str] = EngineOpt,
    compute_type: Optional[str] = ComputeTypeOpt,
    constraints: Optional[Path] = typer.Option(None, "--constraints", help="With --config: a file of the split's "
                                               "source<TAB>term<TAB>… lines, translated with its terms instead of "
                                               "the source; reports the share of terms used."),
    tgt_lang: Optional[str] = TgtLangOpt,
    directions: Optional[str] = typer.Option(None, "--directions", help="With --config, a multilingual run: the "
                                             "directions to score, e.g. de-fr,fr-de (untrained ones: zero-shot), "
                                             "or all (every pair of its languages); default: the run's."),
    augment: Optional[str] = typer.Option(None, "--augment", help="With --config: also score the split as people "
                                          "type it: upper,title,lower,typos,nopunct,mix (or all), a row each with "
                                          "its share of the clean score; --min-bleu upper=30 gates one."),
) -> None:
    """Score translations with sacreBLEU: files (--hyp/--ref) or a model on a split (--config); a
    multilingual run: a table of every direction and their average."""
    from .evaluate import evaluate_files, evaluate_model, gate_verdict, parse_gate, parse_metrics

    gate_direction, gate = parse_gate(min_bleu) if min_bleu is not None else (None, None)
    if constraints is not None and (config is None or hyp):
        raise TfmError("--constraints goes with --config (a model translates the split with the terms)")
    if directions is not None and (config is None or hyp):
        raise TfmError("--directions goes with --config (a multilingual model translates the split's directions)")
    if gate_direction is not None and (config is None or hyp):
        raise TfmError(f"--min-bleu {min_bleu}: a direction's gate goes with --config on a multilingual run")
    chosen = _chosen_directions(directions) if directions is not None else None
    variants = _augmented_variants(augment, config is not None and not hyp, constraints, directions)
    if variants and gate_direction is not None and gate_direction not in variants:
        raise TfmError(f"--min-bleu {min_bleu}: {gate_direction} is not a variant --augment scores "
                       f"({', '.join(variants)})")
    names = parse_metrics(metrics)
    if gate is not None and "bleu" not in names:
        names.insert(0, "bleu")
    if hyp:
        if ref is None:
            raise TfmError("--hyp needs --ref")
        if len(hyp) > 1:
            _evaluate_paired(hyp, ref, names, confidence, as_json, gate)
            return
        result = evaluate_files(hyp[0], ref, names, confidence)
    elif config is not None:
        if split not in ("valid", "test"):
            raise TfmError(f"--split {split!r}: choose valid or test")
        if engine is not None and engine not in ENGINES:
            raise TfmError(f"--engine {engine}: choose {', '.join(ENGINES)}")
        from .decoding.engine import model_files, with_options

        cfg = _load_for_inference(config, set_, checkpoint)
        cfg.decode = with_options(cfg.decode, {"beam": beam})  # the settings travel in the config from here
        if variants:
            if cfg.data.multilingual and chosen is None:
                raise TfmError("--augment scores one direction of a multilingual run: give --directions (e.g. de-en)")
            from .evaluate import evaluate_augmented

            result = evaluate_augmented(cfg, checkpoint or model_files(cfg), split, names, variants, engine=engine,
                                        compute_type=compute_type, tgt_lang=tgt_lang,
                                        direction=chosen[0] if chosen else None)
        elif cfg.data.multilingual or directions is not None:
            result = _evaluate_directions(cfg, checkpoint, split, names, confidence, engine, compute_type,
                                          chosen, constraints, tgt_lang)
        else:
            result = evaluate_model(cfg, checkpoint or model_files(cfg), split, names, confidence,
                                    engine=engine, compute_type=compute_type, constraints=constraints,
                                    tgt_lang=tgt_lang)
    else:
        raise TfmError("give --hyp and --ref, or --config (to translate and score a split)")

    _print_evaluation(result, as_json)
    if gate is not None:
        passed, verdict = gate_verdict(result, gate, gate_direction, min_bleu)
        warn(verdict)
        if not passed:
            raise typer.Exit(1)


def _augmented_variants(spec: str | None, with_config: bool, constraints: Path | None,
                        directions: str | None) -> list[str]:
    """`--augment`'s variants (none without it), checked before anything is translated."""
    if spec is None:
        return []
    from .data.augment import parse_variants

    if not with_config:
        raise TfmError("--augment goes with --config (a model translates the split's variants)")
    if constraints is not None:
        raise TfmError("--augment goes without --constraints: it scores the split's own sources as people type them")
    if directions is not None and (directions.strip() == "all" or len(_chosen_directions(directions)) != 1):
        raise TfmError(f"--augment --directions {directions}: give one direction (e.g. de-en): a multilingual "
                       "run's variants are scored one direction at a time")
    return parse_variants(spec)


def _evaluate_paired(hyp: list[Path], ref: Path, names: list[str], confidence: bool, as_json: bool,
                     gate: float | None) -> None:
    """`--hyp A --hyp B …`: each system against the first; a gate applies to every system."""
    from .evaluate import check_aligned, format_paired, paired_comparison
    from .runtime.files import read_lines

    refs = read_lines(ref)
    systems = {}
    for path in hyp:
        systems[str(path)] = read_lines(path)
        check_aligned(systems[str(path)], refs, str(path), str(ref))
    report = paired_comparison(systems, refs, names, confidence)
    say(json.dumps(report) if as_json else format_paired(report))
    if gate is not None:
        failed = []
        for name, scores in report["systems"].items():
            bleu = scores["bleu"]["score"]
            passed = bleu >= gate
            failed += [] if passed else [name]
            warn(f"{'PASS' if passed else 'FAIL'}: {name} BLEU {bleu:.2f} {'>=' if passed else '<'} {gate}")
        if failed:
            raise typer.Exit(1)


def _print_evaluation(result, as_json: bool) -> None:
    if as_json:
        say(json.dumps(result.to_json()))
        return
    if "directions" in result.extra:
        from .evaluate import directions_table

        say(directions_table(result))
    elif "variants" in result.extra:
        from .evaluate import variants_table

        say(variants_table(result))
    else:
        for s in result.scores.values():
            ci = f" (95% CI ± {s.ci:.2f})" if s.ci is not None else ""
            say(f"{s.text}{ci}\n  {s.signature}")
        use = result.extra.get("term_use")
        if use and use["constraints"]:
            say(f"constraints: {use['met']} of {use['constraints']} terms in the translations "
                f"({100 * use['rate']:.1f}%)")
    if result.extra:
        say(f"{result.n_sentences} sentences, beam {result.extra['beam']}, "
            f"{result.extra['sentences_per_s']} sentences/s ({result.extra['engine']}); "
            f"hypotheses: {result.extra['hyp_file']}")


def _chosen_directions(spec: str) -> list | str:
    """--directions: "all", or the directions it lists (a bad one is an error naming it)."""
    from .experiment.directions import parse_directions

    if spec.strip() == "all":
        return "all"
    try:
        return parse_directions(spec, "--directions")
    except ValueError as exc:
        raise TfmError(str(exc)) from None


def _evaluate_directions(cfg, checkpoint, split, names, confidence, engine, compute_type, chosen,
                         constraints, tgt_lang):
    """`tfm evaluate --config` of a multilingual run (or with --directions): every direction."""
    from .decoding.engine import model_files
    from .evaluate import evaluate_directions
    from .experiment.directions import Direction

    if constraints is not None or tgt_lang is not None:
        option = "--constraints" if constraints is not None else "--tgt-lang"
        raise TfmError(f"{option}: a multilingual run is evaluated direction by direction; choose them with "
                       "--directions (e.g. en-de,de-en)")
    if chosen == "all":  # every ordered pair of the run's languages
        languages = sorted({lang for d in cfg.data.pairs for lang in (d.src, d.tgt)})
        chosen = [Direction(a, b) for a in languages for b in languages if a != b]
    return evaluate_directions(cfg, checkpoint or model_files(cfg), split, names, chosen, confidence,
                               engine=engine, compute_type=compute_type)


@app.command(cls=OneValueOptions)
@user_errors
def average(
    checkpoints: list[Path] = typer.Argument(..., help="Checkpoints to average (same model)."),
    output: Path = typer.Option(..., "--output", "-o", help="Averaged checkpoint to write."),
    force: bool = typer.Option(False, "--force", help="Write it into a run's checkpoints/ (e.g. its "
                               "checkpoint_avg.pt); never over checkpoint_last.pt or step_<N>.pt."),
) -> None:
    """Average the weights of several checkpoints (paper §6.1) into one."""
    from .experiment.checkpoint import average_checkpoints
    from .experiment.rundir import save_checkpoint_file

    check_output(output, {"a checkpoint to average": list(checkpoints)}, run_files=False)  # (force: below)
    save_checkpoint_file(output, lambda: average_checkpoints(list(checkpoints)), force, "tfm average")
    say(f"averaged {len(checkpoints)} checkpoints → {output}")


@app.command(cls=OneValueOptions)
@user_errors
def plot(
    runs: list[Path] = typer.Argument(..., help="Run directories (or their metrics.jsonl); several are overlaid."),
    output: Path = typer.Option(Path("curves.png"), "--output", "-o",
                                help="Picture to write: .png, .svg, .pdf, … (the suffix names the format)."),
    width: int = typer.Option(1200, "--width", help="Image width in pixels."),
    height: int = typer.Option(800, "--height", help="Image height in pixels."),
) -> None:
    """Learning curves (train/valid loss, valid BLEU against step and minutes, LR) as a picture.

    Needs matplotlib: pip install -e '.\\[plot]'.
    """
    from .experiment.rundir import metrics_of
    from .plot import plot_runs

    check_output(output, {"RUNS": [metrics_of(run) for run in runs]})
    plot_runs(list(runs), output, width, height)
    say(f"wrote {output} ({width}x{height}, {len(runs)} run{'s' if len(runs) > 1 else ''})")


@app.command(cls=OneValueOptions)
@user_errors
def attention(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Model file (.pt)."),
    src: str = typer.Option(..., "--src", help="Source sentence."),
    tgt: Optional[str] = typer.Option(None, "--tgt", help="Target to teacher-force (default: the model's own "
                                      "greedy translation)."),
    layer: Optional[int] = typer.Option(None, "--layer", help="Layer whose heads are drawn, 1-based (default: last)."),
    self_: bool = typer.Option(False, "--self", help="Encoder self-attention instead of encoder–decoder."),
    output: Path = typer.Option(Path("attention.png"), "--output", "-o",
                                help="Picture to write: .png, .svg, .pdf, … (the suffix names the format)."),
) -> None:
    """Attention heatmaps: one per head of a layer, plus every layer's head average.

    Source subwords on the x axis, target subwords on the y axis (source on both with --self).
    Needs matplotlib: pip install -e '.\\[plot]'.
    """
    from .attention_maps import attention_maps, check_layer, plot_attention
    from .experiment.checkpoint import load_trained_model
    from .plot import figure_format

    check_output(output, {"--checkpoint": [checkpoint]})
    figure_format(output)  # before any work
    trained = load_trained_model(checkpoint)
    n_layers = trained.model.cfg.enc_layers if self_ else trained.model.cfg.dec_layers
    check_layer(layer, n_layers, "encoder" if self_ else "decoder")  # before decoding anything
    maps = attention_maps(trained, src, tgt, encoder_self=self_)
    plot_attention(maps, layer, output)
    if maps.translation:
        say(f"target: {maps.translation}")
    say(f"wrote {output}")


@app.command(cls=OneValueOptions)
@user_errors
def distill(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    checkpoint: Optional[list[Path]] = typer.Option(
        None, "--checkpoint", help="The teacher's model file (.pt); twice or more: an ensemble. Default: the run's "
        "best checkpoint."),
    device: str = DeviceOpt,
    engine: Optional[str] = EngineOpt,
    restart: bool = typer.Option(False, "--restart", help="Translate from the start, discarding a partial output."),
) -> None:
    """Sequence-level distillation: the teacher translates the run's prepared training source into a
    corpus (distill.output) that a small student is prepared and trained on (configs/student-tiny.yaml).
    Resumable: a stopped run goes on where it stopped."""
    cfg = _load_for_inference(config, set_, checkpoint)
    if engine is not None and engine not in ENGINES:
        raise TfmError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    from tqdm import tqdm

    from .decoding.distill import distill as run_distill
    from .decoding.engine import model_files, open_engine

    def open_teacher():
        teachers = list(checkpoint) if checkpoint else model_files(cfg)
        return open_engine(cfg, set_, teachers, device, engine=engine), teachers

    with tqdm(desc="distilling", unit=" lines", disable=not sys.stderr.isatty(), leave=False) as bar:
        def progress(n: int, total: int) -> None:
            bar.total = total
            bar.update(n)
        result = run_distill(cfg, open_teacher, restart=restart, progress=progress)
    r = result.report
    rate = f"; {r['sentences_per_second']} sentences/s ({r['engine']})" if r["sentences_per_second"] else ""
    resumed = f" (went on from line {result.resumed_at + 1})" if 0 < result.resumed_at < result.lines else ""
    say(f"distilled {result.lines} lines{resumed}{rate}; kept {result.kept}"
        + (f", dropped the worst {r['drop_worst']:g}% by {r['score']} (below {result.threshold:.4g})"
           if result.threshold is not None else "")
        + f" → {result.output}.{cfg.data.src_lang} / .{cfg.data.tgt_lang}")


@app.command(cls=OneValueOptions)
@user_errors
def shortlist(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Learn the run's lexical shortlist (shortlist.*) from its prepared training pairs, for
    decode.shortlist: CTranslate2 then restricts each batch's output to its candidates."""
    cfg = _load(config, set_)
    from .data.shortlist import build_shortlist

    result = build_shortlist(cfg.run, cfg.shortlist, cfg.train.seed)
    say(f"shortlist of {result.source_pieces} source pieces, {result.mean_candidates:.1f} target pieces each "
        f"(+ {cfg.shortlist.frequent} frequent), learned from {result.pairs} pairs in {result.seconds:.1f}s "
        f"→ {result.path}")


@app.command(cls=OneValueOptions)
@user_errors
def export(
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Model file (.pt); default: the --config "
                                              "run's checkpoint that validated best."),
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
    format_: str = typer.Option("ctranslate2", "--format", help="Export format: ctranslate2 (tfm translate "
                                "--model, CTranslate2 users) or huggingface (a transformers model directory "
                                "with its tokenizer and a model card)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory to write."),
    force: bool = typer.Option(False, "--force", help="Replace a previous export in that directory."),
    quantization: str = typer.Option("float32", "--quantization", help="ctranslate2: weights as stored: float32 "
                                     "(any compute type at load time) or int8 (a quarter of the size on disk)."),
) -> None:
    """Convert a checkpoint for serving or sharing: a CTranslate2 model directory (with its
    sentencepiece models), or a Hugging Face transformers directory (save_pretrained's files and a model card).

    CTranslate2: translate with tfm translate --engine ctranslate2 --model DIR. Hugging Face: load with
    AutoModelForSeq2SeqLM/AutoTokenizer; needs the run's test score
    (tfm evaluate --split test) for the model card, and pip install -e '.\\[huggingface]'.
    """
    if format_ not in ("ctranslate2", "huggingface"):
        raise TfmError(f"--format {format_}: choose ctranslate2 or huggingface")
    if quantization not in ("float32", "int8"):
        raise TfmError(f"--quantization {quantization}: choose float32 or int8")
    if format_ == "huggingface" and quantization != "float32":
        raise TfmError(f"--quantization {quantization}: only --format ctranslate2 stores int8 weights")
    if checkpoint is None:
        if config is None:
            raise TfmError("give --checkpoint, or --config (its run's checkpoint that validated best)")
        checkpoint = _load_for_inference(config, set_, None).run.default_checkpoint()
    elif config is not None or set_:
        raise TfmError("give --checkpoint or --config, not both (--config exports its run's checkpoint)")
    if format_ == "huggingface":
        from .interop.huggingface import export_huggingface

        done = export_huggingface(checkpoint, output, force=force)
        say(f"exported {checkpoint} → {output} (Hugging Face {done.architecture}, {done.parameters:,} parameters, "
            f"logits within {done.largest_difference:.1e} of tfm's; load with: "
            f"AutoModelForSeq2SeqLM.from_pretrained(\"{output}\"))")
        return
    from .data.shortlist import check_shortlist
    from .experiment.rundir import run_of
    from .interop.ct2 import export_ctranslate2

    run = run_of(checkpoint)  # the run's shortlist, where it has one (tfm shortlist)
    shortlist = run.shortlist_file if run is not None and run.shortlist_file.exists() else None
    if shortlist is not None:
        check_shortlist(shortlist)  # (its pieces are checked against the model where it is used)
    export_ctranslate2(checkpoint, output, force=force, shortlist=shortlist,
                       quantization=None if quantization == "float32" else quantization)
    say(f"exported {checkpoint} → {output} (CTranslate2{', with the run’s lexical shortlist' if shortlist else ''}; "
        f"translate with: tfm translate --engine ctranslate2 --model {output})")


@app.command(cls=OneValueOptions)
@user_errors
def glossary(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="The model that translates and aligns (.pt)."),
    src: Path = typer.Option(..., "--src", help="Source text (plain or .gz), one sentence a line."),
    ref: Path = typer.Option(..., "--ref", help="Its reference translations, line by line."),
    lines: int = typer.Option(3000, "--lines", min=1, max=1_000_000, help="Pairs read from the start."),
    entries: int = typer.Option(50, "--entries", min=1, max=100_000, help="Glossary entries at most."),
    agreement: float = typer.Option(0.6, "--agreement", min=0.0, max=1.0,
                                    help="Share of a word's occurrences its target must agree on."),
    output: Path = typer.Option(..., "--output", "-o", help="Glossary to write (source<TAB>target lines)."),
) -> None:
    """A glossary from parallel text by word alignment, for tfm translate --glossary."""
    from .decoding.glossary import extract_glossary

    check_output(output, {"--checkpoint": [checkpoint], "--src": [src], "--ref": [ref]})
    say(json.dumps(extract_glossary(checkpoint, src, ref, lines, entries, agreement, output), ensure_ascii=False))


@app.command("sample-constraints", cls=OneValueOptions)
@user_errors
def sample_constraints(
    src: Path = typer.Option(..., "--src", help="Source text (plain or .gz), one sentence a line."),
    ref: Path = typer.Option(..., "--ref", help="Its reference translations, line by line."),
    seed: int = typer.Option(1, "--seed", min=0, max=2**63 - 1, help="Random seed."),
    output: Path = typer.Option(..., "--output", "-o", help="Constraints file to write (source<TAB>phrase…)."),
) -> None:
    """Constraints sampled from references (1–2 phrases a line), for tfm translate/evaluate --constraints."""
    from .decoding.glossary import write_sampled_constraints

    check_output(output, {"--src": [src], "--ref": [ref]})
    written = write_sampled_constraints(src, ref, seed, output)
    say(f"sampled constraints for {written} lines → {output}")


@app.command("import", cls=OneValueOptions)
@user_errors
def import_model(
    source: Path = typer.Argument(..., help="The model directory (what save_pretrained wrote)."),
    format_: str = typer.Option("marian", "--format", help="Model format: marian (Hugging Face MarianMTModel, OPUS-MT)."),
    output: Path = typer.Option(..., "--output", "-o", help="Run directory to create (new or empty)."),
) -> None:
    """Make a trained model from elsewhere a tfm run directory: translate, evaluate, export or
    fine-tune it like one of tfm's own (tfm translate --config RUN_DIR/config.yaml)."""
    if format_ != "marian":
        raise TfmError(f"--format {format_}: only marian is supported")
    from .interop.marian import import_marian

    result = import_marian(source, output)
    for warning in result.warnings:
        warn(f"warning: {warning}")
    say(f"imported {source} → {output}: {result.parameters:,} parameters, {result.vocab_size:,} ids "
        f"(translate with: tfm translate --config {result.run.config_file})")


_RUN_AS_PROGRAM = False  # main() ran: this process is `tfm` itself


def main() -> None:
    global _RUN_AS_PROGRAM
    _RUN_AS_PROGRAM = True
    if hasattr(signal, "SIGXFSZ"):
        # A file-size limit (ulimit -f) then fails the write with EFBIG, reported like a full
        # disk, instead of killing the process in the middle of it.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        app()
    except OSError as exc:  # --help or --version into a full disk (the commands report their own)
        warn(f"error: {describe_os_error(exc, unnamed='standard output')}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
