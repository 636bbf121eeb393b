"""The line counts in docs/architecture.md's tree of wings, generated from the package.

    python scripts/architecture_counts.py          # print the tree as it should read
    python scripts/architecture_counts.py --write  # put it into docs/architecture.md
    python scripts/architecture_counts.py --check  # exit 1 if the page's counts are stale

Counts are rounded to the hundred (a wing's size, not a diff's), so the page changes when a wing
grows or shrinks by about a hundred lines, not at every edit; tests/test_layout.py runs the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402

PACKAGE = ROOT / "transformer_cli"
PAGE = ROOT / "docs" / "architecture.md"
# A tree line: two spaces, a wing ("model/") or the top's modules, its description, its count.
WING_LINE = re.compile(r"^  (?P<wing>[a-z_]+)/ .*?(?P<count>(about )?[0-9,]+ lines)$")
TOP_LINE = re.compile(r"^  cli\.py .*\((?P<count>the top, (about )?[0-9,]+ lines)\)$")
# The package's own modules in the tree's order: the commands' front first, then the commands whose
# work spans the wings.
TOP_ORDER = ["cli.py", "evaluate.py", "plot.py", "attention_maps.py", "__main__.py"]


def lines_of(paths: list[Path]) -> int:
    return sum(len(path.read_text(encoding="utf-8").splitlines()) for path in paths)


def rounded(lines: int) -> str:
    return f"about {round(lines, -2):,} lines"


def wing_counts() -> dict[str, str]:
    """Each wing's lines (all its modules) and the top's (the package's own modules), rounded."""
    counts = {wing.name: rounded(lines_of(sorted(wing.rglob("*.py"))))
              for wing in sorted(PACKAGE.iterdir()) if (wing / "__init__.py").is_file()}
    counts[""] = rounded(lines_of(sorted(PACKAGE.glob("*.py"))))
    return counts


def generated_page(text: str) -> str:
    """`text` (the page) with every count in the tree replaced by the generated one."""
    counts = wing_counts()
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        wing, top = WING_LINE.match(body), TOP_LINE.match(body)
        if wing and wing["wing"] in counts:
            count = counts[wing["wing"]]
            head = body[: wing.start("count")].rstrip()
            body = head + " " * max(2, 98 - len(head) - len(count)) + count
        elif top:
            head = "  " + "  ".join(TOP_ORDER)
            count = f"(the top, {counts['']})"
            body = head + " " * max(2, 98 - len(head) - len(count)) + count
        out.append(body + line[len(line.rstrip("\n")):])
    return "".join(out)


def main() -> None:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/architecture.md in place")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's counts are stale")
    args = parser.parse_args()
    text = PAGE.read_text(encoding="utf-8")
    new = generated_page(text)
    if args.check:
        if new != text:
            print("docs/architecture.md: stale line counts: run python scripts/architecture_counts.py --write")
            raise SystemExit(1)
        return
    if args.write:
        staged = PAGE.with_name(PAGE.name + ".tmp")
        staged.write_text(new, encoding="utf-8")
        staged.replace(PAGE)
        return
    sys.stdout.write("".join(line for line in new.splitlines(keepends=True) if WING_LINE.match(line.rstrip("\n"))
                             or TOP_LINE.match(line.rstrip("\n"))))


if __name__ == "__main__":
    run_script(main)
