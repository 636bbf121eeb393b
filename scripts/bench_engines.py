"""Speed and BLEU of one trained checkpoint under every decoding engine/precision tfm offers.

    pip install -e '.[ct2]'
    python scripts/bench_engines.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz

Systems: tfm fp32, tfm bf16 (where precision: auto picks it, or with --bf16), tfm int8
(dynamic int8 Linear layers), CTranslate2 float32 and int8 (the checkpoint exported with
`tfm export`), "tfm default" (what `tfm translate --checkpoint` runs: decode.engine auto through
tfm's own translate path, chunks, tokenization and detokenization included) and "CT2 direct"
(ctranslate2.Translator.translate_batch called directly on the sentencepiece pieces, max_batch_size
= --batch-size, one thread per core, as a CTranslate2 user would write it). Target: tfm default /
CT2 direct ≥ 0.95x (CPU: int8; CUDA: float16) for greedy and beam 5. Greedy and beam 5, batches of --batch-size sentences, natural output lengths (each
system stops at </s>). Each system's settings are the checkpoint's decode settings; CTranslate2's
length penalty is len^alpha where tfm's is GNMT's ((5+len)/6)^alpha (docs/translation.md), so beam-5 BLEU
may differ slightly between the two engines. Prints one markdown table row per system and beam
(the fastest of --rounds), then the ratios against their targets, both with decode.workers auto: tfm
at its default precision for this CPU against CTranslate2 float32 (≥ 1.0x; beam 5 ≥ 1.3x where
the default is bf16), tfm int8 against CTranslate2 int8 (≥ 1.0x). This VM's speed drifts by
±10% from minute to minute, so every system runs once per round, in alternating order, and each
ratio is the median of the per-round ratios (paired measurements), with their range.

With --device cuda: tfm fp32 and bf16 on the GPU against CTranslate2's GPU compute types
(float32, float16, bfloat16, int8_float16 where this build of CTranslate2 runs on the GPU), one
process each; the ratios printed are tfm's default (bf16) against CT2 bfloat16 and float16. A
system that fails to start (a CTranslate2 build without the CUDA libraries it needs) is reported
and left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import machine_line  # noqa: E402

from transformer_cli.decoding.engine import open_engine  # noqa: E402
from transformer_cli.decoding.torch_engine import Translator  # noqa: E402
from transformer_cli.decoding.translation import Translation, translate_texts  # noqa: E402
from transformer_cli.runtime.cpu import usable_cores  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402
from transformer_cli.runtime.precision import choose_decoding_precision  # noqa: E402


class DefaultPath:
    """`tfm translate --checkpoint CKPT`'s engine (decode.engine auto) through tfm's translate path."""

    def __init__(self, checkpoint: str, device: str, overrides: list[str]):
        self.engine = open_engine(None, overrides, [Path(checkpoint)], device=device)
        self.decode, self.name = self.engine.decode, f"tfm default ({self.engine.describe()})"

    @property
    def decoding_processes(self) -> int:
        return self.engine.decoding_processes

    def translate(self, lines: list[str], beam: int) -> list[list[Translation]]:
        self.engine.decode = self.decode
        return [[Translation(text, 0.0, 0)] for text in translate_texts(self.engine, lines, self.decode.updated(beam=beam))]

    def close(self) -> None:
        self.engine.close()


class DirectCT2:
    """ctranslate2.Translator.translate_batch on the pieces, with sentencepiece around it."""

    def __init__(self, folder: Path, device: str, batch_size: int, length_penalty: float):
        import ctranslate2
        import sentencepiece as spm

        cores = usable_cores() if device == "cpu" else 1
        self.translator = ctranslate2.Translator(str(folder), device=device, compute_type="int8" if device == "cpu"
                                                 else "float16", inter_threads=cores, intra_threads=1)
        self.src = spm.SentencePieceProcessor(model_file=str(folder / "source.spm.model"))
        self.tgt = spm.SentencePieceProcessor(model_file=str(folder / "target.spm.model"))
        self.batch_size, self.length_penalty, self.decoding_processes = batch_size, length_penalty, cores

    def translate(self, lines: list[str], beam: int) -> list[list[Translation]]:
        results = self.translator.translate_batch(self.src.encode(lines, out_type=str), beam_size=beam,
                                                  max_batch_size=self.batch_size,
                                                  length_penalty=self.length_penalty if beam > 1 else 0.0)
        return [[Translation(self.tgt.decode_pieces(r.hypotheses[0]), 0.0, 0)] for r in results]


SINGLE = ("tfm default", "CT2 direct")  # run as they come: their threads are their own choice


def build_parser() -> argparse.ArgumentParser:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--beams", default="1,5")
    parser.add_argument("--bf16", action="store_true",
                        help="also time tfm bf16 where tfm's auto precision does not pick it")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--only", help="comma-separated systems to run (e.g. 'tfm default,CT2 direct')")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per system and beam, in alternating rounds; the table prints the fastest")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    src, ref = read_lines(args.src), read_lines(args.ref)
    beams = [int(b) for b in args.beams.split(",")]
    overrides = [f"decode.batch_size={args.batch_size}"]

    device = torch.device(args.device)
    gpu = device.type == "cuda"

    def tfm_system(precision: str):
        return lambda: Translator.from_checkpoint(args.checkpoint, device=args.device, overrides=overrides,
                                                  precision=precision)

    default = f"tfm {choose_decoding_precision('auto', device).name}"  # what `tfm translate` decodes in here
    systems = {"tfm fp32": tfm_system("fp32")}
    if not gpu:  # dynamic int8 Linear layers are a CPU kernel
        systems["tfm int8"] = tfm_system("int8")
    if default == "tfm bf16" or args.bf16:
        systems["tfm bf16"] = tfm_system("bf16")
    try:
        import ctranslate2

        from transformer_cli.decoding.ct2_engine import CT2Translator
        from transformer_cli.interop.ct2 import export_ctranslate2

        folder = Path(tempfile.mkdtemp()) / "ct2"
        export_ctranslate2(args.checkpoint, folder)
        wanted = ("float32", "float16", "bfloat16", "int8_float16") if gpu else ("float32", "int8", "bfloat16")
        supported = ctranslate2.get_supported_compute_types(args.device) if (
            not gpu or ctranslate2.get_cuda_device_count() > 0) else set()
        for compute_type in wanted:
            if compute_type in supported:
                systems[f"CT2 {compute_type}"] = (lambda ct=compute_type: CT2Translator(
                    folder, device=args.device, compute_type=ct, threads=args.threads, overrides=overrides))
        if gpu and not supported:
            print("this CTranslate2 build sees no CUDA device: CT2 left out", file=sys.stderr)
        else:
            length_penalty = Translator.from_checkpoint(args.checkpoint, device="cpu").decode.length_penalty
            systems["tfm default"] = lambda: DefaultPath(args.checkpoint, args.device, overrides)
            systems["CT2 direct"] = lambda: DirectCT2(folder, args.device, args.batch_size, length_penalty)
    except ImportError:
        print("ctranslate2 not installed: skipping CT2 (pip install -e '.[ct2]')", file=sys.stderr)

    if args.only:
        systems = {name: make for name, make in systems.items() if name in args.only.split(",")}
    print(machine_line(device))
    print(f"{len(src)} sentences, batch {args.batch_size}, {args.device}, {args.threads} threads; each system with decode.workers "
          f"auto (one process, or CT2 inter_thread, per core; one thread each) and 1 (one process, "
          f"{args.threads} threads); fastest of {args.rounds} alternating rounds; tfm's default here: {default}")
    # tfm first: its workers fork before CTranslate2 starts any thread in this process.
    entries = []  # (system, workers, translator)
    for name, make in sorted(systems.items(), key=lambda item: item[0].startswith("CT2") or item[0] in SINGLE):
        for workers in ("auto",) if gpu or name in SINGLE else ("auto", 1):  # a GPU is driven by one process
            try:
                translator = make()
                if name not in SINGLE:
                    translator.decode = translator.decode.model_copy(update={"workers": workers})
                translator.translate(src[: 2 * args.batch_size], decode=translator.settings(beam=1))  # starts the workers
            except Exception as error:  # noqa: BLE001 - e.g. a CUDA library this CT2 build needs is missing
                print(f"{name}: could not run on {args.device}: {str(error).splitlines()[0][:200]}", file=sys.stderr)
                break
            entries.append((name, workers, translator))
    for beam in beams:  # an untimed round: oneDNN builds its kernels for each new batch shape on first use
        for _, _, translator in entries:
            translator.translate(src, decode=translator.settings(beam=beam))
    # The pairs behind the target ratios (workers auto) run next to each other, first in a round;
    # the order flips every round. Targets: tfm's default precision ≥ 1.0x CTranslate2 float32 (beam 5:
    # ≥ 1.3x where the default is bf16), tfm int8 ≥ 1.0x CTranslate2 int8.
    pairs = [("tfm default", "CT2 direct", {1: 0.95, 5: 0.95}),
             (default, "CT2 float32", {1: 1.0, 5: 1.3 if default == "tfm bf16" else 1.0}),
             ("tfm int8", "CT2 int8", {1: 1.0, 5: 1.0})]
    if gpu:  # no stated target on a GPU: the ratios against CT2's half-precision types
        pairs = [("tfm default", "CT2 direct", {1: 0.95, 5: 0.95}), (default, "CT2 bfloat16", {}),
                 (default, "CT2 float16", {})]
    running = {e[0] for e in entries}
    pairs = [(ours, theirs, target) for ours, theirs, target in pairs if ours in running and theirs in running]
    in_pairs = {name for ours, theirs, _ in pairs for name in (ours, theirs)}
    paired = [e for e in entries if e[1] == "auto" and e[0] in in_pairs]
    entries = paired + [e for e in entries if e not in paired]
    seconds: dict[tuple[str, str | int, int], list[float]] = {}
    bleu: dict[tuple[str, str | int, int], float] = {}
    for round_ in range(args.rounds):
        for beam in beams:
            for name, workers, translator in (entries if round_ % 2 == 0 else entries[::-1]):
                start = time.perf_counter()
                hyps = [t[0].text for t in translator.translate(src, decode=translator.settings(beam=beam))]
                seconds.setdefault((name, workers, beam), []).append(time.perf_counter() - start)
                bleu[(name, workers, beam)] = sacrebleu.corpus_bleu(hyps, [ref]).score
    print("| system | workers | beam | sentences/s | BLEU |\n|---|---|---|---|---|")
    for name, workers, translator in sorted(entries, key=lambda e: (list(systems).index(e[0]), e[1] != "auto")):
        for beam in beams:
            best = min(seconds[(name, workers, beam)])
            print(f"| {name} | {translator.decoding_processes} | {beam} | {len(src) / best:.1f} | "
                  f"{bleu[(name, workers, beam)]:.2f} |")
    for beam in beams:
        for ours, theirs, targets in pairs:
            ratios = [t / o for o, t in zip(seconds[(ours, "auto", beam)], seconds[(theirs, "auto", beam)])]
            target = f", target ≥ {targets[beam]:.2f}x" if beam in targets else ""
            print(f"beam {beam}: {ours} / {theirs} (workers auto) {statistics.median(ratios):.2f}x, median of "
                  f"{len(ratios)} rounds ({', '.join(f'{r:.2f}' for r in ratios)}){target}")
    for _, _, translator in entries:
        if hasattr(translator, "close"):
            translator.close()


if __name__ == "__main__":
    run_script(main)
