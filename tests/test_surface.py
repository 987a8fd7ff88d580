"""A surface you can read (issue 44, ask 5): the root namespace is one explicit list and nothing else, no shim
tables or renaming decorators are left, no two modules share a file name, and docs/architecture.md names only
modules and files that exist."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import qkcircuits as qk

ROOT = Path(qk.__file__).resolve().parent
REPO = ROOT.parent


def test_no_two_modules_share_a_file_name():
    names = Counter(p.name for p in ROOT.rglob("*.py") if p.name != "__init__.py")
    assert len(names) > 100
    assert sorted(n for n, c in names.items() if c > 1) == []


def test_the_root_namespace_is_the_one_list():
    listed = [n for names in qk._EXPORTS.values() for n in names.split(", ")]
    names = [n.partition(" as ")[2] or n for n in listed]
    assert len(names) == len(set(names)) and sorted(names) == qk.__all__
    assert [n for n in dir(qk) if not n.startswith("_")] == qk.__all__
    for name in qk.__all__:                              # each importable, from where the list says
        module, attr = qk._HOME[name]
        value = getattr(qk, name)
        want = (importlib.import_module(f"qkcircuits.{attr}") if module == "." else
                getattr(importlib.import_module(module, "qkcircuits"), attr))
        assert value is want, name
    # a fresh process: the same list, and `import qkcircuits` (the list included) loads no torch
    code = "import sys, qkcircuits as qk; print(len(qk.__all__), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(qk.__all__)), "False"]


def test_no_shims_are_left():
    source = (ROOT / "__init__.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert not assigned & {"_MOVED", "_DEPRECATED", "_RENAMED"}
    assert not (ROOT / "_api.py").exists() and not (ROOT / "_foundation" / "renamed.py").exists()
    offenders = []
    for path in ROOT.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for pattern in (r"@renamed\(", r"\brenamed_arg\(", r"DeprecationWarning", r"is deprecated"):
            if re.search(pattern, text):
                offenders.append(f"{path.relative_to(REPO)}: {pattern}")
    assert offenders == []


def test_every_path_the_architecture_page_names_exists():
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set()
    for ref in re.findall(r"`([A-Za-z_][\w/]*(?:\.py)?)`", page):          # `_weights/offsets`, `cli/_common` ...
        head = ref.split("/")[0]
        if "/" in ref and (head.startswith("_") or head in ("cli", "viz", "arch")):
            named.add(ref)
    named |= set(re.findall(r"\b(tests/[\w/]+\.py)", page)) | set(re.findall(r"\b(docs/[\w/]+\.md)", page))
    assert len(named) > 60
    missing = []
    for ref in sorted(named):
        if ref.startswith(("tests/", "docs/")):
            ok = (REPO / ref).exists()
        else:
            base = ROOT / (ref if not ref.startswith("arch/") else "_foundation/" + ref)
            base = base.with_suffix("") if base.suffix == ".py" else base
            ok = base.with_suffix(".py").exists() or (base / "__init__.py").exists()
        if not ok:
            missing.append(ref)
    assert missing == []
    # the module map (the table headed "| module | one concept |"): its first column names every module of the
    # package, and only modules that exist (a bare name continues the folder of the name before it in its row)
    table = page[page.index("| module | one concept |"):].split("\n\n")[0]
    rows = re.findall(r"^\| (`[^|]+`) \|", table, re.M)
    mapped = set()
    for row in rows:
        folder = ""
        for ref in re.findall(r"`([\w/]+)`", row):
            if "/" in ref:
                folder = ref.rpartition("/")[0]
            mapped.add(ref if "/" in ref or not folder else f"{folder}/{ref}")
    assert [m for m in sorted(mapped) if not ((ROOT / m).with_suffix(".py").exists() or (ROOT / m / "__init__.py").exists())] == []
    modules = {str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - mapped) == [], "a module missing from docs/architecture.md's module map"
