"""``qkcircuits`` command line: ``scan | circuits | ablate | diagnose | report | serve``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``.
Bad input (a ``QKCircuitsError``) prints one ``error:`` line and exits with code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from .._errors import QKCircuitsError

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["scan", "circuits", "ablate", "diagnose", "report", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkcircuits", description="Find out what each attention head does.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except QKCircuitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
