"""`tfm glossary` under its earlier name: the same options (`tfm glossary --help`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["tfm", "glossary", *sys.argv[1:]]
    main()
