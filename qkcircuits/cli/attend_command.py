"""``qkcircuits attend MODEL --head L.H``: why a head attends where it does (exact QK attribution).

Rows from a task (``--task induction`` by default; ``ioi`` or a .jsonl file with ``--from END --to IO [--versus S1]``)
or from a prompt (``--prompt TEXT --query I --key J``, or ``--key induction``). Prints sentences a researcher can
quote; ``--json`` keys (keep them): model, head, reading, rows, attention, total, exact_error, query_sources
[[name, value, share], …], key_sources, pairs [[query source, key source, value], …], settings (plus per_row,
expanded, schema). ``-o`` writes a standalone page with the pair heatmap and the two marginals.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import (add_model_args, bounded_int, head_arg, html_arg, input_arg, int_arg, json_arg, load_model,
                      positive_int, short, write_output)

DEFAULT_TASK = "induction"     # the registered task attend reads without --task or --prompt


def _position(text: str):
    if text in ("induction", "duplicate", "previous"):
        return text
    try:
        return bounded_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a position (an integer, negative from the end), induction, duplicate or previous, "
                                         f"got {short(text)!r}") from None




def task_positions(task_spec: str):
    """The position names of ``--task`` without the model: a registered task's declared ones (none declared, or a
    task read by a pattern: None, not checked here), or a .jsonl file's first line's ``positions`` plus END (every
    line names the same ones: ``from_jsonl`` checks it). None when the file cannot be read here (``from_jsonl``
    says why after the load)."""
    from .._tasks.registry import task_names, task_spec as spec_named

    if task_spec in task_names():
        spec = spec_named(task_spec)
        return None if spec.pattern or not spec.positions else [*spec.positions, *(() if "END" in spec.positions else ("END",))]
    import json

    try:
        with open(task_spec, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        named = json.loads(first).get("positions", {})
    except (OSError, ValueError, AttributeError, RecursionError):     # the strict reader says why after the load
        return None
    return [*named, "END"] if isinstance(named, dict) else None


def _check_positions(task_spec: str, given) -> None:
    """``--from`` / ``--to`` / ``--versus`` checked against the task's position names before the model loads."""
    known = task_positions(task_spec)
    if known is None:
        return
    for flag, name in given.items():
        if name is not None and name not in known:
            what = task_spec if not Path(task_spec).is_file() else Path(task_spec).name
            raise QKCircuitsError(f"{flag} {name!r} is not a position of task {what!r}; it has {', '.join(known)}")


def add_parser(sub) -> None:
    p = sub.add_parser("attend", help="why a head attends where it does: its score split into pairs of sources",
                       description="Split one head's attention score (query position -> key position) exactly into "
                                   "pairs (query-side source, key-side source) of upstream components: the "
                                   "embedding, every earlier head and MLP, constant biases. Norm scales are held at "
                                   "their values in the run, so the parts add up to the model's own score.")
    add_model_args(p)
    p.add_argument("--head", required=True, type=head_arg, help="the head to explain, e.g. 18.6")
    p.add_argument("--task", default=None, help="a registered task (induction, the default without --prompt; ioi, "
                                                 "greater-than, ...) or a .jsonl task file")
    p.add_argument("--from", dest="query_name", metavar="POS", help="the task's query position (default END)")
    p.add_argument("--to", dest="key_name", metavar="POS", help="the task's key position, e.g. IO")
    p.add_argument("--versus", metavar="POS", help="compare with this key position (task name, or an integer "
                                                    "with --prompt): score(to) - score(versus)")
    p.add_argument("--prompt", action="append", help="a prompt text (repeat for several); tokenized as the "
                                                      "model's tokenizer does on its own")
    p.add_argument("--query", type=_position, help="with --prompt: the query position (negative: from the end)")
    p.add_argument("--key", type=_position, help="with --prompt: the key position, or induction (each repeated token -> "
                                                  "the token after its earlier copy), duplicate (-> the earlier copy), "
                                                  "previous (each token -> the one before)")
    p.add_argument("--reading", choices=("contrast", "raw"), default="contrast",
                   help="contrast (default): the score at the key minus the mean over the other keys the head may "
                        "attend; raw: the score itself")
    p.add_argument("--expand", choices=("key", "query"), help="split the largest head sources on that side by the "
                                                              "position they read from")
    p.add_argument("--top", type=positive_int, default=5, help="sources listed per side (default 5)")
    p.add_argument("--n", type=positive_int, default=32, help="prompts for ioi/induction (default 32)")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="BOS before ioi / .jsonl prompts: auto (default: what the model's tokenizer does on its own), "
                        "yes, no (induction prompts always start with one)")
    p.add_argument("--seed", type=int_arg, default=0, help="seed of the ioi/induction prompts (default 0)")
    input_arg(p, "--scores", metavar="SCAN.json", help="label sources from this scan (default: a quick scan of the "
                                                       "labelled detectors)")
    p.add_argument("--no-labels", action="store_true", help="do not label sources (no scan)")
    p.add_argument("--allow-other-model", action="store_true",
                   help="label sources from a --scores scan of another model than this one (default: refused)")
    json_arg(p, "the result (the attend JSON contract)")
    html_arg(p, "a standalone page (heatmap and marginals)")
    p.set_defaults(func=run, precheck=precheck)


def precheck(args: argparse.Namespace) -> None:
    """The task's position names checked before the model loads (``cli.main`` runs it)."""
    task_spec = args.task or (None if args.prompt else DEFAULT_TASK)
    if task_spec is not None:
        _check_positions(task_spec, {"--from": args.query_name, "--to": args.key_name, "--versus": args.versus})


def run(args: argparse.Namespace) -> int:
    from .._explain.attend import attend
    from .._explain.labels import source_labels

    if args.prompt and args.task:
        raise QKCircuitsError("give --task or --prompt, not both")
    if args.prompt:
        if args.query_name or args.key_name:
            raise QKCircuitsError("--from/--to name a task's positions; with --prompt give --query I --key J")
        if args.key is None:
            raise QKCircuitsError("with --prompt give --key J (and --query I), or --key induction|duplicate|previous")
    elif args.query is not None or args.key is not None:
        raise QKCircuitsError("--query/--key are positions in a --prompt; with a task use --from/--to")
    task_spec = args.task or (None if args.prompt else DEFAULT_TASK)
    if task_spec is not None:
        from .._tasks.registry import check_task_arg

        spec = check_task_arg(task_spec, bos=args.bos)          # a registered task or a .jsonl file
        if spec is not None and spec.pattern and (args.query_name or args.key_name or args.versus):
            raise QKCircuitsError(f"--task {task_spec} picks its own rows ({spec.pattern} pattern); --from/--to/--versus "
                                  f"are for a task with named positions")
        if (spec is None or not spec.pattern) and not args.key_name:
            raise QKCircuitsError(f"--task {task_spec}: name the key position with --to (e.g. --from END --to IO)")
    if args.versus is not None and args.versus == (args.key_name if task_spec is not None else str(args.key)):
        raise QKCircuitsError(f"--versus {short(args.versus)!r} is the key position itself: score(to) - score(versus) "
                              f"would be 0 by construction; compare with another position")
    precheck(args)
    scan = None
    if args.scores is not None and not args.no_labels:     # a missing or foreign scan: one line before the model loads
        from .._analysis.head_scores import HeadScores
        from .report_command import _read

        scan = _read(HeadScores, args.scores, "--scores", "a scan JSON from `qkcircuits scan --json`")
    model = load_model(args)
    if scan is not None:                                   # another model's scan: one line naming both
        from .report_command import check_same_model

        check_same_model(model, args, ("--scores", args.scores, scan))
    kw = dict(reading=args.reading, expand=args.expand, k=args.top)
    if task_spec is not None:
        from .._tasks.registry import build_task, task_names
        from .._tasks.task import bos_mode_arg

        task = build_task(model, task_spec, args.n, args.seed, prepend_bos=bos_mode_arg(args.bos))
        res = attend(model, args.head, task=task, query=args.query_name, key=args.key_name, versus=args.versus, **kw)
        from_file = Path(task_spec).is_file() and task_spec not in task_names()
        res.settings["prompts"] = {"task": Path(task_spec).name if from_file else task_spec, "n": int(task.n),
                                   **({} if from_file else {"seed": args.seed})}
    else:
        versus = None
        if args.versus is not None:
            try:
                versus = bounded_int(args.versus)
            except ValueError:
                raise QKCircuitsError(f"--versus {short(args.versus)!r}: with --prompt give an integer position") from None
        res = attend(model, args.head, args.prompt, query=args.query, key=args.key, versus=versus, **kw)
        res.settings["prompts"] = {"task": "--prompt", "n": len(args.prompt)}
    if not args.no_labels:
        res.settings["labels"] = source_labels(model, res, scores=scan)
    print(f"{args.model}: head {res.head}, {len(res.rows)} rows, reading {res.reading}")
    for line in res.sentences(k=args.top):
        print(f"  {line}")
    write_output(args.json, res)
    if args.output:
        from ..viz._attend_view import attend_page

        write_output(args.output, attend_page(res))
    return 0
