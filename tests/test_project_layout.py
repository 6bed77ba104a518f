"""The project's layout: the package's import graph has no circles (every ``import`` and ``from
... import`` in ``src/nvfp4_mla``, at module level or inside a function or a ``TYPE_CHECKING``
block, is an edge, and no module reaches itself along them); ``import nvfp4_mla`` loads no torch
and its public names are those of their modules; the suite fails a hung test."""

from __future__ import annotations

import ast
import importlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: its file and whether it is a package's ``__init__``."""
    found = {}
    for path in (SRC / "nvfp4_mla").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a package counts as its
    submodule where one has that name, else as the package)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, package) in known.items():
        here = name if package else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in known and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_check_sees_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    graph = import_graph()
    assert "nvfp4_mla.ops.decode_launch" in graph["nvfp4_mla.ops.decode"]  # relative imports resolved
    assert "nvfp4_mla.help_text" in graph["nvfp4_mla.cli"]


def type_checking_imports() -> dict[str, str]:
    """The names the package's ``if TYPE_CHECKING:`` block imports, each with its module (a star
    import: each name of that module's ``__all__``)."""
    tree = ast.parse((SRC / "nvfp4_mla" / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    found = {}
    for node in block.body:
        if isinstance(node, ast.AnnAssign):  # __all__'s type; its value is made at run time
            assert ast.unparse(node.target) == "__all__" and node.value is None
            continue
        assert isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names:
            if alias.name == "*":
                module_name = f"nvfp4_mla.{node.module}"
                found.update(dict.fromkeys(importlib.import_module(module_name).__all__, module_name))
            else:
                assert alias.asname == alias.name, "a PEP 484 re-export: import x as x"
                found[alias.name] = f"nvfp4_mla.{node.module}" if node.module else f"nvfp4_mla.{alias.name}"
    return found


IMPORT_SCRIPT = """
import logging, sys
import nvfp4_mla
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "cupy")))
import nvfp4_mla.__main__
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "cupy", "nvfp4_mla")))
import nvfp4_mla.config
print([type(h).__name__ for h in logging.getLogger("nvfp4_mla").handlers])
print(hasattr(nvfp4_mla, "_repr_html_"), any(m.split(".")[0] == "torch" for m in sys.modules))
from nvfp4_mla import Geometry, reference
print(Geometry is sys.modules["nvfp4_mla.geometry"].Geometry, reference is sys.modules["nvfp4_mla.reference"])
"""


def test_import_loads_no_torch():
    """``import nvfp4_mla`` and the console script's module load neither torch nor the ops (a
    Ctrl-C while they load then ends as one line: test_cli_errors); the logger gets its
    NullHandler where the library logs from; a probe of a private name (IPython's ``_repr_html_``)
    loads no torch either; ``from nvfp4_mla import`` loads a name's module."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    lines = ["[]", "['nvfp4_mla', 'nvfp4_mla.__main__']", "['NullHandler']", "False False", "True True"]
    assert (done.returncode, done.stdout.splitlines()) == (0, lines), done.stderr


def test_public_names_load_from_their_modules():
    """Each name of ``__all__`` but the version is imported for type checkers and, at run time,
    is that module's object (the module itself for a submodule); dir() lists them; another name
    is an AttributeError."""
    import nvfp4_mla

    homes = type_checking_imports()
    assert sorted(homes) == sorted(set(nvfp4_mla.__all__) - {"__version__"})
    for name, module_name in homes.items():
        module = importlib.import_module(module_name)
        expected = module if module_name == f"nvfp4_mla.{name}" else getattr(module, name)
        assert getattr(nvfp4_mla, name) is expected, name
    assert set(nvfp4_mla.__all__) <= set(dir(nvfp4_mla))
    assert nvfp4_mla.config.log is logging.getLogger("nvfp4_mla")  # a submodule, as an attribute
    assert not hasattr(nvfp4_mla, "no_such_name")


def test_a_hung_test_fails(pytestconfig):
    """pytest-timeout is active with the project's bound (pyproject.toml), where it is installed
    (``make test`` installs it; the GPU machine's python may lack it)."""
    if not pytestconfig.pluginmanager.hasplugin("timeout"):
        pytest.skip("pytest-timeout is not installed here")
    assert float(pytestconfig.getini("timeout")) == 600


def test_each_writer_entry_is_listed_where_it_is_exported():
    """A writer entry's name is listed once a layer (``ops.writer_api.__all__``,
    ``reference.writers.__all__``) and the packages export it from there (the package's ``__all__``
    is made of the first): no entry of ``ops.writers.ENTRIES`` is missing from one of them, and no
    other name is listed."""
    import nvfp4_mla
    from nvfp4_mla import ops, reference
    from nvfp4_mla.ops import writer_api, writers
    from nvfp4_mla.reference import writers as reference_writers

    names = {entry.name for entry in writers.ENTRIES}
    assert set(writer_api.__all__) == names
    assert set(reference_writers.__all__) == names | {"new_cache"}
    assert names <= set(nvfp4_mla.__all__)
    for name in names:
        assert getattr(ops, name) is getattr(writer_api, name) is getattr(nvfp4_mla, name), name
        assert getattr(reference, name) is getattr(reference_writers, name), name
