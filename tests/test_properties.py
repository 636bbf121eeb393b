"""Property-based tests (hypothesis): whatever the input, no traceback and no corruption."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import multi30k_config, tiny_run
from transformer_cli.data.prepare import prepare
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.decoding.translation import read_decoded_lines, translate_stream
from transformer_cli.experiment.config import ExperimentConfig, config_from_dict, load_config
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.runtime.errors import TfmError
from transformer_cli.training.train import train

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,  # CI sees the same examples each run
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def config_keys() -> list[str]:
    keys = []
    for section, field in ExperimentConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            keys += [f"{section}.{name}" for name in annotation.model_fields]
        else:
            keys.append(section)
    return keys


values = st.one_of(
    st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.booleans().map(str), st.sampled_from(["", "null", "[1, 2]", "{a: 1}", "30m", "-1s", "auto", "[0.9, 0.98]",
                                              "!!python/object/apply:os.system ['true']", "'", "- - -"]),
    st.text(max_size=20),
)
keys = st.one_of(st.sampled_from(config_keys()), st.text(max_size=15))


@SETTINGS
@given(st.lists(st.tuples(keys, values), max_size=4))
@pytest.mark.slow
def test_random_overrides_are_accepted_or_refused_with_a_tfm_error(assignments):
    """Any `--set key=value` list either validates or raises TfmError (one line): never another exception."""
    try:
        config = load_config(None, [f"{key}={value}" for key, value in assignments])
    except TfmError as err:
        assert "\n" not in str(err).strip()
    else:
        assert config.model.d_model % config.model.n_heads == 0 and 0 <= config.model.dropout < 1


@pytest.fixture(scope="module")
def multi30k_spm(multi30k_2k, tmp_path_factory) -> spm.SentencePieceProcessor:
    """The sentencepiece model `prepare` trains on 2,000 Multi30k pairs (joint de+en, 1000 pieces)."""
    run = tmp_path_factory.mktemp("spm_run")
    result = prepare(config_from_dict(multi30k_config(multi30k_2k, run)), progress=False)
    return spm.SentencePieceProcessor(model_file=str(RunDirectory(run).vocab_file(result.manifest, "src")))


def known_characters(sp: spm.SentencePieceProcessor) -> str:
    pieces = (sp.id_to_piece(i) for i in range(sp.vocab_size()) if not sp.is_control(i) and not sp.is_unknown(i))
    return "".join(sorted({c for piece in pieces for c in piece if c != "▁"}))


@pytest.mark.slow
def test_random_text_round_trips_through_prepares_sentencepiece_model(multi30k_spm):
    sp = multi30k_spm
    alphabet = known_characters(sp) + "  \t"

    @SETTINGS
    @given(st.text(alphabet=alphabet, max_size=80))
    def known_text(text: str) -> None:
        # Exact modulo sentencepiece's normalisation (NFKC, whitespace collapsed and stripped).
        assert sp.decode(sp.encode(text)) == sp.normalize(text).replace("▁", " ").strip()

    @SETTINGS
    @given(st.text(max_size=80))
    def any_text(text: str) -> None:
        # Characters it has never seen become ⁇ (unknown); nothing else is invented.
        decoded = sp.decode(sp.encode(text))
        normalized = sp.normalize(text).replace("▁", " ")
        assert set(decoded) <= set(normalized) | {" ", "⁇"}

    known_text()
    any_text()


@pytest.fixture(scope="module")
def tiny_translator(tiny_prepared, tmp_path_factory) -> Translator:
    root = tmp_path_factory.mktemp("tiny_translator")
    summary = train(load_config(tiny_run(tiny_prepared, root, max_steps=20)), progress_bar=False)
    return Translator.from_checkpoint(summary.last_checkpoint, precision="fp32")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.binary(max_size=300))
@pytest.mark.slow
def test_random_bytes_on_stdin_never_crash_translate(tiny_translator, data):
    warnings, output = io.StringIO(), io.StringIO()
    lines = read_decoded_lines(io.BytesIO(data), warnings)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # a UTF-16 byte-order mark: refused in one line, nothing written
        with pytest.raises(TfmError, match="UTF-16"):
            translate_stream(tiny_translator, lines, output, tiny_translator.settings(beam=2))
        assert output.getvalue() == ""
        return
    stats = translate_stream(tiny_translator, lines, output, tiny_translator.settings(beam=2))
    lines_in = len(io.BytesIO(data).readlines())
    assert stats.sentences == lines_in and output.getvalue().count("\n") == lines_in
