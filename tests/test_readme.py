"""The README runs as written (issue 37 ask 1): its Python block prints what its ``# -> `` comments show (on the toy
model here, with the SmolLM2 names swapped for the toy's and every number compared by shape; exactly, up to the
``...`` it leaves out, on SmolLM2 under ``-m smollm2``), it starts with exactly the two commands, and
``bash scripts/dev.sh qk ARGS`` runs a qkcircuits command in ``.venv`` without activating it (on a stand-in
``.venv`` whose pip fails if called, so the test proves nothing is installed)."""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TOY = {'"smollm2-135m"': '"toy-induction"', '"18.6"': '"1.0"'}     # the SmolLM2 names -> the toy's


def python_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) == 1, "the README has one Python block"
    return blocks[0]


def expected(code: str):
    """The ``# -> `` comments, in order (one printed line each)."""
    return [m.group(1).strip() for m in re.finditer(r"#\s*->\s*(.*)$", code, re.M)]


def run_block(code: str):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return [line for line in out.getvalue().splitlines() if line.strip()]


def matches(want: str, got: str) -> bool:
    """doctest's ELLIPSIS rule: ``...`` in ``want`` stands for anything."""
    return doctest.OutputChecker().check_output(want + "\n", got + "\n", doctest.ELLIPSIS)


def shape(text: str) -> str:
    """Every number as N: the toy's heads and scores differ from SmolLM2's, their form must not."""
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", text)


def test_readme_starts_with_the_two_commands():
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    cmds = [line.split("#")[0].strip() for line in first.splitlines() if line.split("#")[0].strip()]
    assert cmds == ["bash scripts/dev.sh scan", "bash scripts/dev.sh test"]
    assert README.index("```bash") < README.index("```python")


def test_python_block_on_the_toy_model():
    code = python_block()
    for a, b in TOY.items():
        assert a in code
        code = code.replace(a, b)
    want, got = expected(code), run_block(code)
    assert len(want) == len(got) == 3, (want, got)
    for w, g in zip(want, got):
        assert matches(shape(w), shape(g)), (w, g)
    assert got[1].startswith("1.0 reads its keys from 0.0 (previous-token; ")      # the fixture, by construction
    assert got[2].startswith("Key side: 0.0 ")                                     # why 1.0 attends: 0.0's write


@pytest.mark.smollm2
def test_python_block_on_smollm2():
    code = python_block()
    want, got = expected(code), run_block(code)
    assert len(want) == len(got) and all(matches(w, g) for w, g in zip(want, got)), list(zip(want, got))


def test_dev_sh_qk_runs_a_command_in_the_venv(tmp_path):
    # a copy of the repository's set-up script and pyproject beside a stand-in .venv: python is this interpreter
    # (a venv with the shared environment's packages on its path), pip fails if anything calls it, and the install
    # stamp is current, so `qk` must set up nothing and run the command
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "dev.sh", repo / "scripts" / "dev.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" "$@"\n')
    (bin_ / "pip").write_text("#!/bin/sh\necho 'pip was called' >&2\nexit 3\n")
    for f in ("python", "pip"):
        (bin_ / f).chmod(0o755)
    digest = subprocess.run("cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16", shell=True, cwd=repo,
                            capture_output=True, text=True, check=True).stdout.strip()
    (repo / ".venv" / ".qkcircuits-installed").write_text(digest + "\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run(["bash", "scripts/dev.sh", "qk", "scan", "toy-induction", "--quiet"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-800:]
    assert "pip was called" not in out.stderr
    assert re.search(r"^\s*1\.0\s+1\.000", out.stdout, re.M), out.stdout       # the induction head, by construction
