"""The namespace of the package's docstring examples, run as doctests (``pytest --doctest-modules qkcircuits``).

Every example sees exactly these names (besides its own module's globals):

- ``qk``: the package; ``torch``; ``Head`` (``qk.Head``);
- ``model`` = ``qk.load("toy-induction")``: 2 layers x 2 heads, 0.0 previous-token and 1.0 induction by
  construction, loaded fresh for each example (0.3 s), so an example may edit or hook it;
- ``tokens`` = ``qk.repeated_tokens(model, n_seqs=2, seg_len=5, seed=0)``: [BOS] + R + R, shape [2, 11];
- ``tmp``: a fresh empty folder (``pathlib.Path``) for anything an example writes.

Examples that need SmolLM2 or Ray stay ``# doctest: +SKIP (needs SmolLM2)`` / ``(needs Ray)``. This file sits at
the repository root so that its fixture reaches the doctests in ``qkcircuits/`` as well as ``tests/``; it imports
nothing from the package at import time, so tests/conftest.py's type-check hook is installed first.
"""

import doctest
import re

import pytest
from _pytest.doctest import DoctestItem

# The project writes why an example is skipped on its line: `# doctest: +SKIP (needs SmolLM2)`. The standard
# parser reads every word after "doctest:" as an option and refuses the whole module on "(needs" (ValueError:
# invalid option). Here the options are the leading run of `+NAME`/`-NAME` words; whatever follows is the reason.
doctest.DocTestParser._OPTION_DIRECTIVE_RE = re.compile(r"#\s*doctest:\s*((?:[+-][A-Z_]+(?:\s*,\s*|[ \t]+)?)+)",
                                                        re.MULTILINE)

# `python -m qkcircuits` runs the CLI when imported: not a module for doctest collection.
collect_ignore = ["qkcircuits/__main__.py"]


@pytest.fixture(autouse=True)
def _qkcircuits_doctest_namespace(request):
    if not isinstance(request.node, DoctestItem):
        return
    import torch

    import qkcircuits as qk

    torch.manual_seed(0)
    model = qk.load("toy-induction", verbose=False)
    request.getfixturevalue("doctest_namespace").update(
        qk=qk, torch=torch, Head=qk.Head, model=model,
        tokens=qk.repeated_tokens(model, n_seqs=2, seg_len=5, seed=0), tmp=request.getfixturevalue("tmp_path"))
