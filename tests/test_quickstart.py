"""The README's main job, scripts/quickstart.sh, run end to end as a user runs it (a short budget):
every step's options must be accepted by the command they go to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_quickstart_prepares_trains_translates_and_evaluates(tmp_path):
    run = tmp_path / "quickstart"
    env = {**os.environ, "TIME": "15s", "RUN_DIR": str(run),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # this Python's tfm
    result = subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BLEU = " in result.stdout and "chrF2 = " in result.stdout
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "checkpoint_best.pt").is_file()
    hypotheses = (run / "test_2016_flickr.hyp.en").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 1000  # one line out per test2016 line in
    assert f"tfm translate --config {run}/config.yaml" in result.stdout
