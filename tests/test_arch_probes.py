"""The adapters own the architecture: ``getattr``/``hasattr`` probes of a model's modules or configs live in
``qkcircuits/_foundation/arch/`` and nowhere else (issue 36, ask 1), and so does every branch on the attention
family (issue 44, ask 2): no ``x.family == ...``, ``family(model) != ...`` or ``fam in (...)`` outside it — what a
caller needs of a family is one adapter method, each family answering it.

A probe is a ``getattr(x, name)`` / ``hasattr(x, name)`` call whose object names a model, its config, a block, an
attention, a norm, an MLP, a hook point or the wrapped Hugging Face module (``PROBE_TARGET``). Not probes: our own
records on a model (``_qk_*`` attributes, ``own_tokenizer.ATTR``), the tokenizer, and ``importlib`` lookups. The
few that remain are listed in ``SURVIVORS`` with the reason each cannot move; the test fails on any other, and
on more than five survivors.

What it does not count (read by review instead): plain attribute chains (``model.blocks[L].attn``: the structure
TransformerLens guarantees, used everywhere to reach a hook point), class-name checks, a probe through a variable
whose name the pattern does not know, and ``vars(module)`` (the skips' check that no one else overrides a
module's forward: hook machinery, not architecture).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "qkcircuits"
PROBE_TARGET = re.compile(r"\b(model|cfg|config|blk|block|blocks|attn|module|ln1|ln2|ln_final|comp|orig|bridge|mlp|"
                          r"norm|post|embed|rotary|original_model|hf_cfg|att|lin|mod|oc|native|hook)\b")
NOT_ARCHITECTURE = {"tokenizer", "qk_load_spec", "qk_tokenizer_own", "__name__", "name_or_path", "ATTR"}
SURVIVORS = {
    ("qkcircuits/_foundation/model.py", "getattr(hf_model.config, 'architectures')"):
        "the loader names a GGUF model's architecture before TransformerLens picks its adapter: no adapter exists "
        "yet (it is what lets one exist)",
}


def probes(source: str, rel: str) -> List[Tuple[str, int, str]]:
    """(file, line, call) of every architecture probe in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        target = ast.unparse(node.args[0])
        name = node.args[1].value if isinstance(node.args[1], ast.Constant) else ast.unparse(node.args[1])
        if name in NOT_ARCHITECTURE or str(name).startswith("_qk_") or target.startswith("importlib."):
            continue
        if PROBE_TARGET.search(target):
            out.append((rel, node.lineno, f"{node.func.id}({target}, {name!r})"))
    return out


def _is_family(node: ast.AST) -> bool:
    """``x.family``, ``family(...)`` / ``arch.family(...)``, or a name ``family`` / ``fam``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "family"
    if isinstance(node, ast.Call):
        f = node.func
        return (isinstance(f, ast.Name) and f.id == "family") or (isinstance(f, ast.Attribute) and f.attr == "family")
    return isinstance(node, ast.Name) and node.id in ("family", "fam")


def family_branches(source: str, rel: str) -> List[Tuple[str, int, str]]:
    """(file, line, comparison) of every ``==`` / ``!=`` / ``in`` / ``not in`` comparison with the attention family
    in ``source`` (a ``match`` on it too)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
            if any(isinstance(op, ops) for op in node.ops) and any(
                    _is_family(x) for x in [node.left, *node.comparators]):
                out.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and _is_family(node.subject):
            out.append((rel, node.lineno, f"match {ast.unparse(node.subject)}"))
    return sorted(out)


def _outside_arch():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if "/_foundation/arch/" not in rel:
            yield rel, path.read_text(encoding="utf-8")


def package_probes() -> List[Tuple[str, int, str]]:
    return [p for rel, src in _outside_arch() for p in probes(src, rel)]


def package_family_branches() -> List[Tuple[str, int, str]]:
    return [b for rel, src in _outside_arch() for b in family_branches(src, rel)]


def test_no_architecture_probe_outside_the_adapters():
    found = package_probes()
    unexpected = [f"{f}:{line}: {call}" for f, line, call in found if (f, call) not in SURVIVORS]
    assert not unexpected, "architecture probes outside _foundation/arch (move them into an adapter):\n" + \
        "\n".join(unexpected)
    assert len(found) <= 5 and len(SURVIVORS) <= 5


def test_the_counter_sees_a_probe():
    # the rule itself: each of these is a probe, none of the second group is
    src = ("getattr(model.cfg, 'rmsnorm_uses_offset', False)\nhasattr(blk.attn, 'q_norm')\n"
           "getattr(self.bridge.original_component, 'scaling', None)\n"
           "getattr(model, '_qk_adapters', None)\ngetattr(model, 'tokenizer', None)\n"
           "getattr(importlib.import_module(m), 'attr')\ngetattr(args, 'json', None)\n")
    assert [call for _, _, call in probes(src, "x.py")] == [
        "getattr(model.cfg, 'rmsnorm_uses_offset')", "hasattr(blk.attn, 'q_norm')",
        "getattr(self.bridge.original_component, 'scaling')"]


def test_no_family_branch_outside_the_adapters():
    found = package_family_branches()
    assert not found, "branches on the attention family outside _foundation/arch (answer the question in the " \
        "adapter, one method per family):\n" + "\n".join(f"{f}:{line}: {c}" for f, line, c in found)


def test_the_counter_sees_a_family_branch():
    # each of the first group is a branch on the family; none of the second group is
    src = ("if att.family == 'latent': pass\nif family(model) != 'latent': pass\nok = arch.family(m) in FAMILIES\n"
           "if fam == 'standard': pass\nif adapter(model, 0).family is not None: pass\n"
           "match att.family:\n    case 'latent': pass\n"
           "settings = {'family': att.family}\nname = family(model)\nif att.n_heads == 2: pass\n"
           "x = 'font-family' == css\n")
    assert [(line, c) for _, line, c in family_branches(src, "x.py")] == [
        (1, "att.family == 'latent'"), (2, "family(model) != 'latent'"), (3, "arch.family(m) in FAMILIES"),
        (4, "fam == 'standard'"), (5, "adapter(model, 0).family is not None"), (6, "match att.family")]
    # and the package's own file would fail with one put back
    assert family_branches("def f(att):\n    return att.family == 'latent'\n", "y.py")
