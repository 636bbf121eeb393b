"""`tfm import --format marian`: a Hugging Face MarianMTModel that no one in the project wrote,
built here by transformers itself (random weights, its own sentencepiece models and id map),
saved with save_pretrained, imported, and compared with transformers' own forward and generate.
Nothing is downloaded."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import sentencepiece as spm
import torch

from tests.conftest import multi30k_config, tfm_in_process
from transformer_cli.data.prepare import prepare
from transformer_cli.decoding.torch_engine import decode_in_batches
from transformer_cli.experiment.checkpoint import load_trained_model
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.interop.marian import import_marian, tfm_order
from transformer_cli.model.special_tokens import BOS_ID, EOS_ID, PAD_ID
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train

SENTENCES = 60

if TYPE_CHECKING:
    from transformers import MarianMTModel, MarianTokenizer


def read_gz(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def unigram_model(lines: list[str], size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=size,
                                   model_type="unigram", minloglevel=2)
    return model.getvalue()


def save_hf_marian(folder: Path, de: list[str], en: list[str]) -> tuple[MarianMTModel, MarianTokenizer]:
    """What an OPUS-MT model directory holds: source.spm, target.spm, one vocab.json over both
    (</s>=0, <unk>=1, …, <pad> last), config.json and model.safetensors."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer  # here: its import takes seconds
    folder.mkdir(parents=True)
    models = {"source.spm": unigram_model(de, 300), "target.spm": unigram_model(en, 250)}
    vocab = {"</s>": 0, "<unk>": 1}
    for name, data in models.items():
        (folder / name).write_bytes(data)
        sp = spm.SentencePieceProcessor(model_proto=data)
        for i in range(sp.vocab_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab[">>fra<<"] = len(vocab)  # a target-language token, as multi-target OPUS-MT models have
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = MarianTokenizer(source_spm=str(folder / "source.spm"), target_spm=str(folder / "target.spm"),
                                vocab=str(folder / "vocab.json"), source_lang="de", target_lang="en")
    size = len(vocab)
    config = MarianConfig(vocab_size=size, decoder_vocab_size=size, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=size - 1, eos_token_id=0,
                          decoder_start_token_id=size - 1, forced_eos_token_id=None, bad_words_ids=[[size - 1]],
                          activation_function="swish", scale_embedding=True, dropout=0.1)
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # weights large enough that outputs differ by input and the bias matters
        for name, p in model.named_parameters():
            if "embed_positions" not in name and "layer_norm" not in name:
                p.normal_(0.0, 1.0 if "shared" in name else 0.3)
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] += 3.0  # </s> now and then
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module")
def marian(multi30k_2k, tmp_path_factory):
    root = tmp_path_factory.mktemp("marian")
    de, en = read_gz(multi30k_2k / "train.de.gz", 2000), read_gz(multi30k_2k / "train.en.gz", 2000)
    hf_model, tokenizer = save_hf_marian(root / "hf", de, en)
    result = import_marian(root / "hf", root / "run")
    trained = load_trained_model(root / "run/checkpoints/checkpoint_best.pt")
    return hf_model, tokenizer, trained, result, root, de[:SENTENCES], en[:SENTENCES]


def marian_to_tfm(marian) -> dict[int, int]:
    """Marian id → tfm id (the decoder-start <pad> is tfm's <pad>; tfm's <s> is its copy)."""
    hf_model, root = marian[0], marian[4]
    order = tfm_order(json.loads((root / "hf/vocab.json").read_text()), hf_model.config.to_dict())
    return {m: t for t, m in enumerate(order) if t != BOS_ID}


def test_tfm_segments_text_into_the_same_ids_as_marians_tokenizer(marian):
    hf_model, tokenizer, trained, _, _, de, _ = marian
    to_tfm = marian_to_tfm(marian)
    for line in de + [">>fra<< " + de[0]]:
        theirs = [to_tfm[i] for i in tokenizer(line)["input_ids"]]  # ends with </s>
        assert trained.src_sp.encode(line) + [EOS_ID] == theirs, line


def test_per_token_log_probabilities_equal_transformers_on_a_padded_batch(marian):
    hf_model, tokenizer, trained, _, _, de, en = marian
    to_tfm = marian_to_tfm(marian)
    batch = tokenizer(de[:8], text_target=en[:8], padding=True, return_tensors="pt")
    labels = batch["labels"]  # padded with <pad>
    pad = hf_model.config.pad_token_id
    start = torch.full((labels.size(0), 1), hf_model.config.decoder_start_token_id)
    with torch.no_grad():
        logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          decoder_input_ids=torch.cat([start, labels[:, :-1]], dim=1)).logits
        logits[..., pad] = float("-inf")  # generate never produces <pad> (bad_words_ids)
        theirs = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(-1)

        def mapped(ids: torch.Tensor) -> torch.Tensor:
            return ids.apply_(lambda i: to_tfm[i])

        src, gold = mapped(batch["input_ids"].clone()), mapped(labels.clone())
        tgt_in = torch.cat([torch.full_like(start, BOS_ID), gold[:, :-1]], dim=1)
        ours = trained.model(src, tgt_in).log_softmax(-1).gather(2, gold[..., None]).squeeze(-1)
    real = labels != pad
    assert real.sum() > 100 and (~real).sum() > 0  # a batch with padding
    assert torch.allclose(ours[real], theirs[real], atol=1e-4), (ours[real] - theirs[real]).abs().max()


def generate(hf_model, tokenizer, lines: list[str], beams: int, max_new_tokens: int) -> list[list[int]]:
    inputs = tokenizer(lines, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, num_beams=beams, do_sample=False, max_new_tokens=max_new_tokens,
                                length_penalty=1.0)
    specials = {hf_model.config.pad_token_id, hf_model.config.eos_token_id}
    return [[int(t) for t in row[1:] if int(t) not in specials] for row in out]


def tfm_decode(trained, lines: list[str], beams: int, max_new_tokens: int) -> list[list[int]]:
    sources = [trained.src_sp.encode(line) for line in lines]
    decode = trained.config.decode.updated(precision="fp32", length_penalty=1.0, beam=beams)
    hyps = decode_in_batches(trained.model, sources, decode, torch.device("cpu"), max_len=max_new_tokens)
    return [[t for t in h[0].tokens if t not in (EOS_ID, PAD_ID)] for h in hyps]


def test_the_model_filter_scores_pairs_with_an_imported_model_as_transformers_does(marian):
    """An imported OPUS-MT run is a source of the model filter (data.filters.model): accepted for its
    languages, and each pair's source gain is the mean of the per-token log-probabilities that
    transformers gives the target (its </s> included) given the source, less that given an empty
    source (</s> alone)."""
    from transformer_cli.data.model_filter import CT2Scorer, ModelFilter, TorchScorer, _side_log_probs, check_model

    hf_model, tokenizer, _, _, root, de, en = marian
    checkpoint = check_model(str(root / "run"), "forward", "de", "en")
    assert checkpoint.name == "checkpoint_best.pt"

    def mean_log_probability(sources: list[str]) -> torch.Tensor:  # (pairs,) of en[:8] given the sources
        batch = tokenizer(sources, text_target=en[:8], padding=True, return_tensors="pt")
        labels, pad = batch["labels"], hf_model.config.pad_token_id
        start = torch.full((labels.size(0), 1), hf_model.config.decoder_start_token_id)
        with torch.no_grad():
            logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              decoder_input_ids=torch.cat([start, labels[:, :-1]], dim=1)).logits
            logits[..., pad] = float("-inf")
            theirs = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(-1)  # (B, T)
        real = labels != pad
        return torch.where(real, theirs, 0.0).sum(1) / real.sum(1)  # <pad>'s log-probability is -inf

    expected = mean_log_probability(de[:8]) - mean_log_probability([""] * 8)
    pieces = [len(tokenizer(text)["input_ids"]) - 1 for text in de[:8]], [len(tokenizer(text_target=text)["input_ids"]) - 1
                                                                         for text in en[:8]]  # less </s>
    by_ct2 = ModelFilter([(checkpoint, None)], 64)
    assert by_ct2.use_engine("ctranslate2").startswith("ctranslate2")  # an imported model converts too
    for scorer in (TorchScorer(checkpoint), CT2Scorer(by_ct2.conversions[checkpoint], "float32")):
        cross, src_pieces, tgt_pieces = _side_log_probs(scorer, de[:8], en[:8], batch_tokens=64)  # several batches
        assert np.allclose(cross, expected.numpy(), atol=1e-4), (type(scorer), cross - expected.numpy())
        assert src_pieces.tolist() == pieces[0] and tgt_pieces.tolist() == pieces[1]


def test_greedy_translations_are_token_for_token_transformers_generate(marian):
    hf_model, tokenizer, trained, _, _, de, _ = marian
    to_tfm = marian_to_tfm(marian)
    theirs = [[to_tfm[t] for t in row] for row in generate(hf_model, tokenizer, de, 1, 40)]
    ours = tfm_decode(trained, de, 1, 40)
    assert len({tuple(row) for row in theirs}) > SENTENCES // 2  # outputs depend on the input
    assert ours == theirs


def test_beam_search_agrees_with_transformers_generate(marian):
    hf_model, tokenizer, trained, _, _, de, _ = marian
    to_tfm = marian_to_tfm(marian)
    theirs = [[to_tfm[t] for t in row] for row in generate(hf_model, tokenizer, de, 4, 40)]
    ours = tfm_decode(trained, de, 4, 40)
    agree = sum(a == b for a, b in zip(ours, theirs))
    assert agree >= 0.9 * len(de), f"{agree} of {len(de)}"


def test_the_imported_run_translates_from_the_command_line_and_fine_tunes(marian, multi30k_2k, tmp_path):
    hf_model, tokenizer, trained, result, root, de, _ = marian
    run = root / "run"
    lines = "\n".join(de[:5]) + "\n"
    proc = tfm_in_process("translate", "--config", run / "config.yaml", "--beam", "1", "--set",
                          "decode.precision=fp32", "--set", "decode.max_len_a=0", "--set", "decode.max_len_b=40",
                          input=lines)
    assert proc.exit_code == 0, proc.stderr
    inputs = tokenizer(de[:5], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=40)
    assert proc.stdout.splitlines() == tokenizer.batch_decode(out, skip_special_tokens=True)
    # ... and exported to CTranslate2, it translates the same
    assert tfm_in_process("export", "--checkpoint", run / "checkpoints/checkpoint_best.pt", "-o",
                          tmp_path / "ct2").exit_code == 0
    ct2 = tfm_in_process("translate", "--engine", "ctranslate2", "--model", tmp_path / "ct2", "--compute-type",
                         "float32", "--beam", "1", "--set",
                         "decode.max_len_a=0", "--set", "decode.max_len_b=40", input=lines)
    assert ct2.exit_code == 0 and ct2.stdout == proc.stdout, ct2.stderr

    # Fine-tuning: the imported run is the parent (vocabulary and weights) of a Multi30k child.
    imported = config_from_dict(json.loads(json.dumps(trained.config.model_dump(mode="json"))))
    raw = multi30k_config(multi30k_2k, tmp_path / "child", vocab={"joint": False, "size": result.vocab_size,
                                                                   "from_run": str(run)},
                          model=imported.model.model_dump(mode="json"))
    raw["train"].update(max_steps=30, eval_every=30, log_every=5, lr=1e-3, warmup=5, precision="fp32",
                        init_from=str(run))
    child = config_from_dict(raw)
    prepare(child, progress=False)
    assert (tmp_path / "child/spm.src.model").read_bytes() == (run / "spm.src.model").read_bytes()
    train(child, progress_bar=False)
    losses = [json.loads(r)["loss"] for r in (tmp_path / "child/metrics.jsonl").read_text().splitlines()
              if json.loads(r)["kind"] == "train"]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("damage, message", [
    (lambda hf: (hf / "config.json").write_text(json.dumps({"model_type": "bart"})), "is not a Marian model"),
    (lambda hf: (hf / "vocab.json").unlink(), "vocab.json not found"),
    (lambda hf: (hf / "source.spm").unlink(), "source.spm not found"),
    (lambda hf: (hf / "target.spm").write_bytes(b"not a model"), "target.spm: not a sentencepiece model"),
    (lambda hf: (hf / "model.safetensors").unlink(), "no model.safetensors or pytorch_model.bin"),
    (lambda hf: (hf / "config.json").unlink(), "is not a Hugging Face model directory"),
])
def test_a_damaged_model_directory_is_one_line_and_leaves_nothing(marian, tmp_path, damage, message):
    hf = tmp_path / "hf"
    shutil.copytree(marian[4] / "hf", hf)
    damage(hf)
    proc = tfm_in_process("import", "--format", "marian", hf, "-o", tmp_path / "run")
    assert proc.exit_code == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_learned_positions_are_refused_with_the_reason(marian, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(marian[4] / "hf", hf)
    weights = load_file(str(hf / "model.safetensors"))
    # transformers 4.x wrote the position table too; here it is a trained one, not sinusoids.
    weights["model.encoder.embed_positions.weight"] = torch.randn(128, 32)
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TfmError, match="learned positions"):
        import_marian(hf, tmp_path / "run")


def test_a_pytorch_model_bin_with_its_tied_copies_imports_and_a_copy_that_differs_is_refused(marian, tmp_path):
    """pytorch_model.bin holds the shared embedding three more times (encoder, decoder, lm_head):
    they are the same matrix, or the weights are not the tied model config.json describes."""
    hf_model, _, trained, result, root, _, _ = marian
    hf = tmp_path / "hf"
    shutil.copytree(root / "hf", hf)
    (hf / "model.safetensors").unlink()
    state = hf_model.state_dict()
    assert {"model.encoder.embed_tokens.weight", "lm_head.weight"} <= set(state)
    torch.save(state, hf / "pytorch_model.bin")
    again = import_marian(hf, tmp_path / "run")
    assert again.parameters == result.parameters
    imported = load_trained_model(tmp_path / "run/checkpoints/checkpoint_best.pt").model.state_dict()
    assert all(torch.equal(tensor, imported[name]) for name, tensor in trained.model.state_dict().items())

    state["model.decoder.embed_tokens.weight"] = state["model.decoder.embed_tokens.weight"] + 0.5
    torch.save(state, hf / "pytorch_model.bin")
    with pytest.raises(TfmError, match="'model.decoder.embed_tokens.weight' differs from the shared embedding"):
        import_marian(hf, tmp_path / "run2")
    assert not (tmp_path / "run2").exists()


def test_weights_with_nan_are_refused_naming_the_tensor(marian, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(marian[4] / "hf", hf)
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.decoder.layers.1.fc2.weight"][3, 5] = float("nan")
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    proc = tfm_in_process("import", "--format", "marian", hf, "-o", tmp_path / "run")
    assert proc.exit_code == 2 and "'model.decoder.layers.1.fc2.weight' holds NaN" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_target_language_tag_is_added_and_an_unknown_one_refused(marian):
    """The imported model knows >>fra<< (a piece of its source vocabulary): `--tgt-lang fra` puts
    it before every line, and the translation is transformers' of the tagged line; `>>esp<<`, which
    the model does not know (Hugging Face's own example sends such a tag), is a one-line error
    naming the tags it knows, on the command line and in a line of its own."""
    hf_model, tokenizer, trained, result, root, de, _ = marian
    run = root / "run"
    settings = ["--beam", "1", "--set", "decode.precision=fp32", "--set", "decode.max_len_a=0", "--set",
                "decode.max_len_b=40", "--engine", "torch"]
    lines = de[:3]
    tagged = tfm_in_process("translate", "--config", run / "config.yaml", *settings, "--tgt-lang", "fra",
                            input="\n".join(lines) + "\n")
    assert tagged.exit_code == 0, tagged.stderr
    inputs = tokenizer([">>fra<< " + line for line in lines], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=40)
    assert tagged.stdout.splitlines() == tokenizer.batch_decode(out, skip_special_tokens=True)
    unknown = tfm_in_process("translate", "--config", run / "config.yaml", *settings, "--tgt-lang", "esp",
                             input=lines[0] + "\n")
    assert unknown.exit_code == 2 and "--tgt-lang esp: the model knows no tag >>esp<<; it knows fra" in unknown.stderr
    in_line = tfm_in_process("translate", "--config", run / "config.yaml", *settings, input=">>esp<< " + lines[0])
    assert in_line.exit_code == 2 and "input line 1: tag esp: the model knows no tag >>esp<<" in in_line.stderr
