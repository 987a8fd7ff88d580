"""``CircuitReport``: what ``qk.find_circuit`` found, as ``qkcircuits circuit`` prints it and writes it (``--json``).

>>> r = CircuitReport({"model": "m", "task": "t", "curve": {"100": 1.0}, "circuit": {"edges": []},
...                    "warnings": [], "summary": ["m: task t", "  core circuit: ..."]})
>>> print(r)
m: task t
  core circuit: ...
>>> CircuitReport.from_json(r.to_json()).data == r.data
True

``data`` is the JSON contract, documented once (docs/tasks.md, "The circuit JSON"): model, fingerprint (the
model's: docs/reliability.md), task, n_prompts,
metric, clean, corrupt (means over every prompt), does_task, method, steps, rule, curve {percent: f}, cpr, cmd (on the held-out
prompts when there are some), circuit {edges: [[sender, receiver, input, score], ...], heads, mlps, n_edges,
faithfulness, node_faithfulness, named, ...}, core {heads, mlps, node_faithfulness, interval, holdout, margin,
curve, how, ...}, roles {head: {role, evidence, why, in_circuit}}, roles_of, warnings [one line each], bos, timing,
holdout, selection, graph, stability (with resamples), bootstrap, sign_check, summary [the printed lines]. Every
non-finite number is ``null``. A report read back from its JSON has the same ``data`` and prints the same lines;
the objects behind them (``scores``, ``edge_circuit``, ``core_circuit``, ``stability``) are held only by the
report ``find_circuit`` returned (``None`` on one read from a file: ``scores`` is saved on its own,
``scores.to_json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from .._foundation.display import box, escape, table
from .._foundation.io import dump_json
from .._foundation.result import Result

SCHEMA = "qkcircuits.circuit/1"


@dataclass(frozen=True, repr=False)
class CircuitReport(Result):
    """What ``qk.find_circuit`` found (module docstring): ``data`` (the JSON contract) and, when just computed, the
    objects behind it."""

    data: Dict[str, Any]
    scores: Any = field(default=None, compare=False, repr=False)           # EdgeScores
    edge_circuit: Any = field(default=None, compare=False, repr=False)     # TaskCircuit named, or None
    core_circuit: Any = field(default=None, compare=False, repr=False)     # CoreCircuit, or None
    stability: Any = field(default=None, compare=False, repr=False)        # Stability, or None

    SCHEMA: ClassVar[str] = SCHEMA
    WHAT: ClassVar[str] = "a 'qkcircuits circuit --json' output (qk.find_circuit's report)"
    KEYS: ClassVar[Tuple[str, ...]] = ("curve", "circuit")

    def __post_init__(self) -> None:
        # the data is what the file holds (schema included; string keys, lists, null for non-finite numbers), so a
        # report read back from its file is equal to it
        held = json.loads(dump_json({"schema": SCHEMA, **self.data}, None, None))
        self.data.clear()
        self.data.update(held)

    # ------------------------------------------------------------------------------------------ reading
    @property
    def summary(self) -> List[str]:
        """The lines ``qkcircuits circuit`` prints (warnings first)."""
        return list(self.data.get("summary") or [])

    @property
    def warnings(self) -> List[str]:
        return list(self.data.get("warnings") or [])

    @property
    def core(self) -> Optional[Dict[str, Any]]:
        """The core circuit (heads, mlps, node_faithfulness, interval, holdout, ...), or None."""
        return self.data.get("core")

    @property
    def roles(self) -> Dict[str, Dict[str, Any]]:
        """{head: {role, evidence, why, in_circuit}}."""
        return dict(self.data.get("roles") or {})

    @property
    def curve(self) -> Dict[float, Optional[float]]:
        """{percent of edges: f} (held out where there is a held-out part)."""
        return {float(k): v for k, v in (self.data.get("curve") or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    # ------------------------------------------------------------------------------------------ the contract
    def to_dict(self) -> Dict[str, Any]:
        return dict(self.data)

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "CircuitReport":
        for key in cls.KEYS:
            if not isinstance(d[key], dict):
                raise TypeError(f"{key} must be an object, got {type(d[key]).__name__}")
        return cls(dict(d))

    def to_frame(self):
        """The circuit's edges, one row each: sender, receiver, input, score."""
        import pandas as pd

        edges = self.data["circuit"].get("edges") or []
        return pd.DataFrame([list(e[:4]) for e in edges], columns=["sender", "receiver", "input", "score"])

    def top(self, k: int = 5) -> List[Tuple[Any, float]]:
        """The circuit's ``k`` edges of largest |score|: ((sender, receiver, input), score)."""
        edges = [e for e in self.data["circuit"].get("edges") or [] if e[3] is not None]
        edges.sort(key=lambda e: -abs(float(e[3])))
        return [((e[0], e[1], e[2]), float(e[3])) for e in edges[:k]]

    def _text(self) -> str:
        return "\n".join(self.summary) or f"CircuitReport({self.data.get('model')}, {self.data.get('task')})"

    def _html(self) -> str:
        roles = [[h, str(r.get("role", "")), str(r.get("why", ""))] for h, r in self.roles.items()]
        return box(f"circuit of {self.data.get('task')} on {self.data.get('model')}",
                   f"<pre>{escape(self._text())}</pre>", table(roles, ["head", "role", "why"]) if roles else "")


def assemble(*, model: str, header: str, task, held, graph, drawn: str, holdout, seed: int, method: str, by: str,
             how: str, force: bool, edges, percent, scores, core, faith, circ, f_circ, node_f, named: bool, done: bool,
             roles, stability, sign, warnings: List[str], timing: Dict[str, float], backend) -> CircuitReport:
    """The report of ``find_circuit``'s steps: the printed lines and the JSON contract, from what they computed."""
    n_all = task.n + (held.n if held is not None else 0)
    undefined = scores.clean == scores.corrupt
    explicit = edges is not None or percent is not None
    # the means over every row of the task (the selection and the held-out part)
    clean_all, corrupt_all = scores.clean, scores.corrupt
    if held is not None and faith.holdout:
        clean_all = (scores.clean * task.n + faith.holdout["clean"] * held.n) / n_all
        corrupt_all = (scores.corrupt * task.n + faith.holdout["corrupt"] * held.n) / n_all
    lines = [f"warning: {w}" for w in warnings] + [header,
             f"  clean {task.metric_name} {clean_all:.4f}, corrupt {corrupt_all:.4f} (every prompt)"]
    if core is not None:
        lines += core_lines(core)
        lines.append("  roles (the core's heads, and heads outside it whose direct or node effect reaches 5 %):")
        lines += [f"  {line}" for line in roles.sentences()]
        if stability is not None:
            lines += [f"  {line}" for line in stability.lines()]
        lines.append("  edge circuit:")
    elif graph.positions:
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
        lines.append(f"  faithfulness f by percent of edges{where}: "
                     + ", ".join(f"{k:g}%: {v:.3f}" for k, v in curve.items()))
        if report:
            lines.append(f"    on the {task.n} selection prompts (where the circuit was chosen): "
                         + ", ".join(f"{k:g}%: {v:.3f}" for k, v in faith.curve.items()))
        ci = ((lambda key: f" [{100 * b['level']:g} % interval {b[key][0]:.3f}-{b[key][1]:.3f}]") if b
              else (lambda key: ""))
        lines.append(f"  CPR {cpr:.3f}{ci('cpr')} (higher is better), CMD {cmd:.3f}{ci('cmd')} (lower is "
                     f"better){where}" + (f"; intervals from {b['n']} resamples of the prompts" if b else "")
                     + (f"; on the selection prompts CPR {faith.cpr:.3f}, CMD {faith.cmd:.3f}" if report else ""))
    size = (f"{edges} edges requested" if edges is not None else f"{percent:g}% requested"
            if percent is not None else f"smallest grid size with f >= 0.8 on the selection prompts: "
            f"{faith.chosen_percent:g}%" if faith.reached else f"f undefined: the largest grid size, "
            f"{faith.chosen_percent:g}%" if undefined else
            f"no grid size below 100% reaches f >= 0.8: the largest, {faith.chosen_percent:g}%")
    if named:
        f_sel = faith.curve.get(faith.chosen_percent) if not explicit else None
        sel_part = f" (selection {f_sel:.3f})" if report and f_sel is not None else ""
        lines.append(f"  circuit ({size}): {circ.n_edges} edges after pruning, f {f_circ:.3f}{where}{sel_part}; "
                     f"{len(circ.heads)} heads, node view f {node_f:.3f} (every other head's output corrupted)")
        lines += [f"    {s:>7} -> {r:<8} {x:<3} {v:+.4f}" for s, r, x, v in circ.edges()[:10]]
        if circ.position_mask is not None:
            where_nodes = circ.position_nodes
            lines.append(f"  where its nodes act ({len(where_nodes)} node@position): {', '.join(where_nodes[:24])}"
                         f"{' …' if len(where_nodes) > 24 else ''}")
    else:
        lines.append(f"  no circuit named ({size}): " + (
            "the model does not do the task" if not done or undefined else "it would be the whole graph")
            + "; --force names it anyway")
    if core is None:
        lines += [f"  {line}" for line in roles.sentences()]
    circuit = {**circ.to_dict(), "faithfulness": f_circ, "node_faithfulness": node_f, "named": bool(named)}
    if report and not explicit:
        circuit["selection_faithfulness"] = faith.curve[faith.chosen_percent]
        circuit["selection_node_faithfulness"] = faith.node_faithfulness
    if not named:                       # the edges of no circuit are not drawn as one (the CSV keeps every score)
        circuit.update(edges=[], heads=[], mlps=[], n_edges=0,
                       **({"position_nodes": []} if "position_nodes" in circuit else {}))
    data = {"schema": SCHEMA, "model": model, "fingerprint": graph.fingerprint, "task": task.name, "n_prompts": n_all,
            "metric": task.metric_name, "clean": clean_all, "corrupt": corrupt_all, "does_task": bool(done),
            "method": method,
            "steps": scores.steps, "rule": scores.rule, "curve": {f"{k:g}": v for k, v in curve.items()},
            "cpr": cpr, "cmd": cmd, "circuit": circuit, "roles": dict(roles.roles),
            "roles_of": "core" if core is not None else "circuit" if named else None, "warnings": list(warnings),
            "timing": timing, "bos": task.bos_info(), "bos_prepended": bool(task.bos), "graph": graph.to_dict(),
            "n_edges_by_percent": {f"{k:g}": v for k, v in faith.n_edges.items()},
            "chosen_percent": faith.chosen_percent, "by": by, "how": how, "force": bool(force),
            "positions": sorted(task.positions), "versions": scores.settings.get("versions", {}),
            "holdout": holdout_json(holdout, seed, task, held, drawn),
            "selection": {"n": task.n, "clean": scores.clean, "corrupt": scores.corrupt,
                          "curve": {f"{k:g}": v for k, v in faith.curve.items()}, "cpr": faith.cpr, "cmd": faith.cmd}}
    if core is not None:
        data["core"] = core_json(core)
    if b:
        data["bootstrap"] = b
    if stability is not None:
        data["stability"] = stability.to_dict()
    if sign is not None:
        data["sign_check"] = sign
    if backend is not None:
        data["backend"] = {k: v for k, v in backend.items() if k != "plan"}
    data["summary"] = lines
    return CircuitReport(data, scores=scores, edge_circuit=circ if named else None, core_circuit=core,
                         stability=stability)


def holdout_json(fraction, seed: int, task, held, drawn: str) -> dict:
    """The ``holdout`` key: how the prompts were split (docs/tasks.md)."""
    from .holdout import FRESH, HELD_SEED, HOLDOUT

    if held is None:
        return {"fraction": 0.0, "n": 0, "how": "none: chosen and judged on the same prompts"}
    return {"fraction": HOLDOUT if fraction is None else fraction, "n": held.n, "selection_n": task.n,
            "how": drawn, "seed": seed + (HELD_SEED if drawn == FRESH else 0)}


def core_json(core) -> dict:
    """The ``core`` key (docs/tasks.md): heads, mlps, node_faithfulness, interval, holdout, margin, curve {heads in
    the ranked prefix: f}, how, and the search's settings."""
    d = core.to_dict()
    keep = ("heads", "mlps", "node_faithfulness", "interval", "holdout", "margin", "curve", "how", "threshold",
            "pruned", "needed", "path")
    return {**{k: d[k] for k in keep}, "by": core.settings.get("by"),
            "mlps_searched": core.settings.get("mlps") == "searched",
            "sets_measured": core.settings.get("sets_measured"), "seconds": core.timing.get("core_s")}


def core_lines(core) -> List[str]:
    """The summary's lines of the core circuit: its size and node f, its nodes, how it was found, the grow curve."""
    mlps = f" + {len(core.mlps)} MLPs" if core.mlps and core.settings.get("mlps") == "searched" else ""
    return [f"  core circuit: {len(core.heads)} heads{mlps}, {core.f_text()} (every other head"
            f"{' and MLP' if mlps else ''} gives its corrupt output)",
            f"    heads {', '.join(core.heads)}" + (f"; MLPs {', '.join(core.mlps)}" if mlps else ""),
            f"    how: {core.how}",
            "    f by heads in the ranked prefix (selection prompts): "
            + ", ".join(f"{k}: {v:.3f}" for k, v in core.curve.items())]


__all__ = ["CircuitReport", "SCHEMA", "assemble", "core_json", "core_lines", "holdout_json"]
