"""The house: the import graph of ``moe_jax`` (read from the source, nothing imported) has
no loop, no import running upward, and package indexes that list what is there; no
function is longer than a reader can hold (80 lines) outside the synthetic experiments'
runners."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "moe_jax"

# Bottom up, as the package docstring of moe_jax lists them: a module may import from its
# own layer and those below.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "storage", "hardware", "partitioning", "param_paths", "plotting"}),
    frozenset({"moe", "data", "synthetic"}),
    frozenset({"models"}),
    frozenset({"runtime"}),
    frozenset({"compile", "analysis", "interop"}),
    frozenset({"commands"}),
    frozenset({"experiments"}),
    frozenset({"cli", "smoke"}),
)
MAX_FUNCTION_LINES = 80
# The synthetic experiments' runners: one experiment's steps in order, read top to bottom.
RUNNERS = ("synthetic/experiments/", "synthetic/train.py:train_runs")
# Deferred on purpose (TensorFlow / seqio load only when data is read); said in a comment.
DEFERRED = frozenset({"moe_jax.data.pipeline", "moe_jax.data.tasks", "moe_jax.data.vocab"})


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported project module, inside a function) of module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                found.append((node, target, id(node) in in_function))
    return found


GRAPH = {name: sorted({t for _, t, _ in _imports(name)}) for name in MODULES}


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    return -1  # the package itself (moe_jax/__init__.py)


def test_every_top_level_module_has_a_layer():
    tops = {m.split(".")[1] for m in MODULES if m.count(".")}
    assert tops == set().union(*LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a)
    ]
    assert upward == []


def test_commands_do_not_import_each_other():
    sideways = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if a.startswith("moe_jax.commands.")
        and b.startswith("moe_jax.commands.")
        and b != "moe_jax.commands.subcommands"
    ]
    assert sideways == []


def test_no_import_loop():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for name in MODULES:
        if name not in index:
            visit(name)
    assert loops == []


def test_project_imports_are_at_module_level_unless_deferred_on_purpose():
    hidden = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, target, in_function in _imports(name):
            said = "deferred on purpose" in lines[node.lineno - 2]
            if in_function and not (target in DEFERRED or target.startswith("moe_jax.data")):
                hidden.append(f"{path.name}:{node.lineno} {target}")
            elif in_function and not said:
                hidden.append(f"{path.name}:{node.lineno} {target} (no comment says why)")
    assert hidden == []


@pytest.mark.parametrize(
    "package",
    sorted(
        str(p.parent.relative_to(PACKAGE.parent)).replace("/", ".")
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE / "synthetic" / "experiments"  # an index of experiments
    ),
)
def test_package_index_lists_its_modules(package):
    folder = PACKAGE.parent / package.replace(".", "/")
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    words = set(doc.replace(",", " ").replace("`", " ").split())
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert sorted(modules - words) == []


def test_no_function_is_over_80_lines_outside_the_synthetic_runners():
    long = []
    for path in MODULES.values():
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            name = f"{where}:{node.name}"
            if lines > MAX_FUNCTION_LINES and not name.startswith(RUNNERS):
                long.append(f"{name} ({lines} lines)")
    assert long == []
