import json
from pathlib import Path

import pytest

from transformer_cli.experiment.config import ExperimentConfig, load_config, parse_duration
from transformer_cli.runtime.errors import TfmError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_the_paper_base_model():
    cfg = ExperimentConfig()
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.d_ff) == (512, 8, 6, 2048)
    assert cfg.train.label_smoothing == 0.1 and cfg.train.warmup == 4000
    assert cfg.train.adam_betas == (0.9, 0.98)


def test_yaml_values_and_dotted_overrides(tmp_path):
    path = write(tmp_path, "run_dir: runs/x\nmodel:\n  d_model: 128\ntrain:\n  max_steps: 5\n")
    cfg = load_config(path, ["train.max_steps=200", "model.norm_position=pre", "train.max_time=30m"])
    assert cfg.model.d_model == 128
    assert cfg.train.max_steps == 200 and isinstance(cfg.train.max_steps, int)
    assert cfg.model.norm_position == "pre"
    assert parse_duration(cfg.train.max_time) == 1800.0
    assert cfg.model.n_heads == 8  # untouched default


def test_unknown_key_suggests_the_closest(tmp_path):
    path = write(tmp_path, "model:\n  d_modle: 128\n")
    with pytest.raises(TfmError, match=r"unknown key 'model.d_modle' \(did you mean 'model.d_model'\?\)"):
        load_config(path)
    with pytest.raises(TfmError, match=r"unknown key 'trian'.*did you mean 'train'"):
        load_config(None, ["trian.max_steps=3"])


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: lots\n")
    with pytest.raises(TfmError, match=r"exp.yaml: key 'train.max_steps': .*integer.*'lots'"):
        load_config(path)
    with pytest.raises(TfmError, match=r"key 'model.norm_position'"):
        load_config(None, ["model.norm_position=middle"])
    with pytest.raises(TfmError, match=r"train.max_time"):
        load_config(None, ["train.max_time=soon"])


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("3", 3), ("1", 1)])
def test_decode_workers_is_auto_or_a_count(value, expected):
    assert load_config(None, [f"decode.workers={value}"]).decode.workers == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "true", "1.5"])
def test_bad_decode_workers_name_the_key(value):
    with pytest.raises(TfmError, match=r"key 'decode.workers': .*auto or a whole number"):
        load_config(None, [f"decode.workers={value}"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(TfmError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    path = write(tmp_path, "model: [unclosed\n")
    with pytest.raises(TfmError, match=r"exp.yaml: line \d+ invalid YAML"):
        load_config(path)


def test_relative_paths_resolve_against_working_directory(tmp_path, monkeypatch):
    cfg = load_config(ROOT / "configs" / "de-en.yaml")
    monkeypatch.chdir(tmp_path)
    assert cfg.run_path.resolve() == (tmp_path / "runs" / "de-en").resolve()


def test_every_shipped_config_is_tested():
    assert {p.name for p in (ROOT / "configs").glob("*.yaml")} == set(SHIPPED)


SHIPPED = ["de-en.yaml", "en-de.yaml", "tiny.yaml", "base.yaml", "de-en-gpu.yaml", "ted-de-en.yaml",
           "wmt14-en-de-base.yaml", "wmt14-en-de-big.yaml", "multi30k-multilingual.yaml", "student-tiny.yaml"]


def test_the_fine_tuning_config_fits_its_parent():
    """configs/ted-de-en.yaml starts from configs/de-en.yaml's run: the same vocabulary settings and
    model (what vocab.from_run and train.init_from refuse otherwise; dropout may differ)."""
    child, parent = load_config(ROOT / "configs/ted-de-en.yaml"), load_config(ROOT / "configs/de-en.yaml")
    assert child.vocab.from_run == child.train.init_from == parent.run_dir
    assert (child.vocab.size, child.vocab.joint) == (parent.vocab.size, parent.vocab.joint)
    assert child.model.model_dump(exclude={"dropout"}) == parent.model.model_dump(exclude={"dropout"})


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "configs" / name)
    if name == "base.yaml":
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.dec_layers,
                cfg.model.d_ff, cfg.model.dropout, cfg.train.warmup) == (512, 8, 6, 6, 2048, 0.1, 4000)
    if name == "multi30k-multilingual.yaml":  # English-centric, de-en.yaml's shape
        assert [d.name for d in cfg.data.pairs] == ["en-de", "de-en", "en-fr", "fr-en", "en-cs", "cs-en"]
        shipped = load_config(ROOT / "configs" / "de-en.yaml").model  # its auto's fallback shape, pinned here
        assert cfg.model.model_dump(exclude={"size"}) == shipped.model_dump(exclude={"size"}) | {"dropout": 0.1}
    if name.startswith("wmt14"):  # the paper's shapes, a joint 32k BPE, 25k–100k target tokens an update
        shape = (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.dec_layers, cfg.model.d_ff)
        assert shape == ((512, 8, 6, 6, 2048) if "base" in name else (1024, 16, 6, 6, 4096))
        assert cfg.vocab.joint and cfg.vocab.size == 32000 and cfg.model.share_embeddings
        assert 20_000 <= cfg.train.max_tokens * cfg.train.accum_steps <= 100_000


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.slow
def test_shipped_configs_build_their_model(name):
    """Every shipped config's model section builds (on the meta device: no memory, no time)."""
    import torch

    from transformer_cli.training.train import build_model

    cfg = load_config(ROOT / "configs" / name)
    with torch.device("meta"):
        model = build_model(cfg, cfg.vocab.size, cfg.vocab.size)
    assert model.num_parameters() > 0
    if name == "de-en-gpu.yaml":  # the paper's base shape, trained in bf16 on CUDA by default
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.d_ff) == (512, 8, 6, 2048)
        assert cfg.train.precision == "auto" and cfg.train.device in ("auto", "cuda")


# Every key with a valid range: a value just inside it is accepted, one just outside is refused
# when the config is read, in one line naming the key.
BOUNDS = [
    # (key, accepted, refused)
    ("data.max_len", 1, 0), ("data.max_len_ratio", 1.0, 0.5), ("data.train_limit", 1, 0),
    ("data.src_lang", "x", ""), ("data.temperature", 1.0, 0.99), ("data.temperature", 1000.0, 1001.0),
    ("data.filters.length.min_words", 1, 0), ("data.filters.length.max_words", 1, 0),
    ("data.filters.length.max_chars", 1, 0), ("data.filters.length.max_sentences", 1, 0),
    ("data.filters.copies.max_overlap", 1.0, 1.01), ("data.filters.copies.max_overlap", 0.01, 0.0),
    ("data.filters.characters.min_letters", 1.0, 1.1), ("data.filters.characters.min_script", 0.0, -0.1),
    ("data.filters.repeats.max_share", 1.0, 0.0), ("data.filters.repeats.min_words", 2, 1),
    ("data.filters.numbers.min_similarity", 0.0, -0.5), ("data.filters.lexical.recall", 0.99, 1.0),
    ("data.filters.lexical.sample_pairs", 100, 99),
    ("data.filters.lexical.sample_pairs", 1_000_000, 1_000_001), ("data.filters.lexical.min_count", 1, 0),
    ("data.filters.model.recall", 0.99, 1.0), ("data.filters.model.partial_recall", 0.01, 0.0),
    ("data.filters.model.max_share", 1.0, 0.0), ("data.filters.model.clean_loss", 0.5, 1.0), ("data.filters.model.sample_pairs", 100, 99),
    ("data.filters.model.sample_pairs", 100_000, 100_001), ("data.filters.model.batch_tokens", 64, 63),
    ("data.filters.model.engine", "ctranslate2", "ct2"),
    ("data.filters.model.forward", "runs/de-en", ""), ("data.filters.model.backward", "runs/en-de", ""),
    ("data.filters.model.train_time", "1s", 0), ("data.filters.model.train_time", 0.5, "5 minutes"),
    ("data.filters.model.train_updates", 1, 0), ("data.filters.model.train_updates", 5000, "1k"),
    ("data.augment.upper", 1.0, 1.01), ("data.augment.title", 0.0, -0.01), ("data.augment.lower", 1.0, 1.5),
    ("data.augment.typos", 1.0, 1.01), ("data.augment.end_punctuation", 0.0, -1), ("data.augment.typo_words", 1.0, 0.0),
    ("data.filters.warn_share", 1.0, 0.0), ("data.filters.language.min_words", 1, 0), ("data.filters.duplicates.by", "source", "sources"),
    ("vocab.size", 8, 7), ("vocab.character_coverage", 1.0, 0.0), ("vocab.input_sentence_size", 0, -1),
    ("prepare.workers", 1, 0), ("prepare.chunk_lines", 1, 0),
    ("model.d_model", 8, 0), ("model.n_heads", 1, 0), ("model.enc_layers", 1, 0), ("model.dec_layers", 1, 0),
    ("model.d_ff", 1, 0), ("model.dropout", 0.0, 1.0), ("model.attention_dropout", 0.99, -0.1),
    ("model.activation_dropout", 0.0, 1.0),
    ("model.max_positions", 4, 3),
    ("train.seed", 0, -1), ("train.threads", 1, 0), ("train.threads", 4096, 4097), ("train.max_tokens", 1, 0), ("train.accum_steps", 1, 0),
    ("train.max_steps", 1, 0), ("train.max_epochs", 1, 0), ("train.max_time", "1s", 0), ("train.lr_min", 0.0, -1e-9),
    ("train.lr_factor", 1e-9, 0.0), ("train.lr", 1e-9, 0.0), ("train.warmup", 0, -1), ("train.warmup_ratio", 1.0, 0.0),
    ("train.adam_betas", [0.0, 0.999], [0.9, 1.0]), ("train.adam_eps", 1e-12, 0.0), ("train.weight_decay", 0.0, -0.1),
    ("train.label_smoothing", 0.0, 1.0), ("train.clip_norm", 0.0, -1.0), ("train.log_every", 1, 0),
    ("train.eval_every", 1, 0), ("train.eval_bleu_sentences", 1, 0), ("train.patience", 1, 0),
    ("train.keep_last", 1, 0), ("train.save_every", 1, 0), ("train.max_bad_steps", 1, 0),
    ("train.average_last", 0, -1), ("train.average_window", 1.0, 0.0), ("train.ema_decay", 0.5, 1.0),
    ("decode.beam", 1, 0), ("decode.length_penalty", 0.0, -0.1), ("decode.max_len_a", 0.0, -0.5),
    ("decode.max_len_b", 0, -1), ("decode.batch_size", 1, 0), ("decode.batch_tokens", 1, 0), ("decode.nbest", 1, 0),
    ("decode.max_memory", 1, 0),
]


@pytest.mark.parametrize("key,accepted,refused", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_every_bounded_key_is_checked_when_the_config_is_read(key, accepted, refused):
    dump = lambda value: f"{key}={json.dumps(value)}"  # noqa: E731 (JSON is YAML)
    load_config(None, [dump(accepted)])
    with pytest.raises(TfmError) as err:
        load_config(None, [dump(refused)])
    assert f"key '{key}'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("settings,key", [
    (["train.keep_last=2", "train.average_last=3"], "train.keep_last"),
    (["train.lr_schedule=budget", "train.lr=0.001", "train.lr_min=0.002"], "train.lr_min"),
    (["decode.max_len_a=0", "decode.max_len_b=0"], "decode.max_len_b"),
    (["decode.beam=2", "decode.nbest=3"], "decode.nbest"),
    (["train.lr=.inf"], "train.lr"), (["decode.length_penalty=.nan"], "decode.length_penalty"),
    (["data.augment.lower=0.7", "data.augment.title=0.4"], "data.augment.upper"),
])
def test_rules_across_keys_and_non_finite_values_name_the_key(settings, key):
    with pytest.raises(TfmError, match=f"key '{key}'"):
        load_config(None, settings)
    # the same keys within the rules are fine
    load_config(None, ["train.keep_last=3", "train.average_last=3", "train.lr_schedule=budget", "train.lr_min=0.0005",
                       "decode.max_len_a=0", "decode.max_len_b=1", "decode.beam=3", "decode.nbest=3"])


@pytest.mark.parametrize("text, says", [
    ("decode:\n  beam: 4\ntrain:\n  max_steps: 3\ndecode:\n  beam: 2\n",
     "line 5 invalid YAML: key 'decode' given twice (first on line 1)"),
    ("decode:\n  beam: 4\n  beam: 5\n", "line 3 invalid YAML: key 'beam' given twice (first on line 2)"),
    ("train: {max_steps: 3, max_steps: 4}\n", "key 'max_steps' given twice"),
])
def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path, text, says):
    """PyYAML keeps the last of two equal keys: a second `decode:` section silently replaced the first."""
    with pytest.raises(TfmError) as err:
        load_config(write(tmp_path, text))
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_nesting_is_bounded_in_a_file_and_in_set(tmp_path):
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(TfmError, match=r"line 2 invalid YAML: nested more than 32 levels deep"):
        load_config(write(tmp_path, f"train:\n  max_steps: {deep}\n"))
    with pytest.raises(TfmError, match=r"key 'train.max_steps'"):  # not YAML: read as text, and refused as such
        load_config(None, [f"train.max_steps={deep}"])


@pytest.mark.parametrize("assignment, says", [
    ("decode.beam=true", "key 'decode.beam': true is a boolean; give a number"),
    ("train.max_steps=false", "key 'train.max_steps': false is a boolean"),
    ("train.lr=true", "key 'train.lr': true is a boolean"),
    ("decode.max_memory=true", "key 'decode.max_memory': true is a boolean; give a number or string"),
    ("decode.alignment=1", "key 'decode.alignment': 1 is not a boolean; give true or false"),
    ("decode.sample=on!", "key 'decode.sample': 'on!' is not a boolean"),
])
def test_booleans_are_not_numbers_nor_numbers_booleans(assignment, says):
    with pytest.raises(TfmError) as err:
        load_config(None, [assignment])
    assert says in str(err.value)
    assert load_config(None, ["decode.beam=3", "decode.alignment=true"]).decode.beam == 3


def test_yaml_aliases_that_fan_out_are_one_line_errors_before_they_expand(tmp_path):
    """946 bytes of aliases within aliases were 10^8 references: 51 s and 3 GB, then a message that
    printed them. Bounded (as XML's entity expansion is), and said in one line naming it."""
    import time

    levels = ["a: &a [" + ", ".join(['"x"'] * 10) + "]"]
    for name, inner in zip("bcdefg", "abcdef"):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{inner}"] * 10) + "]")
    path = write(tmp_path, "\n".join(levels) + "\ndata:\n  train: [" + ", ".join(["*g"] * 10) + "]\n")
    started = time.perf_counter()
    with pytest.raises(TfmError, match="aliases expand to more than 100,000 values") as caught:
        load_config(path)
    assert time.perf_counter() - started < 5 and "\n" not in str(caught.value) and len(str(caught.value)) < 300
    shared = write(tmp_path, "data:\n  valid: &v data/multi30k/val\n  test: *v\n", name="shared.yaml")
    assert load_config(shared).data.test == "data/multi30k/val"  # aliases that do not fan out still work


def test_integers_past_pythons_digit_limit_are_one_line_errors(tmp_path):
    path = write(tmp_path, "model:\n  d_model: " + "9" * 5000 + "\n")
    with pytest.raises(TfmError, match=r"line 2 invalid YAML: an integer of more than 4,300 digits"):
        load_config(path)
    with pytest.raises(TfmError, match=r"key 'model.d_model'") as caught:
        load_config(None, ["model.d_model=" + "9" * 5000])
    assert len(str(caught.value)) < 400 and "(5,002 characters)" in str(caught.value)
