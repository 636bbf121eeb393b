"""Profile training steps and beam-search steps with torch.profiler; prints the top ops.

usage: python scripts/profile_step.py --config configs/de-en.yaml [--what train|beam|both]
(needs a prepared run dir: `tfm prepare --config ...`)
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from transformer_cli.data.batches import ParallelData
from transformer_cli.decoding.search import beam_search
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID
from transformer_cli.runtime.cpu import keep_freed_memory
from transformer_cli.runtime.entry import ScriptParser, run_script
from transformer_cli.training.loss import batch_loss
from transformer_cli.training.train import build_model


def main() -> None:
    parser = ScriptParser()
    parser.add_argument("--config", default="configs/de-en.yaml")
    parser.add_argument("--what", default="both", choices=["train", "beam", "both"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast the training step to bfloat16")
    args = parser.parse_args()
    keep_freed_memory()  # as tfm train and translate do: no fresh pages per large tensor
    config = load_config(args.config)
    manifest = RunDirectory(config.run_path).load_manifest()
    data = ParallelData(config.run, "train")
    model = build_model(config, manifest.vocab_size["src"], manifest.vocab_size["tgt"])
    batches = [data.collate(b) for b in data.batches(config.train.max_tokens, seed=0)[: args.steps + 1]]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    amp = args.precision == "bf16"

    def train_step(batch) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = batch_loss(model, batch, config.train.label_smoothing)
        (loss / batch.n_tgt_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if args.what in ("train", "both"):
        model.train()
        train_step(batches[0])  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for batch in batches[1:]:
                train_step(batch)
        print(f"== training: {args.steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.what in ("beam", "both"):
        model.eval()
        valid = ParallelData(config.run, "test")
        src = valid.collate(list(range(32))).src
        beam_search(model, src, BOS_ID, EOS_ID, beam=5, max_len_a=0, max_len_b=5, min_len=5)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            beam_search(model, src, BOS_ID, EOS_ID, beam=5, max_len_a=0, max_len_b=30, min_len=30)
        print("== beam search: 32 sentences x 30 steps, beam 5")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    run_script(main)
