"""``qkcircuits`` command line: ``scan | circuits | ablate | diagnose | report | serve``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``.
Bad input prints one ``error:`` line and exits with code 2, no traceback: argument errors,
``QKCircuitsError``, and output paths that cannot be written (checked before any model loads).
An unexpected failure prints one line and exits 1 (``QKCIRCUITS_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, NoReturn, Optional

from .._foundation.errors import QKCircuitsError
from .._foundation.io import check_writable

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["scan", "circuits", "ablate", "diagnose", "report", "serve", "trace", "zoo", "circuit"]
# Arguments that name files a subcommand will write.
OUTPUT_ARGS = ("json", "csv", "output")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage stays behind --help)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qkcircuits", description="Find out what each attention head does.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for name in OUTPUT_ARGS:
            if getattr(args, name, None):
                check_writable(getattr(args, name))
        return int(args.func(args) or 0)
    except QKCircuitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, not a traceback, unless asked for
        if os.environ.get("QKCIRCUITS_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"error: unexpected {type(e).__name__}: {first} (set QKCIRCUITS_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
