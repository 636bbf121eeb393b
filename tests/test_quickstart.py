"""The README's main job, scripts/quickstart.sh, run end to end as a user runs it (a short budget):
every step's options must be accepted by the command they go to."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.warm_processes import tfm_in_scripts


@pytest.mark.slow
def test_quickstart_prepares_trains_translates_and_evaluates(tmp_path):
    run = tmp_path / "quickstart"
    # the script's `tfm` is this Python's, its commands forked from the test process's warm processes
    env = {**tfm_in_scripts(tmp_path / "bin"), "TIME": "15s", "RUN_DIR": str(run)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BLEU = " in result.stdout and "chrF2 = " in result.stdout
    # ...and the same sentences as people type them: a row per variant, ALL CAPS answered in capitals.
    assert [line.split()[0] for line in result.stdout.splitlines() if re.match(r"(clean|upper|mix) ", line)] == \
        ["clean", "upper", "mix"] and "answered in capitals" in result.stdout
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "checkpoint_best.pt").is_file()
    hypotheses = (run / "test_2016_flickr.hyp.en").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 1000  # one line out per test2016 line in
    assert f"tfm translate --config {run}/config.yaml" in result.stdout
    # configs/de-en.yaml's model.size auto: the shapes were timed, the choice printed and kept in the run.
    assert "model.size auto: training " in result.stderr and (run / "shape_choice.json").is_file()

    # The row for docs/performance.md, read back from the finished run: the BLEU evaluate printed.
    row = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(run)],
                         capture_output=True, text=True, timeout=300)
    assert row.returncode == 0, row.stderr[-2000:]
    bleu = re.search(r"BLEU = ([0-9.]+)", result.stdout).group(1)
    assert f"**{float(bleu):.2f} / " in row.stdout and "model name" not in row.stdout
    # A run's conditions are what its record says: --isa-cap beside --read cannot label an uncapped run
    # capped; a run the script made capped (its record beside it) is named so, with its caps.
    relabel = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(run),
                              "--isa-cap", "avx2"], capture_output=True, text=True, timeout=300)
    assert relabel.returncode == 2 and "--isa-cap with --read" in relabel.stderr, relabel.stderr
    (tmp_path / "quickstart.row.json").write_text(
        '{"command": "python scripts/quickstart_row.py --isa-cap avx2 --time 10m", "isa_cap": "avx2"}')
    capped = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(run)],
                            capture_output=True, text=True, timeout=300)
    assert capped.returncode == 0, capped.stderr[-2000:]
    assert "capped to avx2: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in capped.stdout
    assert "`python scripts/quickstart_row.py --isa-cap avx2 --time 10m`" in capped.stdout
    (tmp_path / "quickstart.row.json").write_text('{"command": "python scr')
    torn_record = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(run)],
                                 capture_output=True, text=True, timeout=300)
    assert torn_record.returncode == 2 and "quickstart.row.json: torn" in torn_record.stderr
    (tmp_path / "quickstart.row.json").unlink()
    # an unknown class is one line
    unknown = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--isa-cap", "avx9"],
                             capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: ") and len(unknown.stderr.splitlines()) == 1
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--run-dir", str(run)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "exists" in again.stderr
    # A torn run is one line (a kill mid-write: shape_choice.json half written), a torn metrics line skipped.
    import shutil

    torn = tmp_path / "torn"
    shutil.copytree(run, torn)
    with open(torn / "metrics.jsonl", "a", encoding="utf-8") as metrics:
        metrics.write('{"kind": "tra')
    assert subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(torn)],
                          capture_output=True, text=True, timeout=300).returncode == 0
    (torn / "shape_choice.json").write_text('{"chosen": "d1')
    half = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--read", str(torn)],
                          capture_output=True, text=True, timeout=300)
    assert half.returncode == 2 and "shape_choice.json: torn" in half.stderr and len(half.stderr.splitlines()) == 1
    for busy in ("-1", "nan", "9999"):
        bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_row.py"), "--busy", busy],
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and "--busy" in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr


@pytest.mark.slow
def test_the_student_script_distills_trains_scores_and_exports_a_student_of_its_teachers_shape(tiny_prepared,
                                                                                                 tmp_path):
    """scripts/student.sh on a tiny teacher (the reverse task, 2+3 layers) as a user runs it on the
    quickstart's run: every step's options accepted, the student's shape derived from the teacher's."""
    import json
    import shutil

    from tests.conftest import tiny_reverse_config
    from transformer_cli.experiment.checkpoint import load_checkpoint
    from transformer_cli.experiment.config import config_from_dict
    from transformer_cli.training.train import train

    data, run = tiny_prepared
    shutil.copytree(run, tmp_path / "teacher")
    teacher = tiny_reverse_config(data, tmp_path / "teacher", max_steps=20, eval_every=20, eval_bleu_sentences=10)
    teacher["model"].update(enc_layers=2, dec_layers=3)
    config = config_from_dict(teacher)
    (tmp_path / "teacher" / "config.yaml").write_text(json.dumps(teacher))
    train(config, progress_bar=False)
    student = tiny_reverse_config(data, tmp_path / "unused")
    student["model"] = {"size": "student", "dropout": 0.0, "norm_position": "pre"}
    student["decode"].update(beam=1, shortlist=True)
    (tmp_path / "student.yaml").write_text(json.dumps(student))
    env = {**tfm_in_scripts(tmp_path / "bin"), "TEACHER": str(tmp_path / "teacher"), "TIME": "5s",
           "CONFIG": str(tmp_path / "student.yaml"), "ORIGINAL": str(data / "train")}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "student.sh")], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("BLEU = ") == 2 and "the student, at its shipped settings" in result.stdout
    out = tmp_path / "teacher-student"
    shape = load_checkpoint(out / "checkpoints" / "checkpoint_last.pt")["model_config"]
    assert (shape["enc_layers"], shape["dec_layers"], shape["d_model"]) == (3, 1, 32)
    assert (out / "export" / "model.bin").is_file() and (out / "export" / "vmap.txt").is_file()
    assert f"tfm translate --model {out}/export" in result.stdout
    missing = subprocess.run(["bash", str(ROOT / "scripts" / "student.sh")], env={**env, "TEACHER": str(tmp_path / "x")},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no trained run there" in missing.stderr
