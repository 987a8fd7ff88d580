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
edges name their group, as ``20.0@END``, and ``circuit.position_nodes`` lists where its nodes act); this process
only, not with ``--ray``. ``--mib PATH`` writes the edge scores in the MIB circuit track's JSON (the named edge
circuit's edges in_graph; the ungrouped graph's k/v per query head one to one; not on the position-aware graph).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Optional

from .._foundation.errors import QKCircuitsError
from .._foundation.metric_table import names
from ._common import add_model_args, metric_arg, non_negative_int, output_arg, positive_int

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
                        "at END; 'loss' is its old name), "
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
    p.add_argument("--json", metavar="PATH", help="write the result (the circuit JSON contract)")
    p.add_argument("--csv", metavar="PATH", help="write every edge's score (sender, receiver, input, score, in_circuit)")
    p.add_argument("-o", "--output", metavar="HTML", help="write the report's circuit section as one offline HTML "
                                                          "file (curve, graph, roles, top edges)")
    p.add_argument("--timing", action="store_true", help="print how long each step took (also in the JSON's timing)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS|local:N",
                   help="run on Ray workers (each loads the model once; prompt shards, sums combined exactly): an "
                        "address, local:N, or nothing ($RAY_ADDRESS, else a local instance). A .jsonl task must "
                        "be readable by the workers")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def build_task(model, spec: str, n: int, seed: int, prepend_bos=None, metric: Optional[str] = None):
    from .._tasks.registry import build_task as build

    return build(model, spec, n, seed, prepend_bos=prepend_bos, metric=metric)


def backend(args: argparse.Namespace):
    """The backend of this command: ``qk.Ray`` with ``--ray`` (each worker loads the model as the flags say), else
    ``qk.Local`` (this process). Every step runs on ONE pool of it (``run``)."""
    from .._foundation.backends import Local, Ray

    load_kwargs = {"device": args.device, "dtype": args.dtype, "fold_ln": not args.no_fold_ln}
    if args.ray is not None:
        return Ray(address=args.ray or None, threads=args.threads or 1, load_kwargs=load_kwargs)
    return Local(load_kwargs={**load_kwargs, "verbose": True})


# The in-process computations of the command's own steps (``local=`` of ``pool.run``; on Ray the same steps are
# ``qk.Ray.jobs``' "task", "circuit_faithfulness" and "roles", in qkcircuits._scale.ray_tasks).


def task_step(model, *, task: str, n: int, seed: int, prepend_bos=None, metric: Optional[str] = None,
              holdout: Optional[float] = None, gqa: str = "grouped", positions: bool = False):
    """The step "task": the task built with this model's tokenizer (its selection part, and its held-out part or
    None: ``holdout.Source.parts``), and the graph its edges are scored on."""
    from .._tasks.holdout import Source
    from .._tasks.scores import task_graph

    # the default third (``holdout`` None) is dropped when the prompts are too few to split; a given one is not
    source = Source.of(model, task, n, seed, prepend_bos, metric)
    sel, held = source.parts(HOLDOUT if holdout is None else holdout, strict=holdout is not None)
    return sel, held, task_graph(model, sel, gqa, positions), source.how


def stability_step(model, *, task: str, n: int, seed: int, prepend_bos=None, metric: Optional[str] = None,
                   sel, held, resamples: int, first, percent: float, progress: bool = True, **kw):
    """The step "stability": ``resamples`` draws of the prompts (``_tasks.stability``), draw 0 being ``first``."""
    from .._tasks.holdout import Source
    from .._tasks.stability import stability

    source = Source.of(model, task, n, seed, prepend_bos, metric)
    return stability(model, source, sel, held, resamples, first=first, percent=percent, progress=progress, **kw)


def circuit_faithfulness_step(model, *, task, circuit, graph, progress: bool = True):
    """The step "circuit_faithfulness": (f, node-view f) of one circuit (``--edges`` / ``--percent``)."""
    from .._tasks.faithfulness import circuit_metric, node_faithfulness, ratio
    from .._tasks.scores import shard_rows

    rows = shard_rows(model, graph, task, buffers=3)
    # one shard: its corrupt record serves the node view too (as in ``faithfulness``)
    records = {} if rows >= task.n else None
    mask = circuit.mask if circuit.position_mask is None else circuit.position_mask
    (m,), clean, corrupt = circuit_metric(model, task, [mask], rows, records=records, g=graph)
    return ratio(m, clean, corrupt), node_faithfulness(model, task, circuit.heads, rows, clean=clean, records=records)


def roles_step(model, *, task, circuit, clean, corrupt, force: bool = False, also=()):
    """The step "roles": the circuit's heads' roles (``also``: heads outside it judged beside them)."""
    return circuit.roles(model, task, clean=clean, corrupt=corrupt, force=force, also=list(also))


def token_text(pool, i: int) -> str:
    """Token ``i`` as text where the model is loaded in this process (its tokenizer), else its id."""
    tok = getattr(pool.here, "tokenizer", None)
    try:
        return repr(tok.decode([int(i)])) if tok is not None else f"id {int(i)}"
    except Exception:      # an id the tokenizer cannot decode: its number says enough
        return f"id {int(i)}"


def run(args: argparse.Namespace) -> int:
    from .._tasks.registry import check_task_arg

    check_task_arg(args.task, bos=args.bos)          # a registered task or a .jsonl file; --bos no where it cannot be
    if args.rule is not None and args.method not in ("eap-ig", "eap-ig-activations"):
        raise QKCircuitsError(f"--rule {args.rule}: applies to --method eap-ig and eap-ig-activations, not {args.method}")
    if args.mib and args.positions:
        raise QKCircuitsError("--mib: MIB's graph has no position groups; drop --positions (--gqa ungrouped is MIB's "
                              "own k/v count)")
    if args.ray is not None and (args.gqa != "grouped" or args.positions):
        raise QKCircuitsError("--gqa ungrouped and --positions run in this process only (not with --ray)")
    if args.resamples and args.ray is not None:
        raise QKCircuitsError("--resamples runs in this process only (not with --ray)")
    if args.resamples and (args.no_core or args.positions):
        raise QKCircuitsError("--resamples compares the draws' core circuits: not with --no-core or --positions")
    t0 = time.perf_counter()
    with backend(args).pool(args.model) as pool:      # the model loaded once (here, or on each Ray worker)
        return _run(args, pool, t0)


def bos_text(task, pool, args) -> str:
    """How the prompts start, in words (the first line says it)."""
    from .._tasks.registry import spec_of

    spec = spec_of(task)
    if spec is not None and spec.always_bos and args.task == spec.name:
        return f"BOS {token_text(pool, int(task.clean[0, 0]))} prepended ({spec.name} prompts always start with BOS)"
    mode = task.bos_mode or ("yes" if task.bos else "no")
    if mode == "auto":
        return (f"BOS {token_text(pool, int(task.clean[0, 0]))} prepended (--bos auto: the tokenizer adds it)" if task.bos
                else "no BOS (--bos auto: the tokenizer adds none; --bos yes prepends one)")
    return f"BOS {token_text(pool, int(task.clean[0, 0]))} prepended (--bos yes)" if task.bos else "no BOS (--bos no)"


@contextmanager
def _quiet_python_warnings():
    """The run's own Python warnings that the CLI says itself, once, in its own words (stdout summary, JSON)."""
    from .._tasks.caveats import UNREACHED
    from .._tasks.task import NOT_DONE

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NOT_DONE)
        warnings.filterwarnings("ignore", message=UNREACHED)
        yield


def _run(args: argparse.Namespace, pool, t0: float) -> int:
    """The command's steps, each one ``pool.run`` (the local function, or the backend's own job of that name)."""
    from .._tasks import caveats
    from .._tasks.faithfulness import THRESHOLD, faithfulness
    from .._tasks.core import core_circuit
    from .._tasks.scores import edge_scores
    from .._tasks.task import bos_mode_arg, does_the_task, not_done_message

    progress = not args.quiet
    task, held, g, drawn = pool.run("task", local=task_step, task=args.task, n=args.n, seed=args.seed,
                             prepend_bos=bos_mode_arg(args.bos), metric=args.metric, holdout=args.holdout,
                             **_graph_kw(args))
    t_load = time.perf_counter() - t0
    n_all = task.n + (held.n if held is not None else 0)
    split = (f" ({task.n} to choose the circuit on, {held.n} held out to judge it: "
             f"{drawn})"
             if held is not None else " (no held-out part: chosen and judged on the same prompts" + (
                 ", too few to hold a third out)" if args.holdout is None else ")"))
    header = (f"{args.model}: task {task.name}, {n_all} prompts x {task.clean.shape[1]} tokens{split}, "
              f"{bos_text(task, pool, args)}, metric {task.metric_name}; graph {g.n_nodes} nodes, {g.n_edges} edges"
              + (f"; on Ray, {pool.workers.size} workers" if args.ray is not None else ""))
    print(header, file=sys.stderr, flush=True)             # the first line: the BOS is said before anything runs
    warned = []

    def warn_now(line: str) -> None:
        """A warning found: kept for the summary, and on stderr now (every progress bar is closed here)."""
        warned.append(line)
        print(f"warning: {line}", file=sys.stderr, flush=True)

    hold = {"holdout": held} if held is not None else {}
    with _quiet_python_warnings():
        t1 = time.perf_counter()
        scores = pool.run("edge_scores", local=edge_scores, task=task, method=args.method, steps=args.steps,
                          rule=args.rule, progress=progress, **_graph_kw(args))
        t2 = time.perf_counter()
        print(f"  clean {task.metric_name} {scores.clean:.4f}, corrupt {scores.corrupt:.4f}", file=sys.stderr,
              flush=True)
        done = does_the_task(task, scores.clean, scores.corrupt)
        if not done:
            warn_now(not_done_message(task, scores.clean, scores.corrupt, pool.here))
        undefined = scores.clean == scores.corrupt
        core = None
        # the core first: the fewest heads (and MLPs) that carry the behaviour; none on the position-aware graph
        # (core_circuit refuses it) and none named when the model does not do the task, unless --force
        if not args.no_core and not g.positions and (args.force or (done and not undefined)):
            core = pool.run("core_circuit", local=core_circuit, task=task, scores=scores, by=args.by,
                            mlps=args.core_mlps == "searched", progress=progress, **hold)
        t_core = time.perf_counter()
        faith = pool.run("faithfulness", local=faithfulness, task=task, scores=scores, by=args.by, how=args.how,
                         progress=progress, **({"bootstrap": args.bootstrap} if args.bootstrap else {}), **hold)
        t3 = time.perf_counter()
        explicit = args.edges is not None or args.percent is not None
        if done and not undefined and not explicit and not faith.reached:
            warn_now(caveats.unreached_message(faith.curve, THRESHOLD))
        sign = None
        if args.method not in ("eap-ig", "exact") and not args.no_sign_check:
            sign = _sign_check(args, pool, task, scores, warn_now)
        t_sign = time.perf_counter()
        named = args.force or (done and not undefined and (explicit or faith.reached))
        judged = held if held is not None else task          # the rows f is reported on
        if explicit:
            circ = scores.circuit(edges=args.edges, percent=args.percent, by=args.by, how=args.how)
            f_circ, node_f = pool.run("circuit_faithfulness", local=circuit_faithfulness_step, task=judged,
                                      circuit=circ, graph=g, progress=progress)
        elif held is not None:
            circ = faith.circuit
            f_circ, node_f = faith.holdout["curve"][faith.chosen_percent], faith.holdout["node_faithfulness"]
        else:
            circ, f_circ, node_f = faith.circuit, faith.curve[faith.chosen_percent], faith.node_faithfulness
        t4 = time.perf_counter()
        if core is not None:            # the core's heads, and those outside it whose effect reaches 5 %
            roles = pool.run("roles", local=roles_step, task=task, circuit=core.circuit(scores), clean=scores.clean,
                             corrupt=scores.corrupt, force=args.force, also=core.outside(scores))
        elif named:
            roles = pool.run("roles", local=roles_step, task=task, circuit=circ, clean=scores.clean,
                             corrupt=scores.corrupt, force=args.force)
        else:
            from .._tasks.roles import Roles

            why = ("the model does not do the task (warning above)" if not done or undefined else
                   "no grid size below 100% reaches f >= 0.8 (warning above)")
            roles = Roles({}, task.name, {"not_named": f"{why}; --force names them anyway"})
        t5 = time.perf_counter()
        stab = None
        if args.resamples and core is not None:
            stab = pool.run("stability", local=stability_step, task=args.task, n=args.n, seed=args.seed,
                            prepend_bos=bos_mode_arg(args.bos), metric=args.metric, sel=task, held=held,
                            resamples=args.resamples, first={"scores": scores, "core": core, "roles": roles},
                            percent=faith.chosen_percent, progress=progress, method=args.method, steps=args.steps,
                            rule=args.rule, by=args.by, mlps=args.core_mlps == "searched")
        t6 = time.perf_counter()
    # the means over every row of the task (the selection and the held-out part)
    clean_all, corrupt_all = scores.clean, scores.corrupt
    if held is not None and faith.holdout:
        clean_all = (scores.clean * task.n + faith.holdout["clean"] * held.n) / n_all
        corrupt_all = (scores.corrupt * task.n + faith.holdout["corrupt"] * held.n) / n_all
    lines = [f"warning: {w}" for w in warned] + [header,
             f"  clean {task.metric_name} {clean_all:.4f}, corrupt {corrupt_all:.4f} (every prompt)"]
    if core is not None:
        lines += core_lines(core)
        lines.append("  roles (the core's heads, and heads outside it whose direct or node effect reaches 5 %):")
        lines += [f"  {line}" for line in roles.sentences()]
        if stab is not None:
            lines += [f"  {line}" for line in stab.lines()]
        lines.append("  edge circuit:")
    elif g.positions and not args.no_core:
        lines.append("  core circuit: none on the position-aware graph (the core's nodes are heads at every position)")
    report = faith.holdout if held is not None else None     # the numbers reported: held-out when there is a part
    curve = report["curve"] if report else faith.curve
    cpr, cmd = (report["cpr"], report["cmd"]) if report else (faith.cpr, faith.cmd)
    b = report["bootstrap"] if report else faith.bootstrap
    where = f" on the {held.n} held-out prompts" if report else ""
    if undefined:                         # f = (m − m(corrupt)) / (m(clean) − m(corrupt)) has no value
        lines.append(f"  faithfulness is undefined: clean and corrupt {task.metric_name} are equal ({scores.clean:.4g});"
                     f" the curve, CPR and CMD are NaN (null in the JSON)")
    else:
        lines.append(f"  faithfulness f by percent of edges{where}: " + ", ".join(f"{k:g}%: {v:.3f}" for k, v in curve.items()))
        if report:
            lines.append(f"    on the {task.n} selection prompts (where the circuit was chosen): "
                         + ", ".join(f"{k:g}%: {v:.3f}" for k, v in faith.curve.items()))
        ci = (lambda key: f" [{100 * b['level']:g} % interval {b[key][0]:.3f}-{b[key][1]:.3f}]") if b else (lambda key: "")
        lines.append(f"  CPR {cpr:.3f}{ci('cpr')} (higher is better), CMD {cmd:.3f}{ci('cmd')} (lower is "
                     f"better){where}" + (f"; intervals from {b['n']} resamples of the prompts" if b else "")
                     + (f"; on the selection prompts CPR {faith.cpr:.3f}, CMD {faith.cmd:.3f}" if report else ""))
    how = (f"{args.edges} edges requested" if args.edges is not None else f"{args.percent:g}% requested"
           if args.percent is not None else f"smallest grid size with f >= 0.8 on the selection prompts: "
           f"{faith.chosen_percent:g}%" if faith.reached else f"f undefined: the largest grid size, "
           f"{faith.chosen_percent:g}%" if undefined else
           f"no grid size below 100% reaches f >= 0.8: the largest, {faith.chosen_percent:g}%")
    if named:
        f_sel = faith.curve.get(faith.chosen_percent) if not explicit else None
        sel_part = (f" (selection {f_sel:.3f})" if report and f_sel is not None else "")
        lines.append(f"  circuit ({how}): {circ.n_edges} edges after pruning, f {f_circ:.3f}{where}{sel_part}; "
                     f"{len(circ.heads)} heads, node view f {node_f:.3f} (every other head's output corrupted)")
        lines += [f"    {s:>7} -> {r:<8} {x:<3} {v:+.4f}" for s, r, x, v in circ.edges()[:10]]
        if circ.position_mask is not None:
            where_nodes = circ.position_nodes
            lines.append(f"  where its nodes act ({len(where_nodes)} node@position): {', '.join(where_nodes[:24])}"
                         f"{' …' if len(where_nodes) > 24 else ''}")
    else:
        lines.append(f"  no circuit named ({how}): " + (
            "the model does not do the task" if not done or undefined else "it would be the whole graph")
            + "; --force names it anyway")
    if core is None:
        lines += [f"  {line}" for line in roles.sentences()]
    print("\n".join(lines), flush=True)
    timing = {"load_s": round(t_load, 2), "edge_scores_s": round(t2 - t1, 2), "core_s": round(t_core - t2, 2),
              "faithfulness_s": round(t3 - t_core, 2),
              "sign_check_s": round(t_sign - t3, 2), "circuit_s": round(t4 - t_sign, 2), "roles_s": round(t5 - t4, 2),
              "stability_s": round(t6 - t5, 2), "total_s": round(t6 - t0, 2)}
    circuit = {**circ.to_dict(), "faithfulness": f_circ, "node_faithfulness": node_f, "named": bool(named)}
    if report and not explicit:
        circuit["selection_faithfulness"] = faith.curve[faith.chosen_percent]
        circuit["selection_node_faithfulness"] = faith.node_faithfulness
    if not named:                       # the edges of no circuit are not drawn as one (the CSV keeps every score)
        circuit.update(edges=[], heads=[], mlps=[], n_edges=0, **({"position_nodes": []} if "position_nodes" in circuit
                                                                   else {}))
    data = {"schema": SCHEMA, "model": args.model, "task": task.name, "n_prompts": n_all,
            "metric": task.metric_name, "clean": clean_all, "corrupt": corrupt_all, "method": args.method,
            "steps": scores.steps, "rule": scores.rule, "curve": {f"{k:g}": v for k, v in curve.items()},
            "cpr": cpr, "cmd": cmd, "circuit": circuit, "roles": dict(roles.roles),
            "roles_of": "core" if core is not None else "circuit" if named else None, "warnings": warned,
            "timing": timing, "bos": task.bos_info(), "bos_prepended": bool(task.bos), "graph": g.to_dict(),
            "n_edges_by_percent": {f"{k:g}": v for k, v in faith.n_edges.items()},
            "chosen_percent": faith.chosen_percent, "by": args.by, "how": args.how, "force": bool(args.force),
            "positions": sorted(task.positions), "versions": scores.settings.get("versions", {}),
            "holdout": _holdout_json(args, task, held, drawn),
            "selection": {"n": task.n, "clean": scores.clean, "corrupt": scores.corrupt,
                          "curve": {f"{k:g}": v for k, v in faith.curve.items()}, "cpr": faith.cpr, "cmd": faith.cmd}}
    if core is not None:
        data["core"] = core_json(core)
    if b:
        data["bootstrap"] = b
    if stab is not None:
        data["stability"] = stab.to_dict()
    if sign is not None:
        data["sign_check"] = sign
    if args.timing:
        print("  timing: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in timing.items()))
    if args.ray is not None:
        data["backend"] = {k: v for k, v in scores.settings.get("backend", {}).items() if k != "plan"}
    _write(args, data, scores, circ if named else None, roles)
    return 0


def _holdout_json(args, task, held, drawn: str) -> dict:
    """The ``holdout`` key: how the prompts were split (docs/tasks.md)."""
    from .._tasks.holdout import FRESH, HELD_SEED

    if held is None:
        return {"fraction": 0.0, "n": 0, "how": "none: chosen and judged on the same prompts"}
    return {"fraction": HOLDOUT if args.holdout is None else args.holdout, "n": held.n, "selection_n": task.n,
            "how": drawn, "seed": args.seed + (HELD_SEED if drawn == FRESH else 0)}


def core_json(core) -> dict:
    """The ``core`` key of the circuit JSON (docs/tasks.md): heads, mlps, node_faithfulness, curve {heads in the
    ranked prefix: f}, how, and the search's settings."""
    d = core.to_dict()
    keep = ("heads", "mlps", "node_faithfulness", "interval", "holdout", "margin", "curve", "how", "threshold",
            "pruned", "needed", "path")
    return {**{k: d[k] for k in keep}, "by": core.settings.get("by"), "mlps_searched": core.settings.get("mlps") == "searched",
            "sets_measured": core.settings.get("sets_measured"), "seconds": core.timing.get("core_s")}


def core_lines(core) -> list:
    """The summary's lines of the core circuit: its size and node f, its nodes, how it was found, the grow curve."""
    mlps = f" + {len(core.mlps)} MLPs" if core.mlps and core.settings.get("mlps") == "searched" else ""
    return [f"  core circuit: {len(core.heads)} heads{mlps}, {core.f_text()} (every other head"
            f"{' and MLP' if mlps else ''} gives its corrupt output)",
            f"    heads {', '.join(core.heads)}" + (f"; MLPs {', '.join(core.mlps)}" if mlps else ""),
            f"    how: {core.how}",
            "    f by heads in the ranked prefix (selection prompts): "
            + ", ".join(f"{k}: {v:.3f}" for k, v in core.curve.items())]


def _graph_kw(args) -> dict:
    """The edge-score keywords of a graph other than the default (grouped, not position-aware); none otherwise, so
    that Ray's edge scores (the default graph only) take the same call."""
    return {"gqa": args.gqa, "positions": args.positions} if args.gqa != "grouped" or args.positions else {}


def _sign_check(args, pool, task, scores, warn_now):
    """EAP-IG (5 steps, left rule) on the first ``SIGN_ROWS`` prompts against ``scores``' top 100 edges by |score|:
    the share of opposite signs (``caveats.sign_disagreement``); a warning above ``caveats.SIGN_LIMIT``."""
    from .._tasks import caveats

    from .._tasks.scores import edge_scores

    rows = min(SIGN_ROWS, task.n)
    ref = pool.run("edge_scores", local=edge_scores, task=task.rows(slice(0, rows)), method="eap-ig", steps=5,
                   progress=not args.quiet, **_graph_kw(args))
    found = caveats.sign_disagreement(scores.scores, ref.scores, scores.graph.valid)
    g = scores.graph
    names = {(s, r): f"{g.senders[s]} -> {g.receivers[r][0]} {g.receivers[r][1]}" for s, r, _, _ in found["worst"]}
    if found["fraction"] > caveats.SIGN_LIMIT:
        warn_now(caveats.sign_message(args.method, found, names, rows))
    return {"fraction": found["fraction"], "top": found["top"], "prompts": rows, "limit": caveats.SIGN_LIMIT,
            "worst": [[names[(s, r)], a, b] for s, r, a, b in found["worst"]]}


def _finite(o):
    """``o`` with every non-finite float as None (JSON's null)."""
    from .._foundation.io import json_number

    if isinstance(o, float):
        return json_number(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _write(args, data, scores, circ, roles) -> None:
    from .._foundation.io import csv_text, dump_json, write_atomic

    if args.json:
        dump_json(_finite(data), args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.csv:
        inside = {tuple(e[:3]) for e in circ.edges()} if circ is not None else set()
        rows = [[s, r, x, float(f"{v:.6g}"), int((s, r, x) in inside)] for s, r, x, v in scores.edge_list()]
        write_atomic(args.csv, csv_text(["sender", "receiver", "input", "score", "in_circuit"], rows))
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.mib:
        scores.to_mib(args.mib, circuit=circ)
        print(f"wrote {args.mib}", file=sys.stderr)
    if args.output:          # the report's own circuit section (warnings, curve, graph, roles, top edges), alone
        from ..viz._report import circuit_page, write_report

        write_report(args.output, circuit_page(_finite(data), source=args.json or f"{data['model']}, {data['task']}"))
        print(f"wrote {args.output}", file=sys.stderr)
