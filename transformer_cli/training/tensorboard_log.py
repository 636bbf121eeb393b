"""TensorBoard event files of a training run (`train.tensorboard: true`): the scalars of the
records that metrics.jsonl gets, under <run_dir>/tensorboard/, written by rank 0 only."""

from __future__ import annotations

from pathlib import Path

from ..runtime.errors import TfmError

# Record kind → the scalars TensorBoard shows of it (tags "<kind>/<name>").
SCALARS = {
    "train": ("loss", "ppl", "lr", "tokens_per_s"),
    "valid": ("loss", "ppl", "bleu"),
    "valid_avg": ("loss", "ppl", "bleu"),
    "valid_ema": ("loss", "ppl", "bleu"),
}


class TensorBoardLog:
    def __init__(self, log_dir: Path, resumed_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TfmError("key 'train.tensorboard': needs the tensorboard package: "
                           "pip install 'transformer-cli[tensorboard]'") from None
        # A resumed run goes on after its checkpoint's step: purge_step makes TensorBoard drop what an
        # interrupted process had logged after that step, so no step appears twice.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resumed_step + 1 if resumed_step else None)

    def add(self, record: dict) -> None:
        """One metrics.jsonl record; flushed at once, so a killed run keeps what it logged."""
        names = SCALARS.get(record.get("kind", ""), ())
        for name in names:
            if name in record:
                self.writer.add_scalar(f"{record['kind']}/{name}", record[name], record["step"])
        if names:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()
