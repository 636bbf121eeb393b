"""Terminology: positive lexical constraints (beam search with dynamic beam allocation), avoided
terms, glossaries and their files, on the reverse task's trained model (target: the source's words
reversed; every word is one piece, and also spellable from its characters)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import FP32, WORDS, fp32_translator, tfm_in_process
from transformer_cli.decoding.constraints import AvoidedSequences, ConstraintTable, kmp_transitions, recent_tokens
from transformer_cli.decoding.terms import (
    Glossary,
    LineTerms,
    avoided_present,
    missing_constraints,
    spellings,
    split_constraints_line,
    whole_word_pattern,
)
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.runtime.files import read_lines


@pytest.fixture(scope="module")
def checkpoint(reverse_model):
    return reverse_model[1].best_checkpoint


@pytest.fixture(scope="module")
def lines(reverse_model):
    config, _ = reverse_model
    return read_lines(f"{config.data.test}.src.gz")[:24]


engine = fp32_translator


def absent_words(text: str, count: int, seed: int) -> list[str]:
    """`count` words of the vocabulary the text lacks (a constraint the plain output does not meet)."""
    present = set(text.split())
    return random.Random(seed).sample([w for w in WORDS if w not in present], count)


def has_word(text: str, word: str) -> bool:
    return bool(whole_word_pattern(word).search(text))


# --------------------------------------------------------------------------- the automaton


def longest_prefix_at_end(stream: list[int], pattern: list[int]) -> int:
    return max(m for m in range(len(pattern) + 1) if m <= len(stream) and stream[len(stream) - m :] == pattern[:m])


@pytest.mark.parametrize("seed", range(4))
def test_the_automaton_tracks_each_terms_longest_matched_prefix(seed):
    """Against brute force, over patterns with repeated and self-overlapping tokens (a a b, a b a b):
    a term's state is the longest prefix of it that the output ends with, and it is met once the
    whole term has occurred, however the occurrence overlaps a false start."""
    rng = random.Random(seed)
    patterns = [[rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    table = ConstraintTable([patterns], torch.device("cpu"))
    sentences = torch.zeros(1, dtype=torch.long)
    matched, met = table.initial(sentences)
    stream: list[int] = []
    for _ in range(40):
        token = rng.randrange(4)  # 3: a token in no pattern
        stream.append(token)
        matched, met = table.advance(sentences, matched, met, torch.tensor([token]))
        for c, pattern in enumerate(patterns):
            assert int(matched[0, c]) == longest_prefix_at_end(stream, pattern), (pattern, stream)
            occurs = any(stream[i : i + len(pattern)] == pattern for i in range(len(stream)))
            assert bool(met[0, c]) == occurs
    assert kmp_transitions([0, 0, 1])[2] == [2, 2, 3]  # "a a" then "a": still "a a" matched, not a restart


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow
def test_barred_tokens_are_the_last_of_every_sequence_the_output_is_inside(seed):
    """The automaton of avoided sequences against brute force: after any output, exactly the last
    tokens of the sequences whose other tokens the output ends with are barred, per sentence (two
    sentences with the same list share one automaton; a third has its own)."""
    rng = random.Random(seed)
    for _ in range(100):
        lists = [[[rng.randrange(5) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
                 for _ in range(2)]
        table = AvoidedSequences([lists[0], lists[1], lists[0]], torch.device("cpu"))
        for _ in range(10):
            output = [rng.randrange(7) for _ in range(rng.randint(0, 6))]
            for sentence, sequences in enumerate([lists[0], lists[1], lists[0]]):
                logprobs = torch.randn(1, 8)
                table.ban(logprobs, torch.tensor([sentence]),
                          recent_tokens(torch.tensor(output, dtype=torch.long).view(1, -1), table.width))
                expected = {q[-1] for q in sequences if len(output) >= len(q) - 1 and
                            output[len(output) - len(q) + 1 :] == q[:-1]}
                assert {i for i in range(8) if logprobs[0, i] == float("-inf")} == expected, (sequences, output)


def test_spellings_are_the_ways_the_vocabulary_writes_a_term(checkpoint):
    """Every spelling detokenizes to the term, the usual one among them, and a word is found in its
    characters too (what a search reaches for when the usual spelling is barred)."""
    translator = engine(checkpoint)
    sp, pieces = translator.tgt_sp, translator.target_pieces()
    ways = spellings("\u2581wa\u2581wb", pieces)
    assert sp.encode("wa wb") in ways and len(ways) > 2
    assert all(sp.decode(w) == "wa wb" for w in ways)
    assert len({tuple(w) for w in ways}) == len(ways)
    assert spellings("\u2581w\u00e4", pieces) == []  # a character the vocabulary lacks: no spelling


# --------------------------------------------------------------------------- positive constraints


def test_a_constraint_the_plain_output_lacks_appears(checkpoint, lines):
    """One word, two words, and a repeated word (its pieces overlap themselves) each appear
    verbatim where the plain translation has none of them; the rest of the translation stays the
    reversed source."""
    translator = engine(checkpoint)
    plain = [t[0].text for t in translator.translate(lines)]
    terms = []
    for i, text in enumerate(plain):
        one, two, three = absent_words(text, 3, i)
        terms.append(LineTerms(constraints=[(one,), (f"{one} {two}",), (f"{three} {three}",)][i % 3]))
    forced = translator.translate(lines, terms=terms)
    for i, (t, hyps) in enumerate(zip(terms, forced)):
        assert not any(c in plain[i] for c in t.constraints)
        assert all(c in hyps[0].text for c in t.constraints), (t, hyps[0].text)
        assert hyps[0].unmet == ()
        kept = [w for w in plain[i].split() if w in hyps[0].text.split()]
        assert 2 * len(kept) >= len(plain[i].split())  # the term is placed into the translation, not instead of it


def test_each_line_keeps_its_own_constraints_in_a_mixed_batch(checkpoint, lines):
    """Lines with different constraints and lines without any, of different lengths, in one batch:
    each constrained line gets its own term and no other line's (a search that attached terms to the
    wrong sentence, as fairseq's did, fails), and each unconstrained line is its plain translation."""
    translator = engine(checkpoint, batch_size=64)
    plain = [t[0].text for t in translator.translate(lines)]
    terms = [LineTerms(constraints=(absent_words(plain[i], 1, i)[0],)) if i % 2 == 0 else LineTerms()
             for i in range(len(lines))]
    forced = translator.translate(lines, terms=terms)
    for i, hyps in enumerate(forced):
        if terms[i].constraints:
            assert has_word(hyps[0].text, terms[i].constraints[0]), (terms[i], hyps[0].text)
            others = {t.constraints[0] for j, t in enumerate(terms) if t.constraints and j != i}
            assert not any(has_word(hyps[0].text, w) for w in others - set(terms[i].constraints) - set(plain[i].split()))
        else:
            assert hyps[0].text == plain[i]


def test_every_nbest_hypothesis_and_every_ensemble_translation_has_the_terms(checkpoint, lines):
    translator = engine(checkpoint)
    plain = [t[0].text for t in translator.translate(lines[:8])]
    terms = [LineTerms(constraints=tuple(absent_words(p, 2, i))) for i, p in enumerate(plain)]
    nbest = translator.translate(lines[:8], decode=translator.settings(beam=4, nbest=3), terms=terms)
    assert all(len(h) == 3 and all(all(c in x.text for c in t.constraints) for x in h) for h, t in zip(nbest, terms))
    ensemble = Translator.from_checkpoint([checkpoint, checkpoint], device="cpu", overrides=FP32)
    together = ensemble.translate(lines[:8], terms=terms)
    assert all(all(c in h[0].text for c in t.constraints) for h, t in zip(together, terms))


def test_a_constraint_that_cannot_fit_warns_and_still_translates(checkpoint, lines, capsys):
    """More constraint tokens than the model's positions hold, and a term the vocabulary cannot
    spell: the line gets its best translation without them and a warning naming it."""
    translator = engine(checkpoint)
    plain = [t[0].text for t in translator.translate(lines[:3])]
    too_long = " ".join(["wa"] * (translator.model.cfg.max_positions + 5))
    terms = [LineTerms(), LineTerms(constraints=(too_long,)), LineTerms(constraints=("w\u00e4",))]
    found = translator.translate(lines[:3], terms=terms, first_line=10)
    assert [h[0].text for h in found] == plain
    assert found[1][0].unmet == (too_long,) and found[2][0].unmet == ("w\u00e4",)
    err = capsys.readouterr().err
    assert "input line 11: the translation lacks" in err and "input line 12: the constraint 'wä' cannot be spelled" in err


def test_constraints_need_beam_search_and_tfms_engine(checkpoint, lines):
    translator = engine(checkpoint)
    with pytest.raises(Exception, match="need beam search"):
        translator.translate(lines[:2], decode=translator.settings(beam=1), terms=[LineTerms(constraints=("wa",))] * 2)
    sampler = engine(checkpoint, sample=True)
    with pytest.raises(Exception, match="not --sample"):
        sampler.translate(lines[:2], decode=sampler.settings(beam=1), terms=[LineTerms(constraints=("wa",))] * 2)


# --------------------------------------------------------------------------- avoided terms


@pytest.mark.parametrize("settings", [{"beam": 1}, {"beam": 4}, {"beam": 1, "sample": True, "seed": 3}])
def test_avoided_words_appear_in_no_output(checkpoint, lines, settings):
    """The words the plain outputs use most, avoided: none appears (in any spelling: the model can
    write a word from its characters), in greedy, beam and sampling, and lines whose plain output
    had none of them are unchanged."""
    translator = engine(checkpoint, **settings)
    plain = [t[0].text for t in translator.translate(lines)]
    counts = {w: sum(has_word(p, w) for p in plain) for w in WORDS}
    avoided = tuple(sorted(counts, key=lambda w: -counts[w])[:2])
    found = translator.translate(lines, terms=[LineTerms(avoid=avoided)] * len(lines))
    assert sum(counts[w] for w in avoided) > 0
    for p, hyps in zip(plain, found):
        assert not any(has_word(hyps[0].text, w) for w in avoided), hyps[0].text
        if not any(has_word(p, w) for w in avoided) and not settings.get("sample"):
            assert hyps[0].text == p


# --------------------------------------------------------------------------- files and the command line


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def test_translate_constraints_file_json_and_glossary_on_the_command_line(checkpoint, lines, tmp_path):
    """`tfm translate --constraints --json` on the command line (in this process) (prefix and avoided fields, a line without
    terms), then `--glossary`: its entries fire on whole words, case-insensitively, and are reported."""
    src = [lines[0], lines[1], lines[2]]
    first_word = src[0].split()[-1]  # the reverse task's translation starts with the source's last word
    term = absent_words(src[1], 1, 0)[0]
    data = f"{src[0]}\t^{first_word}\t{term}\n{src[1]}\t\n{src[2]}\t!{src[2].split()[0]}\n"
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--set", "decode.precision=fp32", "--constraints",
                            "--json", "-i", write(tmp_path / "in.tsv", data))
    assert result.exit_code == 0, result.stderr
    assert "engine: torch (constraints and avoided terms are tfm's own" in result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [0, 1, 2]
    first = records[0]["translations"][0]
    assert first["text"].startswith(first_word) and term in first["text"] and first["unmet"] == []
    assert "constraints" not in records[1]
    assert not has_word(records[2]["translations"][0]["text"], src[2].split()[0])

    source_word = src[1].split()[0]
    glossary = write(tmp_path / "g.tsv", f"{source_word.upper()}\t{term}\nwz\twa\n")
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--glossary", glossary, "--json",
                            input="\n".join(src) + "\n")
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    for record, line in zip(records, src):
        fired = source_word in line.split()
        assert (record.get("glossary") == [{"source": source_word.upper(), "target": term}]) == fired
        assert (term in record["translations"][0]["text"]) or not fired


@pytest.mark.parametrize("option, data, says", [
    ("--constraints", "wa wb\twb\nwa wc\n", "line 2: no tab"),
    ("--constraints", "wa wb\twb\t\twa\n", "line 1, field 3: an empty term"),
    ("--constraints", "wa wb\t^wb\t^wa\n", "line 1, field 3: a second prefix"),
    ("--constraints", b"wa wb\twb\nwa\twc\xff\n", "line 2 is not valid UTF-8"),
    ("--constraints", "wa wb\twb wc\t!wc\n", "line 1: the constraint 'wb wc' contains the avoided term 'wc'"),
    ("--constraints", "wa wb\t" + "\t".join(f"w{i}" for i in range(33)) + "\n", "line 1: 33 constraints, more than 32"),
    ("--avoid", "wa\n \n", "line 2: an empty term"),
    ("--avoid", "\n\n", "no terms in it"),
    ("--avoid", b"wa\n\xffwb\n", "line 2 is not valid UTF-8"),
    ("--glossary", "wa\twb\nwc\n", "line 2: 1 fields"),
    ("--glossary", "wa\twb\nWA\twc\n", "line 2: the source term 'WA' is also on line 1"),
    ("--glossary", "wa\t \n", "line 1, target term: an empty term"),
])
def test_bad_terminology_files_are_one_line_errors_naming_the_line(checkpoint, tmp_path, option, data, says):
    path = write(tmp_path / "terms", data)
    if option == "--constraints":
        args, given = ["-i", str(path), "--constraints"], None
    else:
        args, given = [option, str(path)], "wa wb\n"
    result = tfm_in_process("translate", "--checkpoint", checkpoint, *args, input=given)
    assert result.exit_code == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in result.stderr, result.stderr


def test_settings_that_cannot_apply_constraints_are_refused_before_reading(checkpoint, tmp_path):
    path = write(tmp_path / "in.tsv", "wa wb\twc\n")
    greedy = tfm_in_process("translate", "--checkpoint", checkpoint, "--constraints", "-i", path, "--beam", "1")
    assert greedy.exit_code == 2 and "need beam search" in greedy.stderr
    ct2 = tfm_in_process("translate", "--checkpoint", checkpoint, "--constraints", "-i", path, "--engine", "ctranslate2")
    assert ct2.exit_code == 2 and "--engine ctranslate2: constraints and avoided terms are tfm's own" in ct2.stderr


def test_evaluate_with_a_constraints_file_reports_term_use(reverse_model, tmp_path):
    """References' own words as constraints (the protocol of Post & Vilar): every term is used and
    BLEU does not fall."""
    config, summary = reverse_model
    src = read_lines(f"{config.data.test}.src.gz")
    ref = read_lines(f"{config.data.test}.tgt.gz")
    rng = random.Random(0)
    rows = []
    for s, r in zip(src, ref):
        words = r.split()
        start = rng.randrange(len(words))
        rows.append(f"{s}\t{' '.join(words[start : start + rng.randint(1, 2)])}")
    constraints = write(tmp_path / "test.tsv", "\n".join(rows) + "\n")
    config_file = write(tmp_path / "c.json", json.dumps({**config.model_dump(mode="json"), "run_dir": str(tmp_path / "run")}))
    args = ["evaluate", "--config", config_file, "--checkpoint", summary.best_checkpoint, "--set",
            "decode.precision=fp32", "--json"]
    plain = json.loads(tfm_in_process(*args).stdout)
    result = tfm_in_process(*args, "--constraints", constraints)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["term_use"]["constraints"] == len(src) and report["term_use"]["rate"] == 1.0
    assert report["scores"]["bleu"]["score"] >= plain["scores"]["bleu"]["score"] - 0.5
    bad = tfm_in_process(*args, "--constraints", write(tmp_path / "short.tsv", rows[0] + "\n"))
    assert bad.exit_code == 2 and "line counts differ" in bad.stderr
    # The same number of lines, of other sentences (shifted by one): scored against these references
    # they gave a BLEU that meant nothing, exit 0.
    shifted = write(tmp_path / "shifted.tsv", "\n".join(rows[1:] + rows[:1]) + "\n")
    bad = tfm_in_process(*args, "--constraints", shifted)
    assert bad.exit_code == 2 and "line 1's source is not line 1 of" in bad.stderr, bad.stderr


def test_split_constraints_line_reads_escapes():
    source, terms = split_constraints_line("a b\t\\^2\t\\!x\t^Pre\t!bad", "in")
    assert source == "a b" and terms.constraints == ("^2", "!x") and terms.prefix == "Pre" and terms.avoid == ("bad",)
    assert Glossary((("New York", "NYC"),)).matches("to new  york") == ()
    assert Glossary((("New York", "NYC"),)).matches("to NEW YORK now") == (("New York", "NYC"),)
    assert Glossary((("York", "Y"),)).matches("Yorkshire") == ()


def test_the_memory_bound_counts_the_constrained_beams_candidates(checkpoint):
    """Each candidate of the constrained beam is compared with every piece of every term: the bound
    grows with them, so that a server's limit refuses 32 long terms on many lines at beam 64."""
    from transformer_cli.decoding.budget import decoding_bytes, decoding_shape

    cfg = engine(checkpoint).model.cfg
    decode = engine(checkpoint).decode
    plain = decoding_bytes(cfg, decoding_shape(cfg, decode.updated(beam=64), 64, 20))
    constrained = decoding_bytes(cfg, decoding_shape(cfg, decode.updated(beam=64), 64, 20, constraints=(32, 64)))
    assert constrained > plain + 64 * 64 * 35 * 32 * 64


# --------------------------------------------------------------------------- terminology from parallel text


def test_a_glossary_keeps_consistent_alignments_confirmed_by_the_references():
    from transformer_cli.decoding.glossary import extract

    sources = ["das haus ist rot", "ein haus steht da", "der baum ist grün", "ein baum"]
    hypotheses = ["the house is red", "a house stands there", "the tree is green", "a tree"]
    alignments = ["0-0 1-1 2-2 3-3", "0-0 1-1 2-2 3-3", "0-0 1-1 2-2 3-3", "0-0 1-1"]
    references = ["the house is red", "a house is there", "the tree is green", "a shrub"]
    chosen = extract(sources, references, hypotheses, alignments, entries=10, agreement=0.6)
    assert ("haus", "house", 2) in chosen  # consistent and confirmed by both references
    assert not any(source == "baum" for source, _, _ in chosen)  # "tree" in 1 of its 2 references only
    assert all(len(s) >= 4 for s, _, _ in chosen)  # "das", "ist": not content words


def test_sampled_constraints_are_reference_phrases_seeded_and_never_replace_an_input(reverse_model, tmp_path):
    config, _ = reverse_model
    src, ref = f"{config.data.test}.src.gz", f"{config.data.test}.tgt.gz"
    first, again = tmp_path / "a.tsv", tmp_path / "b.tsv"
    for out in (first, again):
        result = tfm_in_process("sample-constraints", "--src", src, "--ref", ref, "--seed", "3", "-o", out)
        assert result.exit_code == 0, result.stderr
    assert first.read_text() == again.read_text()
    rows = first.read_text().splitlines()
    references = read_lines(ref)
    assert len(rows) == len(references) == len(read_lines(src))
    for row, reference in zip(rows, references):
        source, *phrases = row.split("\t")
        assert 1 <= len([p for p in phrases if p]) <= 2 and all(p in reference for p in phrases if p), row
    copy = tmp_path / "src.txt"
    copy.write_text("\n".join(read_lines(src)) + "\n")
    before = copy.read_text()
    for output in (copy, tmp_path):  # an input, a directory
        result = tfm_in_process("sample-constraints", "--src", copy, "--ref", ref, "-o", output)
        assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert copy.read_text() == before


def test_glossary_runs_on_a_model_and_refuses_to_replace_its_inputs(reverse_model, tmp_path):
    config, summary = reverse_model
    src, ref = f"{config.data.test}.src.gz", f"{config.data.test}.tgt.gz"
    out = tmp_path / "glossary.tsv"
    result = tfm_in_process("glossary", "--checkpoint", summary.best_checkpoint, "--src", src, "--ref", ref,
                            "--lines", "50", "-o", out)
    assert result.exit_code == 0 and json.loads(result.stdout)["lines"] == 50, result.stderr
    assert out.is_file()
    result = tfm_in_process("glossary", "--checkpoint", summary.best_checkpoint, "--src", src, "--ref", ref,
                            "-o", summary.best_checkpoint)
    assert result.exit_code == 2 and "also this command's input (--checkpoint)" in result.stderr, result.stderr


# --------------------------------------------------------------------------- one strict reading of terms

NFD_MUELLER, NFC_MUELLER = "Mu\u0308ller", "M\u00fcller"  # as macOS writes file names and text; as most text is


def test_a_constraint_is_met_as_whole_words_as_an_avoided_term_is_present():
    terms = LineTerms(constraints=("Hund",), avoid=("Katze",))
    assert missing_constraints("Der Hundeeee bellt", terms) == ["Hund"]  # not inside a longer word
    assert missing_constraints("Der Hund bellt.", terms) == []
    assert missing_constraints("Hund", terms) == [] and missing_constraints("(Hund)", terms) == []
    assert avoided_present("Katzenfutter", terms) == [] and avoided_present("die Katze", terms) == ["Katze"]


def test_terms_glossaries_and_texts_are_compared_in_nfc(tmp_path):
    assert NFD_MUELLER != NFC_MUELLER
    terms = LineTerms(prefix=NFD_MUELLER, constraints=(NFD_MUELLER,), avoid=(f"{NFD_MUELLER}s",))
    assert terms.prefix == terms.constraints[0] == NFC_MUELLER and terms.avoid == (f"{NFC_MUELLER}s",)
    assert missing_constraints(f"Herr {NFC_MUELLER} kommt", terms) == []
    assert missing_constraints(f"Herr {NFD_MUELLER} kommt", terms) == []  # an output in NFD, too
    assert avoided_present(f"des {NFD_MUELLER}s", terms) == [f"{NFC_MUELLER}s"]
    glossary_file = tmp_path / "glossary.tsv"
    glossary_file.write_text(f"{NFD_MUELLER}\tmiller\n", encoding="utf-8")
    glossary = Glossary.read(glossary_file)
    assert glossary.matches(f"Herr {NFC_MUELLER} kommt") == ((NFC_MUELLER, "miller"),)
    assert glossary.matches(f"Herr {NFD_MUELLER} kommt") == ((NFC_MUELLER, "miller"),)
    _, from_file = split_constraints_line(f"Herr {NFC_MUELLER}\t{NFD_MUELLER}\t!{NFD_MUELLER}s", "line 1")
    assert from_file.constraints == (NFC_MUELLER,) and from_file.avoid == (f"{NFC_MUELLER}s",)


def test_a_lines_own_prefix_and_another_prefix_option_are_refused_not_one_dropped(checkpoint):
    result = tfm_in_process("translate", "--checkpoint", checkpoint, "--engine", "torch", "--constraints",
                            "--prefix", "wb", input="wa wb wc\t^wc\n")
    assert result.exit_code == 2 and "line 1: its own ^prefix 'wc' and --prefix 'wb'" in result.stderr, result.stderr
    same = tfm_in_process("translate", "--checkpoint", checkpoint, "--engine", "torch", "--constraints",
                          "--prefix", "wc", input="wa wb wc\t^wc\nwd we\t\n", )
    assert same.exit_code == 0 and all(line.startswith("wc") for line in same.stdout.splitlines()), same.stderr


def test_after_a_term_the_constrained_beam_bars_pieces_that_would_continue_its_word():
    from transformer_cli.decoding.constraints import ConstrainedBeams

    beams = ConstrainedBeams([[[5, 6]], [[7]]], torch.arange(2), k=2)  # sentence 0: term 5 6; sentence 1: term 7
    beams.just_met = torch.tensor([True, False, False, True])  # rows 0 and 3 just placed their term's last token
    logprobs = torch.zeros(4, 10)
    continuations = torch.zeros(10, dtype=torch.bool)
    continuations[[2, 8]] = True  # e.g. "eeee", "s": no "▁" before a letter
    beams.bar_word_continuations(logprobs, continuations)
    barred = logprobs == float("-inf")
    assert barred[0].nonzero().flatten().tolist() == [2, 8] and barred[3].nonzero().flatten().tolist() == [2, 8]
    assert not barred[1].any() and not barred[2].any()


def test_constraints_placed_by_the_search_are_met_as_whole_words(checkpoint, lines):
    """Every term the constrained beam places is reported met under the whole-word rule."""
    translator = engine(checkpoint)
    terms = [LineTerms(constraints=tuple(absent_words(line, 2, seed))) for seed, line in enumerate(lines)]
    found = translator.translate(lines, decode=translator.settings(beam=4), terms=terms)
    assert all(not t[0].unmet for t in found), [(t[0].text, t[0].unmet) for t in found if t[0].unmet]
    assert all(missing_constraints(t[0].text, terms) == [] for t, terms in zip(found, terms))
