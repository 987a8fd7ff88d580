"""A circuit found by ``qkcircuits circuit --json`` (issue 17 ask 6), read and checked for the views.

>>> view = load_circuit({"curve": {"0": 0.0, "100": 1.0},
...                      "circuit": {"edges": [["embed", "0.0", "q", 0.5], ["0.0", "logits", None, -0.25]]}})
>>> [str(n) for n in view.nodes()]
['emb', '0.0', 'logits']
>>> view.curve
[(0.0, 0.0), (100.0, 1.0)]
>>> load_circuit({"curve": {"ten": 0.5}, "circuit": {"edges": []}})
Traceback (most recent call last):
...
qkcircuits._foundation.errors.QKCircuitsError: circuit JSON: curve key 'ten' is not a percent (a number in 0-100)

The contract (keys kept by the CLI): ``model``, ``task``, ``n_prompts``, ``metric``, ``clean``, ``corrupt``,
``method``, ``steps``, ``curve`` {percent: f}, ``cpr``, ``cmd``, ``circuit`` {``edges``: [[sender, receiver,
input, score], ...], ``heads``, ``node_faithfulness``}, ``roles`` {head: {role, evidence}}, ``timing``; and
(docs/tasks.md) ``core`` {``heads``, ``mlps``, ``node_faithfulness``, ``curve`` {n heads: f}, ``how``} and
``warnings`` [one line each]. Node names may carry a position (``"20.0@END"``, position-aware circuits).
Only ``circuit.edges`` is needed to draw the graph and ``curve`` to draw the faithfulness curve; every
key that is present is type-checked, so a foreign or damaged file fails here in one line naming the file
and the key, before a model loads. Node names as ``qk.graph`` writes them: ``emb``, ``L.H`` (a head),
``L.kvG`` (a key-value head under grouped-query attention: the receiver of k/v edges), ``mlpL``, ``logits``
(a few other spellings are read too: see ``parse_node``).
Memory: the file's numbers as Python floats (a few per edge).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .._foundation.errors import QKCircuitsError
from .._foundation.io import check_schema
from .._foundation.jsonread import JSONProblem, parse_json, read_text_file
from .._tasks.roles import most_text

SCHEMA = "qkcircuits.circuit"       # the CLI's file; a Faithfulness result's JSON holds a circuit too
# the schemas this reader knows (name/newest version): the CLI's file, qk.faithfulness(...) and scores.circuit(...)
READABLE = (f"{SCHEMA}/1", "qkcircuits.faithfulness/1", "qkcircuits.task_circuit/1")
KINDS = ("embed", "head", "kv", "mlp", "logits")

_HEAD = re.compile(r"^(?:a|attn\.?|head\.?)?(\d+)\.(\d+)$|^[Ll](\d+)[Hh](\d+)$")
_KV = re.compile(r"^(\d+)\.kv(\d+)$")
_MLP = re.compile(r"^(?:mlp|m)\.?(\d+)$", re.I)
_EMBED = ("embed", "embedding", "emb", "input", "hook_embed", "tokens")
_LOGITS = ("logits", "logit", "unembed", "output", "out")


@dataclass(frozen=True)
class Node:
    """One node of the circuit graph: ``kind`` (embed, head, kv, mlp, logits), its ``layer`` and ``index`` (the
    query head of a head; the key-value head G of ``"L.kvG"``: with grouped-query attention the k and v inputs
    belong to the KV head, which its group of query heads shares)."""

    kind: str
    layer: int = -1
    index: int = -1
    pos: str = ""             # a position-aware circuit's position ("END", "S2", "other"); "" = all positions

    def __str__(self) -> str:
        return self.base + (f"@{self.pos}" if self.pos else "")

    @property
    def base(self) -> str:
        """The name without its position: ``"20.0@END"`` → ``"20.0"``."""
        if self.kind == "head":
            return f"{self.layer}.{self.index}"
        if self.kind == "kv":
            return f"{self.layer}.kv{self.index}"
        return f"mlp{self.layer}" if self.kind == "mlp" else {"embed": "emb"}.get(self.kind, self.kind)

    @property
    def order(self) -> Tuple[float, int]:
        """Sort key along the forward pass: embed, then each layer's heads, its MLP, ..., logits."""
        rank = {"embed": (-1.0, 0), "logits": (math.inf, 0)}
        if self.kind in rank:
            return rank[self.kind]
        return (self.layer + (0.5 if self.kind == "mlp" else 0.0), max(self.index, 0))


_POS = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,31}$")


def parse_node(name: Any) -> Optional[Node]:
    """A node from its name (``"embed"`` / ``"emb"``, ``"3.1"`` / ``"L3H1"`` / ``"a3.1"``, ``"3.kv1"`` (KV head 1
    of layer 3, a receiver of k/v edges under grouped-query attention), ``"mlp.3"`` / ``"mlp3"`` / ``"m3"``,
    ``"logits"``), each optionally at a position, ``"20.0@END"``, ``"mlp3@S2"``, ``"emb@IO"`` (a position-aware
    circuit), or None when ``name`` is not one."""
    if not isinstance(name, str):
        return None
    s = name.strip()
    if "@" in s:
        s, pos = s.rsplit("@", 1)
        node = parse_node(s)
        if node is None or not _POS.match(pos):
            return None
        return Node(node.kind, node.layer, node.index, pos)
    if s.lower() in _EMBED:
        return Node("embed")
    if s.lower() in _LOGITS:
        return Node("logits")
    m = _HEAD.match(s)
    if m:
        a, b = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        return Node("head", int(a), int(b))
    m = _KV.match(s)
    if m:
        return Node("kv", int(m.group(1)), int(m.group(2)))
    m = _MLP.match(s)
    return Node("mlp", int(m.group(1))) if m else None


@dataclass(frozen=True)
class Edge:
    """A sender's output into a receiver's ``input`` (q, k, v for a head or KV head; None or "in" for an MLP or
    the logits)."""

    sender: Node
    receiver: Node
    input: Optional[str]
    score: float


@dataclass
class CircuitView:
    """The checked contents of a circuit JSON; ``source`` names where it came from (for messages)."""

    source: str
    edges: List[Edge]
    curve: List[Tuple[float, float]]              # (percent of edges, f), sorted by percent; f NaN = undefined
    heads: List[str] = field(default_factory=list)
    roles: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    info: Dict[str, Any] = field(default_factory=dict)   # model, task, n_prompts, metric, clean, corrupt, ...
    core: Optional["Core"] = None                        # the core circuit, when the file has one
    warnings: List[str] = field(default_factory=list)    # one line each, shown first (a banner in the report)

    def nodes(self) -> List[Node]:
        """Every node of the edges and every head of ``heads``, in forward order."""
        out = {e.sender for e in self.edges} | {e.receiver for e in self.edges}
        out |= {parse_node(h) for h in self.heads}
        return sorted(out, key=lambda n: n.order)

    def get(self, key: str, default=None):
        return self.info.get(key, default)

    def top_edges(self, k: int) -> List[Edge]:
        """The ``k`` edges of largest |score| (ties: file order)."""
        return sorted(self.edges, key=lambda e: -abs(e.score))[:k]

    def role(self, node: Union[Node, str]) -> str:
        """The node's role from ``roles`` ("" when it has none); a position-aware node takes its own entry, else
        its head's."""
        r = self.roles.get(str(node))
        if r is None and isinstance(node, Node) and node.pos:
            r = self.roles.get(node.base)
        return str(r.get("role") or "") if isinstance(r, dict) else ""

    def shape(self) -> Tuple[int, int]:
        """(layers, heads) of the graph: the file's own (``graph``/top-level ``n_layers``, ``n_heads``) or at least
        1 + the largest layer and head index named."""
        ns = self.nodes()
        layers = [n.layer for n in ns if n.kind in ("head", "kv", "mlp")]
        heads = [n.index for n in ns if n.kind == "head"]
        need = (max(layers, default=-1) + 1, max(heads, default=-1) + 1)
        return (max(need[0], self._dim("n_layers")), max(need[1], self._dim("n_heads")))

    def n_kv(self) -> Optional[int]:
        """Key-value heads per layer, when the file says (``graph.n_kv_heads`` or top-level ``n_kv_heads``)."""
        return self._dim("n_kv_heads") or None

    def _dim(self, key: str) -> int:
        g = self.info.get("graph")
        v = g.get(key) if isinstance(g, dict) else None
        v = self.info.get(key) if v is None else v
        return int(v) if _number(v) and float(v) == int(v) and v > 0 else 0


@dataclass
class Core:
    """The core circuit of the file's ``core`` (docs/tasks.md): the fewest heads and MLPs whose node view reaches
    f ≥ 0.8, in the order they were chosen; ``curve`` {n heads: f}; ``how`` (one sentence); ``edges`` when the
    file gives them (else the views take the edge circuit's edges between core nodes)."""

    heads: List[Node]
    mlps: List[Node]
    node_faithfulness: Optional[float] = None
    curve: Dict[int, float] = field(default_factory=dict)
    how: str = ""
    edges: Optional[List[Edge]] = None
    holdout_f: Optional[float] = None          # its f on the held-out prompts, when the file has them

    def nodes(self) -> List[Node]:
        return self.heads + self.mlps


def _short(x: Any, n: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def _read(source: Any) -> Tuple[Dict, str]:
    """(the JSON object, a name for messages) from a dict, a path, JSON text or a result with ``to_dict``
    (``Faithfulness``, a circuit; edge scores give their chosen circuit, ``scores.circuit()``)."""
    if isinstance(source, dict):
        return source, "circuit JSON"
    if not isinstance(source, (str, Path)):
        if callable(getattr(source, "circuit", None)) and hasattr(source, "graph"):   # EdgeScores
            source = source.circuit()
        if callable(getattr(source, "to_dict", None)):
            data = source.to_dict()
            if not isinstance(data, dict):
                raise QKCircuitsError(f"{type(source).__name__}.to_dict() gave a {type(data).__name__}, not a "
                                      f"circuit JSON object")
            owner = getattr(source, "circuit", source)          # the graph's counts lay the figure out
            g = getattr(owner, "graph", None)
            if "graph" not in data and callable(getattr(g, "to_dict", None)):
                data = {**data, "graph": g.to_dict()}
            return data, type(source).__name__
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        name = str(source)
        p = Path(source)
        if not p.is_file():
            raise QKCircuitsError(f"no circuit JSON file at {name!r} (write one with `qkcircuits circuit MODEL "
                                  f"--task ioi --json FILE`)")
        text = read_text_file(p, name, "a circuit JSON from `qkcircuits circuit --json`")
    elif isinstance(source, str):
        name, text = "circuit JSON", source
    else:
        raise QKCircuitsError(f"expected a circuit (a result, a JSON dict, a path or JSON text), got "
                              f"{type(source).__name__}")
    try:
        data = parse_json(text)            # the strict reader: NaN, 1e400, huge integers, deep nesting refused
    except JSONProblem as e:
        if e.syntax:
            raise QKCircuitsError(f"{name}: not JSON ({e.error.msg} at line {e.error.lineno}, column "
                                  f"{e.error.colno})") from None
        raise QKCircuitsError(f"{name}: {e.detail}") from None
    if not isinstance(data, dict):
        raise QKCircuitsError(f"{name}: expected a JSON object from `qkcircuits circuit --json`, got a "
                              f"{type(data).__name__}")
    return data, name


def _check_schema(data: Dict, name: str) -> None:
    def hint(got: str) -> str:
        return ("(it holds edge scores, not a circuit: choose one with scores.circuit(...) or write one with "
                "`qkcircuits circuit MODEL --json FILE`)" if got == "qkcircuits.edge_scores" else "")

    check_schema(data, READABLE, name, "a circuit file (from `qkcircuits circuit --json`)", hint)


def _edges(raw: Any, name: str) -> List[Edge]:
    if not isinstance(raw, list):
        raise QKCircuitsError(f"{name}: circuit.edges must be a list of [sender, receiver, input, score], got "
                              f"{type(raw).__name__}")
    out = []
    for i, e in enumerate(raw):
        if isinstance(e, dict):               # tolerate {"sender", "receiver", "input", "score"} rows
            e = [e.get("sender"), e.get("receiver"), e.get("input"), e.get("score")]
        if not isinstance(e, (list, tuple)) or len(e) != 4:
            raise QKCircuitsError(f"{name}: circuit.edges[{i}] must be [sender, receiver, input, score], got "
                                  f"{_short(e)}")
        s, r, x, score = e
        sn, rn = parse_node(s), parse_node(r)
        for what, n, raw_n in (("sender", sn, s), ("receiver", rn, r)):
            if n is None:
                raise QKCircuitsError(f"{name}: circuit.edges[{i}] {what} {_short(raw_n)} is not a node "
                                      f"(emb, L.H, L.kvG, mlpL or logits)")
        if sn.kind in ("logits", "kv") or rn.kind == "embed":
            raise QKCircuitsError(f"{name}: circuit.edges[{i}] runs {sn} -> {rn}: the logits send nothing and the "
                                  f"embedding receives nothing")
        if sn.order[0] >= rn.order[0]:
            raise QKCircuitsError(f"{name}: circuit.edges[{i}] runs {sn} -> {rn}, which is not forward in the model")
        if x is not None and not isinstance(x, str):
            raise QKCircuitsError(f"{name}: circuit.edges[{i}] input must be a string such as 'q', 'k', 'v' (or "
                                  f"null), got {_short(x)}")
        if not _number(score):
            raise QKCircuitsError(f"{name}: circuit.edges[{i}] score must be a finite number, got {_short(score)}")
        out.append(Edge(sn, rn, x or None, float(score)))
    return out


def _curve(raw: Any, name: str) -> List[Tuple[float, float]]:
    if isinstance(raw, list):                 # tolerate [[percent, f], ...]
        try:
            raw = {p: f for p, f in raw}
        except (TypeError, ValueError):
            raise QKCircuitsError(f"{name}: curve must be {{percent: f}}, got {_short(raw)}") from None
    if not isinstance(raw, dict):
        raise QKCircuitsError(f"{name}: curve must be {{percent: f}}, got {type(raw).__name__}")
    out = []
    for p, f in raw.items():
        try:
            pct = float(p)
        except (TypeError, ValueError):
            pct = math.nan
        if not (0.0 <= pct <= 100.0):
            raise QKCircuitsError(f"{name}: curve key {p!r} is not a percent (a number in 0-100)")
        if f is None:                         # f undefined: m(full) = m(∅), the model does not do the task
            out.append((pct, math.nan))
            continue
        if not _number(f):
            raise QKCircuitsError(f"{name}: curve[{p!r}] must be a finite number (the faithfulness f) or null, got "
                                  f"{_short(f)}")
        out.append((pct, float(f)))
    return sorted(out)


def _core(raw: Any, name: str) -> Optional[Core]:
    """The ``core`` entry checked (None when absent): heads 'L.H' (optionally '@POS'), MLPs 'mlpL', numbers."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QKCircuitsError(f"{name}: core must be {{heads, mlps, node_faithfulness, curve, how}}, got "
                              f"{type(raw).__name__}")
    out = {}
    for key, kind in (("heads", "head"), ("mlps", "mlp")):
        items = raw.get(key) or []
        nodes = [parse_node(x) for x in items] if isinstance(items, list) else [None]
        if any(n is None or n.kind != kind for n in nodes):
            what = "heads written 'L.H' (or 'L.H@POS')" if kind == "head" else "MLPs written 'mlpL' (or 'mlpL@POS')"
            raise QKCircuitsError(f"{name}: core.{key} must be a list of {what}, got {_short(items)}")
        out[key] = nodes
    nf = raw.get("node_faithfulness")
    if nf is not None and not _number(nf):
        raise QKCircuitsError(f"{name}: core.node_faithfulness must be a finite number or null, got {_short(nf)}")
    curve = raw.get("curve") or {}
    if not isinstance(curve, dict):
        raise QKCircuitsError(f"{name}: core.curve must be {{number of heads: f}}, got {_short(curve)}")
    checked = {}
    for k, f in curve.items():
        if not (str(k).isdigit() and (f is None or _number(f))):
            raise QKCircuitsError(f"{name}: core.curve[{k!r}] must map a number of heads to f (a number or null), got "
                                  f"{_short(f)}")
        checked[int(k)] = math.nan if f is None else float(f)
    how = raw.get("how", "")
    if not isinstance(how, str):
        raise QKCircuitsError(f"{name}: core.how must be a sentence, got {_short(how)}")
    edges = _edges(raw["edges"], name + " core") if "edges" in raw else None
    held = raw.get("holdout")
    hf = held.get("f") if isinstance(held, dict) else None
    return Core(out["heads"], out["mlps"], None if nf is None else float(nf), dict(sorted(checked.items())), how,
                edges, float(hf) if _number(hf) else None)


def _warnings(raw: Any, name: str) -> List[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(w, str) for w in raw):
        raise QKCircuitsError(f"{name}: warnings must be a list of one-line strings, got {_short(raw)}")
    return [" ".join(w.split()) for w in raw if w.strip()]


INFO_TYPES = {"model": (str,), "task": (str,), "metric": (str,), "method": (str,), "n_prompts": (int,),
              "steps": (int, type(None)), "clean": (float, int, type(None)), "corrupt": (float, int, type(None)),
              "cpr": (float, int, type(None)), "cmd": (float, int, type(None)), "timing": (dict,)}


def load_circuit(source: Any, *, need: Sequence[str] = (), roles: Any = None) -> CircuitView:
    """Read and check a circuit: a result of the circuit API (``qk.faithfulness(...)``, ``scores.circuit(...)``,
    edge scores, anything whose ``to_dict()`` is the JSON contract or its ``circuit`` part), the ``--json``
    dict, a path to that file, or its text. ``need``: top-level keys that must be present (e.g. ``("curve",)``
    for the faithfulness figure). ``roles``: {head: {role, evidence}} (or a result whose ``to_dict()`` gives
    it, e.g. ``qk.roles(model, task, circuit)``), added to the file's. Bad input: one ``QKCircuitsError`` line
    naming the file and the problem."""
    if roles is not None:
        view = load_circuit(source, need=need)
        extra = roles.to_dict() if callable(getattr(roles, "to_dict", None)) else roles
        if isinstance(extra, dict) and isinstance(extra.get("roles"), dict):
            extra = extra["roles"]
        checked = load_circuit({"circuit": {"edges": []}, "roles": extra})   # the same checks, named "roles"
        view.roles.update(checked.roles)
        return view
    if isinstance(source, CircuitView):
        data, name = None, source.source
        view = source
    else:
        data, name = _read(source)
        _check_schema(data, name)
        view = None
    if view is None:
        circuit = data.get("circuit")
        if circuit is None and "edges" in data:           # a circuit's own to_dict(): the "circuit" part alone
            circuit, data = data, {k: data[k] for k in ("graph", "model") if k in data}
        if not isinstance(circuit, dict) or "edges" not in circuit:
            raise QKCircuitsError(f"{name}: no circuit.edges (is it a `qkcircuits circuit --json` file? keys: "
                                  f"{', '.join(sorted(map(str, data))) or 'none'})")
        for key, types in INFO_TYPES.items():
            v = data.get(key)
            if key in data and not (isinstance(v, types) and not isinstance(v, bool)):
                raise QKCircuitsError(f"{name}: {key} must be {' or '.join(t.__name__ for t in types)}, got "
                                      f"{_short(v)}")
        heads = circuit.get("heads") or []
        if not isinstance(heads, list) or any(parse_node(h) is None or parse_node(h).kind != "head" for h in heads):
            raise QKCircuitsError(f"{name}: circuit.heads must be a list of heads written 'L.H', got {_short(heads)}")
        roles = data.get("roles") or {}
        if not isinstance(roles, dict):
            raise QKCircuitsError(f"{name}: roles must be {{head: {{role, evidence}}}}, got {type(roles).__name__}")
        for h, r in roles.items():
            if parse_node(h) is None or not isinstance(r, dict) or not isinstance(r.get("role", ""), str):
                raise QKCircuitsError(f"{name}: roles[{h!r}] must be a node name with {{role: str, evidence}}, got "
                                      f"{_short(r)}")
        info = {k: v for k, v in data.items() if k not in ("circuit", "curve", "roles", "core", "warnings")}
        info["node_faithfulness"] = circuit.get("node_faithfulness")
        info.update({f"circuit.{k}": v for k, v in circuit.items() if k not in ("edges", "heads", "node_faithfulness")})
        view = CircuitView(name, _edges(circuit["edges"], name), _curve(data.get("curve", {}), name),
                           [str(parse_node(h)) for h in heads], {str(parse_node(h)): r for h, r in roles.items()},
                           info)
        view.info["has_curve"] = "curve" in data
        view.core = _core(data.get("core"), name)
        view.warnings = _warnings(data.get("warnings"), name)
    for key in need:
        if key == "curve" and not view.info.get("has_curve"):
            raise QKCircuitsError(f"{name}: no faithfulness curve ('curve' {{percent: f}}) to draw")
    return view


def check_against_model(view: CircuitView, n_layers: int, n_heads: int, n_kv: Optional[int] = None,
                        what: str = "the model") -> None:
    """One line when the circuit names a head, KV head or MLP that ``what`` (n_layers x n_heads, ``n_kv`` KV
    heads) does not have."""
    kv = n_kv or n_heads
    for n in view.nodes() + (view.core.nodes() if view.core else []):
        if ((n.kind in ("head", "kv", "mlp") and n.layer >= n_layers) or (n.kind == "head" and n.index >= n_heads)
                or (n.kind == "kv" and n.index >= kv)):
            raise QKCircuitsError(f"{view.source}: the circuit names {n}, but {what} has {n_layers} layers x "
                                  f"{n_heads} heads (was it found on another model?)")


def evidence_text(evidence: Any, digits: int = 3) -> str:
    """The evidence behind a role as one line: a sentence as given, a dict as ``key value, ...``, numbers
    to ``digits`` significant digits."""
    if evidence is None:
        return ""
    if isinstance(evidence, str):
        return evidence
    if _number(evidence):
        return f"{float(evidence):.{digits}g}"
    if isinstance(evidence, dict):
        return ", ".join(f"{k} {evidence_text(v, digits)}" for k, v in evidence.items())
    if isinstance(evidence, (list, tuple)):
        return ", ".join(evidence_text(v, digits) for v in evidence)
    return str(evidence)


def evidence_cell(evidence: Any, digits: int = 3) -> Any:
    """A role's evidence as a cell of the report's roles table: a dict as ``{"kv": [[name, value], ...]}``, which
    the page draws as a small table of its own (one row per name, the value as ``evidence_text``: a nested dict on
    one line, an empty list "none"); anything else as ``evidence_text``.

    >>> evidence_cell({"direct_share": 0.51234, "attn_from_END": {"IO": 0.4, "S1": 0.1}, "labels": []})
    {'kv': [['direct share', '0.512'], ['attention from END', 'IO 0.4, S1 0.1'], ['labels', 'none']]}
    >>> evidence_cell({"END_attends_most": {"where": "IO", "rows": 30, "of": 32, "counts": {"IO": 30, "S2": 2}}})
    {'kv': [['END attends most to', 'IO in 30 of 32 prompts']]}
    >>> evidence_cell("a sentence")
    'a sentence'
    """
    if not isinstance(evidence, dict):
        return evidence_text(evidence, digits)
    return {"kv": [[_EVIDENCE_NAMES.get(str(k), str(k).replace("_", " ")),
                    most_text(v) if k == "END_attends_most" and isinstance(v, dict) and "where" in v else
                    "none" if isinstance(v, (list, tuple, dict)) and not v else evidence_text(v, digits)]
                   for k, v in evidence.items()]}


# names of the roles' evidence keys (``_tasks.roles``) as the table shows them; other keys: "_" read as a space
_EVIDENCE_NAMES = {"attn_from_END": "attention from END", "END_attends_most": "END attends most to",
                   "END->IO": "END → IO attention", "END->S": "END → S attention", "END->S2": "END → S2 attention",
                   "S2->S1": "S2 → S1 attention", "S2->S1+1": "S2 → S1+1 attention", "S1+1->S1": "S1+1 → S1 attention",
                   "feeds_name_movers_q": "into the name movers' q"}
