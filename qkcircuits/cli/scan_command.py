"""``qkcircuits scan MODEL``: score every head and print the ranked table."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .._foundation.errors import QKCircuitsError

from ._common import (add_model_args, json_arg, load_model, non_negative_int, output_arg, positive_int,
                      write_output)


def table_scores(scores):
    """(score, title) of the tables the CLI prints: one per labelled detector the scan computed."""
    from .._analysis.detectors import detectors      # the registry imports torch: not at --help time

    return [(d.name, d.label) for d in detectors() if d.label and d.name in scores.scores] or \
        [(n, n) for n in scores.scores]


def table_columns(scores):
    """The score columns of each table: every computed detector that is not on natural text, registry order."""
    from .._analysis.detectors import detectors

    return [d.name for d in detectors() if d.prompts != "text" and d.name in scores.scores]


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="score every head: induction, previous-token, duplicate-token, copying",
                       description="Score every attention head and print the most induction-, previous-token- and "
                                   "duplicate-token-like heads.")
    add_model_args(p)
    p.add_argument("--n-seqs", type=positive_int, default=8, help="sequences of [BOS]+R+R (default 8)")
    p.add_argument("--seg-len", type=positive_int, default=None,
                   help="length of the random segment R (default 40, capped by the context and vocabulary)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompt sets (default 0)")
    p.add_argument("--k", type=positive_int, default=5, help="heads to list per score (default 5)")
    p.add_argument("--text", action="store_true", help="also score previous/duplicate-token heads on natural text")
    p.add_argument("--bos", type=non_negative_int, default=None, help="BOS token id (default: the tokenizer's)")
    p.add_argument("--scores", default=None, metavar="NAMES",
                   help="comma-separated detector names to compute (default: every default detector, not the text "
                        "ones; qk.detectors() lists them, and an unknown name is refused with the list)")
    p.add_argument("--confirm", type=non_negative_int, default=0, metavar="K",
                   help="ablate the top-K induction heads and K random heads and compare the loss rise")
    json_arg(p, "all scores as JSON")
    output_arg(p, "--csv", metavar="PATH", help="write one row per head as CSV")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._foundation.io import frame_csv
    from .._analysis.detect import scan
    from .._analysis.detectors import select

    names = select(args.scores, text=args.text) if args.scores is not None else None   # bad names before loading
    if args.confirm and names is not None and "induction" not in names:
        raise QKCircuitsError("--confirm ablates the top induction heads: add 'induction' to --scores")
    model = load_model(args)
    scores = scan(model, scores=names, n_seqs=args.n_seqs, seg_len=args.seg_len, seed=args.seed, bos=args.bos,
                  text=args.text, confirm_k=args.confirm, progress=not args.quiet)
    scores = replace(scores, model=args.model)
    print(format_table(scores, args.k))
    if "confirmation" in scores.extras:
        print(format_confirmation(scores.extras["confirmation"]))
    write_output(args.json, scores)
    if args.csv:
        write_output(args.csv, frame_csv(scores.to_frame()))      # quoted as needed, formulas made inert
    return 0


def format_table(scores, top: int) -> str:
    """The top heads per score side by side, with every score of each listed head."""
    lines = [f"{scores.model}: {scores.n_layers} layers x {scores.n_heads} heads "
             f"(thresholds: {', '.join(f'{k} >= {v[1]}' for k, v in scores.thresholds.items())})"]
    cols = table_columns(scores)
    for name, title in table_scores(scores):
        lines.append("")
        lines.append(f"top {top} {title} heads")
        lines.append("  head    " + "".join(f"{c[:12]:>13}" for c in cols) + "  labels")
        labels = scores.labels()
        for head, _ in scores.top(top, name):
            vals = "".join(f"{float(scores[c][head.layer, head.head]):>13.3f}" for c in cols)
            lines.append(f"  {str(head):<8}{vals}  {','.join(labels.get(head, []))}")
    return "\n".join(lines)


def format_confirmation(conf: dict) -> str:
    from .._analysis.detect import confirmation_sentence

    return "\n" + confirmation_sentence(conf)
