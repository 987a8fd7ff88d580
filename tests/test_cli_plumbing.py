"""Each common CLI flag is declared once and every output is written one way (issue 44 ask 4): ``--ray``,
``--json``, ``-o/--output``, ``--timing`` and ``--threads`` come from ``cli/_common.py``'s helpers, and "wrote PATH"
is said by ``write_output`` alone; every command that has the flag behaves the same."""

from __future__ import annotations

import re
from pathlib import Path


from qkcircuits.cli import build_parser
from qkcircuits.cli._common import write_output

CLI = Path(__file__).resolve().parents[1] / "qkcircuits" / "cli"
FLAGS = ('"--ray"', '"--json"', '"--output"', '"--timing"', '"--threads"')


def test_common_flags_are_declared_in_one_module():
    for path in sorted(CLI.glob("*.py")):
        if path.name == "_common.py":
            continue
        text = path.read_text(encoding="utf-8")
        for flag in FLAGS:
            assert flag not in text, f"{path.name} declares {flag} itself: use cli/_common.py's helper"
        assert not re.search(r"""print\(f["']wrote """, text), f"{path.name} says 'wrote' itself: use write_output"


def test_every_command_with_a_flag_reads_it_the_same(tmp_path):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    seen = {}
    for name, p in sub.choices.items():
        for action in p._actions:
            for flag in ("--ray", "--json", "--output", "--threads"):
                if flag in action.option_strings:
                    seen.setdefault(flag, []).append((name, action.nargs, action.const, action.default, action.metavar))
    assert {n for n, *_ in seen["--ray"]} == {"ablate", "circuit", "trace", "zoo"}
    assert {(nargs, const, default, metavar) for _, nargs, const, default, metavar in seen["--ray"]} == \
        {("?", "", None, "ADDRESS|local:N")}
    assert len({metavar for *_, metavar in seen["--json"]}) == 1 and len(seen["--json"]) >= 8
    assert {metavar for *_, metavar in seen["--output"]} == {"HTML"}


def test_write_output_writes_each_kind_and_says_so(tmp_path, capsys):
    write_output(None, {"a": 1})                           # the flag not given: nothing
    write_output(str(tmp_path / "d.json"), {"a": float("nan"), "b": [1.5]})
    write_output(str(tmp_path / "t.html"), "<p>x</p>", note=" (0.0 MiB)")
    assert (tmp_path / "d.json").read_text() == '{\n "a": null,\n "b": [\n  1.5\n ]\n}'
    assert (tmp_path / "t.html").read_text() == "<p>x</p>"
    assert capsys.readouterr().err.splitlines() == [f"wrote {tmp_path / 'd.json'}",
                                                    f"wrote {tmp_path / 't.html'} (0.0 MiB)"]
