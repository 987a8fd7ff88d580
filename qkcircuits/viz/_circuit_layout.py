"""Where each node of a circuit graph goes: a layered (Sugiyama) layout by grandalf, rows fixed to the model's layers.

>>> spots = layout({"emb": 0, "0.0": 1, "1.0": 3, "logits": 5},
...                [("emb", "0.0"), ("0.0", "1.0"), ("emb", "1.0"), ("1.0", "logits")],
...                {"emb": 40.0, "0.0": 40.0, "1.0": 40.0, "logits": 50.0})
>>> sorted(spots.nodes)                        # (x, y) of each node's centre, in px
['0.0', '1.0', 'emb', 'logits']
>>> [round(spots.nodes[n][1]) for n in ("emb", "0.0", "1.0", "logits")]   # y: one row per used rank
[0, 46, 92, 138]
>>> len(spots.routes[("emb", "1.0")])          # a long edge bends through a point on each row it crosses
3

The rows are given (``rank``: the embedding, then each layer's heads, its MLP, ..., the logits; only the ranks
that hold a node get a row, ``ROW_PX`` apart). grandalf's ``SugiyamaLayout`` (pure Python, the algorithm of
Graphviz's ``dot``) then does the rest on each connected component: one dummy point per row an edge crosses,
orderings within rows that reduce crossings (barycentre sweeps), x by Brandes–Köpf with each node as wide as
its drawn label. Components are packed side by side row by row (a component goes as far left as every row it
uses allows), and ``columns`` (node → column name: a position of a position-aware circuit) lays each column out
on its own, left to right in the order given, edges between columns drawn straight.

No overlaps: within a row every node box (marker + label, ``width``, plus ``GAP_PX`` of padding) and every bend
point is at least ``SPACE_PX`` from the next, enforced after Brandes–Köpf (whose averaged coordinates can come
closer than its own separation); rows are ``ROW_PX`` apart, more than a label's height. tests/test_circuit_graph.py measures the
drawn text boxes in Chromium.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

ROW_PX = 46.0        # between two rows (a label is ~15 px tall, a marker 12)
GAP_PX = 16.0        # padding a node box keeps beside its label (part of its width in the layout)
SPACE_PX = 3.0       # between any two items of a row (node boxes, bend points)
COLUMN_GAP_PX = 60.0 # between two position columns
DUMMY_PX = 3.0       # the width a bend point takes in its row: edges that pass a row side by side stay apart


@dataclass
class Spots:
    """``nodes``: name → (x, y) of the node box's centre; ``routes``: (sender, receiver) → the polyline's points
    from sender to receiver (only the edges given); ``rows``: used rank → y; ``columns``: column → (x0, x1)."""

    nodes: Dict[Hashable, Tuple[float, float]] = field(default_factory=dict)
    routes: Dict[Tuple[Hashable, Hashable], List[Tuple[float, float]]] = field(default_factory=dict)
    rows: Dict[int, float] = field(default_factory=dict)
    columns: Dict[str, Tuple[float, float]] = field(default_factory=dict)

    def extent(self) -> Tuple[float, float]:
        """(x0, x1) over every node box and route point."""
        xs = [x for x, _ in self.nodes.values()] + [x for r in self.routes.values() for x, _ in r]
        return (min(xs, default=0.0), max(xs, default=0.0))


class _View:
    def __init__(self, w: float, h: float = 16.0):
        self.w, self.h, self.xy = w, h, (0.0, 0.0)


class _EdgeView:
    def __init__(self):
        self.pts: List[Tuple[float, float]] = []

    def setpath(self, pts) -> None:
        self.pts = [tuple(p) for p in pts]


def _component(vertices, edges, rank: Dict[Hashable, int]):
    """grandalf's Sugiyama layout of one connected component with the given ranks; returns
    ({name: local x}, {(s, r): [(local x, rank), ...]}, {rank: [(x0, x1), ...]} boxes per rank)."""
    from grandalf.layouts import Layer, SugiyamaLayout

    class Ranked(SugiyamaLayout):
        def rank_all(self, roots, optimize=False):         # the rows are the model's: no ranking of our own
            used = sorted({rank[v.data] for v in self.g.sV})
            index = {r: i for i, r in enumerate(used)}
            self.layers = [Layer([]) for _ in used]
            for v in self.g.sV:
                self.grx[v].rank = index[rank[v.data]]
                self.layers[index[rank[v.data]]].append(v)
            self._used = used

    sug = Ranked(vertices)
    sug.xspace = SPACE_PX
    sug.init_all(roots=[v for v in vertices.sV if not v.e_in()], inverted_edges=[])
    for v in sug.grx:                                     # dummies: a bend point's width
        if getattr(sug.grx[v], "dummy", False):
            v.view.w = DUMMY_PX
    sug.draw(N=3)
    used = sug._used
    boxes: Dict[int, List[List[float]]] = {}
    for layer_i, layer in enumerate(sug.layers):
        items = []
        for v in layer:
            x = v.view.xy[0]
            items.append([x - v.view.w / 2, x + v.view.w / 2, v])
        items.sort(key=lambda b: b[0])
        for a, b in zip(items, items[1:]):               # keep the space (Brandes–Köpf averages can come closer)
            if b[0] < a[1] + SPACE_PX:
                shift = a[1] + SPACE_PX - b[0]
                b[0] += shift
                b[1] += shift
        for x0, x1, v in items:
            v.view.xy = ((x0 + x1) / 2, v.view.xy[1])
        boxes[used[layer_i]] = [(x0, x1) for x0, x1, _ in items]
    xs = {v.data: v.view.xy[0] for v in vertices.sV}
    routes = {}
    for e in vertices.sE:
        s, r = e.v[0].data, e.v[1].data
        pts = [(e.v[0].view.xy[0], rank[s])]
        ctrl = sug.ctrls.get(e)
        if ctrl:
            r0, r1 = sug.grx[e.v[0]].rank, sug.grx[e.v[1]].rank
            pts += [(ctrl[k].view.xy[0], used[k]) for k in range(r0 + 1, r1)]
        pts.append((e.v[1].view.xy[0], rank[r]))
        routes[(s, r)] = pts
    return xs, routes, boxes


def _column(names: Sequence[Hashable], edges: Sequence[Tuple[Hashable, Hashable]], rank: Dict[Hashable, int],
            width: Dict[Hashable, float]):
    """Layout of one column: each component by ``_component``, packed left to right row by row."""
    from grandalf.graphs import Edge, Graph, Vertex

    vs = {n: Vertex(n) for n in names}
    for n, v in vs.items():
        v.view = _View(width[n] + GAP_PX)
    es = []
    for s, r in edges:
        e = Edge(vs[s], vs[r])
        e.view = _EdgeView()
        es.append(e)
    g = Graph(list(vs.values()), es)
    right: Dict[int, float] = {}
    xs: Dict[Hashable, float] = {}
    routes: Dict[Tuple[Hashable, Hashable], List[Tuple[float, int]]] = {}
    # larger components first (they set the shape), then the small ones fill in
    for comp in sorted(g.C, key=lambda c: (-len(c.sV), min(rank[v.data] for v in c.sV))):
        cx, croutes, boxes = _component(comp, [], rank)
        offset = max((right.get(r, -SPACE_PX) + SPACE_PX - min(x0 for x0, _ in bx) for r, bx in boxes.items()),
                     default=0.0)
        for r, bx in boxes.items():
            right[r] = max(right.get(r, -SPACE_PX), offset + max(x1 for _, x1 in bx))
        xs.update({n: x + offset for n, x in cx.items()})
        routes.update({k: [(x + offset, rr) for x, rr in pts] for k, pts in croutes.items()})
    return xs, routes


def layout(rank: Dict[Hashable, int], edges: Sequence[Tuple[Hashable, Hashable]], width: Dict[Hashable, float],
           columns: Optional[Dict[Hashable, str]] = None, order: Optional[Sequence[str]] = None) -> Spots:
    """Place every node of ``rank`` (name → row rank) with ``edges`` (sender, receiver: sender's rank lower), each
    node ``width[name]`` px wide (its marker and label). ``columns``: name → column (``order``: their left-to-right
    order); edges between columns are drawn straight (module docs)."""
    edges = [(s, r) for s, r in dict.fromkeys(edges) if s in rank and r in rank and rank[s] < rank[r]]
    cols = columns or {n: "" for n in rank}
    names_of: Dict[str, List[Hashable]] = {}
    for n in rank:
        names_of.setdefault(cols.get(n, ""), []).append(n)
    seq = [c for c in (order or []) if c in names_of] + [c for c in names_of if c not in (order or [])]
    used = sorted(set(rank.values()))
    out = Spots(rows={r: i * ROW_PX for i, r in enumerate(used)})
    x_left = 0.0
    for c in seq:
        names = names_of[c]
        inside = [(s, r) for s, r in edges if cols.get(s, "") == c and cols.get(r, "") == c]
        xs, routes = _column(names, inside, rank, width)
        lo = min(xs[n] - width[n] / 2 for n in names)
        hi = max([xs[n] + width[n] / 2 for n in names] + [x for pts in routes.values() for x, _ in pts])
        shift = x_left - lo
        for n in names:
            out.nodes[n] = (xs[n] + shift, out.rows[rank[n]])
        for k, pts in routes.items():
            out.routes[k] = [(x + shift, out.rows[r]) for x, r in pts]
        out.columns[c] = (x_left, hi + shift)
        x_left = hi + shift + COLUMN_GAP_PX
    for s, r in edges:                               # between columns: straight
        if (s, r) not in out.routes:
            out.routes[(s, r)] = [out.nodes[s], out.nodes[r]]
    return out
