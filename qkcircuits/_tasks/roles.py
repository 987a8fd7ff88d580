"""Roles of a circuit's heads, each with its evidence (never a bare label).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> r = scores.circuit(edges=4).roles(model, task)
>>> r.roles["1.0"]["role"], r.roles["0.0"]["role"]
('direct-logit head', 'feeds the circuit')

Evidence per head (one clean forward with the attention patterns of the circuit's layers):

- ``direct_effect``: the score of the edge head → logits (metric units per prompt), and ``direct_share``
  = that / (m(clean) − m(corrupt)), the part of the behaviour it writes straight into the logits;
- ``attn_from_END``: where the head attends from the END position (named positions, mean over prompts);
- IOI (tasks with positions IO, S1, S1+1, S2): ``END→IO``, ``END→S`` (S1 + S2), ``S2→S1`` (duplicate
  token), ``S2→S1+1`` (induction), ``S1+1→S1`` (previous token), and the name movers it feeds on q.

Classes, in this order (thresholds in ``THRESHOLDS``): name mover (direct share ≥ 0.05 and END→IO >
END→S); negative name mover (direct share ≤ −0.05, END→IO > END→S); S-inhibition (a circuit edge into a
name mover's q, END→S2 > END→IO); induction (S2→S1+1 ≥ 0.3); duplicate token (S2→S1 ≥ 0.3); previous token
(S1+1→S1 ≥ 0.3). Other tasks: "direct-logit head" (|direct share| ≥ 0.05) or "feeds the circuit". A head
that fits no class is kept as "unclassified" with its evidence.
"""

from __future__ import annotations

from numbers import Real

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .._foundation.errors import QKCircuitsError
from .._foundation.result import Result

THRESHOLDS = {"direct_share": 0.05, "pattern": 0.3}
IOI_POSITIONS = ("IO", "S1", "S1+1", "S2", "END")


@dataclass(repr=False)      # the repr is _text (Result)
class Roles(Result):
    """``roles[head] = {"role": str, "evidence": {...}}`` and one sentence per class (``sentences``). Its JSON:
    ``{"roles": {head: {role, evidence}}, "task", "settings"}`` (the ``roles`` part is the circuit file's)."""

    SCHEMA = "qkcircuits.roles/1"
    WHAT = "a roles JSON (circuit.roles(model, task).to_json())"
    KEYS = ("roles", "task")

    roles: Dict[str, Dict[str, object]]
    task: str
    settings: Dict[str, object] = field(default_factory=dict)

    def by_role(self) -> Dict[str, List[str]]:
        out: Dict[str, List[str]] = {}
        for h, r in self.roles.items():
            out.setdefault(str(r["role"]), []).append(h)
        return out

    def sentences(self) -> List[str]:
        lines = []
        for role, heads in self.by_role().items():
            ev = [self.roles[h]["evidence"] for h in heads]
            share = ", ".join(f"{e['direct_share']:.2f}" for e in ev)
            label = role + "s" if len(heads) > 1 and role.endswith(("head", "mover")) else role
            text = f"{label} {', '.join(heads)} (direct effect {share} of the metric difference"
            if "END->IO" in ev[0]:
                text += "; END → IO attention " + ", ".join(f"{e['END->IO']:.2f}" for e in ev)
                text += ", END → S " + ", ".join(f"{e['END->S']:.2f}" for e in ev)
            if role in ("induction head", "duplicate-token head", "previous-token head"):
                key = {"induction head": "S2->S1+1", "duplicate-token head": "S2->S1",
                       "previous-token head": "S1+1->S1"}[role]
                text += f"; {key} " + ", ".join(f"{e[key]:.2f}" for e in ev)
            lines.append(text + ")")
        return lines

    def to_dict(self) -> Dict[str, object]:
        return {"roles": dict(self.roles), "task": self.task, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Roles":
        roles = d["roles"]
        if not isinstance(roles, dict) or not all(isinstance(r, dict) and "role" in r for r in roles.values()):
            raise QKCircuitsError("roles must be {head: {role, evidence}}")
        return cls({str(h): dict(r) for h, r in roles.items()}, str(d["task"]), dict(d.get("settings", {})))

    def top(self, k: int = 10) -> List[Tuple[str, float]]:
        """The ``k`` heads of largest |direct share| of the metric difference: ``("L.H", share)``."""
        items = [(h, float(r["evidence"].get("direct_share", float("nan")))) for h, r in self.roles.items()]
        items.sort(key=lambda t: -abs(t[1]) if t[1] == t[1] else 0.0)
        return items[:k]

    def to_frame(self):
        """One row per head: head, role, direct effect, direct share."""
        import pandas as pd

        return pd.DataFrame([{"head": h, "role": r["role"], "direct_effect": r["evidence"].get("direct_effect"),
                              "direct_share": r["evidence"].get("direct_share")} for h, r in self.roles.items()])

    def _text(self) -> str:
        return "Roles(" + "; ".join(self.sentences()) + ")"

    def _html(self) -> str:
        import html

        return "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in self.sentences()) + "</ul>"



def _patterns(model, task, layers: List[int]) -> Dict[int, torch.Tensor]:
    """Clean attention patterns [n, H, pos, pos] of ``layers`` (one forward per 16 rows)."""
    out: Dict[int, List[torch.Tensor]] = {L: [] for L in layers}

    def keep(L: int):
        def fn(t, hook) -> None:
            out[L].append(t.detach().float().cpu())
        return fn

    with torch.no_grad():
        for shard in task.shards(16):
            model.run_with_hooks(shard.clean.to(model.W_E.device),
                                 fwd_hooks=[(f"blocks.{L}.attn.hook_pattern", keep(L)) for L in layers])
    return {L: torch.cat(v) for L, v in out.items()}


def roles(model, task, circuit, clean: Optional[Real] = None, corrupt: Optional[Real] = None) -> Roles:
    """Each head of ``circuit`` with its role and evidence (module docstring). ``clean``/``corrupt``: the
    task's metric means (taken from the circuit's scores when not given)."""
    from .task import evaluate

    g = circuit.graph
    if clean is None or corrupt is None:
        ev = evaluate(model, task, warn=False)
        clean, corrupt = ev["clean"], ev["corrupt"]
    denom = (clean - corrupt) or float("nan")
    heads = circuit.heads
    layers = sorted({int(h.split(".")[0]) for h in heads})
    pats = _patterns(model, task, layers) if layers else {}
    pos = {k: v.cpu() for k, v in task.positions.items()}
    ioi = all(k in pos for k in IOI_POSITIONS)
    rows = torch.arange(task.n)
    named = sorted(pos, key=lambda k: (k != "END", k))

    def attn(L: int, h: int, q: str, k: str) -> float:
        return float(pats[L][rows, h, pos[q], pos[k]].mean())

    evidence: Dict[str, Dict[str, object]] = {}
    for name in heads:
        L, h = map(int, name.split("."))
        de = float(circuit.scores[g.head_sender(L, h), g.logits_receiver])
        e: Dict[str, object] = {"direct_effect": round(de, 6), "direct_share": round(de / denom, 6)}
        end_row = pats[L][rows, h, pos["END"]]                                         # [n, pos]
        e["attn_from_END"] = {k: round(float(end_row[rows, pos[k]].mean()), 4) for k in named}
        top = end_row.mean(0).argmax().item()
        e["END_top_position"] = int(top)
        if ioi:
            e["END->IO"] = round(attn(L, h, "END", "IO"), 4)
            e["END->S"] = round(attn(L, h, "END", "S1") + attn(L, h, "END", "S2"), 4)
            e["END->S2"] = round(attn(L, h, "END", "S2"), 4)
            e["S2->S1"] = round(attn(L, h, "S2", "S1"), 4)
            e["S2->S1+1"] = round(attn(L, h, "S2", "S1+1"), 4)
            e["S1+1->S1"] = round(attn(L, h, "S1+1", "S1"), 4)
        evidence[name] = e
    share, pat = THRESHOLDS["direct_share"], THRESHOLDS["pattern"]
    movers = {n for n, e in evidence.items() if ioi and e["direct_share"] >= share and e["END->IO"] > e["END->S"]}
    out: Dict[str, Dict[str, object]] = {}
    for name, e in evidence.items():
        L, h = map(int, name.split("."))
        if ioi:
            feeds = sorted(m for m in movers if circuit.mask[g.head_sender(L, h), g.receivers.index((m, "q"))])
            e["feeds_name_movers_q"] = feeds
            if name in movers:
                role = "name mover"
            elif e["direct_share"] <= -share and e["END->IO"] > e["END->S"]:
                role = "negative name mover"
            elif feeds and e["END->S2"] > e["END->IO"]:
                role = "S-inhibition head"
            elif e["S2->S1+1"] >= pat:
                role = "induction head"
            elif e["S2->S1"] >= pat:
                role = "duplicate-token head"
            elif e["S1+1->S1"] >= pat:
                role = "previous-token head"
            else:
                role = "unclassified"
        else:
            role = "direct-logit head" if abs(float(e["direct_share"])) >= share else "feeds the circuit"
        out[name] = {"role": role, "evidence": e}
    return Roles(out, task.name, {"thresholds": dict(THRESHOLDS), "clean": clean, "corrupt": corrupt})
