"""How much a circuit's answer would change with other prompts: the core, the edge circuit and the roles found on N
independent draws of the same behaviour (``stability`` → ``Stability``).

>>> source = Source.of(model, "induction", n=12)
>>> sel, held = source.parts()
>>> st = stability(model, source, sel, held, resamples=2, method="exact", progress=False)
>>> st.inclusion["0.0"], st.inclusion["1.0"], st.stable_core["heads"], st.jaccard["nodes"]["min"]
(1.0, 1.0, ['0.0', '1.0'], 1.0)

Draw 0 is the selection part itself (its scores, core and roles may be handed in: ``first``); draw r ≥ 1 is
``Source.draw(r)``: a fresh seeded draw of a generator (leaving one template out in turn where it has templates,
IOI's sentence frames) or a bootstrap resample of a file's rows. On each draw: edge scores (``method``), the core
(``core_circuit``, with its margin), the edge circuit of ``percent`` % of the edges (the same size on every draw)
and, with ``roles=True``, the roles of the core's heads (without their QK evidence). Reported:

- ``inclusion`` {node: the fraction of draws whose core holds it};
- ``jaccard`` {"nodes" | "edges": {"mean", "min"}}: |A ∩ B| / |A ∪ B| over every pair of draws' cores (heads and
  MLPs) and edge circuits (1 = the same answer every time; two published IOI circuits of GPT-2 share 4 % of their
  edges and 64 % of their nodes);
- ``roles`` {head: {role: fraction of draws}} (a head absent from a draw's roles counts as "-");
- ``stable_core``: the nodes in at least ``share`` (0.8) of the draws, with its f on the held-out rows and the
  95 % interval (the circuit to report: it holds across draws, and it is judged on rows none was chosen on);
- ``draws``: per draw its seed, the template left out, the core, its f on its own rows and on the held-out rows,
  and, where a template was left out, f on the held-out rows of that template (``templates``).

Cost: per extra draw, the edge scores, the core search and the roles of that draw (the held-out rows' clean and
corrupt runs are made once and shared by every draw: ``NodeViews``); then one stacked node-view batch on the
held-out rows for every draw's core and the stable core.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._foundation.errors import QKCircuitsError
from .._foundation.result import Result, stamped
from .core import THRESHOLD, Judge, core_circuit, _head_key, _is_head
from .holdout import Source
from .nodeviews import NodeViews
from .task import Task

SCHEMA = "qkcircuits.stability/1"
SHARE = 0.8
PERCENT = 2.0


def jaccard(a: set, b: set) -> float:
    """|a ∩ b| / |a ∪ b| (1 for two empty sets)."""
    return len(a & b) / len(a | b) if a | b else 1.0


def _summary(sets: Sequence[set]) -> Dict[str, float]:
    vals = [jaccard(a, b) for a, b in itertools.combinations(sets, 2)]
    if not vals:
        return {"mean": float("nan"), "min": float("nan"), "pairs": 0}
    return {"mean": sum(vals) / len(vals), "min": min(vals), "pairs": len(vals)}


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Stability(Result):
    """The answers of N independent draws and how much they agree (module docstring)."""

    SCHEMA = SCHEMA
    WHAT = "a stability JSON (qk.stability(...).to_json())"
    KEYS = ("draws", "inclusion", "jaccard", "roles", "stable_core")

    draws: List[Dict[str, Any]]
    inclusion: Dict[str, float]
    jaccard: Dict[str, Dict[str, float]]
    roles: Dict[str, Dict[str, float]]
    stable_core: Dict[str, Any]
    model: str = ""
    settings: Dict[str, object] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.draws)

    def to_dict(self) -> Dict[str, object]:
        from .._foundation.io import json_number

        def clean(o):
            if isinstance(o, float):
                return json_number(o)
            if isinstance(o, dict):
                return {str(k): clean(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [clean(v) for v in o]
            return o

        return {"schema": SCHEMA, "model": self.model, "resamples": self.n, **clean(
            {"draws": self.draws, "inclusion": self.inclusion, "jaccard": self.jaccard, "roles": self.roles,
             "stable_core": self.stable_core}), "settings": self.settings, "timing": self.timing}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "Stability":
        floats = {"f", "holdout_f", "template_f", "interval", "mean", "min"}     # null there is a NaN

        def back(o, key: str = ""):
            if o is None:
                return float("nan") if key in floats else None
            if isinstance(o, dict):
                return {k: back(v, k) for k, v in o.items()}
            if isinstance(o, list):
                return [back(v, key) for v in o]
            return o

        return cls(back(list(d["draws"])), {k: float(v) for k, v in d["inclusion"].items()}, back(dict(d["jaccard"])),
                   back(dict(d["roles"])), back(dict(d["stable_core"])), str(d.get("model", "")),
                   dict(d.get("settings", {})), dict(d.get("timing", {})))

    def role_of(self, head: str) -> Tuple[str, float]:
        """(the head's most frequent role over the draws, its frequency); ("-", 1.0) when it had none."""
        got = self.roles.get(head) or {"-": 1.0}
        role = max(got, key=lambda r: (got[r], r != "-"))
        return role, float(got[role])

    def to_frame(self):
        """One row per node ever in a core: inclusion frequency, its most frequent role and that role's frequency."""
        import pandas as pd

        rows = []
        for node, freq in sorted(self.inclusion.items(), key=lambda t: -t[1]):
            role, rf = self.role_of(node) if _is_head(node) else ("", float("nan"))
            rows.append({"node": node, "inclusion": freq, "role": role, "role_frequency": rf})
        return pd.DataFrame(rows)

    def lines(self) -> List[str]:
        """The summary's lines (the CLI prints them)."""
        sc = self.stable_core
        lo, hi = (list(sc.get("interval") or []) + [float("nan")] * 2)[:2]
        mlps = f" + {len(sc.get('mlps', []))} MLPs" if sc.get("mlps") else ""
        j = self.jaccard
        out = [f"stability over {self.n} draws of the prompts ({self.settings.get('draws_are', '')}):",
               f"  stable core (nodes in >= {100 * float(sc.get('share', SHARE)):g} % of the draws' cores): "
               f"{len(sc.get('heads', []))} heads{mlps}, held-out f {float(sc.get('holdout_f', float('nan'))):.3f} "
               f"[{lo:.3f}-{hi:.3f}]" + (f"; heads {', '.join(sc['heads'])}" if sc.get("heads") else ""),
               f"  Jaccard between draws: nodes mean {j['nodes']['mean']:.2f} (min {j['nodes']['min']:.2f}), "
               f"edges of the {self.settings.get('percent', PERCENT):g} % edge circuit mean {j['edges']['mean']:.2f} "
               f"(min {j['edges']['min']:.2f})",
               "  core per draw: " + "; ".join(
                   f"#{d['draw']} {len(d['heads'])}h+{len(d['mlps'])}m f {d['f']:.2f}, held-out {d['holdout_f']:.2f}"
                   + (f", unseen template {d['template']} {d['template_f']:.2f}" if d.get("template") is not None
                      else "") for d in self.draws)]
        top = sorted(self.inclusion.items(), key=lambda t: (-t[1], t[0]))
        out.append("  inclusion: " + ", ".join(f"{n} {100 * v:.0f} %" for n, v in top[:24])
                   + (f" … ({len(top)} nodes in some core)" if len(top) > 24 else ""))
        roles = [(h, *self.role_of(h)) for h in self.roles]
        roles = [r for r in roles if r[1] not in ("-", "minor")]
        if roles:
            out.append("  roles (most frequent over the draws): " + ", ".join(
                f"{h} {role} {100 * f:.0f} %" for h, role, f in sorted(roles, key=lambda t: (-t[2], _head_key(t[0])))))
        return out

    def _text(self) -> str:
        return "\n".join(self.lines())

    def _html(self) -> str:
        import html

        return "<pre>" + html.escape(self._text()) + "</pre>"


def stability(model, source: Source, sel: Task, held: Optional[Task], resamples: int, *, method: str = "eap-ig",
              steps: int = 5, rule: Optional[str] = None, percent: Real = PERCENT, by: str = "signed",
              threshold: Real = THRESHOLD, margin: str = "interval", mlps: bool = True, share: Real = SHARE,
              roles: bool = True, first: Optional[Dict[str, Any]] = None, progress: bool = True) -> Stability:
    """The circuit found on ``resamples`` independent draws (module docstring). ``sel``/``held``: the task's
    selection and held-out parts (``Source.parts``); ``first``: draw 0's own {scores, core, roles} when already
    computed (the CLI's main run). ``percent``: the edge circuit's size on every draw."""
    from .roles import roles as roles_of          # (``roles`` is this function's switch)
    from .scores import edge_scores

    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise QKCircuitsError(f"resamples must be an integer >= 1 (draws of the prompts, the first being the task's "
                              f"own), got {resamples!r}")
    if isinstance(share, bool) or not isinstance(share, Real) or not 0 < float(share) <= 1:
        raise QKCircuitsError(f"share must be a fraction in (0, 1], got {share!r}")
    t0 = time.perf_counter()
    held_views = NodeViews(model, held) if held is not None else None
    draws, cores, edges, role_of = [], [], [], []
    for r in range(resamples):
        if r == 0 and first is not None:
            task, sc, core, rl = sel, first["scores"], first["core"], first.get("roles")
        else:
            task = source.draw(r, sel)
            sc = edge_scores(model, task, method, steps, rule=rule, progress=progress)
            core = core_circuit(model, task, sc, threshold=threshold, by=by, mlps=mlps, margin=margin,
                                holdout=held_views, progress=progress)
            rl = None
        if roles and rl is None:
            rl = roles_of(model, task, core, scores=sc, qk=False)
        cores.append(set(core.heads) | set(core.mlps if mlps else []))
        edges.append({(s, rc, x) for s, rc, x, _ in sc.circuit(percent=percent, by=by).edges()})
        role_of.append({h: e.get("role", "-") for h, e in (rl.roles if rl is not None else {}).items()})
        t = source.left_out(r)
        draws.append({"draw": r, "seed": source.seed + r if source.generated else None, "template": t,
                      "resampled": not source.generated and r > 0, "n": task.n, "heads": list(core.heads),
                      "mlps": list(core.mlps) if mlps else [], "f": float(core.node_faithfulness),
                      "interval": list(core.interval), "holdout_f": core.holdout_f, "template_f": float("nan")})
    nodes = sorted(set().union(*cores), key=lambda n: (not _is_head(n), _head_key(n) if _is_head(n) else int(n[3:])))
    inclusion = {n: sum(n in c for c in cores) / resamples for n in nodes}
    stable = [n for n in nodes if inclusion[n] >= float(share) - 1e-12]
    all_mlps = [f"mlp{L}" for L in range(held_views.g.n_layers)] if held_views is not None and held_views.g.has_mlp \
        else []
    stable_core = {"heads": [n for n in stable if _is_head(n)], "mlps": [n for n in stable if not _is_head(n)],
                   "share": float(share), "holdout_f": float("nan"), "interval": [float("nan")] * 2}
    if held_views is not None:
        # every draw's core per held-out row, and the stable core, in one stacked batch
        sets = [(tuple(d["heads"]), tuple(d["mlps"]) if mlps else tuple(all_mlps)) for d in draws]
        sets.append((tuple(stable_core["heads"]), tuple(stable_core["mlps"]) if mlps else tuple(all_mlps)))
        rows = held_views.sets([(h, m if held_views.g.has_mlp else None) for h, m in sets])
        clean, corrupt = held_views.clean_rows(), held_views.corrupt_rows()
        judge = Judge(clean, corrupt, float(threshold), margin)
        fs, los, his = judge(rows)
        stable_core.update(holdout_f=fs[-1], interval=[los[-1], his[-1]])
        labels = source.templates(held)
        for d, row in zip(draws, rows[:-1]):
            if d["template"] is not None and labels is not None:
                at = labels == d["template"]
                if bool(at.any()):
                    c, z = float(clean[at].mean()), float(corrupt[at].mean())
                    d["template_f"] = (float(row[at].mean()) - z) / (c - z) if c != z else float("nan")
    heads_seen = sorted({h for ro in role_of for h in ro}, key=_head_key)
    role_freq = {}
    for h in heads_seen:
        counts: Dict[str, int] = {}
        for ro in role_of:
            counts[ro.get(h, "-")] = counts.get(ro.get(h, "-"), 0) + 1
        role_freq[h] = {k: v / resamples for k, v in sorted(counts.items(), key=lambda t: -t[1])}
    how = ("fresh draws of the generator" + (f", each leaving one of its {source.n_templates} templates out"
                                             if source.n_templates > 1 else "")
           if source.generated else "bootstrap resamples of the file's selection rows")
    return Stability(draws, inclusion, {"nodes": _summary(cores), "edges": _summary(edges)}, role_freq, stable_core,
                     getattr(first["scores"] if first else sc, "model", ""),
                     stamped({"method": method, "steps": steps, "percent": float(percent), "by": by,
                              "threshold": threshold, "margin": margin, "mlps": "searched" if mlps else "clean",
                              "share": float(share), "draws_are": f"draw 0 = the selection part, then {how}",
                              "roles": bool(roles), "holdout_rows": held.n if held is not None else 0}, model, sel),
                     {"stability_s": round(time.perf_counter() - t0, 3)})
