"""What tfm wrote before keeps working: a run directory, its checkpoints and its CTranslate2
conversion cache, written by tfm 0.1.0 (tests/fixtures/run_v0.1.0.tar.xz, made at commit bb4a2d6 by
`tfm prepare`, `tfm train` and `tfm translate` on tiny.yaml: the reverse task with a 16-dimensional
model, 20 steps), load, resume, translate and convert with today's code. Module paths are internal;
these files are what users keep."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from tests.conftest import tfm_in_process
from transformer_cli.experiment.checkpoint import load_checkpoint, load_trained_model
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory

FIXTURE = Path(__file__).parent / "fixtures" / "run_v0.1.0.tar.xz"
LINES = ["wa wb wc", "wd we wf wg", "wp"]


@pytest.fixture
def old_run(tmp_path, monkeypatch) -> Path:
    """The 0.1.0 run unpacked into a fresh directory, which becomes the working directory (tiny.yaml
    names its paths relative to it)."""
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_an_old_checkpoint_loads_into_todays_model(old_run):
    config = load_config(old_run / "tiny.yaml")
    run = RunDirectory(config.run_path)
    best = old_run / "run" / "checkpoints" / "checkpoint_best.pt"
    trained = load_trained_model(best)
    payload = load_checkpoint(best)
    assert trained.config.model.d_model == payload["model_config"]["d_model"] == 16
    for name, tensor in trained.model.state_dict().items():
        assert torch.equal(tensor, payload["model"][name].to(tensor.dtype)), name
    assert run.default_checkpoint().resolve() == best.resolve() and run.has_checkpoints()
    assert json.loads(run.manifest_file.read_text())["train_pairs_read"] == 300


def test_an_old_run_resumes_where_it_stopped(old_run):
    before = load_checkpoint(old_run / "run" / "checkpoints" / "checkpoint_last.pt")["progress"]["step"]
    result = tfm_in_process("train", "--config", "tiny.yaml", "--resume", "--set", "train.max_steps=24")
    assert result.exit_code == 0, result.stderr
    assert before == 20
    assert load_checkpoint(old_run / "run" / "checkpoints" / "checkpoint_last.pt")["progress"]["step"] == 24
    steps = [json.loads(line).get("step") for line in (old_run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] < 20 and max(steps) == 24  # appended to the old log, not started anew


def test_an_old_run_translates_with_both_engines_and_its_conversion_cache_is_used(old_run):
    cache = old_run / "run" / "checkpoints" / "ctranslate2"
    (conversion,) = cache.iterdir()
    model_bin = conversion / "model.bin"
    written = model_bin.stat().st_mtime_ns
    source = json.loads((conversion / "tfm_source.json").read_text())
    text = "\n".join(LINES) + "\n"

    ours = tfm_in_process("translate", "--config", "tiny.yaml", "--engine", "torch", input=text)
    default = tfm_in_process("translate", "--config", "tiny.yaml", input=text)
    assert ours.exit_code == default.exit_code == 0, ours.stderr + default.stderr
    assert len(ours.stdout.splitlines()) == len(default.stdout.splitlines()) == len(LINES)
    assert "CTranslate2" in default.stderr, default.stderr

    import ctranslate2

    if source["converter"].endswith(f"ctranslate2-{ctranslate2.__version__}"):
        # The same CTranslate2 as wrote it: the old conversion is the one used, not made again.
        assert [p.name for p in cache.iterdir()] == [conversion.name]
        assert model_bin.stat().st_mtime_ns == written
    else:  # another CTranslate2 reads the checkpoint anew, into a conversion of its own
        assert len(list(cache.iterdir())) == 1


def test_an_old_checkpoint_exports(old_run, tmp_path):
    out = tmp_path / "exported"
    result = tfm_in_process("export", "--checkpoint", "run/checkpoints/checkpoint_best.pt", "--output", str(out))
    assert result.exit_code == 0, result.stderr
    assert (out / "model.bin").is_file() and (out / "tfm_decode.json").is_file()
