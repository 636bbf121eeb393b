"""`tfm export --format huggingface`: tiny models of every exportable kind (post-norm → Marian,
pre-norm → Pegasus; joint and separate vocabularies; a multilingual model) are written, loaded by
transformers without remote code, and must generate exactly tfm's greedy output; the model card's
YAML parses; bad inputs are one-line errors that leave nothing behind."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import TINY_LAYOUTS, fp32_translator, tfm_in_process
from transformer_cli.decoding.translation import translate_texts
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.interop.huggingface import (
    architecture_problems,
    build_transformers_model,
    split_order,
    transformers_state,
)
from transformer_cli.model.transformer import Transformer, TransformerConfig


def transformers():
    """transformers, imported by the first test that needs it (its import takes seconds: not at collection).
    TFM_TRANSFORMERS=4 (CI's second pass, transformers 4 in a side folder): fails on any other major version."""
    import os

    module = pytest.importorskip("transformers", reason="transformers is in the test extra (pip install -e '.[test]')")
    wanted = os.environ.get("TFM_TRANSFORMERS")
    assert not wanted or module.__version__.split(".")[0] == wanted, \
        f"TFM_TRANSFORMERS={wanted}, but transformers {module.__version__} was imported (from {module.__file__})"
    return module


def checkpoint_of(config: Path) -> Path:
    from transformer_cli.experiment.config import load_config
    from transformer_cli.experiment.rundir import RunDirectory

    return RunDirectory(load_config(config).run_path).default_checkpoint()


def greedy_through_transformers(directory: Path, lines: list[str], a: float, b: int) -> list[str]:
    """transformers' greedy translations, each line with tfm's own output limit (a · its tokens + b,
    </s> included): one `generate` call per line, as generate has one limit per call."""
    from transformer_cli.model.lengths import output_length_limit

    tokenizer = transformers().AutoTokenizer.from_pretrained(str(directory))
    model = transformers().AutoModelForSeq2SeqLM.from_pretrained(str(directory), trust_remote_code=False).eval()
    found = []
    for line in lines:
        batch = tokenizer([line], return_tensors="pt")
        limit = output_length_limit(batch["input_ids"].shape[1], a, b, model.config.max_position_embeddings)
        with torch.no_grad():
            out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=limit)
        found.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return found


def test_the_permutation_gives_transformers_an_equal_network_for_every_shape():
    """No training: random weights of both norm positions, interleaved and split sinusoids, odd
    head counts. transformers' logits equal tfm's (the export's own check, here on every layout)."""
    from transformer_cli.experiment.config import config_from_dict as from_dict

    torch.manual_seed(0)
    for norm in ("pre", "post"):
        for positional in ("sinusoidal", "sinusoidal_split"):
            cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=24, n_heads=3, enc_layers=2,
                                    dec_layers=1, d_ff=40, dropout=0.0, norm_position=norm, positional=positional,
                                    max_positions=64, output_bias=norm == "post")
            model = Transformer(cfg).eval()
            with torch.no_grad():
                for p in model.parameters():  # LayerNorms and biases away from their 1/0 starts
                    p.add_(torch.randn_like(p) * 0.1)
            config = from_dict({"data": {"src_lang": "de", "tgt_lang": "en"}})
            hf = build_transformers_model(cfg, config, transformers_state(model))
            src = torch.tensor([[5, 9, 17, 3], [6, 3, 0, 0]])
            tgt = torch.tensor([[2, 7, 8], [2, 11, 0]])
            with torch.no_grad():
                ours = model(src, tgt)
                theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
            assert torch.allclose(ours, theirs, atol=1e-4), (norm, positional, float((ours - theirs).abs().max()))
            order = split_order(cfg)
            assert sorted(order.tolist()) == list(range(24)) and (order[:12] % 2 == 0).all() == (positional == "sinusoidal")


def test_models_no_shipped_architecture_computes_are_named_with_the_reason():
    shared = dict(src_vocab_size=50, tgt_vocab_size=50, d_model=24, n_heads=3)
    assert architecture_problems(TransformerConfig(**shared, norm_position="pre")) == []
    learned = architecture_problems(TransformerConfig(**shared, positional="learned"))
    assert learned and "learned" in learned[0]
    separate = architecture_problems(TransformerConfig(**{**shared, "tgt_vocab_size": 60}, norm_position="pre",
                                                       share_embeddings=False, tie_output=True))
    assert separate and "Pegasus" in separate[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(TINY_LAYOUTS))
def test_an_export_generates_exactly_tfms_greedy_output(layout, layout_runs, tmp_path):
    config = layout_runs(layout)
    checkpoint = checkpoint_of(config)
    out = tmp_path / "hf"
    done = tfm_in_process("export", "--config", config, "--format", "huggingface", "-o", out)
    assert done.exit_code == 0, done.stderr
    architecture = "MarianMTModel" if "post" in layout else "PegasusForConditionalGeneration"
    assert architecture in done.stdout
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == [architecture] and "auto_map" not in saved  # no custom code
    lines = gzip.decompress((config.parent / "data" / "test.src.gz").read_bytes()).decode().splitlines()[:40]
    ours = translate_texts(fp32_translator(checkpoint, beam=1), lines)
    assert greedy_through_transformers(out, lines, 1.0, 5) == ours  # (decode.max_len_a/b of the task's config)
    assert sum(o.lower().split() == list(reversed(s.split())) for o, s in zip(ours, lines)) >= 5  # it learned


@pytest.mark.slow
def test_the_model_card_parses_and_names_the_test_scores(layout_runs, tmp_path):
    config = layout_runs("pre-norm, joint")
    out = tmp_path / "card"
    assert tfm_in_process("export", "--config", config, "--format", "huggingface", "-o", out).exit_code == 0
    text = (out / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["tags"] == ["translation", "tfm"] and front["language"] == ["src", "tgt"]
    assert front["metrics"] == ["bleu", "chrf"] and front["pipeline_tag"] == "translation"
    score = json.loads(next((config.parent / "run" / "eval").glob("test.*.json")).read_text())["scores"]["bleu"]
    metric = front["model-index"][0]["results"][0]["metrics"][0]
    assert metric["value"] == round(score["score"], 2) and metric["args"] == score["signature"]
    assert "pairs and kept" in text and "PegasusForConditionalGeneration" in text
    from transformer_cli.runtime.devices import describe_machine
    assert f"Trained on: {describe_machine(torch.device('cpu'))}." in text


@pytest.mark.slow
def test_bad_exports_are_one_line_and_leave_nothing(layout_runs, tmp_path):
    config = layout_runs("post-norm, joint")
    checkpoint = checkpoint_of(config)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine\n")
    unscored = tmp_path / "unscored.pt"
    unscored.write_bytes(checkpoint.read_bytes())  # outside its run: no test score
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    positions = payload["model_config"]["max_positions"], payload["model_config"]["d_model"]
    payload["model_config"]["positional"] = payload["config"]["model"]["positional"] = "learned"
    payload["model"].update({f"{side}_pos.table": torch.randn(*positions) for side in ("src", "tgt")})
    torch.save(payload, tmp_path / "learned.pt")  # a model no shipped architecture computes
    cases = [
        (["--checkpoint", checkpoint, "-o", taken], "holds files tfm did not write there"),
        (["--checkpoint", unscored, "-o", tmp_path / "a"], "no test score"),
        (["--checkpoint", tmp_path / "learned.pt", "-o", tmp_path / "f"], "model.positional: learned (Marian and"),
        (["--checkpoint", checkpoint, "--config", config, "-o", tmp_path / "b"], "not both"),
        (["-o", tmp_path / "c"], "give --checkpoint, or --config"),
        (["--checkpoint", checkpoint, "-o", tmp_path / "d", "--quantization", "int8"], "only --format ctranslate2"),
    ]
    for args, message in cases:
        result = tfm_in_process("export", "--format", "huggingface", *args)
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1, \
            (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learned.pt", "taken", "unscored.pt"]
    assert (taken / "notes.txt").read_text() == "mine\n"
    first = tfm_in_process("export", "--format", "huggingface", "--checkpoint", checkpoint, "-o", tmp_path / "e")
    assert first.exit_code == 0
    again = tfm_in_process("export", "--format", "huggingface", "--checkpoint", checkpoint, "-o", tmp_path / "e")
    assert again.exit_code == 2 and "--force" in again.stderr
    forced = tfm_in_process("export", "--format", "huggingface", "--checkpoint", checkpoint, "-o", tmp_path / "e",
                            "--force")
    assert forced.exit_code == 0 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    downloaded = tmp_path / "e"  # the same file names, but a config.json tfm did not write (a Hub download)
    hub_config = json.loads((downloaded / "config.json").read_text())
    del hub_config["tfm"]
    (downloaded / "config.json").write_text(json.dumps(hub_config))
    kept = tfm_in_process("export", "--format", "huggingface", "--checkpoint", checkpoint, "-o", downloaded, "--force")
    assert kept.exit_code == 2 and "tfm did not write there" in kept.stderr
    assert json.loads((downloaded / "config.json").read_text()) == hub_config


@pytest.mark.slow
def test_a_multilingual_export_takes_the_target_language_tag_as_tfm_does(shift_model, tmp_path):
    data, shared_config = shift_model
    shutil.copytree(json.loads(shared_config.read_text())["run_dir"], tmp_path / "run")  # evaluate writes its scores
    raw = {**json.loads(shared_config.read_text()), "run_dir": str(tmp_path / "run")}
    raw["decode"]["engine"] = "torch"
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    assert tfm_in_process("evaluate", "--config", tmp_path / "c.yaml", "--split", "test").exit_code == 0
    out = tmp_path / "hf"
    done = tfm_in_process("export", "--config", tmp_path / "c.yaml", "--format", "huggingface", "-o", out)
    assert done.exit_code == 0, done.stderr
    # The card reports each direction's own score (not their average as the first's) and its use the tags.
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    scored = json.loads(next((tmp_path / "run" / "eval").glob("test.*.directions.json")).read_text())["directions"]
    results = front["model-index"][0]["results"]
    assert {r["task"]["name"]: r["metrics"][0]["value"] for r in results} == \
        {f"Translation {name}": round(r["scores"]["bleu"]["score"], 2) for name, r in scored.items()}
    assert "multilingual" in front["tags"] and set(front["language"]) >= {"up", "dn"}
    assert 'tokenizer([">>' in card and "`>>up<<`" in card and "--tgt-lang" in card
    sources = gzip.decompress((data / "test.src.gz").read_bytes()).decode().splitlines()[:30]
    checkpoint = checkpoint_of(tmp_path / "c.yaml")
    for language in ("up", "dn"):
        tagged = [f">>{language}<< {line}" for line in sources]
        ours = translate_texts(fp32_translator(checkpoint, beam=1), tagged)
        assert greedy_through_transformers(out, tagged, 1.0, 5) == ours, language


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(TINY_LAYOUTS))
def test_tfm_import_gives_back_the_exported_model_weight_for_weight(layout, layout_runs, tmp_path):
    from transformer_cli.experiment.checkpoint import load_trained_model

    config = layout_runs(layout)
    checkpoint = checkpoint_of(config)
    assert tfm_in_process("export", "--checkpoint", checkpoint, "--format", "huggingface",
                          "-o", tmp_path / "hf").exit_code == 0
    imported = tfm_in_process("import", "--format", "marian", tmp_path / "hf", "-o", tmp_path / "back")
    assert imported.exit_code == 0, imported.stderr
    original = load_trained_model(checkpoint)
    back = load_trained_model(tmp_path / "back" / "checkpoints" / "checkpoint_best.pt")
    assert back.model.cfg == original.model.cfg
    ours, theirs = original.model.state_dict(), back.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    lines = gzip.decompress((config.parent / "data" / "test.src.gz").read_bytes()).decode().splitlines()[:20]
    assert translate_texts(fp32_translator(checkpoint, beam=1), lines) == \
        translate_texts(fp32_translator(tmp_path / "back" / "checkpoints" / "checkpoint_best.pt", beam=1), lines)


@pytest.mark.slow
def test_the_model_card_uses_only_scores_of_the_exported_weights_and_names_the_set_they_were_measured_on(
        layout_runs, tmp_path):
    """A card reported the test score of an earlier checkpoint_best.pt after training went on (score
    files matched by name only), and named the config's test set after `evaluate --set data.test=…`."""
    import shutil

    source = layout_runs("pre-norm, joint")
    root = tmp_path / "copy"
    shutil.copytree(source.parent, root)
    config = root / source.name
    config.write_text(config.read_text().replace(str(source.parent), str(root)))
    checkpoint = checkpoint_of(config)
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    payload["model"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in payload["model"].items()}
    torch.save(payload, checkpoint)  # "training went on": the same name, other weights
    refused = tfm_in_process("export", "--config", config, "--format", "huggingface", "-o", tmp_path / "a")
    assert refused.exit_code == 2 and "no test score of these weights" in refused.stderr and "other weights" in \
        refused.stderr and len(refused.stderr.splitlines()) == 1, refused.stderr
    other = root / "data" / "other"
    for side in ("src", "tgt"):
        shutil.copy(root / "data" / f"test.{side}.gz", other.with_name(f"other.{side}.gz"))
    scored = tfm_in_process("evaluate", "--config", config, "--split", "test", "--checkpoint", checkpoint,
                            "--set", f"data.test={other}")
    assert scored.exit_code == 0, scored.stderr
    assert tfm_in_process("export", "--config", config, "--format", "huggingface", "-o", tmp_path / "b").exit_code == 0
    card = (tmp_path / "b" / "README.md").read_text()
    assert "## Test scores (other, sacreBLEU)" in card and "name: other" in card


def test_the_model_card_reads_a_torn_record_as_one_line_and_a_budget_of_steps_as_such(tmp_path):
    """An `auto` run trained without train.max_time: a TypeError in the card; a torn prepare_report.json
    or shape_choice.json, or one with a key of the wrong type: JSONDecodeError / AttributeError."""
    from transformer_cli.interop import model_card
    from transformer_cli.runtime.errors import TfmError

    (tmp_path / "shape_choice.json").write_text(json.dumps({"chosen": "d128", "budget_seconds": None,
                                                             "max_steps": 4000}))
    assert "for 4,000 updates on that machine: d128." in " ".join(model_card._training({"step": 10}, RunDirectory(tmp_path)))
    for name, text in (("shape_choice.json", '{"chosen": "d1'), ("shape_choice.json", '{"chosen": "d128", "shapes": 5}'),
                       ("prepare_report.json", "[1, 2]"), ("prepare_report.json", ""),
                       ("prepare_report.json", '{"pairs_read": 10, "dropped": {"x": "many"}}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(TfmError, match=name) as caught:
            model_card._training({}, RunDirectory(tmp_path)) if name == "shape_choice.json" else model_card._cleaning(RunDirectory(tmp_path))
        assert "\n" not in str(caught.value)
    (tmp_path / "prepare_report.json").write_text(json.dumps({"pairs_read": 10, "pairs_kept": 9, "dropped": {"x": 1}}))
    assert model_card._cleaning(RunDirectory(tmp_path)) == ["`tfm prepare` read 10 training pairs and kept 9; dropped: x 1."]


@pytest.mark.slow
def test_the_export_on_a_full_disk_is_one_line_and_leaves_the_previous_export_whole(layout_runs, tmp_path):
    """safetensors' traceback on a full disk (a file-size limit here), where the CTranslate2 export
    and `average` say it in one line."""
    import resource
    import subprocess
    import sys

    from tests.warm_processes import preexec

    config = layout_runs("pre-norm, joint")
    out = tmp_path / "hf"
    assert tfm_in_process("export", "--config", config, "--format", "huggingface", "-o", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    full = subprocess.run([sys.executable, "-m", "transformer_cli", "export", "--config", str(config), "--format",
                           "huggingface", "-o", str(out), "--force"], capture_output=True, text=True,
                          preexec_fn=preexec(limits=((resource.RLIMIT_FSIZE, 50_000),)))
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-2000:]
    assert len(full.stderr.strip().splitlines()) == 1 and str(out) in full.stderr, full.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_multilingual_card_reports_each_directions_own_scores_and_refuses_an_average():
    """A de-en + en-de model's card said "de→en" with the two directions' average as its BLEU: a
    score file without one score per direction is refused, one with them gives each its own."""
    from transformer_cli.experiment.config import load_config
    from transformer_cli.interop.model_card import by_direction
    from transformer_cli.runtime.errors import TfmError

    scores = {"bleu": {"score": 30.0, "signature": "s"}}
    multilingual = load_config(Path("configs/multi30k-multilingual.yaml"))
    with pytest.raises(TfmError, match="not one score per direction"):
        by_direction(multilingual, {"file": "scores.json", "scores": scores})
    with pytest.raises(TfmError, match="not one score per direction"):
        by_direction(multilingual, {"scores": scores, "directions": {"de-en": {"scores": {}}}})
    per = by_direction(multilingual, {"scores": scores, "directions": {
        "de-en": {"scores": {"bleu": {"score": 31.0, "signature": "s"}}},
        "fr-de": {"zero_shot": True, "scores": {"bleu": {"score": 5.0, "signature": "s"}}}}})
    assert {name: s["bleu"]["score"] for name, s in per.items()} == {"de-en": 31.0, "fr-de (zero-shot)": 5.0}
    bilingual = load_config(Path("configs/de-en.yaml"))
    assert by_direction(bilingual, {"scores": scores}) == {"de-en": scores}
