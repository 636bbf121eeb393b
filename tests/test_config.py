from pathlib import Path

import pytest

from transformer_cli.config import ExperimentConfig, load_config, parse_duration
from transformer_cli.errors import TfmError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
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


SHIPPED = ["de-en.yaml", "en-de.yaml", "tiny.yaml", "base.yaml", "de-en-gpu.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "configs" / name)
    if name == "base.yaml":
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.dec_layers,
                cfg.model.d_ff, cfg.model.dropout, cfg.train.warmup) == (512, 8, 6, 6, 2048, 0.1, 4000)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_build_their_model(name):
    """Every shipped config's model section builds (on the meta device: no memory, no time)."""
    import torch

    from transformer_cli.train import build_model

    cfg = load_config(ROOT / "configs" / name)
    with torch.device("meta"):
        model = build_model(cfg, cfg.vocab.size, cfg.vocab.size)
    assert model.num_parameters() > 0
    if name == "de-en-gpu.yaml":  # the paper's base shape, trained in bf16 on CUDA by default
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.enc_layers, cfg.model.d_ff) == (512, 8, 6, 2048)
        assert cfg.train.precision == "auto" and cfg.train.device in ("auto", "cuda")
