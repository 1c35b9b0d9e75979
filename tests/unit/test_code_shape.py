"""The shape the design asks of the driver side: no function in ``cluster/`` over 60 lines, each
recipe's ``run`` at most 40 (it starts its roles and hands its step to the shared loop), and no
recipe importing another (data comes through ``cluster/data_sources.py``); and the linter (ruff) clean."""

import ast
from pathlib import Path

from cluster.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[2]
RECIPE_MODULES = {target.split(":")[0] for target in RECIPES.values()}


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_in_cluster_is_over_60_lines():
    long = [(str(p.relative_to(ROOT)), name, n) for p in sorted((ROOT / "cluster").rglob("*.py"))
            for name, n in _functions(p) if n > 60]
    assert not long, long


def test_each_recipe_run_is_at_most_40_lines_and_imports_no_other_recipe():
    for module in sorted(RECIPE_MODULES):
        path = ROOT / (module.replace(".", "/") + ".py")
        assert dict(_functions(path))["run"] <= 40, module
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     for a in n.names}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not (imported & (RECIPE_MODULES - {module})), (module, imported & RECIPE_MODULES)


def test_the_code_passes_the_linter():
    """ruff, as configured in pyproject.toml (syntax errors, undefined names, unused imports)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
