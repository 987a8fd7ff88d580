"""Roles of a circuit's heads, each with its evidence (never a bare label).

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="exact", progress=False)
>>> r = qk.roles(model, task, scores.circuit(edges=4))
>>> r.roles["1.0"]["role"], r.roles["0.0"]["role"]
('direct-logit head', 'previous-token head')

Evidence per head (one clean forward with the attention patterns of the circuit's layers):

- ``direct_effect``: the score of the edge head → logits (metric units per prompt), and ``direct_share``
  = that / (m(clean) − m(corrupt)), the part of the behaviour it writes straight into the logits;
- ``node_effect``: the sum of the scores of every edge leaving the head (the EAP / EAP-IG node estimate:
  what corrupting its output costs), ``node_share`` the same over m(clean) − m(corrupt);
- ``attn_from_END``: where the head attends from the END position (named positions, mean over prompts),
  ``END_attends_most`` where it attends most, prompt by prompt, named by the task's own positions
  (``attends_most``: "IO in 30 of 32 prompts");
- IOI (tasks with positions IO, S1, S1+1, S2): ``END->IO``, ``END->S`` (S1 + S2), ``END->S2``, ``S2->S1``
  (duplicate token), ``S2->S1+1`` (induction), ``S1+1->S1`` (previous token), ``feeds_name_movers_q``
  {name mover: edge score} and ``patterns`` (the pattern classes below it passes, whatever its effect);
- ``why``: the sentence of the test that gave the role.

IOI classes, tested in this order with the thresholds of ``THRESHOLDS`` (all relative, so they hold for any
logit-difference scale; "large" = at least the fraction given of the largest one among the circuit's heads):

1. name mover: direct effect > 0 and large (``direct_relative`` 0.1 of the largest |direct effect|, and at
   least ``direct_share_min`` 0.01 of m(clean) − m(corrupt)), END → IO ≥ ``names_attention`` (0.1) and
   END → IO > END → S;
2. negative name mover: direct effect < 0 and large (same thresholds), attends the names from END
   (END → IO + END → S ≥ 0.1);
3. S-inhibition: an edge into a name mover's q with a positive score of at least ``edge_relative`` (0.1) of
   the largest edge score into any name mover's q, END → S2 ≥ 0.1 and END → S2 > END → IO, and NOT a large
   direct effect (a head writing the answer itself is judged by 1-2 or left unclassified);
4. induction (S2 → S1+1), duplicate token (S2 → S1), previous token (S1+1 → S1): that attention ≥
   ``pattern`` (0.3), a large node effect (``effect_relative`` 0.1 of the largest |node effect|) and not a
   large direct effect (these heads act through later heads; one that writes the answer is unclassified);
5. unclassified: a large direct or node effect that fits no class, kept with its evidence;
6. minor: the rest (small effects, no class); their evidence is kept, ``patterns`` says what they look like.

Other tasks (no IOI positions): the detectors' labels and the direct effect. Evidence adds ``detectors``
{induction, previous_token, duplicate_token}: each head's score from the restricted scan (``qk.scan`` on its own
[BOS]+R+R prompts, one pattern-only pass) and ``labels``, the scan's labels it earns (``HeadScores.labels``).
Classes, in this order:

1. direct-logit head: a large direct effect (as in 1-2; its sign is in the evidence);
2. induction / previous-token / duplicate-token head: that detector label, a large node effect and not a large
   direct effect;
3. unclassified: a large direct or node effect that fits no class, kept with its evidence;
4. minor: the rest.

A role is a rule over this evidence, declared with the task (``qk.register_task(..., roles=[qk.tasks.Role(name,
rule, why)])``); the IOI classes above are one such declaration (``role_rules.IOI_ROLES``, registered with ``ioi``
and read by any task that names IOI's positions), the other tasks' classes are the built-in ones every task ends
with (``role_rules.classify``, tested on constructed evidence); ``roles`` gathers the evidence.
"""

from __future__ import annotations

from numbers import Real

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._foundation.errors import QKCircuitsError
from .._foundation.result import Result, stamped
from .core import ALSO_SHARE, CoreCircuit, significant_heads  # noqa: F401 (ALSO_SHARE, significant_heads: re-exported)
from .role_rules import DETECTORS, IOI_ROLES, PATTERNS, THRESHOLDS, Role, classify, detector_roles, _largest  # noqa: F401

# heads outside a (core) circuit are named too when their direct or node effect reaches this share of
# m(clean) − m(corrupt), either sign (``significant_heads``): negative name movers are never in a signed circuit
IOI_POSITIONS = ("IO", "S1", "S1+1", "S2", "END")
# IOI classes in the order they are tested, then the two catch-alls (the order ``Roles`` lists them in)
ORDER = ("name mover", "negative name mover", "direct-logit head", "S-inhibition head", "induction head",
         "duplicate-token head", "previous-token head", "unclassified", "minor", "feeds the circuit")


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Roles(Result):
    """``roles[head] = {"role": str, "evidence": {...}, "why": str}`` and one sentence per class (``sentences``).
    Its JSON: ``{"roles": {head: {role, evidence, why}}, "task", "settings"}`` (the ``roles`` part is the circuit
    file's)."""

    SCHEMA = "qkcircuits.roles/1"
    WHAT = "a roles JSON (qk.roles(model, task, circuit).to_json())"
    KEYS = ("roles", "task")

    roles: Dict[str, Dict[str, object]]
    task: str
    settings: Dict[str, object] = field(default_factory=dict)

    def by_role(self) -> Dict[str, List[str]]:
        """Heads per role, roles in ``ORDER``, heads by |direct effect| (name movers) or |node effect|."""
        out: Dict[str, List[str]] = {}
        for h, r in self.roles.items():
            out.setdefault(str(r["role"]), []).append(h)
        for role, heads in out.items():
            key = "direct_effect" if role in ("name mover", "negative name mover", "direct-logit head") else "node_effect"
            heads.sort(key=lambda h: -abs(float(self.roles[h]["evidence"].get(key, 0.0))))
        return {k: out[k] for k in sorted(out, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))}

    def counts(self) -> Dict[str, int]:
        return {k: len(v) for k, v in self.by_role().items()}

    @property
    def not_named(self) -> Optional[str]:
        """Why no roles were named (the model does not do the task, no circuit; ``force`` names them anyway), or
        None."""
        return self.settings.get("not_named")

    def sentences(self) -> List[str]:
        if self.not_named:
            return [f"no roles named: {self.not_named}"]
        lines = []
        for role, heads in self.by_role().items():
            shown = heads[:8] if role == "minor" else heads
            ev = [self.roles[h]["evidence"] for h in shown]
            label = role + "s" if len(heads) > 1 and role.endswith(("head", "mover")) else role
            more = f" (+{len(heads) - len(shown)} more)" if len(shown) < len(heads) else ""
            text = f"{label} {', '.join(shown)}{more} (direct effect " + ", ".join(
                f"{e['direct_share']:.2f}" for e in ev) + " of the metric difference"
            if role in ("S-inhibition head", "induction head", "duplicate-token head", "previous-token head",
                        "unclassified", "minor", "feeds the circuit"):
                text += "; node effect " + ", ".join(f"{e.get('node_share', float('nan')):.2f}" for e in ev)
            if "END->IO" in ev[0]:
                text += "; END → IO attention " + ", ".join(f"{e['END->IO']:.2f}" for e in ev)
                text += ", END → S " + ", ".join(f"{e['END->S']:.2f}" for e in ev)
            if role == "S-inhibition head":
                text += ", END → S2 " + ", ".join(f"{e['END->S2']:.2f}" for e in ev) + "; into name movers' q: " + \
                    "; ".join(f"{h} → " + (", ".join(f"{m} {v:+.3f}" for m, v in e["feeds_name_movers_q"].items())
                                            or "none") for h, e in zip(shown, ev))     # each list names its head
            key = dict(PATTERNS).get(role)
            if key and all(key in e for e in ev):
                text += f"; {key} " + ", ".join(f"{e[key]:.2f}" for e in ev)
            det = {r: k for r, k, _ in detector_roles()}.get(role)
            if det and all(det in e.get("detectors", {}) for e in ev):
                text += f"; scan {det} " + ", ".join(f"{float(e['detectors'][det]):.2f}" for e in ev)
            if role == "unclassified" and all("END_attends_most" in e for e in ev):
                text += "; END attends most to " + ", ".join(most_text(e["END_attends_most"]) for e in ev)
            outside = [h for h in shown if self.roles[h].get("in_circuit") is False]
            if outside:
                text += f"; not in the circuit: {', '.join(outside)}"
            lines.append(text + ")")
            lines += [self.qk_sentence(h) for h in shown if self.roles[h].get("qk")]
        return lines

    def qk_sentence(self, head: str) -> str:
        """Why ``head`` attends where it does (its ``qk`` entry), sources named with their roles and each side's
        coverage: "why 23.0 attends from END to IO (attention 0.57): query side 20.0 (S-inhibition head) 31 %, ...
        (these 3 sources: 62 % of the total; ...); key side emb 60 %, ..."; a head that does not attend its key is
        said so ("17.4 from END to IO does not prefer this key: attention 0.01 ...", values in score units)."""
        from .._explain.evidence import evidence_sentence

        role_of = {h: str(r.get("role")) for h, r in self.roles.items()}
        return "  " + evidence_sentence(head, self.roles[head]["qk"], role_of)

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


def attends_most(end_row: torch.Tensor, positions: Dict[str, torch.Tensor], keep: int = 3) -> Dict[str, object]:
    """Where a head attends most from END, prompt by prompt, named by the task's own positions.

    ``end_row`` [n, pos] is the head's attention from END in each prompt, ``positions`` the task's named positions
    ({name: [n] index}). Each prompt's most-attended key is named: a named position (END first, then by name),
    else ``"position 0"`` (the first token: BOS where the task has one), else its offset from END (``"END-3"``).
    Returns the most frequent name with its count, and the ``keep`` most frequent with theirs:

    >>> row = torch.tensor([[0.1, 0.7, 0.2], [0.1, 0.6, 0.3], [0.8, 0.1, 0.1]])
    >>> attends_most(row, {"END": torch.tensor([2, 2, 2]), "IO": torch.tensor([1, 1, 0])})
    {'where': 'IO', 'rows': 3, 'of': 3, 'counts': {'IO': 3}}
    """
    top = end_row.argmax(-1).tolist()
    names = sorted(positions, key=lambda k: (k != "END", k))
    at = {k: positions[k].tolist() for k in names}
    end = at.get("END")
    counts: Dict[str, int] = {}
    for r, t in enumerate(top):
        label = next((k for k in names if at[k][r] == t), None)
        if label is None:
            label = "position 0" if t == 0 or end is None else f"END-{end[r] - t}"
        counts[label] = counts.get(label, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:keep]
    return {"where": ranked[0][0], "rows": ranked[0][1], "of": len(top), "counts": dict(ranked)}


def most_text(most: Dict[str, object]) -> str:
    """``attends_most``'s answer in words: "IO in 30 of 32 prompts"."""
    return f"{most['where']} in {most['rows']} of {most['of']} prompts"


def roles(model, task, circuit, clean: Optional[Real] = None, corrupt: Optional[Real] = None,
          thresholds: Optional[Dict[str, float]] = None, also: Sequence[str] = (), force: bool = False,
          qk: bool = True, *, scores=None, share: Optional[Real] = None) -> Roles:
    """Each head of ``circuit`` with its role and evidence (module docstring): ``qk.roles(model, task, circuit)``.

    ``circuit``: a ``TaskCircuit`` (``scores.circuit(...)``), or a ``CoreCircuit`` (``qk.core_circuit``) with
    ``scores=`` its edge scores: then the core's heads plus ``core.outside(scores, share)`` (heads outside it with
    at least ``share``, default 5 %, of the effect, so that a negative name mover the core leaves out is named), and
    ``clean``/``corrupt`` default to the scores'. ``clean``/``corrupt``: the
    task's metric means (computed with two forwards per 16 rows when not given). ``thresholds`` override
    ``THRESHOLDS``. ``also``: heads outside the circuit judged beside its own (``significant_heads``; the
    circuit's scores must hold their edges, as ``scores.circuit()``'s and the core's do); every entry says
    ``in_circuit``. Entries are plain dicts: a later step may add keys (e.g. ``qk``, the QK evidence of why a
    head attends where it does) and everything here keeps them. When the model does not do the task (clean not
    better than corrupt) no roles are named (a "negative name mover" with a positive effect says nothing): the
    result holds none and says why (``Roles.not_named``), unless ``force=True``. ``qk`` (default True): every
    name mover, negative name mover and induction head (by role, or by the scan's label on other tasks) also gets
    ``qk``, why it attends where it does at the task's positions (``_explain.evidence.qk_evidence``: the top
    query- and key-side sources of its exact QK attribution, END → IO for IOI, each repeated token → its
    induction target for induction; one forward per key position), its sources named with their roles in the
    sentences and the report."""
    from .task import does_the_task, evaluate, not_done_message, with_reference

    if isinstance(circuit, CoreCircuit):
        if scores is None:
            raise QKCircuitsError("roles of a core circuit need its edge scores: qk.roles(model, task, core, "
                                  "scores=scores)")
        also = list(circuit.outside(scores, share)) + [h for h in also if h not in circuit.heads]
        clean = scores.clean if clean is None else clean
        corrupt = scores.corrupt if corrupt is None else corrupt
        circuit = circuit.circuit(scores)
    elif share is not None:
        raise QKCircuitsError("share= goes with a core circuit (the heads outside it judged beside it); for a "
                              "TaskCircuit pass also=[...]")
    g = circuit.graph
    task = with_reference(model, task)
    if clean is None or corrupt is None:
        ev = evaluate(model, task, warn=False)
        clean, corrupt = ev["clean"], ev["corrupt"]
    if not force and not does_the_task(task, float(clean), float(corrupt)):
        t = {**THRESHOLDS, **(thresholds or {})}
        why = not_done_message(task, float(clean), float(corrupt), model) + " (force=True / --force names them anyway)"
        return Roles({}, task.name, stamped({"thresholds": t, "clean": clean, "corrupt": corrupt, "not_named": why},
                                            model, task, name=True))
    denom = float(clean - corrupt) or float("nan")
    own = circuit.heads
    extra = [h for h in also if h not in set(own)]
    heads = sorted(set(own) | set(extra), key=lambda h: tuple(map(int, h.split("."))))
    layers = sorted({int(h.split(".")[0]) for h in heads})
    pats = _patterns(model, task, layers) if layers else {}
    pos = {k: v.cpu() for k, v in task.positions.items()}
    ioi = all(k in pos for k in IOI_POSITIONS)
    rows = torch.arange(task.n)
    named = sorted(pos, key=lambda k: (k != "END", k))
    scores = torch.nan_to_num(circuit.scores.float(), nan=0.0)

    def attn(L: int, h: int, q: str, k: str) -> float:
        return float(pats[L][rows, h, pos[q], pos[k]].mean())

    evidence: Dict[str, Dict[str, object]] = {}
    for name in heads:
        L, h = map(int, name.split("."))
        de = float(scores[g.head_sender(L, h), g.logits_receiver])
        ne = float(scores[g.head_sender(L, h)].sum())
        e: Dict[str, object] = {"direct_effect": round(de, 6), "direct_share": round(de / denom, 6),
                                "node_effect": round(ne, 6), "node_share": round(ne / denom, 6)}
        end_row = pats[L][rows, h, pos["END"]]                                         # [n, pos]
        e["attn_from_END"] = {k: round(float(end_row[rows, pos[k]].mean()), 4) for k in named}
        e["END_attends_most"] = attends_most(end_row, pos)
        if ioi:
            e["END->IO"] = round(attn(L, h, "END", "IO"), 4)
            e["END->S"] = round(attn(L, h, "END", "S1") + attn(L, h, "END", "S2"), 4)
            e["END->S2"] = round(attn(L, h, "END", "S2"), 4)
            e["S2->S1"] = round(attn(L, h, "S2", "S1"), 4)
            e["S2->S1+1"] = round(attn(L, h, "S2", "S1+1"), 4)
            e["S1+1->S1"] = round(attn(L, h, "S1+1", "S1"), 4)
        evidence[name] = e
    if not ioi and heads:
        # other tasks: the detectors' own scores and labels (the restricted scan: one pattern-only pass)
        from .._analysis.detect import scan

        found = detector_roles()              # the registry's labelled detectors: a user's own included
        hs = scan(model, scores=[k for _, k, _ in found], progress=False)
        labelled = {label: {f"{h.layer}.{h.head}" for h in hs.heads_labelled(label)} for _, _, label in found}
        for name, e in evidence.items():
            L, h = map(int, name.split("."))
            e["detectors"] = {k: round(float(hs.scores[k][L, h]), 4) for _, k, _ in found}
            e["labels"] = [label for _, _, label in found if name in labelled[label]]
    q_edges: Dict[Tuple[str, str], float] = {}
    declared = declared_roles(task, ioi)
    if any(r.feeds is not None for r in declared):         # a role reads edges into other heads' q (IOI's S-inhibition)
        judged, outside = set(heads), set(extra)
        for r, (rname, x) in enumerate(g.receivers):
            if x != "q" or rname not in judged:
                continue
            # the circuit's edges; an edge from or into a head outside it is read from the whole graph's scores
            for s in (circuit.mask[:, r] | g.valid[:, r]).nonzero().flatten().tolist():
                sname = g.senders[s]
                if sname in judged and (bool(circuit.mask[s, r]) or sname in outside or rname in outside):
                    q_edges[(sname, rname)] = float(scores[s, r])
    out = classify(evidence, q_edges, roles=declared, denom=denom, thresholds=thresholds,
                   task=task.name)
    for name, entry in out.items():
        entry["in_circuit"] = name not in set(extra)
    t = {**THRESHOLDS, **(thresholds or {})}
    settings = {"thresholds": t, "clean": clean, "corrupt": corrupt,
                "largest_direct_effect": _largest(e["direct_effect"] for e in evidence.values()),
                "largest_node_effect": _largest(e["node_effect"] for e in evidence.values())}
    if qk:
        _add_qk_evidence(model, task, out, settings)
    return Roles(out, task.name, stamped(settings, model, task, name=True))


QK_ROLES = ("name mover", "negative name mover", "induction head")


def declared_roles(task, ioi: bool) -> Tuple[Role, ...]:
    """The task's roles: those its registration declares (``qk.tasks.Role``; IOI's are ``IOI_ROLES``), then IOI's
    where it names IOI's positions and does not declare them already (a .jsonl IOI)."""
    from .registry import spec_of

    spec = spec_of(task)
    declared = tuple(spec.roles) if spec is not None else ()
    if ioi and not any(r in declared for r in IOI_ROLES):
        declared += IOI_ROLES
    return declared


def _add_qk_evidence(model, task, out: Dict[str, Dict[str, object]], settings: Dict[str, object]) -> None:
    """``out[head]["qk"]`` for each head whose role is in ``QK_ROLES`` or that the scan labels an induction head
    (``roles``' docstring). A head the attribution refuses (an attention it cannot decompose exactly, a key
    outside its window) keeps its role without ``qk``, and ``settings["qk_error"]`` maps it to the reason; a task
    that names no position but END gives no evidence (there is no key to read the head at)."""
    from .._explain.evidence import qk_evidence

    chosen = [h for h, r in out.items() if r.get("role") in QK_ROLES
              or "induction" in r.get("evidence", {}).get("labels", ())]   # e.g. a direct-logit induction head
    if not chosen:
        return
    role_of = {h: str(r["role"]) for h, r in out.items()}
    errors: Dict[str, str] = {}
    for h, ev in qk_evidence(model, task, chosen, labels=role_of, errors=errors).items():
        out[h]["qk"] = ev
    if errors:
        settings["qk_error"] = errors
