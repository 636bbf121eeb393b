"""Distillation (`tfm distill`), the lexical shortlist (`tfm shortlist`, decode.shortlist) and the
student configs: a teacher's translation of the training source, line for line, resumable; a
vocabulary map that restricts CTranslate2's output and changes nothing where it covers it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sacrebleu.metrics import CHRF

from tests.conftest import FP32, ROOT, TFM, fp32_translator, tfm, tfm_in_process, tiny_run
from transformer_cli.data.batches import TokenArray
from transformer_cli.data.prepare import load_sentencepiece, prepare
from transformer_cli.data.shortlist import build_shortlist, check_shortlist
from transformer_cli.decoding.distill import PARTIAL, REPORT, distill, keep_mask
from transformer_cli.decoding.engine import open_engine
from transformer_cli.decoding.translation import translate_texts
from transformer_cli.experiment.config import config_from_dict, load_config
from transformer_cli.experiment.rundir import SHORTLIST_FILE, RunDirectory
from transformer_cli.runtime.errors import TfmError
from transformer_cli.runtime.files import digest_file, read_lines
from transformer_cli.training.train import train

TORCH_FP32 = ["decode.engine=torch", *FP32]  # batch-invariant: a line's translation is the same in any chunk


@pytest.fixture(scope="module")
def teacher(tiny_prepared, tmp_path_factory) -> Path:
    """The tiny reverse task's run, trained 40 steps (step checkpoints at 20 and 40): its config file."""
    config_file = tiny_run(tiny_prepared, tmp_path_factory.mktemp("teacher"), max_steps=40, eval_every=20,
                           keep_last=2)
    train(load_config(config_file), progress_bar=False)
    return config_file


def config_with(config_file: Path, tmp_path: Path, *overrides: str):
    return load_config(config_file, [f"distill.output={tmp_path / 'distilled'}", "distill.chunk_lines=300",
                                     *overrides])


def opener(cfg, checkpoints=None, overrides=()):
    def open_teacher():
        teachers = checkpoints or [RunDirectory(cfg.run_path).default_checkpoint()]
        return open_engine(cfg, list(overrides), teachers, "cpu", announce=lambda _: None), teachers
    return open_teacher


def training_sources(cfg) -> list[str]:
    run = RunDirectory(cfg.run_path)
    sp = load_sentencepiece(run.vocab_file(run.load_manifest(), "src"))
    tokens = TokenArray.load(run.binary_stem("train", "src"))
    return [sp.decode(tokens[i].tolist()) for i in range(len(tokens))]


def corpus(cfg, tmp_path: Path) -> tuple[list[str], list[str]]:
    out = tmp_path / "distilled"
    return ((out / "train.src").read_text().splitlines(), (out / "train.tgt").read_text().splitlines())


@pytest.mark.slow
def test_the_distilled_corpus_is_the_teachers_translation_of_each_training_source_in_order(teacher, tmp_path):
    cfg = config_with(teacher, tmp_path, *TORCH_FP32)
    result = distill(cfg, opener(cfg))
    sources = training_sources(cfg)
    expected = translate_texts(fp32_translator(RunDirectory(cfg.run_path).default_checkpoint(), beam=4), sources)
    src, tgt = corpus(cfg, tmp_path)
    pairs = [(s, t) for s, t in zip(sources, expected) if s and t]
    assert list(zip(src, tgt)) == pairs
    assert result.lines == len(sources) == 2000 and result.kept == len(pairs) and result.resumed_at == 0
    scored = (tmp_path / "distilled" / PARTIAL).read_text().splitlines()
    assert len(scored) == 2000 and [row.split("\t", 1)[1] for row in scored] == expected


@pytest.mark.slow
def test_resuming_a_torn_output_goes_on_from_the_last_whole_chunk_and_repeats_nothing(teacher, tmp_path):
    cfg = config_with(teacher, tmp_path)  # the default engine (CTranslate2): same chunks, same output
    distill(cfg, opener(cfg))
    whole = (tmp_path / "distilled" / PARTIAL).read_bytes()
    first = corpus(cfg, tmp_path)
    lines = whole.split(b"\n")
    torn = b"\n".join(lines[:750]) + b"\n" + lines[750][:5]  # killed in the middle of chunk 3's line 151
    (tmp_path / "distilled" / PARTIAL).write_bytes(torn)
    for f in ("train.src", "train.tgt"):
        (tmp_path / "distilled" / f).unlink()
    result = distill(cfg, opener(cfg))
    assert result.resumed_at == 600  # chunks 1 and 2 kept, the torn third translated again
    assert (tmp_path / "distilled" / PARTIAL).read_bytes() == whole
    assert corpus(cfg, tmp_path) == first


@pytest.mark.slow  # real processes
def test_a_kill_9_mid_distillation_resumes_to_the_uninterrupted_corpus(teacher, tmp_path):
    base = ["distill", "--config", str(teacher), "--set", "distill.chunk_lines=50"]
    uninterrupted = subprocess.run([*TFM, *base, "--set", f"distill.output={tmp_path / 'a'}"], capture_output=True,
                                   text=True)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    killed = subprocess.Popen([*TFM, *base, "--set", f"distill.output={tmp_path / 'b'}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "b" / PARTIAL
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not partial.exists() or partial.stat().st_size < 2000):
        time.sleep(0.01)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "b" / "train.tgt").exists(), "finished before the kill: nothing was tested"
    resumed = subprocess.run([*TFM, *base, "--set", f"distill.output={tmp_path / 'b'}"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "went on from line" in resumed.stdout
    for name in ("train.src", "train.tgt", PARTIAL):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.slow
def test_an_ensemble_teacher_translates_as_the_ensemble_does(teacher, tmp_path):
    cfg = config_with(teacher, tmp_path, *FP32)
    steps = RunDirectory(cfg.run_path).step_checkpoints()
    assert len(steps) == 2
    result = distill(cfg, opener(cfg, steps))
    assert "torch" in result.report["engine"] and len(result.report["teachers"]) == 2
    sources = training_sources(cfg)
    expected = translate_texts(fp32_translator(*steps, beam=4), sources)
    assert corpus(cfg, tmp_path) == tuple(map(list, zip(*[(s, t) for s, t in zip(sources, expected) if s and t])))


@pytest.mark.slow
def test_drop_worst_leaves_out_the_lowest_scores_and_needs_no_second_translation(teacher, tmp_path):
    cfg = config_with(teacher, tmp_path, *TORCH_FP32)
    distill(cfg, opener(cfg))
    rows = [line.split("\t", 1) for line in (tmp_path / "distilled" / PARTIAL).read_text().splitlines()]
    cfg = config_with(teacher, tmp_path, *TORCH_FP32, "distill.drop_worst=10")
    result = distill(cfg, opener(cfg))
    assert result.resumed_at == 2000 and result.report["sentences_per_second"] is None  # nothing translated again
    src, tgt = corpus(cfg, tmp_path)
    sources = training_sources(cfg)
    kept_scores = [float(score) for (score, text), s in zip(rows, sources) if (s, text) in set(zip(src, tgt))]
    dropped = sorted(float(score) for score, _ in rows)[:200]
    assert result.kept <= 1800 and min(kept_scores) >= max(dropped) == result.threshold


def test_keep_mask_drops_exactly_the_share_asked_ties_in_line_order():
    keep, threshold = keep_mask(np.array([0.5, -1.0, -1.0, 2.0, np.nan]), 40.0)
    assert keep.tolist() == [True, False, True, True, False] and threshold == -1.0  # NaN first, then line 2
    assert keep_mask(np.zeros(3), 0.0)[0].all()


@pytest.mark.slow
def test_chrf_scores_are_sentence_chrf_against_the_reference(teacher, tmp_path):
    cfg = config_with(teacher, tmp_path, *TORCH_FP32, "distill.score=chrf")
    distill(cfg, opener(cfg))
    run = RunDirectory(cfg.run_path)
    sp = load_sentencepiece(run.vocab_file(run.load_manifest(), "tgt"))
    refs = TokenArray.load(run.binary_stem("train", "tgt"))
    rows = (tmp_path / "distilled" / PARTIAL).read_text().splitlines()
    for i in (0, 777, 1999):
        score, text = rows[i].split("\t", 1)
        assert float(score) == pytest.approx(CHRF().sentence_score(text, [sp.decode(refs[i].tolist())]).score)


@pytest.mark.slow
def test_a_teacher_of_another_vocabulary_is_refused(teacher, tmp_path, tiny_prepared):
    data, _ = tiny_prepared
    raw = json.loads(teacher.read_text())
    raw.update(run_dir=str(tmp_path / "other"))
    raw["vocab"].update(model_type="unigram", size=38)
    raw["train"].update(max_steps=2, eval_every=2)
    other = config_from_dict(raw)
    prepare(other, progress=False)
    train(other, progress_bar=False)
    result = tfm_in_process("distill", "--config", teacher, "--checkpoint", tmp_path / "other/checkpoints/checkpoint_last.pt",
                            "--set", f"distill.output={tmp_path / 'd'}")
    assert result.exit_code == 2 and "another source vocabulary" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "d" / PARTIAL).exists()


def test_bad_inputs_are_one_line_errors(teacher, tmp_path):
    out = tmp_path / "d"
    unprepared = tmp_path / "unprepared.yaml"
    unprepared.write_text(json.dumps({**json.loads(teacher.read_text()), "run_dir": str(tmp_path / "nothing")}))
    cases = {
        "a missing run": (["--config", unprepared], "not found: run `tfm prepare"),
        "a missing teacher": (["--config", teacher, "--checkpoint", tmp_path / "nope.pt"], "nope.pt"),
    }
    for name, (args, message) in cases.items():
        result = tfm_in_process("distill", *args, "--set", f"distill.output={out}")
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1, name
    out.mkdir()
    first = tfm_in_process("distill", "--config", teacher, "--set", f"distill.output={out}", "--set",
                           "distill.chunk_lines=300")
    assert first.exit_code == 0, first.stderr
    lines = (out / PARTIAL).read_text().splitlines()
    (out / PARTIAL).write_text("\n".join(lines[:10] + ["garbage without a score", *lines[11:600]]) + "\n")
    corrupt = tfm_in_process("distill", "--config", teacher, "--set", f"distill.output={out}", "--set",
                             "distill.chunk_lines=300")
    assert corrupt.exit_code == 2 and f"{out / PARTIAL} line 11: not 'score<TAB>translation'" in corrupt.stderr
    (out / PARTIAL).write_text("\n".join(lines[:300]) + "\n")
    other_beam = tfm_in_process("distill", "--config", teacher, "--set", f"distill.output={out}", "--set",
                                "distill.chunk_lines=300", "--set", "distill.beam=2")
    assert other_beam.exit_code == 2 and "another teacher, beam or training data" in other_beam.stderr
    restarted = tfm_in_process("distill", "--config", teacher, "--set", f"distill.output={out}", "--set",
                               "distill.chunk_lines=300", "--set", "distill.beam=2", "--restart")
    assert restarted.exit_code == 0 and len((out / PARTIAL).read_text().splitlines()) == 2000


# --------------------------------------------------------------------------- the lexical shortlist


def shortlist_lines(path: Path) -> list[tuple[str, list[str]]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        key, tab, values = line.partition("\t")
        assert tab, line
        rows.append((key, values.split()))
    return rows


def test_the_shortlist_is_a_well_formed_map_of_the_runs_pieces(reverse_model, tmp_path):
    config, _ = reverse_model
    settings = config.shortlist.model_copy(update={"top": 3, "frequent": 5})
    result = build_shortlist(RunDirectory(shutil.copytree(config.run_path, tmp_path / "run")), settings)
    rows = shortlist_lines(result.path)
    run = RunDirectory(tmp_path / "run")
    src_sp, tgt_sp = (load_sentencepiece(run.vocab_file(run.load_manifest(), s)) for s in ("src", "tgt"))
    src_pieces = {src_sp.id_to_piece(i) for i in range(src_sp.get_piece_size())}
    tgt_pieces = {tgt_sp.id_to_piece(i) for i in range(tgt_sp.get_piece_size())}
    assert rows[0][0] == "" and len(rows[0][1]) == 5
    assert all(key in src_pieces and 1 <= len(values) <= 3 and set(values) <= tgt_pieces for key, values in rows[1:])
    assert len({key for key, _ in rows}) == len(rows)
    # On the reverse task each word translates into itself: Model 1 ranks it first.
    words = [(key, values) for key, values in rows[1:] if key.startswith("▁w")]
    assert words and sum(values[0] == key for key, values in words) / len(words) > 0.9
    check_shortlist(result.path, tgt_sp)


def test_translating_with_a_covering_shortlist_equals_translating_without(reverse_model, tmp_path):
    config, _ = reverse_model
    run = shutil.copytree(config.run_path, tmp_path / "run")
    cfg = config.model_copy(update={"run_dir": str(run)})
    build_shortlist(RunDirectory(run), cfg.shortlist.model_copy(update={"top": 3, "frequent": 0}))
    sources = read_lines(config.data.test + ".src.gz")[:100]
    ck = [run / "checkpoints" / "checkpoint_last.pt"]
    plain = translate_texts(open_engine(cfg, [], ck, "cpu", engine="ctranslate2"), sources)
    listed = translate_texts(open_engine(cfg, [], ck, "cpu", engine="ctranslate2", shortlist=True), sources)
    assert listed == plain
    # A shortlist that leaves out the words the sentences need changes the output: the map is used.
    (run / SHORTLIST_FILE).write_text("\t▁wa\n")
    digest_file(run / SHORTLIST_FILE).unlink()  # an edited map: without its digest (else refused as changed)
    narrow = translate_texts(open_engine(cfg, [], ck, "cpu", engine="ctranslate2", shortlist=True), sources)
    assert sum(a != b for a, b in zip(narrow, plain)) > 50


def test_a_shortlist_of_another_vocabulary_or_none_at_all_is_a_one_line_error(reverse_model, tmp_path):
    config, _ = reverse_model
    run = shutil.copytree(config.run_path, tmp_path / "run")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({**config.model_dump(mode="json"), "run_dir": str(run)}))
    src = tmp_path / "in.txt"
    src.write_text("wa wb wc\n")
    missing = tfm_in_process("translate", "--config", cfg, "-i", src, "--set", "decode.shortlist=true")
    assert missing.exit_code == 2 and "has no lexical shortlist: make one with `tfm shortlist" in missing.stderr
    (run / SHORTLIST_FILE).write_text("▁wa\t▁wa ▁Zebra\n")
    foreign = tfm_in_process("translate", "--config", cfg, "-i", src, "--set", "decode.shortlist=true")
    assert foreign.exit_code == 2 and "line 1: '▁Zebra' is not a piece of this model's target vocabulary" in foreign.stderr
    made = tfm_in_process("shortlist", "--config", cfg)
    assert made.exit_code == 0 and "shortlist of" in made.stdout
    ok = tfm_in_process("translate", "--config", cfg, "-i", src, "--set", "decode.shortlist=true")
    assert ok.exit_code == 0, ok.stderr


def test_export_ships_the_shortlist_and_int8_weights(reverse_model, tmp_path):
    config, _ = reverse_model
    run = shutil.copytree(config.run_path, tmp_path / "run")
    build_shortlist(RunDirectory(run), config.shortlist)
    ck = run / "checkpoints" / "checkpoint_last.pt"
    for quantization in ("float32", "int8"):
        result = tfm_in_process("export", "--checkpoint", ck, "-o", tmp_path / quantization, "--quantization", quantization)
        assert result.exit_code == 0, result.stderr
        assert (tmp_path / quantization / "vmap.txt").read_bytes() == (run / SHORTLIST_FILE).read_bytes()
    sizes = {q: (tmp_path / q / "model.bin").stat().st_size for q in ("float32", "int8")}
    assert sizes["int8"] < 0.5 * sizes["float32"]  # (layer norms and biases stay float32: a large share here)
    src = tmp_path / "in.txt"
    src.write_text("wa wb wc\nwd we\n")
    out = tfm_in_process("translate", "--model", tmp_path / "int8", "-i", src, "--set", "decode.shortlist=true")
    assert out.exit_code == 0 and len(out.stdout.splitlines()) == 2, out.stderr


SHORTLIST_DAMAGES = {  # what is done to a good shortlist → what the one-line error says
    "empty": (lambda p: p.write_bytes(b""), "empty (a lexical shortlist"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "truncated or changed"),
    "a line changed": (lambda p: p.write_text(p.read_text().replace("\t", "\t▁wa ", 1)), "truncated or changed"),
    "a directory": (lambda p: (p.unlink(), p.mkdir()), "not a file"),
    "not UTF-8": (lambda p: (p.write_bytes(b"\xff\xfe\t\xff\n"), digest_file(p).unlink()), "not UTF-8 text"),
    "no tab": (lambda p: (p.write_text("\n"), digest_file(p).unlink()), "line 1: not '<source piece><TAB>"),
    "emptied, digest gone": (lambda p: (p.write_bytes(b""), digest_file(p).unlink()), "empty (a lexical shortlist"),
}


@pytest.mark.parametrize("damage", SHORTLIST_DAMAGES)
def test_every_shortlist_damage_is_one_line_and_exit_2_before_ctranslate2_sees_it(reverse_model, tmp_path, damage):
    """CTranslate2 dies by SIGSEGV on an empty vocabulary map: the run's shortlist and an exported
    model's vmap.txt, however damaged, are refused first, with or without decode.shortlist."""
    config, _ = reverse_model
    run = shutil.copytree(config.run_path, tmp_path / "run")
    build_shortlist(RunDirectory(run), config.shortlist)
    export = tmp_path / "export"
    assert tfm_in_process("export", "--checkpoint", run / "checkpoints" / "checkpoint_last.pt", "-o", export).exit_code == 0
    assert digest_file(export / "vmap.txt").read_text().split()[0] == digest_file(run / SHORTLIST_FILE).read_text().split()[0]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({**config.model_dump(mode="json"), "run_dir": str(run)}))
    src = tmp_path / "in.txt"
    src.write_text("wa wb wc\n")
    damage_it, says = SHORTLIST_DAMAGES[damage]
    damage_it(run / SHORTLIST_FILE)
    damage_it(export / "vmap.txt")
    for shortlist in ("true", "false"):
        for args in (["--config", cfg, "--engine", "ctranslate2"], ["--model", export]):
            result = tfm_in_process("translate", *args, "-i", src, "--set", f"decode.shortlist={shortlist}")
            assert result.exit_code == 2 and says in result.stderr, (args, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    again = tfm_in_process("export", "--checkpoint", run / "checkpoints" / "checkpoint_last.pt", "-o", tmp_path / "again")
    assert again.exit_code == 2 and says in again.stderr and not (tmp_path / "again").exists()


def test_an_empty_vmap_is_refused_by_a_real_process_not_a_sigsegv(reverse_model, tmp_path):
    config, _ = reverse_model
    export = tmp_path / "export"
    assert tfm_in_process("export", "--checkpoint", reverse_model[1].best_checkpoint, "-o", export).exit_code == 0
    (export / "vmap.txt").write_bytes(b"")
    result = tfm("translate", "--model", export, input="wa wb\n")
    assert result.returncode == 2 and result.stderr.strip().endswith("vmap.txt: empty (a lexical shortlist: make it "
                                                                    "again with `tfm shortlist`)"), result.stderr


# --------------------------------------------------------------------------- student configs


def test_the_student_config_is_a_deep_encoder_shallow_decoder_on_the_teachers_vocabulary():
    student, teacher = load_config(ROOT / "configs/student-tiny.yaml"), load_config(ROOT / "configs/de-en.yaml")
    assert student.vocab.from_run == teacher.run_dir
    assert student.data.train == [f"{teacher.run_dir}/distilled/train", *teacher.data.train]  # the originals beside
    # its shape and peak learning rate are the teacher's student's (model.size student, read in tfm train)
    assert student.model.size == "student" and "lr" not in student.train.model_fields_set
    assert (student.data.valid, student.data.test) == (teacher.data.valid, teacher.data.test)
    assert student.decode.beam == 1


@pytest.mark.slow  # real processes
def test_the_distill_command_translates_a_run_with_its_defaults(teacher, tmp_path):
    result = subprocess.run([*TFM, "distill", "--config", str(teacher), "--set", f"distill.output={tmp_path / 'd'}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "d" / REPORT).read_text())
    assert report["lines"] == 2000 and "CTranslate2" in report["engine"] and report["sentences_per_second"] > 0
    assert "distilled 2000 lines" in result.stdout


def test_distill_refuses_its_own_run_directory_as_the_output(teacher, tmp_path):
    cfg = load_config(teacher)
    cfg = config_with(teacher, tmp_path, f"distill.output={cfg.run_dir}")
    with pytest.raises(TfmError, match="a directory of its own"):
        distill(cfg, opener(cfg))



def test_a_second_distillation_into_the_same_directory_is_refused_while_one_runs(teacher, tmp_path):
    from transformer_cli.experiment.runlock import RunLock

    cfg = config_with(teacher, tmp_path)
    (tmp_path / "distilled").mkdir()
    with RunLock(tmp_path / "distilled", "tfm distill"):
        with pytest.raises(TfmError, match="is in use by"):
            distill(cfg, opener(cfg))
    assert not (tmp_path / "distilled" / PARTIAL).exists()


@pytest.mark.slow
def test_the_benchmarks_print_their_targets(teacher, tmp_path):
    """scripts/bench_distill.py and bench_student_shapes.py on the tiny run: every row and ratio."""
    ck = RunDirectory(load_config(teacher).run_path).default_checkpoint()
    src = tmp_path / "src.txt"
    src.write_text("wa wb wc\nwd we wf wg\n" * 20)
    ref = tmp_path / "ref.txt"
    ref.write_text("wc wb wa\nwg wf we wd\n" * 20)
    run = subprocess.run([sys.executable, str(ROOT / "scripts/bench_distill.py"), "--teacher", str(ck), "--student",
                          str(ck), "--baseline", str(ck), "--src", str(src), "--ref", str(ref), "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    # The same checkpoint as student and baseline (both int8, both greedy): no gain; as teacher, beam 5 in float32.
    assert re.search(r"student keeps \d+\.\d% of the teacher's BLEU", run.stdout), run.stdout
    assert "distillation gain: +0.00 BLEU" in run.stdout
    assert run.stdout.count("speed-up") == 2 and "size: student int8" in run.stdout
    # The shipped pairing names the student as it ships: with its shortlist where its run has one (this one has none).
    assert run.stdout.count("shipped settings (student): ") == 2, run.stdout
    shapes = subprocess.run([sys.executable, str(ROOT / "scripts/bench_student_shapes.py"), "--run",
                             str(load_config(teacher).run_path), "--src", str(src), "--lines", "40"],
                            capture_output=True, text=True, timeout=600)
    assert shapes.returncode == 0, shapes.stderr[-2000:]
    assert len([line for line in shapes.stdout.splitlines() if line.startswith(("teacher", "d"))]) == 6
