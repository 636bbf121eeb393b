"""The output layer's loss, forward and backward (`loss.output_layer_loss`: the vocabulary
projection and the label-smoothed cross-entropy, chunk by chunk), with each chunk's loss and
gradient computed eagerly in place (the default) or fused by torch.compile (`train.compile: true`),
in the same run, alternating: the median time of each and their ratio.

    python scripts/bench_loss.py                          # CPU: 2,048 rows, d_model 512, 32k vocabulary
    python scripts/bench_loss.py --device cuda --rows 28000 --d-model 1024    # the big WMT shape's batch

Random states and targets, bf16 autocast (as training runs) unless --precision fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformer_cli.runtime.entry import ScriptParser, run_script
from transformer_cli.training.loss import compiled_chunk_loss, output_layer_loss, smoothed_chunk_loss


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=positive, default=2048, help="target tokens of a batch (2048)")
    parser.add_argument("--d-model", type=positive, default=512, help="width of the decoder states (512)")
    parser.add_argument("--vocab", type=positive, default=32000, help="target vocabulary (32000)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=positive, default=7, help="timed rounds of each, alternating (7)")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads on CPU (2)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    projection = torch.nn.Linear(args.d_model, args.vocab, bias=False, device=device)
    hidden = torch.randn(args.rows, args.d_model, device=device, requires_grad=True)  # (N, D)
    target = torch.randint(0, args.vocab, (args.rows,), device=device)  # (N,)
    kinds = {"eager": smoothed_chunk_loss, "compiled": compiled_chunk_loss()}

    def step(chunk_loss) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss, _ = output_layer_loss(hidden, projection, target, 0.1, chunk_loss=chunk_loss)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    started = time.perf_counter()
    for chunk_loss in kinds.values():  # the compile, and every chunk size, before timing
        step(chunk_loss)
        step(chunk_loss)
    print(f"output loss: {args.rows:,} rows, d_model {args.d_model}, vocabulary {args.vocab:,}, {args.device}, "
          f"{args.precision}; compiled and warmed up in {time.perf_counter() - started:.1f} s")
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, chunk_loss in kinds.items():
            times[name].append(step(chunk_loss))
    median = {name: statistics.median(values) * 1000 for name, values in times.items()}
    for name, ms in median.items():
        print(f"{name:9} {ms:10.2f} ms per forward and backward")
    print(f"ratio eager/compiled {median['eager'] / median['compiled']:.2f}x")


if __name__ == "__main__":
    run_script(main)
