"""A trained run exported with `tfm export --format huggingface`: does transformers translate it as tfm does?

Exports the run's checkpoint that validated best (the run must have a test score: `tfm evaluate
--config C --split test`), loads it with AutoTokenizer/AutoModelForSeq2SeqLM (no custom code) and
translates the run's test set with `generate`, beside tfm:

- greedy, fp32: transformers against tfm's own engine, line by line. Target: equal on at least
  999 of 1,000 lines; an output that loops until a length cap counts as equal where the shorter is
  the start of the longer (generate has one cap per batch, tfm one per sentence).
- beam 5 (the run's length penalty; generate's and CTranslate2's rule): BLEU of transformers'
  against tfm's default engine. Target: within 0.1 BLEU.
- the export's size and time, and sentences/s of `generate` beside tfm's default engine (reported,
  no target). Needs transformers (`pip install -e '.[huggingface]'`).

    python scripts/check_hf_export.py --config runs/de-en/config.yaml [--lines 1000] [--workdir /tmp/hf_check]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.data.prepare import split_files  # noqa: E402
from transformer_cli.decoding.engine import open_engine  # noqa: E402
from transformer_cli.decoding.translation import translate_texts  # noqa: E402
from transformer_cli.experiment.config import load_config  # noqa: E402
from transformer_cli.experiment.rundir import RunDirectory  # noqa: E402
from transformer_cli.interop.huggingface import export_huggingface  # noqa: E402
from transformer_cli.model.lengths import output_length_limit  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import read_lines, scratch_directory  # noqa: E402

FP32 = ["decode.precision=fp32", "train.precision=fp32"]


def generate(directory: Path, lines: list[str], beam: int, a: float, b: int, batch: int = 32) -> tuple[list[str], float]:
    """transformers' translations of `lines` in length-sorted batches (each batch capped at tfm's
    limit for its longest line), and sentences/s."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(directory), trust_remote_code=False).eval()
    order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
    found: list[str] = [""] * len(lines)
    started = time.perf_counter()
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        inputs = tokenizer([lines[i] for i in chunk], return_tensors="pt", padding=True)
        limit = output_length_limit(inputs["input_ids"].shape[1], a, b, model.config.max_position_embeddings)
        with torch.no_grad():
            out = model.generate(**inputs, num_beams=beam, do_sample=False, max_new_tokens=limit, max_length=None)
        for i, text in zip(chunk, tokenizer.batch_decode(out, skip_special_tokens=True)):
            found[i] = text
    return found, len(lines) / (time.perf_counter() - started)


def tfm_translations(config_file: Path, checkpoint: Path, lines: list[str], overrides: list[str],
                     **settings) -> tuple[list[str], float]:
    config = load_config(config_file, overrides)
    engine = open_engine(config, None, [checkpoint], device="cpu", **settings)
    try:
        started = time.perf_counter()
        found = translate_texts(engine, lines, engine.settings())
        return found, len(lines) / (time.perf_counter() - started)
    finally:
        engine.close()


def same_or_cut_loop(ours: str, theirs: str) -> bool:
    """Equal, or a loop cut at another length: the shorter output (8 words or more) is the start of the
    longer, to the character (a loop may repeat inside one word: "Clalalala…")."""
    shorter, longer = sorted((ours, theirs), key=len)
    return ours == theirs or (len(shorter.split()) >= 8 and len(longer) > len(shorter) and longer.startswith(shorter))


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hf_check"))
    args = parser.parse_args()
    from bench_common import machine_line
    from sacrebleu import corpus_bleu

    print(machine_line())
    config = load_config(args.config)
    checkpoint = RunDirectory(config.run_path).default_checkpoint()
    scratch_directory(args.workdir, {"--config": [args.config]})
    export_dir = args.workdir / "hf"
    started = time.perf_counter()
    export_huggingface(checkpoint, export_dir, force=True)
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in export_dir.iterdir())
    print(f"export: {checkpoint} → {export_dir}: {seconds:.1f} s, {size / 2**20:.1f} MiB "
          f"(model.safetensors {(export_dir / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    source_file, reference_file = split_files(config, "test")
    lines, references = read_lines(source_file)[:args.lines], read_lines(reference_file)[:args.lines]
    a, b = config.decode.max_len_a, config.decode.max_len_b

    ours, _ = tfm_translations(args.config, checkpoint, lines, [*FP32, "decode.beam=1"], engine="torch")
    theirs, hf_greedy_speed = generate(export_dir, lines, 1, a, b)
    equal = sum(o == t for o, t in zip(ours, theirs))
    loops = sum(o != t and same_or_cut_loop(o, t) for o, t in zip(ours, theirs))
    print(f"greedy, fp32: {equal} of {len(lines)} equal, {loops} more a loop cut at another cap "
          f"(target: 999 of 1,000 together); {len(lines) - equal - loops} differ")
    for o, t in [(o, t) for o, t in zip(ours, theirs) if not same_or_cut_loop(o, t)][:3]:
        print(f"  tfm: {o}\n  hf:  {t}")
    # CTranslate2 in float32: generate's length penalty (length ** alpha) and precision; the default (int8) beside it
    beam_ours, _ = tfm_translations(args.config, checkpoint, lines, ["decode.beam=5"], engine="ctranslate2",
                                    compute_type="float32")
    beam_default, tfm_speed = tfm_translations(args.config, checkpoint, lines, ["decode.beam=5"])
    beam_theirs, hf_speed = generate(export_dir, lines, 5, a, b)
    bleu_ours, bleu_default, bleu_theirs = (corpus_bleu(h, [references]).score
                                            for h in (beam_ours, beam_default, beam_theirs))
    print(f"beam 5: tfm (CTranslate2 float32) {bleu_ours:.2f}, transformers generate (fp32) {bleu_theirs:.2f}: "
          f"{bleu_theirs - bleu_ours:+.2f} (target: within 0.1); tfm's default engine (int8) {bleu_default:.2f}")
    print(f"sentences/s, beam 5: tfm's default engine {tfm_speed:.1f}, generate (fp32, batches of 32) {hf_speed:.1f} "
          f"({hf_speed / tfm_speed:.2f}x); greedy generate {hf_greedy_speed:.1f}")


if __name__ == "__main__":
    run_script(main)
