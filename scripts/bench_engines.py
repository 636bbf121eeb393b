"""Speed and BLEU of one trained checkpoint under every decoding engine/precision tfm offers.

    pip install -e '.[ct2]'
    python scripts/bench_engines.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz

Systems: tfm fp32, tfm bf16 (where precision: auto picks it, or with --bf16), tfm int8
(dynamic int8 Linear layers), CTranslate2 float32 and int8 (the checkpoint exported with
`tfm export`). Greedy and beam 5, batches of --batch-size sentences, natural output lengths (each
system stops at </s>). Each system's settings are the checkpoint's decode settings; CTranslate2's
length penalty is len^alpha where tfm's is GNMT's ((5+len)/6)^alpha (see README), so beam-5 BLEU
may differ slightly between the two engines. Prints one markdown table row per system and beam.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer_cli.io_utils import read_lines  # noqa: E402
from transformer_cli.runtime import choose_precision  # noqa: E402
from transformer_cli.translate import Translator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--beams", default="1,5")
    parser.add_argument("--bf16", action="store_true",
                        help="also time tfm bf16 on a CPU without AMX (tfm's auto precision would not pick it)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="runs per system and beam; the fastest is printed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    src, ref = read_lines(args.src), read_lines(args.ref)
    beams = [int(b) for b in args.beams.split(",")]
    overrides = [f"decode.batch_size={args.batch_size}"]

    systems = {"tfm fp32": lambda: Translator.from_checkpoint(args.checkpoint, device="cpu", overrides=overrides,
                                                              precision="fp32"),
               "tfm int8": lambda: Translator.from_checkpoint(args.checkpoint, device="cpu", overrides=overrides,
                                                              precision="int8")}
    if choose_precision("auto", torch.device("cpu")).bf16 or args.bf16:
        systems["tfm bf16"] = lambda: Translator.from_checkpoint(args.checkpoint, device="cpu",
                                                                 overrides=overrides, precision="bf16")
    try:
        import ctranslate2

        from transformer_cli.export import CT2Translator, export_ctranslate2

        folder = Path(tempfile.mkdtemp()) / "ct2"
        export_ctranslate2(args.checkpoint, folder)
        for compute_type in ("float32", "int8", "bfloat16"):
            if compute_type in ctranslate2.get_supported_compute_types("cpu"):
                systems[f"CT2 {compute_type}"] = (lambda ct=compute_type: CT2Translator(
                    folder, compute_type=ct, threads=args.threads, overrides=overrides))
    except ImportError:
        print("ctranslate2 not installed: skipping CT2 (pip install -e '.[ct2]')", file=sys.stderr)

    print(f"{len(src)} sentences, batch {args.batch_size}, {args.threads} threads; each system with decode.workers "
          f"auto (one process, or CT2 inter_thread, per core; one thread each) and 1 (one process, "
          f"{args.threads} threads); best of {args.repeats}")
    print("| system | workers | beam | sentences/s | BLEU |\n|---|---|---|---|---|")
    for name, make in systems.items():
        for workers in ("auto", 1):
            translator = make()
            translator.decode = translator.decode.model_copy(update={"workers": workers})
            translator.translate(src[: 2 * args.batch_size], beam=1)  # warm-up; starts the workers
            for beam in beams:
                seconds = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    hyps = [t[0].text for t in translator.translate(src, beam=beam)]
                    seconds = min(seconds, time.perf_counter() - start)
                bleu = sacrebleu.corpus_bleu(hyps, [ref]).score
                print(f"| {name} | {translator.decoding_processes} | {beam} | {len(src) / seconds:.1f} | {bleu:.2f} |",
                      flush=True)
            if hasattr(translator, "close"):
                translator.close()
            del translator


if __name__ == "__main__":
    main()
