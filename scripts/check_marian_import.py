"""A briefly trained Marian model, imported: does tfm translate it token for token like transformers?

Builds a small MarianMTModel with transformers itself (its own sentencepiece models and vocab.json
over Multi30k de→en, as OPUS-MT models are laid out), trains it for --steps steps with
transformers' own loss, saves it with save_pretrained, imports it with `tfm import --format
marian`, and greedy-decodes --sentences Multi30k test2016 sentences with both (fp32).
Target: at least 95 of 100 token-identical. Needs transformers (`pip install -e '.[bench]'`).

    python scripts/check_marian_import.py [--steps 600] [--sentences 100] [--workdir /tmp/marian_check]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_marian import generate, save_hf_marian  # noqa: E402  (the tests' model builder)
from transformer_cli.decoding.torch_engine import decode_in_batches  # noqa: E402
from transformer_cli.experiment.checkpoint import load_trained_model  # noqa: E402
from transformer_cli.interop.marian import import_marian, tfm_order  # noqa: E402
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import scratch_directory  # noqa: E402


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/marian_check"))
    args = parser.parse_args()
    subprocess.run(["bash", str(ROOT / "scripts/get_data.sh"), "multi30k"], check=True, capture_output=True)
    data = ROOT / "data/multi30k"
    de, en = read(data / "train.de.gz"), read(data / "train.en.gz")
    scratch_directory(args.workdir)  # its own from an earlier run, or new: never a folder of the user's
    for made in ("random", "hf", "run"):
        shutil.rmtree(args.workdir / made, ignore_errors=True)
    model, tokenizer = save_hf_marian(args.workdir / "random", de, en)
    with torch.no_grad():  # a fresh start at transformers' own initialisation scale
        for name, p in model.named_parameters():
            if "embed_positions" not in name and "layer_norm" not in name:
                p.normal_(0.0, 0.05)
        model.final_logits_bias.zero_()

    # Train with transformers' own loss: teacher forcing on 32-sentence batches.
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    rng = random.Random(1)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        picks = rng.sample(range(len(de)), 32)
        batch = tokenizer([de[i] for i in picks], text_target=[en[i] for i in picks], padding=True,
                          truncation=True, max_length=64, return_tensors="pt")
        batch["labels"][batch["labels"] == model.config.pad_token_id] = -100
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    hf_dir = args.workdir / "hf"
    shutil.copytree(args.workdir / "random", hf_dir)
    model.save_pretrained(hf_dir)

    import_marian(hf_dir, args.workdir / "run")
    trained = load_trained_model(args.workdir / "run/checkpoints/checkpoint_best.pt")
    test = read(data / "test_2016_flickr.de.gz")[: args.sentences]
    vocab = json.loads((hf_dir / "vocab.json").read_text())
    to_tfm = {m: t for t, m in enumerate(tfm_order(vocab, model.config.to_dict())) if t != BOS_ID}
    theirs = [[to_tfm[t] for t in row] for row in generate(model, tokenizer, test, 1, 60)]
    decode = trained.config.decode.updated(precision="fp32", beam=1)
    hyps = decode_in_batches(trained.model, [trained.src_sp.encode(s) for s in test], decode, torch.device("cpu"),
                             max_len=60)
    ours = [[t for t in h[0].tokens if t not in (EOS_ID, PAD_ID)] for h in hyps]
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy, token for token: {same} of {len(test)} sentences identical (target ≥ 95 of 100)")
    print(f"example: {test[0]!r} → {trained.tgt_sp.decode(ours[0])!r}")


if __name__ == "__main__":
    run_script(main)
