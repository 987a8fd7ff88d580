"""``qkcircuits`` command line: ``scan | circuits | ablate | diagnose | report | serve | trace | attend | circuit | zoo
| cache``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``; the
modules import torch and TransformerLens inside ``run`` only, so ``--help`` and argument errors answer at
once. Bad input prints one ``error:`` line and exits with code 2, no traceback: argument errors,
``QKCircuitsError``, and output paths that name an input or cannot be written (``_common.check_paths``,
before any model loads). An unexpected failure prints one line and exits 1 (``QKCIRCUITS_DEBUG=1`` shows
the traceback). Ctrl-C prints ``interrupted`` (exit 130) and SIGTERM ``terminated`` (exit 143) at any
point, start-up included; a file being written is removed, never left half-written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import List, NoReturn, Optional

from .._foundation.errors import QKCircuitsError
from .._foundation.io import Terminated

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["scan", "circuits", "ablate", "diagnose", "report", "serve", "trace", "attend", "circuit", "zoo", "cache"]
DEBUG_HINT = "set QKCIRCUITS_DEBUG=1 for the traceback"
# Subcommands that never import torch (the rest import it first, with Ctrl-C held: see _import_torch).
TORCH_FREE = {"cache"}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage stays behind --help)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {' '.join(message.split())} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qkcircuits", description="Find out what each attention head does.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f".{name}_command", __name__).add_parser(sub)
    from ._common import add_threads_arg

    for name, p in sub.choices.items():
        if name not in TORCH_FREE:
            add_threads_arg(p)
    return parser


_SIGNALLED = {"int": False}


def _on_sigterm(signum, frame) -> NoReturn:
    raise Terminated()


def _on_sigint(signum, frame) -> NoReturn:
    # Remember it: a third-party import cut short by Ctrl-C can fail later with another error (seen: a
    # RecursionError); that failure is still the interruption, not a bug to report.
    _SIGNALLED["int"] = True
    raise KeyboardInterrupt


def _import_torch() -> None:
    """Import torch with Ctrl-C held until the import is done, then act on it.

    torch's import runs C++ (pybind11) that calls back into Python; a KeyboardInterrupt raised by the
    handler inside such a call cannot cross the C++ frames, and the process aborts ("terminate called
    after throwing an instance of 'pybind11::error_already_set'", exit -6; seen in CI with Ctrl-C at
    0.5 s). Holding the signal for the import (~1.4 s here) turns that abort into a clean exit 130.
    """
    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401  (already imported, or no handler of ours to hold)
        return
    held: List[int] = []
    ours = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import torch  # noqa: F401,F811
    finally:
        signal.signal(signal.SIGINT, ours)
    if held:
        _on_sigint(signal.SIGINT, None)


def main(argv: Optional[List[str]] = None) -> int:
    """Run one subcommand; returns the exit code (0 ok, 1 a bug, 2 bad input, 130 Ctrl-C, 143 SIGTERM). While it
    runs, a warning prints as ``warning: <message>`` on one line (not Python's file:line, category and source
    line); the caller's format is restored afterwards."""
    import warnings

    previous = threads = None
    _SIGNALLED["int"] = False
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        if threading.current_thread() is threading.main_thread():
            previous = (signal.signal(signal.SIGTERM, _on_sigterm), signal.signal(signal.SIGINT, _on_sigint))
        args = build_parser().parse_args(argv)
        from ._common import check_paths, check_shape, output_paths

        check_paths(args)                         # outputs vs inputs, before any work
        check_shape(args)                         # heads vs the model's shape from its metadata, before the load
        if args.command not in TORCH_FREE:
            _import_torch()                       # (signals held while torch imports: nothing imports it before)
        if getattr(args, "precheck", None):       # a command's own argument checks, before its model loads
            args.precheck(args)
        if args.command not in TORCH_FREE:
            if getattr(args, "threads", None):
                import torch

                threads = torch.get_num_threads()        # restored afterwards (main() may run inside a process)
                torch.set_num_threads(args.threads)
        from .._foundation.io import output_set

        with output_set(output_paths(args)):      # the run's outputs: all written at its end, or none
            return int(args.func(args) or 0)
    except QKCircuitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except SystemExit as e:                       # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except Exception as e:  # one line, not a traceback, unless asked for
        if _SIGNALLED["int"]:
            print("interrupted", file=sys.stderr)
            return 130
        if os.environ.get("QKCIRCUITS_DEBUG"):
            raise
        first = " ".join((str(e).strip().splitlines() or [""])[0].split())[:300]
        print(f"error: unexpected {type(e).__name__}: {first} ({DEBUG_HINT})", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _terminated_now(signum, frame) -> NoReturn:
    print("terminated", file=sys.stderr, flush=True)
    os._exit(143)


def entry() -> NoReturn:
    """``python -m qkcircuits`` and the ``qkcircuits`` script: run :func:`main`, exit with its code. SIGTERM
    outside ``main`` (before it installs its handler, or after its outputs are committed and it restored this one)
    is ``terminated``, exit 143, too (not a silent -15)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated_now)
    code = main()
    # CPython (3.8-3.13) marks an interruption "unhandled" when a KeyboardInterrupt leaves code run from a
    # *string* (exec/eval of source: dataclasses, typing and many libraries do that while importing), even
    # though main() caught it; under `python -m` the interpreter then kills itself with SIGINT (exit -2)
    # instead of exiting 130. Each string eval clears that mark when it starts, so evaluate one.
    exec("None", {})
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
