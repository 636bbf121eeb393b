"""The peer `tfm translate` is timed against (scripts/bench_default_engine.py): the shortest script
a CTranslate2 user writes to translate a file with a model directory (`tfm export` or the
conversion tfm caches), sentencepiece in and out, the same beam, batch and threads as tfm's.

    python scripts/ct2_reference.py MODEL_DIR INPUT OUTPUT --beam 5 --batch-size 64 --length-penalty 1.0
"""

import argparse
import os
import sys

import ctranslate2
import sentencepiece as spm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from transformer_cli.runtime.errors import TfmError  # noqa: E402  (no torch: the output rule alone)
from transformer_cli.runtime.files import check_output  # noqa: E402


def fail(message: str) -> None:
    print(f"error: ct2_reference.py: {message}", file=sys.stderr)
    sys.exit(2)


parser = argparse.ArgumentParser()
parser.add_argument("model_dir"), parser.add_argument("input"), parser.add_argument("output")
parser.add_argument("--beam", type=int, default=5), parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--length-penalty", type=float, default=1.0), parser.add_argument("--compute-type", default="int8")
args = parser.parse_args()
# What a careful script checks before it writes: a model directory, an input, an output that is not an input.
if not os.path.isfile(os.path.join(args.model_dir, "model.bin")):
    fail(f"{args.model_dir}: not a CTranslate2 model directory (no model.bin)")
if not os.path.isfile(args.input):
    fail(f"{args.input}: no such file")
try:  # tfm's output rule: not a directory, not the input (links included), not a run's own file
    check_output(args.output, {"INPUT": [args.input], "MODEL_DIR": [os.path.join(args.model_dir, "model.bin")]},
                 flag="OUTPUT")
except TfmError as exc:
    fail(str(exc))
cores = len(os.sched_getaffinity(0))
translator = ctranslate2.Translator(args.model_dir, compute_type=args.compute_type, inter_threads=cores, intra_threads=1)
source = spm.SentencePieceProcessor(model_file=f"{args.model_dir}/source.spm.model")
target = spm.SentencePieceProcessor(model_file=f"{args.model_dir}/target.spm.model")
with open(args.input, encoding="utf-8") as f:
    lines = f.read().splitlines()
results = translator.translate_batch(source.encode(lines, out_type=str), beam_size=args.beam, max_batch_size=args.batch_size,
                                     length_penalty=args.length_penalty if args.beam > 1 else 0.0)
try:
    with open(args.output, "w", encoding="utf-8") as f:
        f.write("".join(target.decode_pieces(r.hypotheses[0]) + "\n" for r in results))
except OSError as exc:
    fail(f"{args.output}: {exc.strerror}")
