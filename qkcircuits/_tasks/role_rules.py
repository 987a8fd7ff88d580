"""Roles as rules over a head's evidence, declared with a task (``Role``), and the classifier that applies them.

>>> year = Role("year reader", lambda v: v["attn_from_END"].get("YY", 0) > 0.3 and v["large_node"],
...             why="attends the start year's tens digit from END and carries the behaviour")
>>> out = classify({"3.1": {"direct_effect": 0.0, "node_effect": 2.0, "attn_from_END": {"YY": 0.6}},
...                 "0.0": {"direct_effect": 0.0, "node_effect": 0.01, "attn_from_END": {"YY": 0.9}}},
...                {}, roles=[year], denom=4.0)
>>> out["3.1"]["role"], out["0.0"]["role"]
('year reader', 'minor')

A rule reads a **view** of one head: its evidence (``roles``' keys: ``direct_effect``, ``direct_share``,
``node_effect``, ``node_share``, ``attn_from_END`` {position: attention}, ``END_attends_most`` {where, rows, of, counts} (per prompt, named by the task's positions); IOI's attention keys
``END->IO`` ...; ``detectors``/``labels`` on tasks without IOI positions) and what only the whole circuit decides:

- ``large_direct``: |direct effect| ≥ the direct cut = max(``direct_relative`` × the largest |direct effect| among
  the judged heads, ``direct_share_min`` × |m(clean) − m(corrupt)|), and not 0; ``direct_cut`` that cut;
- ``large_node``: |node effect| ≥ ``effect_relative`` × the largest |node effect|; ``node_cut`` that cut;
- ``thresholds``: the thresholds in force (``THRESHOLDS``, with a call's overrides);
- ``patterns``: the IOI pattern classes whose attention reaches ``pattern`` (where the IOI keys are present);
- ``feeds`` (a role declared with ``feeds="name mover"``): {receiver: score} of the circuit's edges from this head
  into the q of heads holding that role, positive and at least ``edge_relative`` × the largest such edge into any
  of them; ``edge_cut`` that cut. The evidence keeps it as ``feeds_<role>s_q`` (``feeds_name_movers_q``).

Order: the task's roles in their order, the first whose rule holds naming the head (a role with ``feeds`` reads
the heads the roles before it named: its target is declared before it); then the built-in classes: a
direct-logit head (a large direct effect), a detector label with a large node effect (the scan's induction,
previous-token, duplicate-token heads, or a user's labelled detector), unclassified (a large effect no class
fits), minor (the rest). IOI's classes are one such declaration (``IOI_ROLES``, registered with ``ioi``, and read
by any task that names IOI's positions: docs/tasks.md, "Roles").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from .._foundation.errors import QKCircuitsError

THRESHOLDS = {"direct_relative": 0.1, "direct_share_min": 0.01, "effect_relative": 0.1, "edge_relative": 0.1,
              "names_attention": 0.1, "pattern": 0.3}
# IOI's attention pattern classes: (role, the attention key it reads)
PATTERNS = (("induction head", "S2->S1+1"), ("duplicate-token head", "S2->S1"), ("previous-token head", "S1+1->S1"))
# tasks without IOI positions: (role, the scan's score, its label)
DETECTORS = (("induction head", "induction", "induction"), ("duplicate-token head", "duplicate_token", "duplicate-token"),
             ("previous-token head", "previous_token", "previous-token"))
View = Dict[str, object]


@dataclass(frozen=True)
class Role:
    """A role as a rule over one head's view (module docstring): ``rule(view) -> bool``. ``why``: the reason it
    gives, a sentence or a function of the view. ``feeds``: the role whose heads' q this role's heads write into
    (the view's ``feeds``; declared after that role).

    >>> r = Role("year reader", lambda v: v["attn_from_END"].get("YY", 0) > 0.3 and v["node_share"] > 0.05,
    ...          why="attends the start year's last two digits from END and carries the behaviour")
    >>> r.rule({"attn_from_END": {"YY": 0.5}, "node_share": 0.2})
    True
    """

    # typed Any: __post_init__ checks them and says what it takes in one line
    name: Any                                   # str
    rule: Any                                   # Callable[[View], bool]
    why: Any = ""                               # str or Callable[[View], str]
    feeds: Any = None                           # Optional[str]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise QKCircuitsError(f"a role's name must be a non-empty string, got {self.name!r}")
        if not callable(self.rule):
            raise QKCircuitsError(f"role {self.name!r}: rule must be callable (evidence dict -> bool), got "
                                  f"{type(self.rule).__name__}")
        if not (isinstance(self.why, str) or callable(self.why)):
            raise QKCircuitsError(f"role {self.name!r}: why must be a sentence or a function of the evidence, got "
                                  f"{type(self.why).__name__}")
        if self.feeds is not None and (not isinstance(self.feeds, str) or not self.feeds.strip()):
            raise QKCircuitsError(f"role {self.name!r}: feeds must name a role, got {self.feeds!r}")

    def reason(self, view: View, task: str = "") -> str:
        if callable(self.why):
            return str(self.why(view))
        return self.why or f"the {task or 'task'}'s rule for a {self.name}"


def _na(v: View) -> float:
    return float(v["thresholds"]["names_attention"])


# IOI (Wang et al. 2022), in the order they are tested; then the built-in catch-alls (unclassified, minor)
IOI_ROLES: Tuple[Role, ...] = (
    Role("name mover",
         lambda v: v["large_direct"] and v["direct_effect"] > 0 and v["END->IO"] >= _na(v) and v["END->IO"] > v["END->S"],
         why=lambda v: (f"direct effect {v['direct_effect']:+.3g} ≥ {v['direct_cut']:.3g} and END→IO "
                        f"{v['END->IO']:.2f} > END→S {v['END->S']:.2f}")),
    Role("negative name mover",
         lambda v: v["large_direct"] and v["direct_effect"] < 0 and v["END->IO"] + v["END->S"] >= _na(v),
         why=lambda v: (f"direct effect {v['direct_effect']:+.3g} ≤ −{v['direct_cut']:.3g}; END→IO {v['END->IO']:.2f}"
                        f" + END→S {v['END->S']:.2f} ≥ {_na(v):g}")),
    Role("S-inhibition head",
         lambda v: bool(v["feeds"]) and not v["large_direct"] and v["END->S2"] >= _na(v) and v["END->S2"] > v["END->IO"],
         why=lambda v: (f"edges into name movers' q {', '.join(v['feeds'])} ≥ "
                        f"{v['thresholds']['edge_relative']:g} × {v['largest_feed']:.3g}; END→S2 {v['END->S2']:.2f} > "
                        f"END→IO {v['END->IO']:.2f}"),
         feeds="name mover"),
    *(Role(role, (lambda v, role=role: bool(v["patterns"]) and v["patterns"][0] == role and v["large_node"]
                  and not v["large_direct"]),
           why=(lambda v, key=key: (f"{key} {v[key]:.2f} ≥ {v['thresholds']['pattern']:g}; |node effect| "
                                    f"{abs(float(v['node_effect'])):.3g} ≥ {v['thresholds']['effect_relative']:g} × "
                                    f"{v['largest_node_effect']:.3g}")))
      for role, key in PATTERNS),
    Role("unclassified", lambda v: v["large_direct"] or v["large_node"],
         why=lambda v: (f"large effect (direct {float(v['direct_effect']):+.3g}, node {float(v['node_effect']):+.3g}) "
                        f"but no class fits")),
)
IOI_KEYS = ("END->IO", "END->S", "END->S2", "S2->S1", "S2->S1+1", "S1+1->S1")


def detector_roles() -> Tuple[Tuple[str, str, str], ...]:
    """(role, score, label) of every labelled detector in the registry, in its order: the built-ins' roles above,
    a user's detector (``qk.register_detector`` or the ``qkcircuits.detectors`` entry point) as "<label> head"."""
    from .._analysis.detectors import detectors

    known = {label: role for role, _, label in DETECTORS}
    return tuple((known.get(d.label, f"{d.label} head"), d.name, d.label) for d in detectors() if d.label)


def _largest(values) -> float:
    return max((abs(float(v)) for v in values), default=0.0)


def classify(evidence: Dict[str, Dict[str, object]], q_edges: Dict[Tuple[str, str], float], *,
             roles: Optional[Sequence[Role]] = None, ioi: bool = False, denom: float = float("nan"),
             thresholds: Optional[Dict[str, float]] = None, task: str = "") -> Dict[str, Dict[str, object]]:
    """Each head's role from its ``evidence`` and ``q_edges`` {(sender head, receiver head): score} of the circuit's
    edges into heads' q (module docstring). ``roles``: the task's declared roles (``ioi=True``: ``IOI_ROLES``).
    ``denom`` = m(clean) − m(corrupt). Returns {head: {role, evidence, why}}."""
    declared = tuple(roles if roles is not None else IOI_ROLES if ioi else ())
    t = {**THRESHOLDS, **(thresholds or {})}
    max_de = _largest(e["direct_effect"] for e in evidence.values())
    max_ne = _largest(e.get("node_effect", 0.0) for e in evidence.values())
    floor = t["direct_share_min"] * abs(denom) if denom == denom else 0.0
    d_cut = max(t["direct_relative"] * max_de, floor)
    views: Dict[str, View] = {}
    for name, e in evidence.items():
        if all(k in e for _, k in PATTERNS):
            e["patterns"] = [role for role, key in PATTERNS if e[key] >= t["pattern"]]
        views[name] = {**e, "thresholds": t, "direct_cut": d_cut, "largest_node_effect": max_ne,
                       "node_cut": t["effect_relative"] * max_ne,
                       "large_direct": abs(float(e["direct_effect"])) >= d_cut and float(e["direct_effect"]) != 0.0,
                       "large_node": max_ne > 0 and abs(float(e.get("node_effect", 0.0))) >= t["effect_relative"] * max_ne}
    out: Dict[str, Dict[str, object]] = {}
    # role by role, head by head: a head takes the first role whose rule holds, and a role that feeds another
    # reads the heads every role before it has named
    for role in declared:
        if role.feeds is not None:
            _feeds(role.feeds, q_edges, out, views, evidence, t)
        for name, v in views.items():
            if name not in out and role.rule(v):
                out[name] = {"role": role.name, "evidence": evidence[name], "why": role.reason(v, task)}
    labelled = detector_roles() if any("labels" in e for e in evidence.values()) else ()
    for name, v in views.items():
        if name not in out:
            out[name] = {**_built_in(v, labelled, t, max_de, d_cut, max_ne), "evidence": evidence[name]}
    return {name: out[name] for name in evidence}


def _feeds(target: str, q_edges, out, views, evidence, t) -> None:
    """Each view's ``feeds``: its edges into the q of the heads named ``target`` so far (module docstring); the
    evidence keeps them as ``feeds_<target>s_q``."""
    holders = {h for h, r in out.items() if r["role"] == target}
    into = {(s, m): val for (s, m), val in q_edges.items() if m in holders}
    max_q = max((val for val in into.values() if val > 0), default=0.0)
    key = f"feeds_{target.replace(' ', '_').replace('-', '_')}s_q"
    for name, v in views.items():
        feeds = {m: round(val, 6) for (s, m), val in sorted(into.items()) if s == name
                 and val > 0 and val >= t["edge_relative"] * max_q}
        evidence[name][key] = feeds
        v.update(feeds=feeds, largest_feed=max_q, edge_cut=t["edge_relative"] * max_q)


def _built_in(v: View, labelled, t, max_de: float, d_cut: float, max_ne: float) -> Dict[str, str]:
    """The catch-all classes after the declared roles: direct-logit head, a detector label, unclassified, minor."""
    de, ne = float(v["direct_effect"]), float(v.get("node_effect", 0.0))
    labels = [role for role, _, label in labelled if label in v.get("labels", ())]
    if v["large_direct"]:
        return {"role": "direct-logit head",
                "why": f"|direct effect| {abs(de):.3g} ≥ {d_cut:.3g} ({t['direct_relative']:g} × the largest {max_de:.3g})"}
    if labels and v["large_node"]:
        score = dict((r, k) for r, k, _ in labelled)[labels[0]]
        return {"role": labels[0], "why": (f"the scan labels it ({score} {float(v['detectors'][score]):.2f}); "
                                           f"|node effect| {abs(ne):.3g} ≥ {t['effect_relative']:g} × {max_ne:.3g}")}
    if v["large_node"]:
        return {"role": "unclassified", "why": (f"large node effect {ne:+.3g} but no detector label and a small "
                                                f"direct effect")}
    return {"role": "minor", "why": (f"|direct| {abs(de):.3g} < {d_cut:.3g}, |node effect| {abs(ne):.3g} < "
                                     f"{t['effect_relative'] * max_ne:.3g}")}


__all__ = ["Role", "IOI_ROLES", "IOI_KEYS", "THRESHOLDS", "PATTERNS", "DETECTORS", "classify"]
