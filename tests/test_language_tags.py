"""Target-language tags (>>xx<<): added by --tgt-lang, checked against the model's vocabulary."""

from __future__ import annotations

import pytest

from tests.conftest import tfm_in_process
from transformer_cli.data.language_tags import TargetLanguages, known_languages
from transformer_cli.runtime.errors import TfmError


def test_known_languages_are_the_tag_pieces_with_or_without_the_word_mark():
    pieces = ["<pad>", "\u2581>>fra<<", ">>deu<<", ">>x", "\u2581the", "<<y>>", ">>a b<<"]
    assert known_languages(pieces) == ["deu", "fra"]


def test_a_model_into_several_languages_needs_a_tag_on_every_line():
    languages = TargetLanguages(["deu", "fra"], own="fra")
    assert languages.tag_lines(["a b", "", ">>deu<< c"], "fra") == [">>fra<< a b", "", ">>deu<< c"]
    with pytest.raises(TfmError, match=r"input line 7: this model translates into several languages \(deu, fra\)"):
        languages.tag_lines(["", "a b"], None, first_line=6)
    with pytest.raises(TfmError, match="input line 1: tag spa: the model knows no tag >>spa<<; it knows deu, fra"):
        languages.tag_lines([">>spa<< a"], "fra")
    with pytest.raises(TfmError, match="--tgt-lang spa: the model knows no tag"):
        languages.check("spa")


def test_a_model_into_one_language_takes_its_own_and_refuses_another(reverse_model):
    checkpoint = reverse_model[1].best_checkpoint
    own = tfm_in_process("translate", "--checkpoint", checkpoint, "--tgt-lang", "tgt", input="wa wb\n")
    assert own.exit_code == 0 and own.stdout.split() == ["wb", "wa"], own.stderr
    other = tfm_in_process("translate", "--checkpoint", checkpoint, "--tgt-lang", "fr", input="wa wb\n")
    assert other.exit_code == 2 and "--tgt-lang fr: this model translates into tgt only" in other.stderr
    bad = tfm_in_process("translate", "--checkpoint", checkpoint, "--tgt-lang", "a b", input="wa\n")
    assert bad.exit_code == 2 and "tgt_lang" in bad.stderr and "Traceback" not in bad.stderr
    text = tfm_in_process("translate", "--checkpoint", checkpoint, input=">>fr<< wa\n")  # no tags: just text
    assert text.exit_code == 0, text.stderr
