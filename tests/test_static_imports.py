"""Static tools follow the project's own imports: every `deepinfer.*` module that the code imports
resolves, without running any import hook, to a file of this checkout.

Editors and type checkers (jedi, pyright, mypy) read files; they never run setuptools' editable
finder. So `deepinfer/engine` must exist as a path: the repository's top-level folders are linked
into `deepinfer/` (deepinfer/engine -> ../engine, ...). This test asks jedi, the completion
engine behind many editors, with the checkout as its project and the running interpreter (the
checkout's .venv) as its environment, where each imported module lives.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

jedi = pytest.importorskip("jedi")

REPO = Path(__file__).resolve().parents[1]
CODE = ("deepinfer", "engine", "frontend", "workers", "kernels", "scripts", "tests", "examples")


def _python_files() -> list[Path]:
    """The code's files, each once (deepinfer/engine is engine/: only deepinfer's own files)."""
    files = sorted((REPO / "deepinfer").glob("*.py"))
    for top in CODE[1:]:
        files += (p for p in (REPO / top).rglob("*.py") if ".venv" not in p.parts)
    return files


def imported_modules() -> set[str]:
    """Every `deepinfer.*` module name the code imports, as `import X` or `from X import name`
    (a `from X import name` may name a submodule: X.name counts when it is a package's file)."""
    names: set[str] = set()
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.split(".")[0] == "deepinfer"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module.split(".")[0] == "deepinfer"):
                names.add(node.module)
    return names


def test_the_top_level_folders_are_linked_into_the_package():
    for folder in ("engine", "frontend", "workers", "kernels"):
        link = REPO / "deepinfer" / folder
        assert link.is_symlink() and link.resolve() == REPO / folder, link


def test_jedi_resolves_every_deepinfer_import_to_a_file_of_the_checkout():
    modules = sorted(imported_modules())
    assert len(modules) > 100, modules  # the code's own imports were found
    project = jedi.Project(REPO)
    environment = jedi.create_environment(sys.executable, safe=False)
    source = "\n".join(f"import {m}" for m in modules)
    script = jedi.Script(source, path=REPO / "static_import_probe.py", project=project,
                         environment=environment)
    unresolved, outside = [], []
    for line, module in enumerate(modules, start=1):
        found = script.goto(line, len(f"import {module}"), follow_imports=True)
        paths = {d.module_path for d in found if d.module_path is not None}
        if not paths:
            unresolved.append(module)
            continue
        for path in paths:
            if not Path(path).resolve().is_relative_to(REPO) or not Path(path).is_file():
                outside.append((module, path))
    assert not unresolved, f"{len(unresolved)} of {len(modules)} unresolved: {unresolved}"
    assert not outside, outside
