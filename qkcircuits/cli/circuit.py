"""``qkcircuits circuit MODEL --task ioi|induction|FILE.jsonl``: a task's circuit over the whole graph.

Scores every edge (EAP-IG by default), finds the core circuit (the fewest heads and MLPs whose node view
reaches f ≥ 0.8, printed first) and names its heads' roles (with the heads outside it whose effect reaches
5 %), measures the edge circuit's faithfulness curve over the MIB grid (CPR/CMD, with ``--bootstrap N``
their intervals over prompts) and picks the edge circuit (``--edges``/``--percent``, else the smallest grid
size with f ≥ 0.8). ``--json`` keys (the contract the views read): model, task, n_prompts, metric, clean,
corrupt, method, steps, core {heads, mlps, node_faithfulness, curve {heads: f}, how, ...}, curve {percent:
f}, cpr, cmd, circuit {edges: [[sender, receiver, input, score], ...], heads, node_faithfulness, ...}, roles
{head: {role, evidence, why, in_circuit}} (of the core; ``roles_of`` says which circuit), timing; plus
schema, graph, bos_prepended, and bootstrap with ``--bootstrap``. ``--mib PATH`` writes the edge scores in
the MIB circuit track's JSON, the edge circuit's edges ``in_graph``.
"""

from __future__ import annotations

import argparse
import html
import sys
import time
import warnings
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, load_model, non_negative_int, output_arg, positive_int

SCHEMA = "qkcircuits.circuit/1"


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"expected a percent in (0, 100], got {text!r}")
    return v


def add_parser(sub) -> None:
    p = sub.add_parser("circuit", help="find a task's circuit: edge scores, faithfulness curve, roles",
                       description="Score every edge of the model's graph for a task with counterfactual prompts "
                                   "(clean vs corrupt), measure how much of the behaviour the top edges carry "
                                   "(faithfulness over 0.1-100%% of the edges, CPR and CMD) and name the roles of "
                                   "the circuit's heads.")
    add_model_args(p)
    p.add_argument("--task", required=True, help="ioi, induction, or a .jsonl file (one {clean, corrupt, answer, "
                                                 "wrong} object per line)")
    p.add_argument("--n", type=positive_int, default=64, help="prompts for ioi/induction (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the ioi/induction prompts (default 0)")
    p.add_argument("--method", choices=("eap", "eap-ig", "exact"), default="eap-ig",
                   help="eap-ig (default), eap, or exact (one patched run per edge: small models only)")
    p.add_argument("--steps", type=positive_int, default=5, help="EAP-IG interpolation steps (default 5)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--edges", type=positive_int, help="circuit size in edges")
    size.add_argument("--percent", type=_percent, help="circuit size in percent of the graph's edges")
    p.add_argument("--by", choices=("signed", "abs"), default="signed",
                   help="rank edges by score in the metric's better direction (default: the edges that carry the "
                        "behaviour) or by |score| (edges that work against it too)")
    p.add_argument("--how", choices=("top", "greedy"), default="top",
                   help="top: the top edges of the whole graph (default); greedy: grown from the logits")
    p.add_argument("--no-core", action="store_true",
                   help="skip the core circuit (the fewest heads and MLPs whose node view reaches f >= 0.8); the "
                        "roles are then the edge circuit's")
    p.add_argument("--core-mlps", choices=("searched", "clean"), default="searched",
                   help="searched (default): MLPs are nodes of the core like heads (one left out gives its "
                        "corrupt output); clean: every MLP stays clean and only heads are searched")
    p.add_argument("--bootstrap", type=non_negative_int, default=0, metavar="N",
                   help="N resamples of the prompts give 95%% intervals of the curve, CPR and CMD (no model run "
                        "per resample; default 0: none)")
    output_arg(p, "--mib", metavar="PATH", help="write the edge scores in the MIB circuit track's JSON (the edge "
                                                "circuit's edges in_graph)")
    p.add_argument("--json", metavar="PATH", help="write the result (the circuit JSON contract)")
    p.add_argument("--csv", metavar="PATH", help="write every edge's score (sender, receiver, input, score, in_circuit)")
    p.add_argument("-o", "--output", metavar="HTML", help="write a standalone HTML summary")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS|local:N",
                   help="run on Ray workers (each loads the model once; prompt shards, sums combined exactly): an "
                        "address, local:N, or nothing ($RAY_ADDRESS, else a local instance). A .jsonl task must "
                        "be readable by the workers")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def build_task(model, spec: str, n: int, seed: int):
    from .._tasks import builders

    if spec == "ioi":
        return builders.ioi(model, n=n, seed=seed)
    if spec == "induction":
        return builders.induction(model, n=n, seed=seed)
    return builders.from_jsonl(model, spec)


class _Here:
    """The command's heavy steps in this process (the model loaded here)."""

    def __init__(self, args):
        from .._tasks.graph import graph

        self.model = load_model(args)
        self.task = build_task(self.model, args.task, args.n, args.seed)
        self.graph = graph(self.model)

    def edge_scores(self, **kw):
        from .._tasks.scores import edge_scores

        return edge_scores(self.model, self.task, **kw)

    def faithfulness(self, scores, **kw):
        from .._tasks.circuit import faithfulness

        return faithfulness(self.model, self.task, scores, **kw)

    def circuit_f(self, circ):
        from .._tasks.circuit import circuit_metric, node_faithfulness, ratio
        from .._tasks.scores import shard_rows

        rows = shard_rows(self.model, self.graph, self.task, buffers=3)
        # one shard: its corrupt record serves the node view too (as in ``faithfulness``)
        records = {} if rows >= self.task.n else None
        (m,), clean, corrupt = circuit_metric(self.model, self.task, [circ.mask], rows, records=records)
        return ratio(m, clean, corrupt), node_faithfulness(self.model, self.task, circ.heads, rows, clean=clean, records=records)

    def core(self, scores, mlps: bool, progress: bool):
        from .._tasks.core import core_circuit

        return core_circuit(self.model, self.task, scores, mlps=mlps, progress=progress)

    def roles(self, circ, clean, corrupt, also=()):
        return circ.roles(self.model, self.task, clean=clean, corrupt=corrupt, also=list(also))

    def close(self) -> None:
        pass


class _OnRay:
    """The same steps on one pool of Ray workers (``qkcircuits._scale.ray_tasks``); the driver loads no model."""

    def __init__(self, args):
        from .._scale import ray_tasks
        from .._scale.distributed import Pool

        self.rt = ray_tasks
        self.pool = Pool(args.model, load_kwargs={"device": args.device, "dtype": args.dtype,
                                                  "fold_ln": not args.no_fold_ln},
                         address=args.ray or None, progress=not args.quiet)
        self.pool.start()
        try:
            self.task, self.graph = ray_tasks.ray_task_and_graph(self.pool, args.task, args.n, args.seed)
        except BaseException:
            self.pool.close()
            raise

    def edge_scores(self, **kw):
        return self.rt.ray_edge_scores(None, self.task, pool=self.pool, **kw)

    def faithfulness(self, scores, **kw):
        return self.rt.ray_faithfulness(None, self.task, scores, pool=self.pool, **kw)

    def circuit_f(self, circ):
        (m,), clean, corrupt, _ = self.rt.ray_circuit_metric(self.pool, self.task, [circ.mask])
        return self.rt.ratio(m, clean, corrupt), self.rt.ray_node_faithfulness(self.pool, self.task, circ.heads,
                                                                                clean=clean)

    def core(self, scores, mlps: bool, progress: bool):
        return self.rt.ray_core_circuit(None, self.task, scores, mlps=mlps, progress=progress, pool=self.pool)

    def roles(self, circ, clean, corrupt, also=()):
        return self.rt.ray_roles(self.pool, self.task, circ, clean, corrupt, also=also)

    def close(self) -> None:
        self.pool.close()


def run(args: argparse.Namespace) -> int:
    if args.task not in ("ioi", "induction") and not Path(args.task).is_file():
        raise QKCircuitsError(f"--task {args.task!r}: expected ioi, induction, or an existing .jsonl file")
    t0 = time.perf_counter()
    here = _OnRay(args) if args.ray is not None else _Here(args)
    try:
        return _run(args, here, t0)
    finally:
        here.close()


def _run(args: argparse.Namespace, here, t0: float) -> int:
    from .._tasks.circuit import THRESHOLD
    from .._tasks.task import NOT_DONE, does_the_task

    progress = not args.quiet
    task, g = here.task, here.graph
    t_load = time.perf_counter() - t0
    print(f"{args.model}: task {task.name}, {task.n} prompts x {task.clean.shape[1]} tokens "
          f"(BOS {'prepended' if task.bos else 'not prepended'}), metric {task.metric_name}; graph {g.n_nodes} "
          f"nodes, {g.n_edges} edges" + (f"; on Ray, {here.pool.size} workers" if args.ray is not None else ""),
          flush=True)
    t1 = time.perf_counter()
    with warnings.catch_warnings():                 # said once below, in the CLI's own words
        warnings.filterwarnings("ignore", message=NOT_DONE)
        scores = here.edge_scores(method=args.method, steps=args.steps, progress=progress)
    t2 = time.perf_counter()
    print(f"  clean {task.metric_name} {scores.clean:.4f}, corrupt {scores.corrupt:.4f}", flush=True)
    if not does_the_task(task, scores.clean, scores.corrupt):
        print(f"warning: the model does not do this task (clean {scores.clean:.4g} vs corrupt {scores.corrupt:.4g}); "
              f"circuits and faithfulness will say little", file=sys.stderr, flush=True)
    core = roles = None
    if not args.no_core:                        # the core first: the fewest heads (and MLPs) that carry it
        core = here.core(scores, mlps=args.core_mlps == "searched", progress=progress)
        _print_core(core)
        roles = _core_roles(here, core, scores)
        _print_roles(roles, "the core's heads, and heads outside it whose direct or node effect reaches 5 %")
    t3 = time.perf_counter()
    faith = here.faithfulness(scores, by=args.by, how=args.how, progress=progress,
                              **({"bootstrap": args.bootstrap} if args.bootstrap else {}))
    t4 = time.perf_counter()
    if args.edges is not None or args.percent is not None:
        circ = scores.circuit(edges=args.edges, percent=args.percent, by=args.by, how=args.how)
        f_circ, node_f = here.circuit_f(circ)
    else:
        circ, f_circ, node_f = faith.circuit, faith.curve[faith.chosen_percent], faith.node_faithfulness
    t5 = time.perf_counter()
    if roles is None:
        roles = here.roles(circ, scores.clean, scores.corrupt)
    t6 = time.perf_counter()
    print("  edge circuit:")
    if scores.clean == scores.corrupt:          # f = (m − m(corrupt)) / (m(clean) − m(corrupt)) has no value
        print(f"  faithfulness is undefined: clean and corrupt {task.metric_name} are equal ({scores.clean:.4g}); the "
              f"curve, CPR and CMD are NaN (null in the JSON) and the circuit is the largest grid size")
    else:
        print("  faithfulness f by percent of edges: " + ", ".join(f"{k:g}%: {v:.3f}" for k, v in faith.curve.items()))
        b = faith.bootstrap
        ci = (lambda key: f" [{100 * b['level']:g} % interval {b[key][0]:.3f}-{b[key][1]:.3f}]") if b else (lambda key: "")
        print(f"  CPR {faith.cpr:.3f}{ci('cpr')} (higher is better), CMD {faith.cmd:.3f}{ci('cmd')} (lower is better)"
              + (f"; intervals from {b['n']} resamples of the prompts" if b else ""))
    how = (f"{args.edges} edges requested" if args.edges is not None else f"{args.percent:g}% requested"
           if args.percent is not None else f"smallest grid size with f >= 0.8: {faith.chosen_percent:g}%"
           if any(v >= THRESHOLD for v in faith.curve.values()) else
           f"f undefined: the largest grid size, {faith.chosen_percent:g}%" if scores.clean == scores.corrupt else
           f"no grid size reaches f >= 0.8: the largest, {faith.chosen_percent:g}%")
    print(f"  circuit ({how}): {circ.n_edges} edges after pruning, f {f_circ:.3f}; {len(circ.heads)} heads, node "
          f"view f {node_f:.3f} (every other head's output corrupted)")
    for s, r, x, v in circ.edges()[:10]:
        print(f"    {s:>7} -> {r:<8} {x:<3} {v:+.4f}")
    if core is None:
        _print_roles(roles, "")
    timing = {"load_s": round(t_load, 2), "edge_scores_s": round(t2 - t1, 2), "core_s": round(t3 - t2, 2),
              "faithfulness_s": round(t4 - t3, 2), "circuit_s": round(t5 - t4, 2), "roles_s": round(t6 - t5, 2),
              "total_s": round(t6 - t0, 2)}
    data = {"schema": SCHEMA, "model": args.model, "task": task.name, "n_prompts": task.n,
            "metric": task.metric_name, "clean": scores.clean, "corrupt": scores.corrupt, "method": args.method,
            "steps": scores.steps, "curve": {f"{k:g}": v for k, v in faith.curve.items()}, "cpr": faith.cpr,
            "cmd": faith.cmd,
            "circuit": {**circ.to_dict(), "faithfulness": f_circ, "node_faithfulness": node_f},
            "roles": dict(roles.roles), "roles_of": "circuit" if core is None else "core", "timing": timing,
            "bos_prepended": bool(task.bos), "graph": g.to_dict(),
            "n_edges_by_percent": {f"{k:g}": v for k, v in faith.n_edges.items()},
            "chosen_percent": faith.chosen_percent, "by": args.by, "how": args.how,
            "versions": scores.settings.get("versions", {})}
    if core is not None:
        data["core"] = core_json(core)
    if faith.bootstrap:
        data["bootstrap"] = faith.bootstrap
    if args.ray is not None:
        data["backend"] = {k: v for k, v in scores.settings.get("backend", {}).items() if k != "plan"}
    _write(args, data, scores, circ, roles)
    return 0


def core_json(core) -> dict:
    """The ``core`` key of the circuit JSON (docs/tasks.md): heads, mlps, node_faithfulness, curve {heads in the
    ranked prefix: f}, how, and the search's settings."""
    d = core.to_dict()
    keep = ("heads", "mlps", "node_faithfulness", "curve", "how", "threshold", "pruned")
    return {**{k: d[k] for k in keep}, "by": core.settings.get("by"), "mlps_searched": core.settings.get("mlps") == "searched",
            "sets_measured": core.settings.get("sets_measured"), "seconds": core.timing.get("core_s")}


def _core_roles(here, core, scores):
    """The core's roles and those of the heads outside it with >= 5 % effect (``CoreCircuit.roles``), here or on Ray."""
    return here.roles(core.circuit(scores), scores.clean, scores.corrupt, also=core.outside(scores))


def _print_core(core) -> None:
    mlps = f" + {len(core.mlps)} MLPs" if core.mlps and core.settings.get("mlps") == "searched" else ""
    print(f"  core circuit: {len(core.heads)} heads{mlps}, node f {core.node_faithfulness:.3f} (every other head"
          f"{' and MLP' if mlps else ''} gives its corrupt output)", flush=True)
    print(f"    heads {', '.join(core.heads)}" + (f"; MLPs {', '.join(core.mlps)}" if mlps else ""))
    print(f"    how: {core.how}")
    print("    f by heads in the ranked prefix: " + ", ".join(f"{k}: {v:.3f}" for k, v in core.curve.items()))


def _print_roles(roles, of: str) -> None:
    if of:
        print(f"  roles ({of}):")
    for line in roles.sentences():
        print(f"  {line}")


def _write(args, data, scores, circ, roles) -> None:
    from .._foundation.io import dump_json, json_number, write_atomic

    if args.json:
        def clean(o):
            if isinstance(o, float):
                return json_number(o)
            if isinstance(o, dict):
                return {k: clean(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [clean(v) for v in o]
            return o
        dump_json(clean(data), args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.csv:
        inside = {tuple(e[:3]) for e in circ.edges()}
        lines = ["sender,receiver,input,score,in_circuit"]
        lines += [f"{s},{r},{x},{v:.6g},{int((s, r, x) in inside)}" for s, r, x, v in scores.edge_list()]
        write_atomic(args.csv, "\n".join(lines) + "\n")
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.mib:
        scores.to_mib(args.mib, circuit=circ)
        print(f"wrote {args.mib}", file=sys.stderr)
    if args.output:
        rows = "".join(f"<tr><td>{html.escape(s)}</td><td>{html.escape(r)}</td><td>{x}</td><td>{v:+.4f}</td></tr>"
                       for s, r, x, v in circ.edges()[:50])
        curve = "".join(f"<tr><td>{k}%</td><td>{json_number(v)}</td></tr>" for k, v in data["curve"].items())
        page = (f"<!doctype html><meta charset='utf-8'><title>circuit: {html.escape(str(data['model']))}</title>"
                f"<h1>{html.escape(str(data['model']))}: {html.escape(str(data['task']))}</h1>"
                f"<p>clean {data['clean']:.4f}, corrupt {data['corrupt']:.4f}; CPR {data['cpr']:.3f}, "
                f"CMD {data['cmd']:.3f}</p><table><tr><th>percent</th><th>f</th></tr>{curve}</table>"
                f"<ul>{''.join(f'<li>{html.escape(s)}</li>' for s in roles.sentences())}</ul>"
                f"<table><tr><th>sender</th><th>receiver</th><th>input</th><th>score</th></tr>{rows}</table>")
        write_atomic(args.output, page)
        print(f"wrote {args.output}", file=sys.stderr)
