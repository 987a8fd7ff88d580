"""``qk.find_circuit(model, task)``: a task's circuit over the whole graph in one call — every step of
``qkcircuits circuit`` (the command parses its flags, calls this and prints the report).

>>> report = qk.find_circuit("toy-induction", "induction", n=9, steps=2, edges=4, progress=False)
>>> report.core["heads"], report.data["circuit"]["n_edges"] <= 4, report.warnings
(['0.0', '1.0'], True, [])
>>> print(report)                                   # what the command prints, line for line  # doctest: +ELLIPSIS
toy-induction: task induction, 9 prompts x 20 tokens (6 to choose the circuit on, 3 held out to judge it: ...
>>> back = qk.load_result(report.to_json())         # the command's --json file is this report's JSON
>>> back.data == report.data, back.summary == report.summary
(True, True)

The steps, each ``pool.run(job, local=...)`` (or a split analysis given ``backend=pool``) on ONE pool of ``backend`` (the model loaded once, here or on each Ray
worker): the task (its selection part and held-out part: ``holdout.Source``) and its graph; the edge scores
(``method``); the core circuit (``core.core_circuit``: chosen on the selection part, judged on the held-out part);
the faithfulness curve with CPR/CMD (``faithfulness``, judged on the held-out part); where ``method`` is not EAP-IG
or exact, EAP-IG on the first ``SIGN_ROWS`` prompts to check the signs (``caveats.sign_disagreement``); the edge
circuit (``edges`` / ``percent``, else the smallest grid size with f ≥ 0.8 on the selection part) and its f on the
held-out part; the roles of the core's heads (and of heads outside it whose effect reaches 5 %), else of the edge
circuit's; with ``resamples``, the core's stability over that many independent draws (``stability``).
Warnings (the model does not do the task; no grid size reaches f ≥ 0.8; the signs disagree) are said through
``say`` as they are found and lead the report. Cost: the command's (docs/benchmarks.md: 52 plain forwards of the
prompts for IOI on SmolLM2, 224 with ``resamples=5``). Memory: the edge scores ([senders, receivers] floats) and
one prompt shard's activations at a time.
"""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import contextmanager
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Optional

from .._foundation.backends import as_backend
from .._foundation.errors import QKCircuitsError
from .circuit_report import CircuitReport, assemble
from .holdout import HOLDOUT, Source, check_holdout
from .task import Task

METHODS = ("eap-ig", "eap", "exact", "eap-ig-activations", "clean-corrupted")
# the sign check's EAP-IG runs on this many prompts (the first ones): a quarter of the default 64's cost
SIGN_ROWS = 16


def find_circuit(model, task: Any, *, n: int = 64, seed: int = 0, bos: str = "auto",
                 metric: Optional[str] = None, method: str = "eap-ig", steps: int = 5, rule: Optional[str] = None,
                 gqa: str = "grouped", positions: bool = False, edges: Optional[int] = None,
                 percent: Optional[Real] = None, by: str = "signed", how: str = "top", force: bool = False,
                 sign_check: bool = True, core: bool = True, core_mlps: str = "searched",
                 holdout: Optional[Real] = None, resamples: int = 0, bootstrap: int = 0, backend: Any = None,
                 progress: bool = True, say: Optional[Callable[[str], None]] = None,
                 _started: Optional[float] = None) -> CircuitReport:
    """A task's circuit, what ``qkcircuits circuit`` prints and writes (module docstring), as a ``CircuitReport``.

    ``model``: a loaded model or a spec (``"smollm2-135m"``, a folder, a GGUF). ``task``: a registered task's name
    (``qk.tasks.task_names()``), a .jsonl path, or a ``qk.Task`` (fixed rows, like a file). ``n``/``seed``/``bos``/
    ``metric``: how a registered task is built (``bos``: "auto" = what the tokenizer does, "yes", "no"; ``metric``:
    the task's own by default). ``holdout``: the fraction of the prompts held out to judge the circuit on (None:
    1/3, none when too few to split; 0: none). ``edges``/``percent``: the edge circuit's size (else the smallest grid
    size with f ≥ 0.8). ``core=False``: no core circuit (roles are then the edge circuit's). ``resamples``: draws
    for the core's stability. ``bootstrap``: resamples of the prompts for the curve's, CPR's and CMD's intervals.
    ``say``: where progress lines and warnings go as they happen (default: stderr when ``progress``).
    """
    _check(task, method, rule, edges, percent, by, how, core_mlps, gqa, positions, holdout, resamples, bootstrap, n,
           core)
    say = say or ((lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None))
    t0 = time.perf_counter() if _started is None else _started
    chosen = as_backend(backend)
    if resamples and chosen.name == "ray":
        raise QKCircuitsError("resamples run in this process only (not on Ray)")
    graph_kw = {"gqa": gqa, "positions": positions} if gqa != "grouped" or positions else {}
    with chosen.pool(model) as pool, _quiet_python_warnings():
        prepend = {"auto": None, "yes": True, "no": False}[bos]
        if isinstance(task, Task):         # fixed rows: split where the model is (its tokenizer is not needed)
            sel, held, g, drawn = pool.run("task", local=task_step_of, task=task, holdout=holdout, seed=seed,
                                           **graph_kw)
        else:
            sel, held, g, drawn = pool.run("task", local=task_step, task=str(task), n=n, seed=seed,
                                           prepend_bos=prepend, metric=metric, holdout=holdout, **graph_kw)
        name = model if isinstance(model, (str, Path)) else _model_name(pool.here)
        run = _Run(pool, say, progress, graph_kw, str(name), task)
        return run.steps(sel, held, g, drawn, t0, method=method, steps=steps, rule=rule, edges=edges, percent=percent,
                         by=by, how=how, force=force, sign_check=sign_check, core=core, core_mlps=core_mlps,
                         holdout=holdout, resamples=resamples, bootstrap=bootstrap, n=n, seed=seed,
                         prepend=prepend, metric=metric, bos=bos)


class _Run:
    """One call's steps on its pool (``find_circuit``): the state the steps share, nothing more."""

    def __init__(self, pool, say, progress, graph_kw, name, spec):
        self.pool, self.say, self.progress, self.graph_kw, self.name, self.spec = (pool, say, progress, graph_kw,
                                                                                   name, spec)
        self.warned = []

    def warn(self, line: str) -> None:
        """A warning found: kept for the report, and said now."""
        self.warned.append(line)
        self.say(f"warning: {line}")

    def steps(self, task, held, g, drawn, t0, *, method, steps, rule, edges, percent, by, how, force, sign_check,
              core, core_mlps, holdout, resamples, bootstrap, n, seed, prepend, metric, bos):
        from . import caveats
        from .core import core_circuit
        from .faithfulness import THRESHOLD, faithfulness
        from .roles import Roles
        from .scores import edge_scores
        from .task import does_the_task, not_done_message

        pool, progress = self.pool, self.progress
        t_load = time.perf_counter() - t0
        header = _header(self.name, task, held, drawn, g, holdout, bos_text(task, pool, self.spec, bos), pool)
        self.say(header)                            # the first line: the BOS is said before anything runs
        hold = {"holdout": held} if held is not None else {}
        t1 = time.perf_counter()
        scores = edge_scores(pool.model, task, method, steps, rule=rule, progress=progress, backend=pool,
                             **self.graph_kw)
        t2 = time.perf_counter()
        self.say(f"  clean {task.metric_name} {scores.clean:.4f}, corrupt {scores.corrupt:.4f}")
        done = does_the_task(task, scores.clean, scores.corrupt)
        if not done:
            self.warn(not_done_message(task, scores.clean, scores.corrupt, pool.here))
        undefined = scores.clean == scores.corrupt
        the_core = None
        # the core first: the fewest heads (and MLPs) that carry the behaviour; none on the position-aware graph
        # and none named when the model does not do the task, unless forced
        if core and not g.positions and (force or (done and not undefined)):
            the_core = pool.run("core_circuit", local=core_circuit, task=task, scores=scores, by=by,
                                mlps=core_mlps == "searched", progress=progress, **hold)
        t_core = time.perf_counter()
        # the curve's shards mapped on the pool (on Ray: over its workers), its node view one step
        faith = faithfulness(pool.model, task, scores, by=by, how=how, progress=progress, backend=pool,
                             bootstrap=bootstrap, **hold)
        t3 = time.perf_counter()
        explicit = edges is not None or percent is not None
        if done and not undefined and not explicit and not faith.reached:
            self.warn(caveats.unreached_message(faith.curve, THRESHOLD))
        sign = None
        if method not in ("eap-ig", "exact") and sign_check:
            sign = self.sign_check(method, task, scores)
        t_sign = time.perf_counter()
        named = force or (done and not undefined and (explicit or faith.reached))
        if explicit:
            circ = scores.circuit(edges=edges, percent=percent, by=by, how=how)
            f_circ, node_f = pool.run("circuit_faithfulness", local=circuit_faithfulness_step,
                                      task=held if held is not None else task, circuit=circ, graph=g,
                                      progress=progress)
        elif held is not None:
            circ = faith.circuit
            f_circ, node_f = faith.holdout["curve"][faith.chosen_percent], faith.holdout["node_faithfulness"]
        else:
            circ, f_circ, node_f = faith.circuit, faith.curve[faith.chosen_percent], faith.node_faithfulness
        t4 = time.perf_counter()
        if the_core is not None:        # the core's heads, and those outside it whose effect reaches 5 %
            roles = pool.run("roles", local=roles_step, task=task, circuit=the_core.circuit(scores),
                             clean=scores.clean, corrupt=scores.corrupt, force=force, also=the_core.outside(scores))
        elif named:
            roles = pool.run("roles", local=roles_step, task=task, circuit=circ, clean=scores.clean,
                             corrupt=scores.corrupt, force=force)
        else:
            why = ("the model does not do the task (warning above)" if not done or undefined else
                   "no grid size below 100% reaches f >= 0.8 (warning above)")
            roles = Roles({}, task.name, {"not_named": f"{why}; --force names them anyway"})
        t5 = time.perf_counter()
        stab = None
        if resamples and the_core is not None:
            source = (Source(task.n, seed, rows=self.spec) if isinstance(self.spec, Task) else
                      Source.of(pool.here, str(self.spec), n, seed, prepend, metric))
            from .stability import stability

            stab = stability(pool.here, source, task, held, resamples,
                             first={"scores": scores, "core": the_core, "roles": roles},
                             percent=faith.chosen_percent, progress=progress, method=method, steps=steps, rule=rule,
                             by=by, mlps=core_mlps == "searched")
        t6 = time.perf_counter()
        timing = {"load_s": t_load, "edge_scores_s": t2 - t1, "core_s": t_core - t2, "faithfulness_s": t3 - t_core,
                  "sign_check_s": t_sign - t3, "circuit_s": t4 - t_sign, "roles_s": t5 - t4,
                  "stability_s": t6 - t5, "total_s": t6 - t0}
        return assemble(model=self.name, header=header, task=task, held=held, graph=g, drawn=drawn,
                        holdout=holdout, seed=seed, method=method, by=by, how=how, force=force, edges=edges,
                        percent=percent, scores=scores, core=the_core, faith=faith, circ=circ, f_circ=f_circ,
                        node_f=node_f, named=named, done=done, roles=roles, stability=stab, sign=sign,
                        warnings=list(self.warned), timing={k: round(v, 2) for k, v in timing.items()},
                        backend=pool.where())

    def sign_check(self, method: str, task, scores) -> dict:
        """EAP-IG (5 steps, left rule) on the first ``SIGN_ROWS`` prompts against ``scores``' top 100 edges by
        |score|: the share of opposite signs (``caveats.sign_disagreement``); a warning above ``caveats.SIGN_LIMIT``."""
        from . import caveats
        from .scores import edge_scores

        rows = min(SIGN_ROWS, task.n)
        ref = edge_scores(self.pool.model, task.rows(slice(0, rows)), "eap-ig", 5, progress=self.progress,
                          backend=self.pool, **self.graph_kw)
        found = caveats.sign_disagreement(scores.scores, ref.scores, scores.graph.valid)
        g = scores.graph
        names = {(s, r): f"{g.senders[s]} -> {g.receivers[r][0]} {g.receivers[r][1]}" for s, r, _, _ in found["worst"]}
        if found["fraction"] > caveats.SIGN_LIMIT:
            self.warn(caveats.sign_message(method, found, names, rows))
        return {"fraction": found["fraction"], "top": found["top"], "prompts": rows, "limit": caveats.SIGN_LIMIT,
                "worst": [[names[(s, r)], a, b] for s, r, a, b in found["worst"]]}


# ----------------------------------------------------------------------------------------------- the steps
# The steps that are not split (``local=`` of ``pool.run``: they run where the model is, in this process or on one
# Ray worker).


def task_step(model, *, task: str, n: int, seed: int, prepend_bos=None, metric: Optional[str] = None,
              holdout: Optional[Real] = None, gqa: str = "grouped", positions: bool = False):
    """The step "task": the task built with this model's tokenizer (its selection part, and its held-out part or
    None: ``holdout.Source.parts``), the graph its edges are scored on, and where the held-out part comes from."""
    from .scores import task_graph

    # the default third (``holdout`` None) is dropped when the prompts are too few to split; a given one is not
    source = Source.of(model, task, n, seed, prepend_bos, metric)
    sel, held = source.parts(HOLDOUT if holdout is None else holdout, strict=holdout is not None)
    return sel, held, task_graph(model, sel, gqa, positions), source.how


def task_step_of(model, *, task: Task, holdout: Optional[Real], seed: int, gqa: str = "grouped",
                 positions: bool = False):
    """``task_step`` for a ``qk.Task`` given as it is: fixed rows, split as a file's are."""
    from .scores import task_graph

    source = Source(task.n, seed, rows=task)
    sel, held = source.parts(HOLDOUT if holdout is None else holdout, strict=holdout is not None)
    return sel, held, task_graph(model, sel, gqa, positions), source.how


def circuit_faithfulness_step(model, *, task, circuit, graph, progress: bool = True):
    """The step "circuit_faithfulness": (f, node-view f) of one circuit (``edges`` / ``percent``)."""
    from .curve import circuit_metric
    from .faithfulness import node_faithfulness, ratio
    from .scores import shard_rows

    rows = shard_rows(model, graph, task, buffers=3)
    # one shard: its corrupt record serves the node view too (as in ``faithfulness``)
    records = {} if rows >= task.n else None
    mask = circuit.mask if circuit.position_mask is None else circuit.position_mask
    (m,), clean, corrupt = circuit_metric(model, task, [mask], rows, records=records, g=graph)
    return ratio(m, clean, corrupt), node_faithfulness(model, task, circuit.heads, rows, clean=clean, records=records)


def roles_step(model, *, task, circuit, clean, corrupt, force: bool = False, also=()):
    """The step "roles": the circuit's heads' roles (``also``: heads outside it judged beside them)."""
    from .roles import roles

    return roles(model, task, circuit, clean=clean, corrupt=corrupt, force=force, also=list(also))


# ----------------------------------------------------------------------------------------------- words
def token_text(pool, i: int) -> str:
    """Token ``i`` as text where the model is loaded in this process (its tokenizer), else its id."""
    tok = getattr(pool.here, "tokenizer", None)
    try:
        return repr(tok.decode([int(i)])) if tok is not None else f"id {int(i)}"
    except Exception:      # an id the tokenizer cannot decode: its number says enough
        return f"id {int(i)}"


def bos_text(task: Task, pool, spec, bos: str) -> str:
    """How the prompts start, in words (the first line says it)."""
    from .registry import spec_of

    registered = spec_of(task)
    first = token_text(pool, int(task.clean[0, 0]))
    if registered is not None and registered.always_bos and isinstance(spec, str) and spec == registered.name:
        return f"BOS {first} prepended ({registered.name} prompts always start with BOS)"
    mode = task.bos_mode or ("yes" if task.bos else "no")
    if mode == "auto":
        return (f"BOS {first} prepended (--bos auto: the tokenizer adds it)" if task.bos
                else "no BOS (--bos auto: the tokenizer adds none; --bos yes prepends one)")
    return f"BOS {first} prepended (--bos yes)" if task.bos else "no BOS (--bos no)"


def _header(name: str, task: Task, held, drawn: str, g, holdout, bos: str, pool) -> str:
    n_all = task.n + (held.n if held is not None else 0)
    split = (f" ({task.n} to choose the circuit on, {held.n} held out to judge it: {drawn})" if held is not None
             else " (no held-out part: chosen and judged on the same prompts" + (
                 ", too few to hold a third out)" if holdout is None else ")"))
    workers = getattr(pool, "workers", None)          # a Ray pool's workers (none on this process's pool)
    return (f"{name}: task {task.name}, {n_all} prompts x {task.clean.shape[1]} tokens{split}, {bos}, metric "
            f"{task.metric_name}; graph {g.n_nodes} nodes, {g.n_edges} edges"
            + (f"; on Ray, {workers.size} workers" if workers is not None else ""))


def _model_name(model) -> str:
    from .._foundation.arch.model_facts import model_name

    return model_name(model)


@contextmanager
def _quiet_python_warnings():
    """The run's own Python warnings that the report says itself, once, in its own words."""
    from .caveats import UNREACHED
    from .task import NOT_DONE

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NOT_DONE)
        warnings.filterwarnings("ignore", message=UNREACHED)
        yield


def _check(task, method, rule, edges, percent, by, how, core_mlps, gqa, positions, holdout, resamples, bootstrap,
           n, core) -> None:
    """Every argument's form, in one line each, before anything loads."""
    from .._foundation.io import check_int

    if not isinstance(task, (str, Path, Task)):
        raise QKCircuitsError(f"task must be a registered task's name, a .jsonl path or a qk.Task, got "
                              f"{type(task).__name__}")
    if isinstance(task, (str, Path)):
        from .registry import check_task_arg

        check_task_arg(str(task))
    for what, value, allowed in (("method", method, METHODS), ("by", by, ("signed", "abs")),
                                 ("how", how, ("top", "greedy")), ("core_mlps", core_mlps, ("searched", "clean")),
                                 ("gqa", gqa, ("grouped", "ungrouped"))):
        if value not in allowed:
            raise QKCircuitsError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
    if rule is not None and method not in ("eap-ig", "eap-ig-activations"):
        raise QKCircuitsError(f"--rule {rule}: applies to --method eap-ig and eap-ig-activations, not {method}")
    if edges is not None and percent is not None:
        raise QKCircuitsError("give the circuit's size as edges or percent, not both")
    if edges is not None:
        check_int("edges", edges)
    if percent is not None and (isinstance(percent, bool) or not isinstance(percent, Real) or not 0 < percent <= 100):
        raise QKCircuitsError(f"percent must be a number in (0, 100], got {percent!r}")
    if holdout is not None:
        check_holdout(holdout)
    for what, value, least in (("n", n, 1), ("resamples", resamples, 0), ("bootstrap", bootstrap, 0)):
        check_int(what, value, least)
    if resamples and (not core or positions):
        raise QKCircuitsError("--resamples compares the draws' core circuits: not with --no-core or --positions")


__all__ = ["find_circuit", "METHODS", "SIGN_ROWS", "task_step", "task_step_of", "circuit_faithfulness_step",
           "roles_step", "bos_text", "token_text"]
