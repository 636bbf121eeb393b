import json

import pytest
import sacrebleu

from tests.conftest import tfm_in_process
from transformer_cli.evaluate import score
from transformer_cli.runtime.files import read_lines


@pytest.fixture(scope="module")
def pair(multi30k_2k, tmp_path_factory):
    """A real reference (Multi30k val) and a degraded hypothesis (every 3rd sentence truncated)."""
    folder = tmp_path_factory.mktemp("eval")
    refs = read_lines(multi30k_2k / "val.en.gz")[:300]
    hyps = [" ".join(r.split()[: len(r.split()) // 2]) if i % 3 == 0 else r for i, r in enumerate(refs)]
    (folder / "ref.txt").write_text("\n".join(refs) + "\n")
    (folder / "hyp.txt").write_text("\n".join(hyps) + "\n")
    (folder / "short.txt").write_text("\n".join(hyps[:-1]) + "\n")
    return folder, hyps, refs


def test_scores_equal_sacrebleu(pair):
    _, hyps, refs = pair
    result = score(hyps, refs, ["bleu", "chrf", "ter"])
    assert result.scores["bleu"].score == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert result.scores["chrf"].score == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert result.scores["ter"].score == sacrebleu.corpus_ter(hyps, [refs]).score
    assert result.scores["bleu"].signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a")


@pytest.mark.slow
def test_cli_json_and_gate(pair):
    folder, hyps, refs = pair
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    args = ["evaluate", "--hyp", folder / "hyp.txt", "--ref", folder / "ref.txt"]
    proc = tfm_in_process(*args, "--json", "--metrics", "bleu,chrf,ter")
    assert proc.exit_code == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["scores"]["bleu"]["score"] == pytest.approx(expected)
    assert set(data["scores"]) == {"bleu", "chrf", "ter"}

    below = tfm_in_process(*args, "--min-bleu", str(expected + 1))
    assert below.exit_code == 1 and "below --min-bleu" in below.stderr
    above = tfm_in_process(*args, "--min-bleu", str(expected - 1))
    assert above.exit_code == 0 and "BLEU = " in above.stdout and "PASS" in above.stderr


def test_cli_line_count_mismatch(pair):
    folder, _, _ = pair
    proc = tfm_in_process("evaluate", "--hyp", folder / "short.txt", "--ref", folder / "ref.txt")
    assert proc.exit_code == 2
    assert "short.txt has 299 lines" in proc.stderr and "ref.txt has 300" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_confidence_and_paired_comparison(pair):
    folder, hyps, refs = pair
    result = score(hyps, refs, ["bleu"], confidence=True)
    assert result.scores["bleu"].ci is not None and result.scores["bleu"].ci > 0
    proc = tfm_in_process("evaluate", "--hyp", folder / "ref.txt", "--hyp", folder / "hyp.txt",
                          "--ref", folder / "ref.txt", "--metrics", "bleu")
    assert proc.exit_code == 0, proc.stderr
    assert "p = " in proc.stdout


def test_evaluate_model_on_a_split(reverse_model):
    config, summary = reverse_model
    from transformer_cli.evaluate import evaluate_model

    result = evaluate_model(config.model_copy(update={"decode": config.decode.updated(beam=2)}), summary.best_checkpoint,
                            "test", ["bleu"])
    assert result.scores["bleu"].score >= 90
    saved = json.loads(
        (config.run_path / "eval" / f"test.{summary.best_checkpoint.stem}.beam2.json").read_text())
    assert saved["scores"]["bleu"]["score"] == result.scores["bleu"].score


def test_evaluate_config_decodes_exactly_as_translate_config(reverse_model, tmp_path):
    """Both take the same chunks and batches, so even bf16 (whose results depend on batch
    composition) gives the same translations; evaluate once translated a split in one piece."""
    config, _ = reverse_model
    raw = json.loads(json.dumps(config.model_dump(mode="json")))
    raw["decode"].update(precision="bf16", batch_size=16, workers=1)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw))
    source = "\n".join(read_lines(f"{config.data.test}.src.gz")) + "\n"
    translated = tfm_in_process("translate", "--config", path, "--beam", "3", input=source)
    assert translated.exit_code == 0, translated.stderr
    evaluated = tfm_in_process("evaluate", "--config", path, "--split", "test", "--beam", "3", "--json")
    assert evaluated.exit_code == 0, evaluated.stderr
    hyp_file = json.loads(evaluated.stdout)["hyp_file"]
    assert open(hyp_file, encoding="utf-8").read() == translated.stdout


def test_the_training_overrides_repeated_to_translate_and_evaluate_are_accepted(reverse_model, tmp_path):
    """The same `--set` options for every command (as scripts/quickstart.sh passes them): model.*
    values that the run was trained with change nothing and are accepted; a different one is refused,
    naming the trained value."""
    config, _ = reverse_model
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    trained = config.model
    same = ["--set", f"model.d_model={trained.d_model}", "--set", f"model.dropout={trained.dropout}",
            "--set", "train.lr_schedule=inverse_sqrt"]
    source = "\n".join(read_lines(f"{config.data.test}.src.gz")[:20]) + "\n"
    plain = tfm_in_process("translate", "--config", path, "--beam", "2", input=source)
    repeated = tfm_in_process("translate", "--config", path, "--beam", "2", *same, input=source)
    assert plain.exit_code == 0 and repeated.exit_code == 0, repeated.stderr
    assert repeated.stdout == plain.stdout and len(plain.stdout.splitlines()) == 20
    evaluated = tfm_in_process("evaluate", "--config", path, "--split", "test", "--beam", "2", *same)
    assert evaluated.exit_code == 0, evaluated.stderr
    other = tfm_in_process("translate", "--config", path, "--set", f"model.d_model={2 * trained.d_model}",
                           input=source)
    assert other.exit_code == 2
    assert f"--set model.d_model: the model was trained with model.d_model={trained.d_model};" in other.stderr


def test_a_config_whose_vocabulary_changed_since_training_is_flagged(reverse_model, tmp_path):
    """`tfm evaluate/translate --config` on a run prepared and trained with other vocab settings
    (a config pulled after training): the run's model still translates, and the user is told,
    naming the key and both values. The same config unchanged says nothing."""
    import yaml

    config, _ = reverse_model
    size = config.vocab.size
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump({**config.model_dump(mode="json"), "vocab": {**config.vocab.model_dump(), "size": size + 7}}))
    src = tmp_path / "src.txt"
    src.write_text("a b c\n")
    changed = tfm_in_process("translate", "--config", path, "-i", src, "--set", "decode.engine=torch")
    assert changed.exit_code == 0, changed.stderr
    assert f"warning: key 'vocab.size': {size + 7} in the config, but {config.run_dir} was prepared with {size}" \
        in changed.stderr
    assert changed.stdout.strip()  # translated all the same
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    same = tfm_in_process("translate", "--config", path, "-i", src, "--set", "decode.engine=torch")
    assert same.exit_code == 0 and "warning" not in same.stderr, same.stderr
    # The hint reads prepare.json, which translating never needed: an unreadable one changes nothing.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(config.run_path, copy)
    (copy / "prepare.json").write_text("{broken")
    broken = tfm_in_process("translate", "--config", path, "--set", f"run_dir={copy}", "-i", src,
                            "--set", "decode.engine=torch")
    assert broken.exit_code == 0 and broken.stdout == same.stdout, broken.stderr
