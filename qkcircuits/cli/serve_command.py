"""``qkcircuits serve MODEL [--port P] [--host 127.0.0.1] [--trace t.json] [--circuit c.json]``: the local web app (Flask, served by werkzeug)."""

from __future__ import annotations

import argparse
import sys

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, positive_int
from .report_command import add_result_args, check_attend, check_trace, inputs_and_model

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="local web app: pick a head, see its QK/OV heatmaps and attention patterns",
                       description="Serve a local web app (bound to 127.0.0.1 by default) that computes a head's QK/OV "
                                   "heatmaps and attention pattern on demand. Works offline.")
    add_model_args(p)
    p.add_argument("--port", type=positive_int, default=8050, help="port (default 8050)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add_result_args(p)
    p.add_argument("--circuit", metavar="JSON", help="a circuit from `qkcircuits circuit --json`: the report's circuit "
                                                     "section (core circuit graph, curve, roles) above the heads")
    p.add_argument("--no-scan", action="store_true", help="do not scan at start-up (grids show eigenvalue copying only)")
    p.add_argument("--attend", metavar="JSON", action="append",
                   help="a result of `qkcircuits attend --json` (repeat for several): a 'why it attends' section "
                        "(default: the top head of each labelled score, explained when the page first loads)")
    p.add_argument("--no-attend", action="store_true", help="no 'why it attends' sections")
    p.add_argument("--max-request-work", type=work_arg, default=None, metavar="N",
                   help="multiply-adds one request may cost, estimated before it runs (default 1e11; a request past "
                        "it gets a 422; 0: no bound)")
    p.set_defaults(func=run)


def work_arg(text: str) -> float:
    """A number of multiply-adds: ``1e11``, ``200000000``, or 0 (no bound); one line for anything else."""
    try:
        value = float(text) if len(text.strip()) <= 24 else float("nan")
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of multiply-adds such as 1e11 (0: no bound), got "
                                         f"{text[:40]!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from .._analysis.detect import scan
    from ..viz import create_app
    from ..viz._app import make_server

    if args.port > 65535:
        raise QKCircuitsError(f"port {args.port} is out of range 1-65535")
    model, scores, effects, diagnostics, trace, circuit, attend = inputs_and_model(args)
    trace = check_trace(trace, model, args)  # before the scan and before listening
    attend = check_attend(attend, model, args)
    if scores is None and not args.no_scan:
        scores = scan(model, eigen_copying=False)
    from ..viz._app import MAX_WORK

    work = MAX_WORK if args.max_request_work is None else (args.max_request_work or None)
    app = create_app(model, scores=scores, effects=effects, diagnostics=diagnostics, title=args.model, trace=trace,
                     hosts=[args.host], circuit=circuit, attend=attend, max_work=work)
    try:
        server = make_server(args.host, args.port, app)
    except OSError as e:
        raise QKCircuitsError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); try another --port") from None
    if args.host not in LOOPBACK:
        print(f"warning: listening on {args.host}: other machines can reach this app", file=sys.stderr)
    print(f"serving {args.model} on http://{args.host}:{server.port}/  (Ctrl-C stops)", file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
