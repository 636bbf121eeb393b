"""Which engine translates: `decode.engine` (`--engine`) → an open TranslationEngine, for
`tfm translate`, `tfm evaluate --config` and `tfm serve` alike.

- auto: CTranslate2 where the package imports, the checkpoint converts (interop/ct2_cache.py keeps the
  conversion beside it) and every setting is one CTranslate2 has; else tfm's own engine, with the
  reason on stderr once (`engine: torch (ensembles are tfm's own)`).
- torch: tfm's own engine (exact fp32, ensembles, alignments, sampling reproducible by seed).
- ctranslate2: CTranslate2, or an error saying why not. `--model DIR` names a directory `tfm export`
  wrote instead of a checkpoint to convert.

Nothing here imports torch unless tfm's engine (or a first conversion) needs it: a translation
through a cached conversion starts in a fraction of the time importing torch takes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..experiment.config import DecodeConfig, DecodeSettingsError, ExperimentConfig
from ..runtime.console import warn
from ..runtime.errors import TfmError

if TYPE_CHECKING:
    from .translation import TranslationEngine

INSTALL_HINT = "pip install ctranslate2"
# CTranslate2's wheels link CUDA 12's cuBLAS: a machine whose CUDA libraries are another major
# version (or none) shows no device to it although it has a GPU.
CUDA_HINT = ("CTranslate2 sees no CUDA device: its wheel needs CUDA 12's cuBLAS (pip install nvidia-cublas-cu12 "
             "supplies it)")


def torch_only_reason(decode: DecodeConfig | None, models: int, quantize: str | None,
                      lexical: bool = False) -> str | None:
    """Why these settings need tfm's own engine (None: CTranslate2 has every one of them).
    `lexical`: the input has constraints or avoided terms."""
    if models > 1:
        return "ensembles are tfm's own"
    if lexical:
        return "constraints and avoided terms are tfm's own; CTranslate2 offers target prefixes only"
    if quantize is not None:
        return "--quantize is tfm's own int8 (CTranslate2's is --compute-type int8)"
    if decode is None:
        return None
    if decode.alignment:
        return "word alignments are tfm's own"
    if decode.sample:
        # CTranslate2 seeds each of its threads once per process: the same seed would not give the same samples.
        return "sampling is tfm's own (its samples are reproducible from decode.seed)"
    if decode.precision != "auto":
        return f"decode.precision {decode.precision} is a setting of tfm's engine (CTranslate2's is decode.compute_type)"
    return None


def gpu_present() -> bool:
    """An NVIDIA GPU on this machine, seen without loading torch or CUDA."""
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


def ctranslate2_device(device: str) -> tuple[str | None, str | None]:
    """(the device CTranslate2 would run on, None), or (None, why it cannot run there)."""
    try:
        import ctranslate2
    except ImportError:
        return None, f"CTranslate2 is not installed: {INSTALL_HINT} to translate 1.3–2x faster"
    if device == "cpu":
        return "cpu", None
    if device not in ("auto", "cuda"):
        return None, f"--device {device}: CTranslate2 runs on cpu or cuda"
    if ctranslate2.get_cuda_device_count() > 0:
        return "cuda", None
    if device == "cuda" or gpu_present():
        return None, CUDA_HINT
    return "cpu", None


def with_options(decode: DecodeConfig, updates: dict) -> DecodeConfig:
    """`decode` with the command line's decode settings (None: not given), checked where settings are
    built (`DecodeConfig.updated`); a broken rule is one line naming the options as given (--nbest 3)."""
    given = {key: value for key, value in updates.items() if value is not None}
    if not given:
        return decode
    try:
        return decode.updated(**given)
    except DecodeSettingsError as exc:
        options = {key: f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                   for key, value in given.items()}
        raise TfmError(f"command line: {exc.naming(options)}") from None


def apply_decode_options(engine: Any, updates: dict) -> None:
    """Command-line decode settings (None: not given) into the engine's (`with_options`)."""
    engine.decode = with_options(engine.decode, updates)


def model_files(cfg: ExperimentConfig) -> list[Path]:
    """The model(s) a config translates with: decode.checkpoints (several: an ensemble), else the
    run's best-validated checkpoint."""
    if cfg.decode.checkpoints:
        return [Path(p) for p in cfg.decode.checkpoints]
    from ..runtime.console import warn

    run = cfg.run
    checkpoint = run.default_checkpoint()
    # A config edited since the run was trained (say, a larger vocabulary pulled in with a newer
    # config) still names that run: it translates as trained, which the user should be told.
    try:
        mismatch = cfg.vocab_mismatch(run.load_manifest())
    except (TfmError, OSError, ValueError, LookupError, TypeError, AttributeError):
        mismatch = ""  # no or an unreadable prepare.json: a hint only, and translating never reads it
    if mismatch:
        warn(f"warning: {mismatch}: {checkpoint} translates with the vocabulary it was trained on; "
             "re-run `tfm prepare` and `tfm train` for the config's settings")
    return [checkpoint]


def torch_engine(cfg: ExperimentConfig | None, overrides: list[str] | None, checkpoints: list[Path],
                 device: str, quantize: str | None, updates: dict) -> TranslationEngine:
    """tfm's own engine: `checkpoints` (several: an ensemble); the config's decode settings, else
    the checkpoint's edited by `overrides` (--set); then the command line's `updates`."""
    from .torch_engine import Translator

    if quantize not in (None, "int8"):
        raise TfmError(f"--quantize {quantize}: only int8 is supported")
    translator = Translator.from_checkpoint(checkpoints, decode=cfg.decode if cfg else None, device=device,
                                            overrides=None if cfg else overrides, precision=quantize)
    apply_decode_options(translator, updates)
    if translator.decode.shortlist:
        warn("warning: decode.shortlist is CTranslate2's vocabulary map: tfm's engine searches the whole vocabulary")
    return translator


def lexical_engine(chosen: TranslationEngine, cfg: ExperimentConfig | None, overrides: list[str] | None,
                   checkpoints: list[Path] | None, device: str, engine: str | None, model_dir: Path | None,
                   **updates: Any) -> Callable[[], TranslationEngine] | None:
    """For `tfm serve` whose auto choice is CTranslate2: what makes tfm's engine for the requests
    with constraints, avoided terms or word alignments (HTML and other markup) (made at the first one; decoding in the server process, as
    forking beside CTranslate2's threads is not safe). None where the server has tfm's engine, or
    was told CTranslate2 (--engine ctranslate2, --model DIR: no checkpoint to load)."""
    if chosen.lexical_constraints or engine == "ctranslate2" or model_dir is not None:
        return None
    if not checkpoints and cfg is None:
        return None
    files = checkpoints or model_files(cfg)  # type: ignore[arg-type]
    # One snapshot of the model behind a server: the files as they were when it started.
    started = [_identity(path) for path in files]

    def make() -> TranslationEngine:
        for path, identity in zip(files, started):
            if _identity(path) != identity:
                raise CheckpointReplaced(f"{path} was replaced after the server started: requests that need tfm's "
                                         "engine beside CTranslate2 (constraints, avoided terms, word alignments and "
                                         "documents with markup) would load the new model beside the one that "
                                         "answers the others; restart tfm serve, or reload it (SIGUSR1), to serve it")
        translator = torch_engine(cfg, overrides, files, device, None, {**updates, "workers": "1"})
        translator.memory_limit = chosen.memory_limit
        return translator

    return make


class CheckpointReplaced(TfmError):
    """The checkpoint a server started with was replaced: a second engine is not made from the new file."""


def _identity(path: Path) -> list[int] | None:
    """The file as the conversion cache tells files apart (device, inode, size, time); None: gone."""
    from ..interop.ct2_cache import file_identity

    try:
        return file_identity(path)
    except OSError:
        return None


def run_shortlist(cfg: ExperimentConfig | None, checkpoint: Path) -> Path | None:
    """The lexical shortlist of the run a checkpoint belongs to (`tfm shortlist`), if it has one."""
    from ..experiment.rundir import SHORTLIST_FILE

    path = cfg.run.shortlist_file if cfg is not None else Path(checkpoint).resolve().parent.parent / SHORTLIST_FILE
    if path.exists() and not path.is_file():
        raise TfmError(f"{path}: not a file (a lexical shortlist: make it with `tfm shortlist`, or remove it)")
    return path if path.exists() else None


def open_engine(cfg: ExperimentConfig | None, overrides: list[str] | None, checkpoints: list[Path] | None,
                device: str = "auto", quantize: str | None = None, engine: str | None = None,
                compute_type: str | None = None, model_dir: Path | None = None,
                announce: Callable[[str], None] = warn, lexical: bool = False, **updates: Any) -> TranslationEngine:
    """The engine `tfm translate`/`evaluate`/`serve` decode with. `engine`/`compute_type` (the
    command line's; None: decode.engine/decode.compute_type) choose; `updates` are the command line's
    decode settings (None: not given). `announce` receives the one line that says why auto chose
    tfm's engine, or that the conversion went to a temporary directory. `lexical`: the input has
    constraints or avoided terms (tfm's engine applies them)."""
    if engine is not None and engine not in ("auto", "torch", "ctranslate2"):
        raise TfmError(f"--engine {engine}: choose auto, torch or ctranslate2")
    if model_dir is not None:
        return exported_engine(cfg, overrides, checkpoints, device, quantize, engine, compute_type, model_dir, updates)
    if compute_type is not None and engine == "torch":
        raise TfmError("--compute-type is CTranslate2's: tfm's engine (--engine torch) takes --quantize or "
                       "decode.precision")
    if not checkpoints:
        if cfg is None:
            raise TfmError("give --checkpoint, or --config to use the run's best checkpoint")
        checkpoints = model_files(cfg)
    # The config's settings with the command line's: known before anything loads. Without a config
    # they are the checkpoint's, read from its conversion below.
    decode = with_options(cfg.decode, updates) if cfg is not None else None
    choice = engine or (decode.engine if decode is not None else "auto")
    if choice == "torch" or (choice == "auto" and device.startswith("cuda") and not gpu_present()):
        # (--device cuda without a GPU: tfm's engine says what is wrong with the device, in one line)
        return torch_engine(cfg, overrides, checkpoints, device, quantize, updates)
    explicit = choice == "ctranslate2"

    def fall_back(reason: str) -> TranslationEngine:
        if explicit:
            raise TfmError(f"--engine ctranslate2: {reason}")
        if compute_type is not None:  # given for CTranslate2, which will not decode: refused, not ignored
            raise TfmError(f"--compute-type {compute_type} is CTranslate2's, but tfm's engine decodes this ({reason}): "
                           "leave --compute-type out (tfm's engine takes --quantize or decode.precision)")
        announce(f"engine: torch ({reason})")
        return torch_engine(cfg, overrides, checkpoints, device, quantize, updates)

    reason = torch_only_reason(unaligned(decode), len(checkpoints), quantize, lexical)
    ct2_device, device_reason = ctranslate2_device(device) if reason is None else (None, None)
    if reason or device_reason:
        return fall_back(reason or device_reason or "")
    from ..interop.ct2 import NotConvertible
    from .ct2_engine import CT2Translator

    try:
        conversion, exported = read_conversion(checkpoints[0], announce)
    except NotConvertible as exc:
        return fall_back(f"CTranslate2 cannot express this model: {exc}")
    translator = CT2Translator(conversion.directory, device=ct2_device or "cpu", compute_type=compute_type,
                               decode=decode, overrides=None if cfg else overrides, model=exported,
                               shortlist=run_shortlist(cfg, checkpoints[0]))
    if cfg is None:  # the checkpoint's own settings, now known
        apply_decode_options(translator, updates)
        if translator.decode.engine == "torch" and engine is None:
            return torch_engine(cfg, overrides, checkpoints, device, quantize, updates)
        reason = torch_only_reason(unaligned(translator.decode), 1, quantize, lexical)
        if reason:
            return fall_back(reason)
    try:
        translator.open()
    except TfmError as exc:  # e.g. a CUDA library the GPU build needs
        return fall_back(str(exc))
    if translator.decode.alignment:  # CTranslate2 searches; tfm's engine aligns its output (one forced pass)
        translator.aligner = torch_engine(cfg, overrides, checkpoints, ct2_device or "cpu", None,
                                          {**updates, "workers": "1"})
    return translator


def read_conversion(checkpoint: Path, announce: Callable[[str], None]) -> tuple[Any, Any]:
    """The CTranslate2 conversion cached beside `checkpoint` (made now where missing or stale) and
    the export it holds; a cache damaged past what its record shows is made again, once. A model
    CTranslate2 cannot express: `NotConvertible`."""
    from ..interop.ct2 import read_export
    from ..interop.ct2_cache import cached_conversion, discard

    conversion = cached_conversion(checkpoint)
    if conversion.note:
        announce(conversion.note)
    try:
        return conversion, read_export(conversion.directory)
    except TfmError as exc:  # tfm's own cache, damaged past what its record shows: made again, once
        if conversion.converted:
            raise
        discard(conversion.directory)
        why = str(exc).split(": export it again")[0]  # (advice for a user's export, not for tfm's own cache)
        announce(f"warning: the cached CTranslate2 conversion of {checkpoint.name} could not be read ({why}): "
                 "made it again")
        conversion = cached_conversion(checkpoint)
        return conversion, read_export(conversion.directory)


def unaligned(decode: DecodeConfig | None) -> DecodeConfig | None:
    """`decode` without word alignments: CTranslate2 searches where they are the only setting it
    lacks, and tfm's engine on the same checkpoint aligns what it found."""
    return decode.model_copy(update={"alignment": False}) if decode is not None and decode.alignment else decode


def exported_engine(cfg: ExperimentConfig | None, overrides: list[str] | None, checkpoints: list[Path] | None,
                    device: str, quantize: str | None, engine: str | None, compute_type: str | None,
                    model_dir: Path, updates: dict) -> TranslationEngine:
    """`--model DIR`: a directory `tfm export` wrote, through CTranslate2."""
    from .ct2_engine import CT2Translator

    if engine == "torch":
        raise TfmError("--model DIR is a CTranslate2 directory (tfm export): translate it with --engine ctranslate2 "
                       "or auto, or give tfm's engine a --checkpoint")
    if checkpoints or quantize is not None:
        raise TfmError("--checkpoint/--quantize are for tfm's engine; with --model DIR (CTranslate2) use "
                       "--compute-type")
    if cfg is not None and cfg.decode.checkpoints:
        raise TfmError("decode.checkpoints (an ensemble) is for --engine torch")
    translator = CT2Translator(model_dir, device=device, compute_type=compute_type,
                               decode=cfg.decode if cfg else None, overrides=None if cfg else overrides)
    apply_decode_options(translator, updates)
    return translator
