"""Decoding speed: tfm vs HuggingFace `generate` (and CTranslate2 if installed), same shape.

    pip install -e '.[bench]'          # transformers + ctranslate2 (the CT2 column is skipped without it)
    tfm prepare --config configs/de-en.yaml
    python scripts/bench_translate.py --config configs/de-en.yaml [--checkpoint runs/de-en/checkpoints/checkpoint_best.pt]

Decodes the 1,000 sentences of the test split (test_2016_flickr) in length-sorted batches of 32
sentences, greedy and beam 5. Untrained weights would stop at random lengths, so every system is
forced to emit exactly --length target tokens (EOS banned before, forced at the end). Prints
sentences/s and the ratios, each the best of --repeats rounds with the systems alternating. tfm runs
as `tfm translate` does by default (decode.workers: auto, one single-threaded process per core) and
in one process with all --threads ("1p"), HF `generate` in one process with all threads,
CTranslate2 both ways (inter_threads 1 × intra_threads N, and inter_threads = workers × 1).
With --checkpoint, tfm also decodes normally (no forced length).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from functools import partial

import numpy as np
import torch
from bench_common import hf_model, machine_line, tfm_model

from transformer_cli.data.batches import ParallelData
from transformer_cli.decoding.torch_engine import decode_in_batches, decode_task
from transformer_cli.decoding.translation import length_sorted_batches
from transformer_cli.decoding.workers import DecodingWorkers, resolve_workers
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.model.cpu_inference import pack_linear_layers
from transformer_cli.model.special_tokens import EOS_ID, PAD_ID, UNK_ID
from transformer_cli.runtime.cpu import keep_freed_memory
from transformer_cli.runtime.entry import ScriptParser, run_script
from transformer_cli.runtime.precision import choose_precision


def best_times(runs: list, repeats: int) -> list[float]:
    """The best (lowest) wall time of each run over `repeats` rounds, the runs alternating within a
    round, so that a slow phase of a shared machine does not land on one system only."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/de-en.yaml")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=30, help="forced output length in tokens")
    parser.add_argument("--beams", default="1,5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", default="auto", help="tfm's decode.workers (auto = one process per core)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per system; the best is printed")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N sentences (0 = all)")
    parser.add_argument("--checkpoint", default=None, help="also time tfm on trained weights, natural lengths")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="weights/activations for every system (CT2: compute_type); auto = what tfm "
                             "picks on this CPU (decode.precision: auto)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="skip the allocator setting `tfm translate` makes on CPU (keep_freed_memory); it is "
                             "process-wide, so by default every system here runs with it")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if not args.system_malloc:
        keep_freed_memory()
    torch.manual_seed(0)
    config = load_config(args.config)
    manifest = RunDirectory(config.run_path).load_manifest()
    vocab = manifest.vocab_size["tgt"]
    test = ParallelData(config.run, "test")
    n = len(test) if not args.limit else min(args.limit, len(test))
    sources = [np.asarray(test.src[i]).tolist() for i in range(n)]
    beams = [int(b) for b in args.beams.split(",")]
    decode = config.decode.model_copy(update={"batch_size": args.batch_size, "batch_tokens": None})
    print(machine_line())
    print(f"{n} sentences, batches of {args.batch_size}, forced output length {args.length} tokens; allocator: "
          f"{'system default' if args.system_malloc else 'keep_freed_memory (every system)'}")

    if args.precision == "auto":
        choice = choose_precision("auto", torch.device("cpu"), (config.model.d_model, config.model.d_ff))
        args.precision = "bf16" if choice.bf16 else "fp32"
        print(f"precision auto → {choice.describe()}")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    tfm = tfm_model(config, vocab).eval().to(dtype)
    packed = pack_linear_layers(tfm)  # what tfm's Translator does on CPU
    hf = hf_model(config, vocab).eval()
    print(f"precision {args.precision} (all systems); tfm linear layers pre-packed for oneDNN: {packed}")
    device = torch.device("cpu")

    # HF gets the same length-sorted batches tfm builds internally.
    with_eos = [s + [EOS_ID] for s in sources]
    hf_batches = []
    for batch in length_sorted_batches([len(s) for s in with_eos], args.batch_size, None):
        width = max(len(with_eos[i]) for i in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(with_eos[i])] = torch.tensor(with_eos[i])
        hf_batches.append(ids)

    def run_hf(beam: int) -> None:
        with torch.inference_mode():
            for ids in hf_batches:
                hf.generate(input_ids=ids, attention_mask=(ids != PAD_ID).long(), num_beams=beam,
                            do_sample=False, min_new_tokens=args.length, max_new_tokens=args.length,
                            length_penalty=1.0, early_stopping=False)

    # tfm as `tfm translate` runs by default (decode.workers: auto, one process of one thread per
    # core), and in one process with all threads (decode.workers: 1), as HF generate runs.
    processes = resolve_workers(args.workers, device)
    pool = DecodingWorkers(partial(decode_task, tfm, device), processes)
    single = DecodingWorkers(partial(decode_task, tfm, device), 1)

    by_beam = {beam: decode.updated(beam=beam) for beam in beams}  # made before the timing

    def run_tfm(beam: int, workers: DecodingWorkers) -> None:
        decode_in_batches(tfm, sources, by_beam[beam], device, min_len=args.length, max_len=args.length,
                         workers=workers)

    hf.to(dtype)

    # Warm-up (first calls allocate and pick kernels; the pool's processes start).
    small = sources[: 2 * args.batch_size]
    for workers in (pool, single):
        decode_in_batches(tfm, small, decode.updated(beam=2), device, min_len=3, max_len=3, workers=workers)
    hf.generate(input_ids=hf_batches[0][:4], attention_mask=(hf_batches[0][:4] != PAD_ID).long(),
                num_beams=2, max_new_tokens=3)

    print(f"tfm: {processes} decoding process(es) (decode.workers={args.workers}); 'tfm 1p' = one process, "
          f"{args.threads} threads; HF: one process, {args.threads} threads; best of {args.repeats}, alternating")
    seconds_tfm = {}
    for beam in beams:
        t_tfm, t_one, t_hf = best_times([lambda beam=beam: run_tfm(beam, pool), lambda beam=beam: run_tfm(beam, single),
                                         lambda beam=beam: run_hf(beam)], args.repeats)
        seconds_tfm[beam] = t_tfm
        label = "greedy" if beam == 1 else f"beam {beam}"
        print(f"{label:7s} tfm {n / t_tfm:7.1f} sent/s   tfm 1p {n / t_one:7.1f}   HF {n / t_hf:7.1f} sent/s   "
              f"tfm/HF {t_hf / t_tfm:5.2f}x   tfm 1p/HF {t_hf / t_one:5.2f}x")
    pool.close()

    if args.checkpoint:
        from transformer_cli.decoding.torch_engine import Translator

        trained = Translator.from_checkpoint(args.checkpoint, decode=decode.model_copy(
            update={"precision": args.precision, "workers": args.workers}), device="cpu")
        lines = [trained.src_sp.decode(s) for s in sources]
        trained.translate(lines[: 2 * args.batch_size], decode=trained.settings(beam=1))  # warm-up, starts the workers
        for beam in beams:
            seconds = best_times([lambda beam=beam: trained.translate(lines, decode=trained.settings(beam=beam))], args.repeats)[0]
            print(f"trained checkpoint, natural lengths, beam {beam}: {n / seconds:.1f} sent/s")
        trained.close()

    # CTranslate2 last: its thread pool keeps spinning after a call, which would slow whatever
    # ran next in this process.
    ct2 = None
    try:
        import ctranslate2  # noqa: F401

        ct2 = ctranslate2
    except ImportError:
        print("ctranslate2 not installed: skipping the CT2 column (pip install ctranslate2)")
    ct2_translator = ct2_workers = None
    if ct2 is not None:
        folder = tempfile.mkdtemp()
        # CT2's Marian loader drops the last vocabulary row (HF appends <pad> to Marian vocabularies)
        # and reads the vocabulary from a tokenizer: save a copy with one extra row, and hand it
        # token names "0".."V-1" (tfm's ids) + "<pad>" instead of a tokenizer on disk.
        hf_for_ct2 = copy.deepcopy(hf).float()  # hf may be bf16 by now; CT2 reads fp32 and casts itself
        hf_for_ct2.resize_token_embeddings(vocab + 1, mean_resizing=False)
        hf_for_ct2.save_pretrained(folder + "/hf")
        del hf_for_ct2

        class IdTokenizer:
            eos_token, unk_token = str(EOS_ID), str(UNK_ID)

            def get_vocab(self) -> dict[str, int]:
                return {**{str(i): i for i in range(vocab)}, "<pad>": vocab}

        class Converter(ct2.converters.TransformersConverter):
            def load_tokenizer(self, *args, **kwargs):
                return IdTokenizer()

        converter = Converter(folder + "/hf", load_as_float16=False)
        try:
            converter.convert(folder + "/ct2", force=True)
            compute_type = "bfloat16" if args.precision == "bf16" else "float32"
            if compute_type not in ct2.get_supported_compute_types("cpu"):
                print(f"CTranslate2 has no {compute_type} on this CPU: CT2 runs float32")
                compute_type = "float32"
            # As tfm: one translator with all threads, and one of `processes` workers (CT2's
            # inter_threads: batches decoded at once) with one thread each.
            ct2_translator = ct2.Translator(folder + "/ct2", device="cpu", inter_threads=1, intra_threads=args.threads,
                                            compute_type=compute_type)
            ct2_workers = ct2.Translator(folder + "/ct2", device="cpu", inter_threads=processes, intra_threads=1,
                                         compute_type=compute_type)
        except Exception as exc:  # noqa: BLE001 (report any converter failure and go on)
            print(f"CTranslate2 conversion failed: {exc}")

    def run_ct2(translator, beam: int) -> None:
        tokens = [[str(t) for t in s] for s in with_eos]
        order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))
        batch = [tokens[i] for i in order]
        translator.translate_batch(batch, max_batch_size=args.batch_size, beam_size=beam,
                                   min_decoding_length=args.length, max_decoding_length=args.length,
                                   length_penalty=1.0)

    if ct2_translator is not None:
        run_ct2_small = [[str(t) for t in s] for s in with_eos[: 2 * args.batch_size]]
        for translator in (ct2_translator, ct2_workers):  # warm-up
            translator.translate_batch(run_ct2_small, max_batch_size=args.batch_size, beam_size=2,
                                       max_decoding_length=3)
        print(f"CT2 1p: inter_threads 1, intra_threads {args.threads}; CT2 {processes}w: inter_threads {processes}, "
              f"intra_threads 1")
        for beam in beams:
            t_one, t_workers = best_times([lambda beam=beam: run_ct2(ct2_translator, beam), lambda beam=beam: run_ct2(ct2_workers, beam)],
                                          args.repeats)
            label = "greedy" if beam == 1 else f"beam {beam}"
            print(f"{label:7s} CT2 1p {n / t_one:7.1f} sent/s   CT2 {processes}w {n / t_workers:7.1f} sent/s   "
                  f"tfm/CT2 best {min(t_one, t_workers) / seconds_tfm[beam]:5.2f}x")


if __name__ == "__main__":
    run_script(main)
