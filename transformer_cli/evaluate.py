"""Stage 5, scoring: sacreBLEU (BLEU, chrF, TER) with signatures, CI gate, paired comparison."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest

from .decoding.terms import LineTerms, avoided_present, missing_constraints, split_constraints_line
from .experiment.directions import Direction, tag
from .runtime.errors import TfmError
from .runtime.files import atomic_write_text, file_sha256, read_lines

METRICS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}


@dataclass
class MetricScore:
    name: str
    score: float
    signature: str
    text: str  # sacrebleu's own formatting, e.g. "BLEU = 35.12 66.3/41.2/..."
    ci: float | None = None  # ± half-width of the 95% bootstrap confidence interval


@dataclass
class EvalResult:
    scores: dict[str, MetricScore]
    n_sentences: int
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"n_sentences": self.n_sentences, **self.extra,
                "scores": {k: asdict(v) for k, v in self.scores.items()}}


def parse_metrics(spec: str) -> list[str]:
    names = [m.strip().lower() for m in spec.split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise TfmError(f"--metrics {spec!r}: unknown metric {unknown[0] if unknown else ''!r} "
                       f"(choose from {', '.join(METRICS)})")
    return names


def check_aligned(hyps: list[str], refs: list[str], hyp_name: str, ref_name: str) -> None:
    if not refs:
        raise TfmError(f"{ref_name} is empty: there is nothing to score")
    if len(hyps) != len(refs):
        raise TfmError(f"line counts differ: {hyp_name} has {len(hyps)} lines, {ref_name} has {len(refs)}")


def check_same_sources(given: list[str], split: list[str], given_name: str, split_name: str) -> None:
    """A constraints file scored against a split's references must hold that split's source lines,
    line by line (another file's sentences would be scored against references they do not match)."""
    for number, (a, b) in enumerate(zip(given, split), start=1):
        if " ".join(a.split()) != " ".join(b.split()):
            raise TfmError(f"{given_name}: line {number}'s source is not line {number} of {split_name} "
                           f"({a[:40]!r} ≠ {b[:40]!r}): --constraints takes this split's sources with their terms")


def score(hyps: list[str], refs: list[str], metrics: list[str] = ("bleu",), confidence: bool = False,
          caseless: bool = False) -> EvalResult:
    """Corpus scores of `hyps` against one reference set, exactly as sacrebleu computes them
    (`caseless`: each metric's own case-insensitive setting, named in its signature)."""
    results = {}
    for name in metrics:
        metric = METRICS[name](**({"case_sensitive": False} if name == "ter" else {"lowercase": True})
                               if caseless else {})
        result = metric.corpus_score(hyps, [refs], n_bootstrap=1000 if confidence else 1)
        ci = getattr(result, "_ci", None) if confidence else None
        results[name] = MetricScore(name, float(result.score), str(metric.get_signature()),
                                    result.format(), None if ci is None else float(ci))
    return EvalResult(results, len(hyps))


def paired_comparison(systems: dict[str, list[str]], refs: list[str], metrics: list[str],
                      confidence: bool = False) -> dict:
    """Each system against the first, by sacrebleu's paired test.

    Approximate randomisation by default; with `confidence`, paired bootstrap resampling, which
    also gives each system's 95% confidence interval. Returns a JSON-ready dict:
    {"baseline", "test", "systems": {name: {metric: {"score", "p_value", "ci"}}}, "signatures"}.
    """
    test = PairedTest(list(systems.items()), {m: METRICS[m]() for m in metrics}, [refs],
                      test_type="bs" if confidence else "ar", n_samples=1000)
    signatures, results = test()
    report: dict = {"baseline": next(iter(systems)), "test": "paired bootstrap" if confidence else
                    "approximate randomisation", "systems": {name: {} for name in systems},
                    "signatures": {str(k): str(v) for k, v in signatures.items()}}
    for metric, per_system in results.items():
        if metric == "System":  # the names column
            continue
        for system_name, res in zip(systems, per_system):
            ci = getattr(res, "ci", None) if confidence else None
            report["systems"][system_name][metric.lower()] = {
                "score": float(res.score), "p_value": None if res.p_value is None else float(res.p_value),
                "ci": None if ci is None else float(ci)}
    return report


def format_paired(report: dict) -> str:
    lines = []
    for name, scores in report["systems"].items():
        for metric, r in scores.items():
            p = "" if r["p_value"] is None else f"  p = {r['p_value']:.4f}"
            ci = "" if r["ci"] is None else f" (95% CI ± {r['ci']:.2f})"
            lines.append(f"{metric.upper():5s} {name}: {r['score']:.2f}{ci}{p}")
    lines.append(f"baseline: {report['baseline']}; {report['test']}; p < 0.05 means the difference is significant")
    return "\n".join(lines)


def evaluate_files(hyp_path: Path, ref_path: Path, metrics: list[str], confidence: bool = False) -> EvalResult:
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    check_aligned(hyps, refs, str(hyp_path), str(ref_path))
    return score(hyps, refs, metrics, confidence)


def term_use(hyps: list[str], terms: list[LineTerms]) -> dict:
    """How many of the lines' constraints their translations contain (verbatim), and of their
    avoided terms (as whole words)."""
    wanted = sum(len(t.constraints) for t in terms)
    met = sum(len(t.constraints) - len(missing_constraints(h, t)) for h, t in zip(hyps, terms))
    avoided = sum(len(avoided_present(h, t)) for h, t in zip(hyps, terms))
    return {"constraints": wanted, "met": met, "rate": round(met / wanted, 4) if wanted else None,
            "avoided_present": avoided}


def evaluate_model(config, checkpoint: Path | list[Path], split: str, metrics: list[str], confidence: bool = False, engine: str | None = None, compute_type: str | None = None,
                   constraints: Path | None = None, tgt_lang: str | None = None) -> EvalResult:
    """Translate the configured split's raw source with the model (several checkpoints: their
    ensemble) through the engine `tfm translate` would choose (`engine`, `compute_type`: the
    command line's; None: the config's decode.engine, decode.compute_type) and score it against
    the raw reference, one translation a line under the config's decode settings. `constraints`: a `tfm translate --constraints` file of the split's source
    lines with their terms, translated instead of the source; the result adds the term-use rate.
    `tgt_lang`: the target-language tag for a model that translates into several."""
    checkpoints = [Path(p) for p in (checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint])]
    from .data.prepare import split_files  # noqa: PLC0415 (keeps `tfm evaluate --hyp` light)
    from .decoding.engine import open_engine
    from .decoding.translation import translate_texts

    src_path, ref_path = split_files(config, split)
    src, refs = read_lines(src_path), read_lines(ref_path)
    check_aligned(src, refs, str(src_path), str(ref_path))
    terms = None
    if constraints is not None:
        pairs = [split_constraints_line(line, f"{constraints}: line {n}")
                 for n, line in enumerate(read_lines(constraints), start=1)]
        check_aligned([p[0] for p in pairs], refs, str(constraints), str(ref_path))
        check_same_sources([p[0] for p in pairs], src, str(constraints), str(src_path))
        src, terms = [p[0] for p in pairs], [p[1] for p in pairs]
    translator = open_engine(config, None, checkpoints, device=config.train.device, engine=engine,
                             compute_type=compute_type, lexical=terms is not None, tgt_lang=tgt_lang)
    translator.target_languages().check(translator.decode.tgt_lang)
    started = time.perf_counter()
    try:
        decode = translator.settings(nbest=1)
        hyps = translate_texts(translator, src, decode, terms)  # as `tfm translate` would: the same chunks and batches
    finally:
        translator.close()
    seconds = time.perf_counter() - started
    result = score(hyps, refs, metrics, confidence)
    beam_used = decode.beam
    result.extra = {"split": split, "checkpoint": " + ".join(map(str, checkpoints)), "beam": beam_used,
                    "checkpoint_sha256": [file_sha256(p) for p in checkpoints],  # what a model card ties it to
                    "engine": translator.describe(), "source": str(src_path),
                    "reference": str(ref_path), "decode_seconds": round(seconds, 2),
                    "sentences_per_s": round(len(src) / seconds, 2)}
    if terms is not None:
        result.extra.update({"constraints_file": str(constraints), "term_use": term_use(hyps, terms)})
    stem = config.run.eval_stem(split, checkpoints, beam_used, ".constrained" if terms else "")
    atomic_write_text(Path(f"{stem}.hyp"), "\n".join(hyps) + "\n")
    atomic_write_text(Path(f"{stem}.json"), json.dumps(result.to_json(), indent=2))
    result.extra["hyp_file"] = f"{stem}.hyp"
    return result


def evaluate_augmented(config, checkpoint: Path | list[Path], split: str, metrics: list[str], variants: list[str],
                       engine: str | None = None, compute_type: str | None = None,
                       tgt_lang: str | None = None, direction: Direction | None = None) -> EvalResult:
    """The split as written and as people type it (`variants` of data/augment.py: ALL CAPS, Title
    Case, lower case, typos, no final punctuation, a mix), each translated as `tfm translate` would
    and scored against the references; case variants without case, each beside the clean score
    scored the same way (its share). The result's scores are the clean split's; `extra["variants"]`
    holds each variant's scores, share and (ALL CAPS) the share of translations in capitals.
    `direction`: one direction of a multilingual run, its sources tagged with its target."""
    from .data.augment import CASELESS, VARIANT_SEED, shouted, split_variant
    from .data.prepare import split_files  # noqa: PLC0415 (keeps `tfm evaluate --hyp` light)
    from .decoding.engine import open_engine
    from .decoding.translation import translate_texts

    checkpoints = [Path(p) for p in (checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint])]
    src_path, ref_path = split_files(config, split, direction)
    src, refs = read_lines(src_path), read_lines(ref_path)
    check_aligned(src, refs, str(src_path), str(ref_path))
    translator = open_engine(config, None, checkpoints, device=config.train.device, engine=engine,
                             compute_type=compute_type, tgt_lang=direction.tgt if direction else tgt_lang)
    translator.target_languages().check(translator.decode.tgt_lang)
    started, rows = time.perf_counter(), {}
    try:
        decode = translator.settings(nbest=1)
        stem = config.run.eval_stem(split, checkpoints, decode.beam, f".{direction.name}" if direction else "")
        clean = translate_texts(translator, src, decode)
        atomic_write_text(Path(f"{stem}.hyp"), "\n".join(clean) + "\n")
        baseline = {False: score(clean, refs, metrics), True: score(clean, refs, metrics, caseless=True)}
        for name in variants:
            v_src, v_refs = split_variant(name, src, refs)
            hyps = translate_texts(translator, v_src, decode)
            atomic_write_text(Path(f"{stem}.{name}.hyp"), "\n".join(hyps) + "\n")
            caseless = name in CASELESS
            result = score(hyps, v_refs, metrics, caseless=caseless)
            base = baseline[caseless]  # nopunct: against references without it, beside the clean split's score
            rows[name] = {"caseless": caseless, "scores": {k: asdict(v) for k, v in result.scores.items()},
                          "clean": {k: v.score for k, v in base.scores.items()},
                          "share": {k: round(v.score / base.scores[k].score, 4) if base.scores[k].score else None
                                    for k, v in result.scores.items()}}
            if name == "upper":
                answered = [h for h, s in zip(hyps, v_src) if s.strip() and h.strip()]
                rows[name]["in_capitals"] = round(sum(map(shouted, answered)) / max(len(answered), 1), 4)
    finally:
        translator.close()
    seconds = time.perf_counter() - started
    result = baseline[False]
    result.extra = {"split": split, **({"direction": direction.name} if direction else {}),
                    "checkpoint": " + ".join(map(str, checkpoints)), "beam": decode.beam,
                    "engine": translator.describe(), "source": str(src_path), "reference": str(ref_path),
                    "decode_seconds": round(seconds, 2), "variant_seed": VARIANT_SEED,
                    "sentences_per_s": round(len(src) * (1 + len(variants)) / seconds, 2),
                    "clean_caseless": {k: v.score for k, v in baseline[True].scores.items()}, "variants": rows,
                    "hyp_file": f"{stem}.<variant>.hyp"}
    atomic_write_text(Path(f"{stem}.augmented.json"), json.dumps(result.to_json(), indent=2))
    return result


def variants_table(result: EvalResult) -> str:
    """One row per variant: its scores, its share of the clean score (scored as it is) and, for
    ALL CAPS input, the share answered in capitals."""
    metrics = list(result.scores)
    header = f"{'input':<10}" + "".join(f"{m.upper():>8}" for m in metrics) + f"{'of clean':>10}  note"
    rows = [header, "-" * len(header)]
    rows.append(f"{'clean':<10}" + "".join(f"{s.score:>8.2f}" for s in result.scores.values()) + f"{'100.0%':>10}")
    for name, r in result.extra["variants"].items():
        share = r["share"][metrics[0]]
        note = "case-insensitive" if r["caseless"] else ""
        if "in_capitals" in r:
            note += f"; {100 * r['in_capitals']:.1f}% answered in capitals"
        rows.append(f"{name:<10}" + "".join(f"{r['scores'][m]['score']:>8.2f}" for m in metrics)
                    + (f"{100 * share:>9.1f}%" if share is not None else f"{'-':>10}") + f"  {note}".rstrip())
    return "\n".join(rows)


def parse_gate(spec: str) -> tuple[str | None, float]:
    """`--min-bleu`: '30' gates the (average) BLEU, 'en-de=30' one direction's, 'upper=30' one
    `--augment` variant's."""
    name, equals, number = spec.rpartition("=")
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (equals and not name.strip()):
        raise TfmError(f"--min-bleu {spec}: give a finite score (30), or a direction and one (en-de=30)")
    return (name.strip() or None), value


def gate_verdict(result: EvalResult, gate: float, direction: str | None, spec: str) -> tuple[bool, str]:
    """Whether `--min-bleu spec` passes (BLEU, a multilingual run's average, or one direction's), and
    the line that says so; a direction that was not scored is an error."""
    bleu, what = result.scores["bleu"].score, "average BLEU" if "directions" in result.extra else "BLEU"
    if direction is not None and "variants" in result.extra:
        scored = result.extra["variants"]
        if direction not in scored:
            raise TfmError(f"--min-bleu {spec}: variant {direction} was not scored "
                           f"(scored: {', '.join(scored) or 'none'}; --augment names them)")
        return _verdict(scored[direction]["scores"]["bleu"]["score"], gate, f"{direction} BLEU")
    if direction is not None:
        scored = result.extra.get("directions", {})
        if direction not in scored:
            raise TfmError(f"--min-bleu {spec}: direction {direction} was not scored "
                           f"(scored: {', '.join(scored) or 'none'})")
        bleu, what = scored[direction]["scores"]["bleu"]["score"], f"{direction} BLEU"
    return _verdict(bleu, gate, what)


def _verdict(bleu: float, gate: float, what: str) -> tuple[bool, str]:
    if bleu < gate:
        return False, f"FAIL: {what} {bleu:.2f} is below --min-bleu {gate}"
    return True, f"PASS: {what} {bleu:.2f} >= {gate}"


def evaluate_directions(config, checkpoint: Path | list[Path], split: str, metrics: list[str],
                        directions: list[Direction] | None = None, confidence: bool = False,
                        engine: str | None = None, compute_type: str | None = None) -> EvalResult:
    """A multilingual model on every direction of a split (`directions`, default: the run's): each
    direction's source translated with its target tag, scored against its reference, and checked
    for the output language (off-target rate, `data/language_id.py`; None for a language the
    identifier does not know). A direction the run never trained
    is marked zero-shot. The result's scores are the average over the trained directions scored
    (over all of them where none was trained); `extra["directions"]` holds each one's."""
    from .data import language_id
    from .data.prepare import split_files  # noqa: PLC0415 (keeps `tfm evaluate --hyp` light)
    from .decoding.engine import open_engine
    from .decoding.translation import translate_texts

    checkpoints = [Path(p) for p in (checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint])]
    trained = config.data.pairs
    chosen = directions or trained
    files = {d: split_files(config, split, d) for d in chosen}  # every file found before any decoding
    translator = open_engine(config, None, checkpoints, device=config.train.device, engine=engine,
                             compute_type=compute_type)
    try:
        for d in chosen:
            translator.target_languages().check(d.tgt, f"direction {d.name}: target")
        decode = translator.settings(nbest=1)
        beam_used = decode.beam
        stem = config.run.eval_stem(split, checkpoints, beam_used)
        per_direction, started = {}, time.perf_counter()
        for d in chosen:
            src, refs = read_lines(files[d][0]), read_lines(files[d][1])
            check_aligned(src, refs, str(files[d][0]), str(files[d][1]))
            hyps = translate_texts(translator, [f"{tag(d.tgt)} {line}" if line.strip() else line for line in src],
                                   decode)
            result = score(hyps, refs, metrics, confidence)
            atomic_write_text(Path(f"{stem}.{d.name}.hyp"), "\n".join(hyps) + "\n")
            per_direction[d.name] = {"zero_shot": d not in trained, "n_sentences": len(hyps),
                                     "off_target": round(language_id.off_target_rate(hyps, d.tgt), 4)
                                     if language_id.model_language(d.tgt) else None,
                                     "scores": {k: asdict(v) for k, v in result.scores.items()}}
    finally:
        translator.close()
    seconds = time.perf_counter() - started
    counted = [name for name, r in per_direction.items() if not r["zero_shot"]] or list(per_direction)
    average = {m: MetricScore(m, sum(per_direction[n]["scores"][m]["score"] for n in counted) / len(counted),
                              per_direction[counted[0]]["scores"][m]["signature"],
                              f"{m.upper()} average over {len(counted)} direction(s)") for m in metrics}
    total = sum(r["n_sentences"] for r in per_direction.values())
    result = EvalResult(average, total, {
        "split": split, "checkpoint": " + ".join(map(str, checkpoints)), "beam": beam_used,
        "checkpoint_sha256": [file_sha256(p) for p in checkpoints],
        "engine": translator.describe(), "decode_seconds": round(seconds, 2),
        "sentences_per_s": round(total / seconds, 2), "averaged_over": counted, "directions": per_direction,
        "language_id": language_id.MODEL_NAME,  # what the off-target rate was measured with
        "hyp_file": f"{stem}.<direction>.hyp"})
    atomic_write_text(Path(f"{stem}.directions.json"), json.dumps(result.to_json(), indent=2))
    return result


def directions_table(result: EvalResult) -> str:
    """One row per direction (BLEU, chrF, … , off-target share) and the average."""
    metrics = list(result.scores)
    header = f"{'direction':<16}" + "".join(f"{m.upper():>8}" for m in metrics) + f"{'off-target':>12}{'lines':>7}"
    rows = [header, "-" * len(header)]
    for name, r in result.extra["directions"].items():
        label = f"{name}{' (0-shot)' if r['zero_shot'] else ''}"
        rows.append(f"{label:<16}" + "".join(f"{r['scores'][m]['score']:>8.2f}" for m in metrics)
                    + (f"{100 * r['off_target']:>11.1f}%" if r["off_target"] is not None else f"{'-':>12}")
                    + f"{r['n_sentences']:>7}")
    averaged = result.extra["averaged_over"]
    rows.append(f"{'average':<16}" + "".join(f"{s.score:>8.2f}" for s in result.scores.values())
                + f"   (of {len(averaged)}: {', '.join(averaged)})")
    return "\n".join(rows)
