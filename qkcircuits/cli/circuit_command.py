"""``qkcircuits circuit MODEL --task ioi|induction|FILE.jsonl``: a task's circuit over the whole graph.

Scores every edge (EAP-IG by default, the authors' left rule), finds the core circuit (the fewest heads and MLPs
whose node view reaches f ≥ 0.8) and names its heads' roles (with the heads outside it whose effect reaches 5 %),
measures the edge circuit's faithfulness curve over the MIB grid (CPR/CMD; ``--bootstrap N``: their intervals
over prompts), picks the edge circuit (``--edges``/``--percent``, else the smallest grid size with f ≥ 0.8).
Progress goes to stderr (its first line names the model, the task and its BOS); the summary goes to stdout once
everything ran and STARTS with the warnings (the model does not do the task, no grid size reaches f ≥ 0.8, the
method's scores disagree in sign with EAP-IG on the top edges), printed after every progress bar closed, then the
core circuit and its roles, then the edge circuit. When the model does not do the task, no core, no circuit and no
roles are named unless ``--force``; when no size below 100 % reaches f ≥ 0.8, no edge circuit (the core and its
roles stay).
``--json`` keys (the contract the views read): model, task, n_prompts, metric, clean, corrupt, method,
steps, rule, core {heads, mlps, node_faithfulness, curve {heads: f}, how, ...} (absent with ``--no-core``, on the
position-aware graph, or when not named), curve {percent: f}, cpr, cmd, circuit {edges: [[sender, receiver,
input, score], ...], heads, node_faithfulness, named, ...}, roles {head: {role, evidence, why, in_circuit}},
roles_of ("core", "circuit" or null: which circuit's heads), warnings [one line each], bos {prepended, mode},
timing; plus schema, graph, bos_prepended (old readers), bootstrap with ``--bootstrap``. ``--gqa ungrouped`` /
``--positions`` score another graph (``graph.gqa`` / ``graph.positions`` in the JSON; a position-aware circuit's
edges name their group, as ``20.0@END``, and ``circuit.position_nodes`` lists where its nodes act), with or
without ``--ray``. ``--mib PATH`` writes the edge scores in the MIB circuit track's JSON (the named edge
circuit's edges in_graph; the ungrouped graph's k/v per query head one to one; not on the position-aware graph).
"""

from __future__ import annotations

import argparse
import sys
import time

from .._foundation.errors import QKCircuitsError
from .._foundation.metric_table import names
from ._common import (add_model_args, html_arg, json_arg, load_kwargs, metric_arg, non_negative_int, output_arg,
                      positive_int, ray_arg, ray_backend, timing_arg, write_output)

SCHEMA = "qkcircuits.circuit/1"
METHODS = ("eap-ig", "eap", "exact", "eap-ig-activations", "clean-corrupted")
METRICS = names(prompts=("task",))      # the task metrics of the one table: logit-diff, prob-diff, answer-loss, kl
# the sign check's EAP-IG runs on this many prompts (the first ones): a quarter of the default 64's cost
SIGN_ROWS = 16
# the default held-out part (``_tasks.holdout.HOLDOUT``; not imported here: the parser is built without torch)
HOLDOUT = 1 / 3


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"expected a percent in (0, 100], got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction of the prompts in [0, 1) (0: no held-out part), got "
                                         f"{text!r}")
    return v


def add_parser(sub) -> None:
    p = sub.add_parser("circuit", help="find a task's circuit: edge scores, faithfulness curve, roles",
                       description="Score every edge of the model's graph for a task with counterfactual prompts "
                                   "(clean vs corrupt), measure how much of the behaviour the top edges carry "
                                   "(faithfulness over 0.1-100% of the edges, CPR and CMD) and name the roles of "
                                   "the circuit's heads.")
    add_model_args(p)
    p.add_argument("--task", required=True, help="a registered task (ioi, induction, greater-than, ...: "
                                                 "qk.tasks.task_names()) or a .jsonl file (one {clean, corrupt, "
                                                 "answer, wrong[, positions]} object per line)")
    p.add_argument("--n", type=positive_int, default=64, help="prompts for ioi/induction (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the ioi/induction prompts (default 0)")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="prepend a BOS to each prompt: auto (default) = what the model's tokenizer does on its own "
                        "(Llama/Gemma add <bos>, GPT-2 and SmolLM2 add none), yes / no = forced; induction prompts "
                        "always start with BOS")
    p.add_argument("--metric", type=metric_arg("--metric", METRICS, ("task",)), default=None,
                   metavar="{" + ",".join(METRICS) + "}",
                   help="the task's own (a registered task declares it: logit-diff for ioi, prob-diff for "
                        "greater-than; logit-diff for a .jsonl), or logit-diff, prob-diff, answer-loss (-log p(answer) "
                        "at END), "
                        "or kl (KL(clean || patched) at END, lower is better)")
    p.add_argument("--method", choices=METHODS, default="eap-ig",
                   help="eap-ig (default; integrated gradients on the input embeddings), eap, exact (one patched "
                        "run per edge: small models only), eap-ig-activations, clean-corrupted")
    p.add_argument("--steps", type=positive_int, default=5, help="EAP-IG interpolation steps (default 5)")
    p.add_argument("--rule", choices=("left", "right", "midpoint"), default=None,
                   help="EAP-IG's points: left (alpha = k/steps, k = 0..steps-1; the authors' and MIB's, the default "
                        "of eap-ig), right (k = 1..steps: one clean forward fewer; the default of eap-ig-activations, "
                        "as the authors run it) or midpoint")
    p.add_argument("--gqa", choices=("grouped", "ungrouped"), default="grouped",
                   help="k/v inputs per KV head (default) or per query head, as the EAP-IG authors and MIB count edges "
                        "(the same graph without grouped-query attention)")
    p.add_argument("--positions", action="store_true",
                   help="split every edge by the task's named positions (IO, S1, S2, END, ...; the rest pooled as "
                        "'other'): node names like 20.0@END")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--edges", type=positive_int, help="circuit size in edges")
    size.add_argument("--percent", type=_percent, help="circuit size in percent of the graph's edges (truncated to "
                                                       "whole edges, as MIB does)")
    p.add_argument("--by", choices=("signed", "abs"), default="signed",
                   help="rank edges by score in the metric's better direction (default: the edges that carry the "
                        "behaviour) or by |score| (edges that work against it too)")
    p.add_argument("--how", choices=("top", "greedy"), default="top",
                   help="top: the top edges of the whole graph (default); greedy: grown from the logits")
    p.add_argument("--force", action="store_true",
                   help="name a circuit and roles even when the model does not do the task or no grid size reaches "
                        "f >= 0.8 (the warnings stay)")
    p.add_argument("--no-sign-check", action="store_true",
                   help=f"skip the comparison with EAP-IG (run on the first {SIGN_ROWS} prompts) that warns when "
                        f"another method's top edges disagree with it in sign")
    p.add_argument("--no-core", action="store_true",
                   help="skip the core circuit (the fewest heads and MLPs whose node view reaches f >= 0.8); the "
                        "roles are then the edge circuit's (the position-aware graph has no core)")
    p.add_argument("--core-mlps", choices=("searched", "clean"), default="searched",
                   help="searched (default): MLPs are nodes of the core like heads (one left out gives its "
                        "corrupt output); clean: every MLP stays clean and only heads are searched")
    p.add_argument("--holdout", type=_fraction, default=None, metavar="FRACTION",
                   help="the part of the prompts held out (default 1/3, none when the prompts are too few to split; "
                        "0: none): edges, the core and the roles are "
                        "chosen on the rest, f, CPR/CMD and node f reported on these (ioi/induction: a fresh draw "
                        "of the generator; a .jsonl: a seeded random part of its rows)")
    p.add_argument("--resamples", type=non_negative_int, default=0, metavar="N",
                   help="N independent draws of the prompts (the first is the selection part; ioi leaves one "
                        "sentence frame out per draw, a .jsonl is resampled): how often each node is in the core, "
                        "Jaccard between draws, roles with their frequency, the stable core (this process only)")
    p.add_argument("--bootstrap", type=non_negative_int, default=0, metavar="N",
                   help="N resamples of the prompts give 95%% intervals of the curve, CPR and CMD (no model run "
                        "per resample; default 0: none)")
    output_arg(p, "--mib", metavar="PATH", help="write the edge scores in the MIB circuit track's JSON (the edge "
                                                "circuit's edges in_graph; not with --positions)")
    json_arg(p, "the result (the circuit JSON contract: qk.find_circuit's report)")
    output_arg(p, "--csv", metavar="PATH", help="write every edge's score (sender, receiver, input, score, in_circuit)")
    html_arg(p, "the report's circuit section (curve, graph, roles, top edges)")
    timing_arg(p)
    ray_arg(p, "every step (prompt shards, sums combined exactly; a .jsonl task must be readable by the workers)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def backend(args: argparse.Namespace):
    """The backend of this command: ``qk.Ray`` with ``--ray`` (each worker loads the model as the flags say), else
    ``qk.Local`` (this process). Every step runs on ONE pool of it (``qk.find_circuit``)."""
    from .._foundation.backends import Local

    if args.ray is not None:
        return ray_backend(args)
    return Local(load_kwargs={**load_kwargs(args), "verbose": True})


def run(args: argparse.Namespace) -> int:
    """Parse, check, ``qk.find_circuit`` on one pool, print its report, write the files."""
    from .._tasks.find import find_circuit
    from .._tasks.registry import check_task_arg

    check_task_arg(args.task, bos=args.bos)          # a registered task or a .jsonl file; --bos no where it cannot be
    if args.mib and args.positions:
        raise QKCircuitsError("--mib: MIB's graph has no position groups; drop --positions (--gqa ungrouped is MIB's "
                              "own k/v count)")
    if args.resamples and args.ray is not None:
        raise QKCircuitsError("--resamples runs in this process only (not with --ray)")
    t0 = time.perf_counter()
    with backend(args).pool(args.model) as pool:      # the model loaded once (here, or on each Ray worker)
        report = find_circuit(
            pool.model, args.task, n=args.n, seed=args.seed, bos=args.bos, metric=args.metric, method=args.method,
            steps=args.steps, rule=args.rule, gqa=args.gqa, positions=args.positions, edges=args.edges,
            percent=args.percent, by=args.by, how=args.how, force=args.force, sign_check=not args.no_sign_check,
            core=not args.no_core, core_mlps=args.core_mlps, holdout=args.holdout, resamples=args.resamples,
            bootstrap=args.bootstrap, backend=pool, progress=not args.quiet,
            say=lambda line: print(line, file=sys.stderr, flush=True), _started=t0)
    print("\n".join(report.summary), flush=True)
    if args.timing:
        print("  timing: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in report["timing"].items()))
    _write(args, report)
    return 0


def _write(args, report) -> None:
    from .._foundation.io import csv_text

    data, scores, circ = report.to_dict(), report.scores, report.edge_circuit
    write_output(args.json, data)
    if args.csv:
        inside = {tuple(e[:3]) for e in circ.edges()} if circ is not None else set()
        rows = [[s, r, x, float(f"{v:.6g}"), int((s, r, x) in inside)] for s, r, x, v in scores.edge_list()]
        write_output(args.csv, csv_text(["sender", "receiver", "input", "score", "in_circuit"], rows))
    if args.mib:
        write_output(args.mib, scores.to_mib(circuit=circ))
    if args.output:          # the report's own circuit section (warnings, curve, graph, roles, top edges), alone
        from ..viz._report import circuit_page

        write_output(args.output, circuit_page(data, source=args.json or f"{data['model']}, {data['task']}"))
