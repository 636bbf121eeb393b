"""The shape of the code base: what keeps it readable is checked like behaviour.

- model.py reads beside the paper (≤ 500 lines); no function in the package is over 100 lines;
- the modules import one way (no cycle, function-level imports included);
- the README is a user's page (≤ 350 lines) and nothing tracked speaks of how the work is organised.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "transformer_cli"


def test_model_file_and_functions_stay_short():
    assert len((PACKAGE / "model.py").read_text(encoding="utf-8").splitlines()) <= 500
    long = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer_cli."):
            found.add(node.module.split(".")[1])
    return found


def test_modules_import_one_way():
    graph = {path.stem: imports_of(path) for path in PACKAGE.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError("import cycle: " + " → ".join([*stack[stack.index(module):], module]))
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*stack, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    # The paper's model depends on nothing of the toolkit but its kernels and decoding state.
    assert graph["model"] <= {"kernels", "decoder_state"}, graph["model"]
    assert not graph["kernels"] and not graph["decoder_state"]


PROCESS_WORDS = re.compile(r"(first|second|third|[a-z]+th|this|last|previous|earlier|next) session|issue #?[0-9]+",
                           re.IGNORECASE)


def test_readme_is_a_users_page_and_nothing_speaks_of_the_process():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 350
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked, "not a git checkout"
    offending = []
    for name in tracked:
        path = ROOT / name
        if name.startswith("tests/") or not path.is_file() or path.suffix in {".png", ".gz"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offending += [f"{name}: {m.group(0)}" for m in PROCESS_WORDS.finditer(text)]
    assert not offending, offending
