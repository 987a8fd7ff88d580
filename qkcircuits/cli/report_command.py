"""``qkcircuits report MODEL -o report.html``: one self-contained HTML file (works offline)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, head_arg, html_arg, load_model, non_negative_int, positive_int, write_output


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="write a self-contained HTML report of the heads (no network needed)",
                       description="Write one HTML file with the layer x head score grids and, for the top heads, "
                                   "QK/OV heatmaps, the positional/rotary QK profile, K-composition partners and "
                                   "attention patterns. All JavaScript is inlined: it opens offline.")
    add_model_args(p)
    html_arg(p, "the report", required=True)
    p.add_argument("--tokens", nargs="+", metavar="TOKEN",
                   help="token set of the QK/OV views: each the text of one token (e.g. ' the') or #id "
                        "(default: common English words that are single tokens; ids 0-31 without a tokenizer)")
    p.add_argument("--prompt", help="text for the attention patterns (space-separated ids for a model without a "
                                    "tokenizer; default: a sentence said twice)")
    add_result_args(p)
    p.add_argument("--circuit", metavar="JSON", help="a circuit from `qkcircuits circuit --json` (its faithfulness "
                                                     "curve, graph, roles and top edges; panels for its heads)")
    p.add_argument("--attend", metavar="JSON", action="append",
                   help="a result of `qkcircuits attend --json` (repeat for several): a 'why it attends' section "
                        "(default: the top head of each labelled score, explained on the scan's repeated prompts)")
    p.add_argument("--no-attend", action="store_true", help="no 'why it attends' sections")
    p.add_argument("--heads", type=head_arg, help="heads to include besides the top ones, e.g. '5.1,L6H9'")
    p.add_argument("--grid-k", type=non_negative_int, default=3,
                   help="top heads per grid to precompute (default 3)")
    p.add_argument("--k", type=positive_int, default=5, help="output tokens per source token in the OV view")
    p.add_argument("--view", choices=("direct", "effective", "contextual"), default=None,
                   help="token rows of the QK/OV views (default: direct at layer 0, contextual after it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _read(cls, path: str, flag: str, what: str):
    """``cls.from_json`` of the file ``path`` (a path, read once, never its content taken as a path); errors are
    one line naming the file."""
    from .._foundation.io import load_json

    if not Path(path).expanduser().is_file():
        kind = flag.strip("-")
        raise QKCircuitsError(f"{flag}: no {kind} JSON file at {path!r}; pass the path of {what}")
    try:
        if cls.__name__ == "HeadEffects":        # reads JSON text only: parse the file here, errors named
            import json

            return cls.from_json(json.dumps(load_json(Path(path), what)))
        return cls.from_json(Path(path))
    except QKCircuitsError as e:
        raise QKCircuitsError(str(e) if repr(path) in str(e) else f"{flag} {path!r}: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise QKCircuitsError(f"{flag} {path!r} is not {what} ({type(e).__name__}: {e})") from None


def add_result_args(p) -> None:
    """The result files the report and the app read (``load_inputs``, ``read_trace``): --scores, --ablation,
    --diagnostics, --trace (and --allow-other-model)."""
    p.add_argument("--scores", metavar="JSON", help="scores from `qkcircuits scan --json` (default: run a scan)")
    p.add_argument("--ablation", metavar="JSON", help="per-head effects from `qkcircuits ablate --sweep --json`")
    p.add_argument("--diagnostics", metavar="JSON", help="flags from `qkcircuits diagnose --json`")
    p.add_argument("--trace", metavar="JSON", help="path effects from `qkcircuits trace --json` (circuit graph and "
                                                   "a 'reads from' panel per traced head)")
    add_allow_other_model(p)


def load_inputs(args):
    """(scores, effects, diagnostics) from the JSON files named in ``args`` (None where not given)."""
    from .._analysis.diagnose_result import HeadDiagnostics
    from .._analysis.head_scores import HeadScores
    from .._analysis.sweep import HeadEffects

    scores = effects = diagnostics = None
    if getattr(args, "scores", None):
        scores = _read(HeadScores, args.scores, "--scores", "a scan JSON from `qkcircuits scan --json`")
    if getattr(args, "ablation", None):
        effects = _read(HeadEffects, args.ablation, "--ablation",
                        "a sweep JSON from `qkcircuits ablate --sweep --json`")
    if getattr(args, "diagnostics", None):
        diagnostics = _read(HeadDiagnostics, args.diagnostics, "--diagnostics",
                            "a diagnostics JSON from `qkcircuits diagnose --json`")
    return scores, effects, diagnostics


def read_trace(args):
    """The ``PathEffects`` of ``--trace`` (None when not given); one-line error for a missing or foreign file."""
    if not getattr(args, "trace", None):
        return None
    from .._paths.path_effects import PathEffects

    return _read(PathEffects, args.trace, "--trace", "a trace JSON from `qkcircuits trace --json`")


def check_trace(trace, model, args):
    """``trace`` if it was traced on a model of ``model``'s shape (its receivers and senders are heads here)."""
    if trace is None:
        return None
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if (trace.n_layers, trace.n_heads) != (L, H):
        raise QKCircuitsError(f"the trace {args.trace!r} is for {trace.n_layers} layers x {trace.n_heads} heads, "
                              f"but the model has {L} x {H}; trace this model with `qkcircuits trace {args.model} "
                              f"--json FILE`")
    return trace


def read_attend(args):
    """The ``Attribution``s of ``--attend`` (None: the default sections; [] with ``--no-attend``); one-line errors
    naming a missing or foreign file, before the model loads."""
    if getattr(args, "no_attend", False):
        if getattr(args, "attend", None):
            raise QKCircuitsError("--attend and --no-attend: give one")
        return []
    if not getattr(args, "attend", None):
        return None
    from .._explain.attribution import Attribution

    return [_read(Attribution, f, "--attend", "an attend JSON from `qkcircuits attend --json`") for f in args.attend]


def check_attend(attend, model, args):
    """``attend`` if every result names a head of ``model`` (its layer and head in range)."""
    from .._foundation.heads import model_heads

    for res in attend or []:
        try:
            model_heads(model, res.head)
        except QKCircuitsError:
            raise QKCircuitsError(f"--attend: head {res.head} of {res.model!r} is not a head of {args.model!r}; "
                                  f"explain this model with `qkcircuits attend {args.model} --head L.H --json FILE`") from None
    return attend


def add_allow_other_model(p) -> None:
    p.add_argument("--allow-other-model", action="store_true",
                   help="show result files (--scores, --ablation, --diagnostics, --trace, --attend, --circuit) that "
                        "name another model than this one (default: refused)")


def _names_of(model, args) -> set:
    """The names a result of this model may record: the spec it was loaded from (the CLI writes that), its file or
    folder name and resolved path, and ``model_name(model)`` (what the API writes)."""
    from .._foundation.model import model_name

    spec = str(args.model)
    names = {spec, model_name(model)}
    p = Path(spec).expanduser()
    if p.exists():
        names |= {p.name, str(p.resolve())}
    return names


def check_same_model(model, args, *results) -> None:
    """Refuse (one line naming both models, name and fingerprint) a result file of another model than ``model``,
    unless ``--allow-other-model``. ``results``: ``(flag, path, result)``; what a result records is read by
    ``fingerprint.recorded`` (a result's ``model`` and ``settings["fingerprint"]``, a circuit file's keys). The same
    name (any of ``_names_of``) and fingerprint pass; a file without a fingerprint (older files) is compared by
    name; a result that records no model passes."""
    if getattr(args, "allow_other_model", False):
        return
    from .._foundation.fingerprint import fingerprint, mismatch

    names = _names_of(model, args)
    for flag, path, res in results:
        if res is None:
            continue
        other = mismatch(model, res, names)
        if other is not None:
            raise QKCircuitsError(f"{flag} {str(path)!r} is a result of {other}, not of {str(args.model)[:80]!r} "
                                  f"(fingerprint {fingerprint(model)}); compute it for this model, or pass "
                                  f"--allow-other-model to show it anyway")


def inputs_and_model(args):
    """The result files a report or the app is given, parsed BEFORE the model loads (a bad file fails in a second),
    then the model, checked to be the one every file was made on: (model, scores, effects, diagnostics, trace,
    circuit, attend)."""
    scores, effects, diagnostics = load_inputs(args)
    trace = read_trace(args)
    circuit = read_circuit(args)
    attend = read_attend(args)
    model = load_model(args)
    check_same_model(model, args, ("--scores", args.scores, scores), ("--ablation", args.ablation, effects),
                     ("--diagnostics", args.diagnostics, diagnostics), ("--trace", args.trace, trace),
                     ("--circuit", args.circuit, circuit),
                     *(("--attend", f, a) for f, a in zip(args.attend or [], attend or [])))
    return model, scores, effects, diagnostics, trace, circuit, attend


def read_circuit(args):
    """The checked circuit of ``--circuit`` (None when not given): a missing, foreign or damaged file is one line
    naming it, before the model loads."""
    if not getattr(args, "circuit", None):
        return None
    from ..viz._circuit_data import load_circuit

    return load_circuit(Path(args.circuit))


def run(args: argparse.Namespace) -> int:
    from .._analysis.detect import scan
    from ..viz import report_html

    model, scores, effects, diagnostics, trace, circuit, attend = inputs_and_model(args)
    attend = check_attend(attend, model, args)
    if scores is None:
        # eigen_copying comes from the report's own weight-only pass
        scores = scan(model, eigen_copying=False, progress=not args.quiet)
        scores = replace(scores, model=args.model)
    trace = check_trace(trace, model, args)
    html = report_html(model, scores=scores, effects=effects, diagnostics=diagnostics, heads=args.heads,
                       tokens=args.tokens, prompt=args.prompt, grid_k=args.grid_k, k=args.k,
                       title=args.model, view=args.view, progress=not args.quiet, trace=trace,
                       circuit=circuit, attend=attend)
    write_output(args.output, html, note=f" ({len(html.encode('utf-8')) / 2 ** 20:.1f} MiB)")
    return 0
