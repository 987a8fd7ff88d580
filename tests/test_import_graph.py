"""The package's import graph, read from the source (every ``import`` statement, at the top of a module AND inside
functions; ``if TYPE_CHECKING:`` blocks excepted; and every import by string: ``importlib.import_module("...")`` with
a constant name, absolute or relative to the package, and a ``"qkcircuits.x.y:fn"`` string constant, the form jobs
are named in and imported from when they run): no circle, and no module imports a later
layer, except the string imports listed in ``KNOWN_UPWARD`` (each with the issue that removes it).

A function-level import that keeps ``import qkcircuits`` light (torch-free CLI start) is fine when it points DOWN
the layer order (docs/architecture.md); a circle is not, wherever its imports sit: it works only by the order in
which the modules happen to be imported first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Set

import qkcircuits

# docs/architecture.md's order; a module may import its own layer and the layers before it. ``fixtures`` (the toy
# model, built from torch and TransformerLens only) comes first: ``qk.load("toy-induction")`` builds it.
LAYERS = ["fixtures", "_foundation", "_weights", "_analysis", "_paths", "_explain", "_tasks", "_scale", "weights",
          "results", "tasks", "viz", "plot", "cli", "__init__", "__main__"]


def modules(root: Path, package: str) -> Dict[str, Path]:
    """``{"pkg.sub.mod": path}`` for every ``.py`` under ``root`` (a package's ``__init__`` named as the package)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = [package, *p.relative_to(root).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    """``{module: modules it imports}`` inside ``package``: ``from .x import name`` → ``x``; ``from . import sub`` →
    ``sub`` (a submodule) or the package itself (a name defined in its ``__init__``)."""
    mods = modules(root, package)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
        here = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                named = string_import(node, package, m if path.name == "__init__.py" else here)
                targets = [named] if named else []
            for t in targets:
                while t not in mods and "." in t:      # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t in mods and t != m:
                    graph[m].add(t)
    return graph


def string_import(node: ast.AST, package: str, here: str) -> Optional[str]:
    """The module a string names for import: ``importlib.import_module(NAME)`` / ``import_module(NAME, __name__)``
    with a constant NAME (``.x.y`` relative to the package ``here``), or a constant ``"pkg.x.y:fn"`` / ``"pkg.x.y:"``
    (a job named by its module, imported when it runs); None for anything else (a dotted name without the colon is
    not read as an import: entry-point groups and schemas are spelled ``"qkcircuits.tasks"``)."""
    if isinstance(node, ast.Call) and (ast.unparse(node.func).endswith("import_module")) and node.args \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        name = node.args[0].value
        if name.startswith("."):
            dots = len(name) - len(name.lstrip("."))
            parts = here.split(".")
            name = ".".join(parts[:len(parts) - dots + 1] + [name.lstrip(".")])
        return name if name.split(".")[0] == package else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            re.fullmatch(rf"{re.escape(package)}(\.[A-Za-z_]\w*)+:\w*", node.value):
        return node.value.split(":")[0]
    return None


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


ROOT = Path(qkcircuits.__file__).parent
GRAPH = import_graph(ROOT, "qkcircuits")
# The upward imports known and meant to go, each (module, layer it imports by string) with the issue that removes it.
# None now: issue 44 ask 1 ("shards once") removed the last one, qk.Ray's table of "qkcircuits._scale.…:fn" job
# strings and its string import of _scale.distributed (each analysis declares its shards once; backends map them).
KNOWN_UPWARD: dict = {}


def layer(m: str) -> str:
    return m.split(".")[1] if m.count(".") else "__init__"


def known(a: str, b: str) -> bool:
    return (a, layer(b)) in KNOWN_UPWARD


def test_the_package_has_no_import_circle():
    assert len(GRAPH) > 90 and sum(map(len, GRAPH.values())) > 300        # the whole package was read
    graph = {a: {b for b in bs if not known(a, b)} for a, bs in GRAPH.items()}
    assert cycles(graph) == [], "import circles (function-level and string imports included)"


def test_no_module_imports_a_later_layer():
    unknown = sorted({layer(m) for m in GRAPH} - set(LAYERS))
    assert not unknown, f"a new top-level module or package {unknown}: place it in LAYERS (and docs/architecture.md)"
    up = [(a, b) for a, bs in sorted(GRAPH.items()) for b in sorted(bs) if LAYERS.index(layer(b)) > LAYERS.index(layer(a))]
    assert [f"{a} -> {b}" for a, b in up if not known(a, b)] == []
    # every known exception is still there (a stale entry would excuse the next upward import silently)
    assert {(a, layer(b)) for a, b in up if known(a, b)} == set(KNOWN_UPWARD)


def test_the_graph_sees_function_level_imports_and_finds_a_circle(tmp_path):
    """The checker itself: a circle closed by a function-level import, and one through a package ``__init__``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n__version__ = '1'\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f      # late, but still a circle\n    return f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import __version__\n")
    (pkg / "sub" / "d.py").write_text("import pkg.sub.c\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg.a import f\n")
    g = import_graph(pkg, "pkg")
    assert g["pkg.b"] == {"pkg.a"} and g["pkg.sub.c"] == {"pkg"} and g["pkg.sub.d"] == {"pkg.sub.c"}
    assert cycles(g) == [["pkg.a", "pkg.b"]]
    (pkg / "a.py").write_text("from .sub import c\n")      # pkg -> a -> sub.c -> pkg (the __version__ loop)
    (pkg / "b.py").write_text("")
    assert cycles(import_graph(pkg, "pkg")) == [["pkg", "pkg.a", "pkg.sub.c"]]


def test_the_graph_reads_string_imports(tmp_path):
    """Imports by string count: a job named "pkg.mod:fn", ``importlib.import_module`` absolute and relative (its
    package ``__name__``); a string that is no import (prose, an f-string, another package, an entry-point group
    spelled like a module) does not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import importlib\n\ndef f(name):\n    importlib.import_module('.c', __name__)\n"
                                     "    return importlib.import_module(f'.{name}', __name__)\n")
    (pkg / "a.py").write_text("JOBS = {'x': 'pkg.b:run'}\nDOC = 'pkg.b is where it runs'\nOTHER = 'numpy.linalg:norm'\n"
                              "GROUP = 'pkg.c'\n")
    (pkg / "b.py").write_text("import importlib\n\ndef g():\n    return importlib.import_module('pkg.c')\n")
    (pkg / "c.py").write_text("PREFIX = 'pkg.a:'\n")
    g = import_graph(pkg, "pkg")
    assert g == {"pkg": {"pkg.c"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    # and the package's own modules name none of _scale's by string below it: backends imports the Ray workers by
    # statement, from its own layer
    assert "qkcircuits._foundation.workers" in GRAPH["qkcircuits._foundation.backends"]
    assert not any(m.startswith("qkcircuits._scale") for m in GRAPH["qkcircuits._foundation.backends"])
