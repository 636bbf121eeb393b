"""The shape of the code base: what keeps it readable is checked like behaviour.

- the package is in wings, one per stage (docs/architecture.md), and imports between wings run one
  way, lower wings never importing higher ones (function-level and type-checking imports included);
  no import cycle inside a wing; the model wing imports nothing of the toolkit but itself;
- a run directory's files are named in experiment/ alone (its RunDirectory says where each lies);
- model/transformer.py reads beside the paper (≤ 500 lines); no function in the package is over 100 lines,
  none in decoding/ and serve/ over 80;
- the README is a user's page (≤ 350 lines) and nothing tracked speaks of how the work is organised.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "transformer_cli"
# Lowest first: a wing imports its own modules and those of the wings before it, never after.
WINGS = ["model", "runtime", "experiment", "interop", "data", "decoding", "documents", "training", "serve"]
# The modules at the top: the commands' front (cli, __main__) and the commands whose work spans the
# stages (evaluate, plot, attention_maps). They may import any wing; no wing imports them.
TOP = {"__init__", "__main__", "cli", "evaluate", "plot", "attention_maps"}


def module_name(path: Path) -> str:
    """transformer_cli/decoding/search.py → "decoding.search"; the package's own __init__ → "__init__"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `path` imports, at module level, inside functions or for type checking."""
    package = module_name(path).split(".")
    if path.name != "__init__.py" or package == ["__init__"]:
        package = package[:-1]  # a module's package; a wing's __init__ is its own package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "transformer_cli":
            base = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("transformer_cli."):
                    found.add(".".join(alias.name.split(".")[1:]))
            continue
        else:
            continue
        for alias in node.names:  # `from .. import files` names a module; `from .files import x` a name
            name = ".".join([*base, alias.name])
            found.add(name if name in modules else (".".join(base) or "__init__"))
    return found


def wing_of(module: str) -> str:
    return module.split(".")[0] if "." in module or module in WINGS else module


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def layout_violations(graph: dict[str, set[str]]) -> list[str]:
    """Everything in `graph` (module → the modules it imports) that breaks the wing order."""
    problems = []
    for module, imported in sorted(graph.items()):
        wing = wing_of(module)
        if wing not in WINGS and module not in TOP:
            problems.append(f"{module}: neither in a wing ({', '.join(WINGS)}) nor named at the top")
            continue
        for other in sorted(imported):
            other_wing = wing_of(other)
            if other == "__init__" or wing in TOP and other_wing in WINGS:
                continue  # the package root's constants; the top imports every wing
            if wing == "model" and other_wing != "model":
                problems.append(f"{module} imports {other}: the model wing imports nothing outside it")
            elif other_wing in TOP:
                if wing not in TOP:
                    problems.append(f"{module} imports {other}: a wing never imports the top")
            elif WINGS.index(other_wing) > WINGS.index(wing):
                problems.append(f"{module} imports {other}: {wing} comes before {other_wing} in the wing order")
    return problems + import_cycles(graph)


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    done: set[str] = set()
    cycles: list[str] = []

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            cycles.append("import cycle: " + " → ".join([*stack[stack.index(module):], module]))
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*stack, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_every_module_is_in_a_wing_and_imports_run_one_way():
    graph = import_graph()
    assert layout_violations(graph) == []
    assert graph["model.transformer"] <= {"model.kernels", "model.decoder_state", "model.shape"}, graph["model.transformer"]


# What a run directory holds (experiment/rundir.py). runtime/files.py, below experiment in the wing
# order, keeps its own list of them: every writer refuses to write over a run's files.
RUN_FILES = {"prepare.json", "config.yaml", "prepare_report.json", "shape_choice.json", "metrics.jsonl", "scores.json",
             "checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_avg.pt", "checkpoint_ema.pt", "halves.json",
             "shortlist.txt", "spm.model", "spm.src.model", "spm.tgt.model"}
RUN_FOLDERS = {"checkpoints", "data", "eval", "filter_models", "tensorboard", "distilled"}
NAMES_RUN_FILES = {"experiment", "runtime.files"}


def run_file_names(source: str) -> list[str]:
    """Where `source` names a run file: a string that is one's name, or a path joined onto a run's folder
    (`run / "eval"`; f-strings' expressions included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        named = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
        joined = node.right.value if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(
            node.right, ast.Constant) and isinstance(node.right.value, str) else None
        if named in RUN_FILES or joined in RUN_FOLDERS:
            found.append(f"line {node.lineno}: {named or joined!r}")
    return found


def test_no_module_outside_experiment_names_a_run_file():
    named = {module: run_file_names(path.read_text(encoding="utf-8")) for module, path in all_modules().items()
             if module not in NAMES_RUN_FILES and wing_of(module) not in NAMES_RUN_FILES}
    assert {module: lines for module, lines in named.items() if lines} == {}
    assert run_file_names(all_modules()["experiment.rundir"].read_text(encoding="utf-8"))  # where they are named
    for source in ('path = run / "metrics.jsonl"', 'f"{run / \'eval\'}"', 'Path(x) / "checkpoints" / name',
                   'SCORES = "scores.json"'):
        assert run_file_names(source), source
    assert run_file_names('x = "the run\'s config.yaml"; y = run / "vocab.json"; z = {"data": 1}') == []


def test_an_import_against_the_wing_order_or_a_cycle_is_caught():
    graph = import_graph()
    for module, imported, expected in [
        ("decoding.search", "training.train", "decoding comes before training"),
        ("model.transformer", "runtime.errors", "the model wing imports nothing outside it"),
        ("runtime.files", "cli", "a wing never imports the top"),
        ("decoding.top_k", "decoding.search", "import cycle"),
    ]:
        broken = {**graph, module: graph[module] | {imported}}
        assert any(expected in problem for problem in layout_violations(broken)), (module, imported)
    assert any("neither in a wing" in p for p in layout_violations({**graph, "stray": set()}))
    # A function-level import counts: engine.py imports tfm's own engine only inside a function.
    assert "decoding.torch_engine" in graph["decoding.engine"]


def test_each_wing_says_what_it_holds_and_re_exports_nothing():
    for wing in WINGS:
        tree = ast.parse((PACKAGE / wing / "__init__.py").read_text(encoding="utf-8"))
        docstring = ast.get_docstring(tree) or ""
        assert len(docstring.split()) >= 20, f"{wing}/__init__.py: say what the wing holds and may import"
        assert "may import" in docstring.lower(), wing
        assert not [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))], wing


# The most lines a function may have: the search and the server, where every feature lands, are held
# to less than the rest.
FUNCTION_LINES = {"decoding": 80, "serve": 80}


def test_model_file_and_functions_stay_short():
    assert len((PACKAGE / "model" / "transformer.py").read_text(encoding="utf-8").splitlines()) <= 500
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        limit = FUNCTION_LINES.get(path.relative_to(PACKAGE).parts[0], 100)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


PROCESS_WORDS = re.compile(r"(first|second|third|[a-z]+th|this|last|previous|earlier|next) session|issue #?[0-9]+",
                           re.IGNORECASE)


def test_readme_is_a_users_page_and_nothing_speaks_of_the_process():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 350
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked, "not a git checkout"
    offending = []
    for name in tracked:
        path = ROOT / name
        if name.startswith("tests/") or not path.is_file() or path.suffix in {".png", ".gz", ".xz"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offending += [f"{name}: {m.group(0)}" for m in PROCESS_WORDS.finditer(text)]
    assert not offending, offending


def wing_paragraphs(page: str) -> dict[str, str]:
    """docs/architecture.md's paragraph of each wing ("**decoding/** … ") and of the top ("**The top**")."""
    paragraphs = {}
    for block in page.split("\n\n"):
        head = re.match(r"\*\*([a-z_]+)/\*\*|\*\*The top\*\*", block)
        if head:
            paragraphs[head.group(1) or ""] = block
    return paragraphs


def architecture_drift(page: str) -> list[str]:
    """Modules the page or a wing's __init__ fails to name, and module names the page gives that do not exist."""
    paragraphs = wing_paragraphs(page)
    problems = []
    for name, path in all_modules().items():
        if path.name == "__init__.py":
            continue
        wing = name.split(".")[0] if "." in name else ""
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", paragraphs.get(wing, "")):
            problems.append(f"{path.relative_to(PACKAGE)}: not named in docs/architecture.md's {wing or 'top'} paragraph")
        if wing and path.name not in (ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text(
                encoding="utf-8"))) or ""):
            problems.append(f"{path.relative_to(PACKAGE)}: not named in {wing}/__init__.py")
    for wing, paragraph in paragraphs.items():
        for named in re.findall(r"(?<![\w/.])((?:[a-z_]+/)?[a-z_]+\.py)\b", paragraph):
            where = PACKAGE / named if "/" in named else PACKAGE / wing / named
            if not where.is_file():
                problems.append(f"docs/architecture.md names {named} ({wing or 'top'}), which does not exist")
    return problems


def test_architecture_page_names_every_module_and_its_counts_are_current():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert architecture_drift(page) == []
    # A module added without its line is caught, and so is a line naming a module that went away.
    assert any("stray.py" in p for p in architecture_drift(page.replace("`search.py` (greedy", "`stray.py` (greedy")))
    assert any("search.py: not named" in p for p in architecture_drift(page.replace("search.py", "seek.py")))
    spec = importlib.util.spec_from_file_location("architecture_counts", ROOT / "scripts" / "architecture_counts.py")
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    assert counts.generated_page(page) == page, "stale line counts: run python scripts/architecture_counts.py --write"


def test_decode_settings_travel_as_one_decode_config():
    """A function that takes the decode settings (a DecodeConfig) takes no beam, nbest or length penalty
    beside them: the settings are one carrier, copied and updated (DecodeConfig.updated) where a
    command or request changes them, and their rules are checked there."""
    separate = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                carried = any(a.annotation is not None and "DecodeConfig" in ast.unparse(a.annotation)
                              for a in arguments)
                beside = [a.arg for a in arguments if a.arg in ("beam", "nbest", "length_penalty", "alpha")]
                if carried and beside:
                    separate.append(f"{path.relative_to(PACKAGE)}:{node.name} ({', '.join(beside)})")
    assert not separate, separate
