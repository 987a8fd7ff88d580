"""MIB interchange: edge scores and circuits in the MIB circuit track's JSON, written and read back.

>>> task = qk.tasks.induction(model, n=8, seg_len=6)
>>> scores = qk.edge_scores(model, task, method="eap-ig", steps=3, progress=False)
>>> text = scores.to_mib(tmp / "importances.json")
>>> back = qk.results.EdgeScores.from_mib(tmp / "importances.json", model)
>>> bool(torch.equal(back.scores.nan_to_num(0), scores.scores.nan_to_num(0)))
True

The format is the one the EAP-IG library writes (``Graph.to_json``, hannamw/EAP-IG) and the MIB circuit track
reads (``Graph.from_json``; an importance-score submission is one such file per task and model, in a folder
named ``<task>_<model>``, e.g. ``ioi_gpt2``)::

    {"cfg":   {"n_layers": L, "n_heads": H, "parallel_attn_mlp": bool, "d_model": d},
     "nodes": {"input": {"in_graph": bool}, "a0.h0": {...}, ..., "m0": {...}, ..., "logits": {"in_graph": true}},
     "edges": {"input->a0.h0<q>": {"score": float, "in_graph": bool}, ..., "a3.h2->m5": {...},
               "m11->logits": {...}}}

Names: our ``emb`` is ``input``, head ``L.H`` is ``aL.hH``, ``mlpL`` is ``mL``; an edge into a head's query, key
or value input ends in ``<q>``, ``<k>``, ``<v>``. The reference builds every edge of every layer in the order its
``Graph.from_model`` adds them (written in that order here): a head's q/k/v read the embedding, every earlier
head and MLP; an MLP also its own layer's heads unless blocks are parallel; the logits read everything.

**Grouped-query attention.** Our k and v inputs belong to the key-value head (``L.kvG``, read by every query
head of its group); the reference ungroups them, one k and one v input per query head. The gradient of a KV
head's input is the sum of its query heads' copies' gradients, so our KV-head score IS the sum of the
reference's per-query-head scores (EAP, EAP-IG, exactly). Export: each query head h of group G gets
``score(L.kvG) / |G|`` (the group's total kept; which query head carries more is not known from grouped
scores, so the split is even). Import: the group's copies are SUMMED back (a reference file's per-head
scores become their group's total). In a circuit, a KV edge is in_graph for every query head of its group
(a query head reads the patched k/v), and on import a KV edge is in the circuit when ANY query head's copy
is (the reference may keep a k/v edge for some query heads of a group only; the grouped graph cannot, so it
keeps the superset). Export then import returns the same scores (float32, bit for bit) and the same circuit.
The UNGROUPED graph (``qk.graph(model, gqa="ungrouped")``) has the reference's own count, one k and one v input
per query head: its edges map one to one, nothing split or summed (``EdgeScores.from_mib(path, model,
gqa="ungrouped")`` reads a file so). A position-aware graph has no MIB form (the reference's graph has no
positions): ``to_mib`` refuses it in one line.

**Scale.** Our scores are metric units per prompt; the reference divides its batch-mean metric's gradients by
the prompt count again (so its scores are ours / batch size) and negates the logit difference while taking
Δ = corrupt − clean (the two signs cancel: positive = the edge carries the behaviour in both). The MIB
evaluation ranks edges (top-n by score or |score|), so neither changes a circuit.

A model without MLPs: the reference's graph always has them; their nodes are written out of the circuit and
their edges with score 0 (an MLP that is not there has no effect); on import their scores must be 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import Graph, graph as graph_of

PathLike = Union[str, Path]


def _graph(model_or_graph, gqa: str = "grouped") -> Graph:
    return model_or_graph if isinstance(model_or_graph, Graph) else graph_of(model_or_graph, gqa)


def _check_plain(g: Graph) -> None:
    if g.positions:
        raise QKCircuitsError(f"MIB's graph has no position groups, but this graph splits {'/'.join(g.positions)}: "
                              f"export scores of the plain graph (positions=False)")


def node_name(sender: str) -> str:
    """Our sender name → the reference's node name (``emb`` → ``input``, ``3.2`` → ``a3.h2``, ``mlp5`` → ``m5``)."""
    if sender == "emb":
        return "input"
    if sender.startswith("mlp"):
        return f"m{sender[3:]}"
    L, h = sender.split(".")
    return f"a{L}.h{h}"


def reference_nodes(n_layers: int, n_heads: int) -> List[str]:
    """The reference's node names in its order: input, then per layer its heads and its MLP, then logits."""
    out = ["input"]
    for L in range(n_layers):
        out += [f"a{L}.h{h}" for h in range(n_heads)] + [f"m{L}"]
    return out + ["logits"]


def reference_edges(n_layers: int, n_heads: int, parallel: bool) -> Iterator[Tuple[str, str, Optional[str]]]:
    """(parent, child, q/k/v or None) of every edge, in the order ``Graph.from_model`` of the reference adds
    them: per layer, the residual stream so far into each head's q, k, v, then into the MLP (with the layer's
    own heads unless blocks are parallel); at the end everything into the logits."""
    stream = ["input"]
    for L in range(n_layers):
        heads = [f"a{L}.h{h}" for h in range(n_heads)]
        for parent in stream:
            for child in heads:
                for x in "qkv":
                    yield parent, child, x
        if parallel:
            for parent in stream:
                yield parent, f"m{L}", None
            stream = stream + heads + [f"m{L}"]
        else:
            stream = stream + heads
            for parent in stream:
                yield parent, f"m{L}", None
            stream = stream + [f"m{L}"]
    for parent in stream:
        yield parent, "logits", None


def edge_name(parent: str, child: str, x: Optional[str]) -> str:
    return f"{parent}->{child}" if x is None else f"{parent}->{child}<{x}>"


def _index(g: Graph) -> Tuple[Dict[str, int], Dict[Tuple[str, Optional[str]], Tuple[int, int]]]:
    """Reference node name → our sender index; (reference child, q/k/v) → (our receiver index, group size that
    shares it: 1, or the query heads per KV head for k/v under grouped-query attention on the grouped graph; the
    ungrouped graph's k/v inputs are per query head, 1)."""
    _check_plain(g)
    senders = {node_name(s): i for i, s in enumerate(g.senders)}
    group = g.n_heads // g.n_kv_in
    recv: Dict[Tuple[str, Optional[str]], Tuple[int, int]] = {("logits", None): (g.logits_receiver, 1)}
    for L in range(g.n_layers):
        for h in range(g.n_heads):
            recv[(f"a{L}.h{h}", "q")] = (g.recv_slice(L, "q").start + h, 1)
            for x in "kv":
                recv[(f"a{L}.h{h}", x)] = (g.recv_slice(L, x).start + h // group, group)
        if g.has_mlp:
            recv[(f"m{L}", None)] = (g.recv_slice(L, "mlp").start, 1)
    return senders, recv


def to_mib(scores, path: Optional[PathLike] = None, mask: Optional[Tensor] = None,
           d_model: Optional[int] = None) -> str:
    """The MIB JSON of ``scores`` (an ``EdgeScores``, or a circuit: its ``scores`` and ``graph``), with
    ``in_graph`` = ``mask`` [S, R] (a circuit's edges; None: no edge in, as the reference's ``attribute`` leaves
    its graph); written to ``path`` (atomically) when given. Returns the JSON text. Scores unknown (NaN: a
    circuit read back from its JSON keeps only its own edges' scores) are written as 0."""
    from .._foundation.io import write_atomic

    g: Graph = scores.graph
    if d_model is None:                 # the reference reads it only for neuron-level files
        d_model = int((getattr(scores, "settings", None) or {}).get("d_model") or 0)
    sc = scores.scores.double()
    inside = torch.zeros_like(g.valid) if mask is None else mask.bool().cpu() & g.valid
    senders, recv = _index(g)
    edges: Dict[str, Dict[str, object]] = {}
    for parent, child, x in reference_edges(g.n_layers, g.n_heads, g.parallel):
        name = edge_name(parent, child, x)
        s, r = senders.get(parent), recv.get((child, x))
        if s is None or r is None:              # an MLP of a model that has none: no effect
            edges[name] = {"score": 0.0, "in_graph": False}
            continue
        v = float(sc[s, r[0]]) / r[1]
        edges[name] = {"score": v if math.isfinite(v) else 0.0, "in_graph": bool(inside[s, r[0]])}
    used = inside.any(1)
    nodes = {n: {"in_graph": bool(used[senders[n]]) if n in senders else n == "logits"}
             for n in reference_nodes(g.n_layers, g.n_heads)}
    text = json.dumps({"cfg": {"n_layers": g.n_layers, "n_heads": g.n_heads, "parallel_attn_mlp": g.parallel,
                               "d_model": d_model}, "nodes": nodes, "edges": edges})
    if path is not None:
        write_atomic(path, text)
    return text


EDGE_FIELDS = ("score", "in_graph")


def _read_checked(p: Path, g: Graph) -> Dict[str, object]:
    """The MIB JSON at ``p`` through the strict reader (``_foundation/jsonread``: NaN, ``1e400``, huge integers,
    deep nesting, repeated keys refused) and checked against its known shape: keys cfg, nodes, edges; cfg of this
    graph; node names of this graph's reference nodes; edges ``{"score": number, "in_graph": true|false}``. Every
    error is one line naming the file and the place in it (``edges["a3.h2->m5"].in_graph``)."""
    from .._foundation.jsonread import JSONProblem, json_path, parse_json, read_text_file

    what = "a MIB circuit JSON"
    try:
        d = parse_json(read_text_file(p, str(p), what))
    except JSONProblem as e:
        raise QKCircuitsError(f"{p}: not a MIB circuit JSON ({e.detail})") from None
    except QKCircuitsError as e:
        raise QKCircuitsError(f"{p}: not a MIB circuit JSON ({e})") from None
    if not isinstance(d, dict) or not all(isinstance(d.get(k), dict) for k in ("cfg", "nodes", "edges")):
        raise QKCircuitsError(f"{p}: not a MIB circuit JSON: expected the keys cfg, nodes, edges (objects)")
    unknown = sorted(set(d) - {"cfg", "nodes", "edges"})
    if unknown:
        raise QKCircuitsError(f"{p}: unknown key {unknown[0]!r} at the top level; a MIB circuit JSON has cfg, "
                              f"nodes, edges")
    cfg = d["cfg"]
    want = {"n_layers": g.n_layers, "n_heads": g.n_heads, "parallel_attn_mlp": g.parallel}
    for k, v in want.items():
        if k not in cfg:
            raise QKCircuitsError(f"{p}: cfg has no {k!r} (the reference writes n_layers, n_heads, "
                                  f"parallel_attn_mlp, d_model)")
        if type(cfg[k]) is not type(v) or cfg[k] != v:           # True is not 1, 2.0 is not 2
            raise QKCircuitsError(f"{p}: cfg {k} is {cfg[k]!r} but this model's graph has {v!r}")
    known = set(reference_nodes(g.n_layers, g.n_heads))
    for name, node in d["nodes"].items():
        if name not in known:
            raise QKCircuitsError(f"{p}: {json_path(['nodes', name])} is not a node of this model's graph (nodes "
                                  f"are input, aL.hH, mL, logits)")
        flag = node.get("in_graph", False) if isinstance(node, dict) else node
        if not isinstance(node, (dict, bool)) or (isinstance(node, dict) and set(node) - {"in_graph"}) \
                or not isinstance(flag, bool):
            raise QKCircuitsError(f"{p}: {json_path(['nodes', name])} must be {{\"in_graph\": true or false}}, got "
                                  f"{json.dumps(node)[:60]}")
    for name, e in d["edges"].items():
        where = json_path(["edges", name])
        if not isinstance(e, dict):
            raise QKCircuitsError(f"{p}: {where} must be {{\"score\": number, \"in_graph\": true or false}}, got "
                                  f"{json.dumps(e)[:60]}")
        extra = sorted(set(e) - set(EDGE_FIELDS))
        if extra:
            raise QKCircuitsError(f"{p}: {where} has the unknown field {extra[0]!r}; an edge has score and in_graph")
        score = e.get("score")
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise QKCircuitsError(f"{p}: edge {name!r} is missing or has no numeric score ({where}.score is "
                                  f"{json.dumps(score)[:40]})")
        if not isinstance(e.get("in_graph", False), bool):
            raise QKCircuitsError(f"{p}: {where}.in_graph must be true or false, got {json.dumps(e['in_graph'])[:40]}")
    return d


def read_mib(path: PathLike, model_or_graph, gqa: str = "grouped") -> Tuple[Graph, Tensor, Tensor, Dict[str, object]]:
    """(graph, scores [S, R] float32 with NaN off the graph, in_graph mask [S, R], the file's cfg) of a MIB JSON
    for this model's graph (``gqa`` as in ``qk.graph`` when a model is given; grouped k/v: the query heads' copies
    summed, in_graph if any is; ungrouped: one to one). One-line errors for a file that is not MIB JSON, a cfg
    that is not this model's, a missing or unknown edge."""
    g = _graph(model_or_graph, gqa)
    _check_plain(g)
    p = Path(path)
    d = _read_checked(p, g)
    cfg = d["cfg"]
    senders, recv = _index(g)
    acc = torch.zeros(g.n_senders, g.n_receivers, dtype=torch.float64)
    seen = torch.zeros(g.n_senders, g.n_receivers, dtype=torch.int32)
    inside = torch.zeros(g.n_senders, g.n_receivers, dtype=torch.bool)
    names = set()
    for parent, child, x in reference_edges(g.n_layers, g.n_heads, g.parallel):
        name = edge_name(parent, child, x)
        names.add(name)
        e = d["edges"].get(name)
        if e is None:
            raise QKCircuitsError(f"{p}: edge {name!r} is missing or has no numeric score (every edge of the "
                                  f"model's graph must be there)")
        s, r = senders.get(parent), recv.get((child, x))
        if s is None or r is None:              # an MLP of a model that has none
            if float(e["score"]) != 0.0 or e.get("in_graph"):
                raise QKCircuitsError(f"{p}: edge {name!r} scores an MLP this model does not have "
                                      f"({e['score']!r}, in_graph {e.get('in_graph')!r})")
            continue
        acc[s, r[0]] += float(e["score"])
        seen[s, r[0]] += 1
        inside[s, r[0]] |= e.get("in_graph", False)         # a boolean: _read_checked
    extra = [n for n in d["edges"] if n not in names]
    if extra:
        raise QKCircuitsError(f"{p}: edge {extra[0]!r} is not an edge of this model's graph ({len(extra)} unknown)")
    if not bool(acc.float()[g.valid].isfinite().all()):
        raise QKCircuitsError(f"{p}: the scores of one edge of this model's graph add up past the float32 range; "
                              f"expected finite importance scores")
    scores = acc.float()
    scores[~g.valid] = float("nan")
    return g, scores, inside & g.valid, dict(cfg)
