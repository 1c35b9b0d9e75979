"""The shape the design asks of the code: no function in a product folder (``actors/``,
``learners/``, ``serving/``, ``cluster/``) over 60 lines, its docstring not counted; no import
circle among the project's modules; imports pointing down the layers (``learners/`` imports
nothing of ``actors/``, ``cluster/`` or ``serving/``; ``actors/`` nothing of ``cluster/`` or
``serving/``); each recipe's ``run`` at most 40 lines (it starts its roles and hands its step to
the shared loop), and no recipe importing another (data comes through
``cluster/data/sources.py``); and the linter (ruff) clean."""

import ast
from pathlib import Path

import pytest

from cluster.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[2]
RECIPE_MODULES = {target.split(":")[0] for target in RECIPES.values()}
PACKAGES = ("actors", "learners", "serving", "cluster")
# What each layer must not import (the packages above it).
ABOVE = {"learners": {"actors", "cluster", "serving"}, "actors": {"cluster", "serving"}}


def _functions(path: Path):
    """(name, lines) of each function in ``path``, its docstring's lines not counted."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                n -= first.end_lineno - first.lineno + 1
            yield node.name, n


def _modules() -> dict[str, Path]:
    """The project's modules by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports, at module level or inside a function: ``import a.b``
    and ``from a import b`` (b a module) are edges to a.b, ``from a.b import name`` to a.b."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {known(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
    return out - {None, module}


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_function_is_over_60_lines_not_counting_its_docstring(folder):
    long = [
        (str(p.relative_to(ROOT)), name, n)
        for p in sorted((ROOT / folder).rglob("*.py"))
        for name, n in _functions(p)
        if n > 60
    ]
    assert not long, long


def test_no_import_circle_among_the_projects_modules():
    graph = _import_graph()
    circles = _circles(graph)
    assert not circles, [{m: sorted(graph[m] & set(c)) for m in c} for c in circles]


def test_imports_point_down_the_layers():
    wrong = [
        (m, target)
        for m, targets in sorted(_import_graph().items())
        for target in sorted(targets)
        if target.split(".")[0] in ABOVE.get(m.split(".")[0], ())
    ]
    assert not wrong, wrong


def test_the_checks_find_a_circle_and_skip_a_docstring(tmp_path):
    """The checks themselves: a two-module circle is found; a docstring's lines are not counted."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    path = tmp_path / "f.py"
    path.write_text('def f():\n    """Doc\n    string."""\n' + "    x = 1\n" * 59)
    assert dict(_functions(path)) == {"f": 60}


def test_each_recipe_run_is_at_most_40_lines_and_imports_no_other_recipe():
    for module in sorted(RECIPE_MODULES):
        path = ROOT / (module.replace(".", "/") + ".py")
        assert dict(_functions(path))["run"] <= 40, module
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {
            f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names
        }
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not (imported & (RECIPE_MODULES - {module})), (module, imported & RECIPE_MODULES)


def test_the_code_passes_the_linter_and_is_formatted():
    """ruff, as configured in pyproject.toml: the linter (syntax errors, undefined names, unused
    imports) and the formatter (``ruff format --check``: the code is as ``ruff format .`` writes it)."""
    import subprocess
    import sys

    for command in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stdout[-3000:])
