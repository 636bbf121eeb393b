"""How fast each candidate student shape decodes, before any is trained: the measurement that sizes
configs/student-tiny.yaml.

    python scripts/bench_student_shapes.py --run runs/de-en --src data/multi30k/test_2016_flickr.de.gz

Each shape is built with random weights and the run's vocabulary, converted for CTranslate2 and
stored as int8; it then translates the source file with every output forced to `--length` tokens
(untrained models would otherwise stop at random lengths), on one thread, greedy and with beam 5.
The teacher shape (the run's own config) is measured the same way, and `student`, the shape
`model.size: student` derives from it. Targets: a student that decodes ≥ 2x faster than the
teacher at equal settings (both greedy, both beam 5) and ≥ 5x at their shipped settings (teacher
beam 5, student greedy), and is ≤ 1/4 of the teacher's float32 size, with as much capacity as that
leaves. Prints a table: parameters, int8 model.bin size, sentences/s at beam 1 and 5, and the
ratios to the teacher (equal settings: greedy / greedy and beam 5 / beam 5).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402

SHAPES = {  # name: (d_model, n_heads, enc_layers, dec_layers, d_ff)
    "teacher": None,
    "student": "student",  # model.size student: experiment/shapes.py student_of(the teacher's shape)
    "d256-e6d2-ff1024": (256, 4, 6, 2, 1024),
    "d256-e6d2-ff512": (256, 4, 6, 2, 512),
    "d256-e6d1-ff1024": (256, 4, 6, 1, 1024),
    "d192-e6d2-ff768": (192, 4, 6, 2, 768),
    "d128-e6d2-ff512": (128, 4, 6, 2, 512),
}


def convert(run: Path, shape, directory: Path, quantization: str | None) -> int:
    """A random model of `shape` (None: the run's own) with the run's vocabulary, written as a
    CTranslate2 directory; returns its parameter count."""
    import torch

    from transformer_cli.experiment.checkpoint import model_payload, save_checkpoint
    from transformer_cli.experiment.config import load_config
    from transformer_cli.experiment.rundir import RunDirectory
    from transformer_cli.experiment.shapes import student_of
    from transformer_cli.interop.ct2 import write_conversion
    from transformer_cli.model.shape import SHAPE_KEYS, Shape
    from transformer_cli.training.train import build_model

    config = load_config(run / "config.yaml")
    if shape == "student":
        shape = tuple(student_of(Shape(**{key: getattr(config.model, key) for key in SHAPE_KEYS})).keys().values())
    if shape is not None:
        d, h, e, dec, ff = shape
        config.model = config.model.model_copy(update=dict(size=None, d_model=d, n_heads=h, enc_layers=e, dec_layers=dec,
                                                           d_ff=ff))
    manifest = RunDirectory(run).load_manifest()
    spm = {side: RunDirectory(run).vocab_file(manifest, side).read_bytes() for side in ("src", "tgt")}
    vocab = manifest.vocab_size
    torch.manual_seed(0)
    model = build_model(config, vocab["src"], vocab["tgt"])
    checkpoint = directory / "model.pt"
    save_checkpoint(checkpoint, model_payload(model, config, spm, {"step": 0}))
    out = directory / "ct2"
    out.mkdir()
    write_conversion(checkpoint, out, quantization)
    return sum(p.numel() for p in model.parameters())


def speed(model_dir: Path, sources: list[list[str]], beam: int, length: int) -> float:
    import ctranslate2

    translator = ctranslate2.Translator(str(model_dir), compute_type="int8", inter_threads=1, intra_threads=1)
    translator.translate_batch(sources[:64], beam_size=beam, max_decoding_length=length, min_decoding_length=length)
    started = time.perf_counter()
    for i in range(0, len(sources), 64):
        translator.translate_batch(sources[i:i + 64], beam_size=beam, max_decoding_length=length,
                                   min_decoding_length=length)
    return len(sources) / (time.perf_counter() - started)


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="A prepared (teacher) run directory.")
    parser.add_argument("--src", type=Path, required=True, help="Source sentences (plain or .gz).")
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--length", type=int, default=16, help="Output tokens per sentence (test2016's mean is 15).")
    args = parser.parse_args()
    from transformer_cli.data.prepare import load_sentencepiece
    from transformer_cli.experiment.rundir import RunDirectory
    from transformer_cli.runtime.files import read_lines

    run = RunDirectory(args.run)
    sp = load_sentencepiece(run.vocab_file(run.load_manifest(), "src"))
    sources = sp.encode(read_lines(args.src)[:args.lines], out_type=str)
    rows = []
    for name, shape in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            params = convert(args.run, shape, Path(tmp), "int8")
            size = (Path(tmp) / "ct2" / "model.bin").stat().st_size
            rows.append((name, params, size, speed(Path(tmp) / "ct2", sources, 1, args.length),
                         speed(Path(tmp) / "ct2", sources, 5, args.length)))
    teacher = rows[0]
    print(f"{'shape':<20} {'params':>10} {'int8 MB':>8} {'greedy s/s':>10} {'beam5 s/s':>10} "
          f"{'≈size/teacher fp32':>18} {'greedy vs greedy':>16} {'beam5 vs beam5':>14} {'greedy vs teacher beam5':>23}")
    for name, params, size, greedy, beam5 in rows:
        print(f"{name:<20} {params:>10,} {size / 1e6:>8.1f} {greedy:>10.1f} {beam5:>10.1f} "
              f"{params / teacher[1] / 4:>18.2f} {greedy / teacher[3]:>15.2f}x {beam5 / teacher[4]:>13.2f}x "
              f"{greedy / teacher[4]:>22.1f}x")


if __name__ == "__main__":
    run_script(main)
