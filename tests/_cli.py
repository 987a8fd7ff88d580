"""Run ``qkcircuits ...`` in this process (one import for the whole suite, not one interpreter per probe)."""

from __future__ import annotations

from qkcircuits import cli


def run(argv, capsys):
    """(exit code, stdout, stderr) of ``qkcircuits *argv``; output printed before the call is dropped."""
    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:                       # argparse may still exit on its own
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def errors(err: str):
    """The ``error:`` lines of stderr (progress notes such as "qkcircuits: using device cpu" left out)."""
    return [line for line in err.splitlines() if line.startswith("error")]


def script(name: str):
    """``scripts/<name>.py`` as a module: its ``main(argv)`` is what ``python scripts/<name>.py ARGS`` runs, here in
    this process (a fresh interpreter costs ~10 s of imports)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
