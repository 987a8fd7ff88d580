"""Random instances of every ``Result`` class, for the round-trip property test (tests/test_roundtrip.py).

``GENERATORS[cls](rng)`` builds one instance of ``cls`` from a seeded ``random.Random``: random shapes (sometimes
empty), tensors of the class's dtype holding awkward values (numbers one float32 step below a threshold such as
0.3999996, -0.0, 1e-13, subnormals, 3e38, NaN where the class allows it), odd strings (quotes, backslashes,
newlines, U+2028, emoji, "NaN", "null") and free-form settings. A new ``Result`` subclass needs a generator
here: the test fails for a class that has none.

What a generator keeps to is what the class's producers guarantee, and it says so where that is a choice:
free-form dicts (``settings``, ``extras``, ``task``, rows) are JSON data (str keys, lists not tuples, finite
floats: JSON has no NaN, a NaN there is written as null); ``Faithfulness.node_heads`` is its circuit's heads;
a task circuit's scores are NaN outside its mask (its JSON keeps only the circuit's edges, documented).
"""

from __future__ import annotations

import math
from dataclasses import replace
import random
from typing import Any, Callable, Dict, List

import torch
from transformer_lens.FactoredMatrix import FactoredMatrix

from qkcircuits._analysis.ablate import GroupEffect, RandomComparison
from qkcircuits._analysis.diagnose_result import HeadDiagnostics
from qkcircuits._analysis.head_scores import HeadScores
from qkcircuits._analysis.sweep import HeadEffects
from qkcircuits._explain.attribution import Attribution
from qkcircuits._tasks.circuit_report import CircuitReport
from qkcircuits._tasks.core import CoreCircuit
from qkcircuits._tasks.stability import Stability
from qkcircuits._foundation.capture import NAMES, Activations
from qkcircuits._foundation.heads import Head
from qkcircuits._paths.path_effects import PathEffects
from qkcircuits._scale.zoo import Zoo
from qkcircuits._tasks.faithfulness import Faithfulness
from qkcircuits._tasks.graph import Graph
from qkcircuits._tasks.roles import Roles
from qkcircuits._tasks.scores import EdgeScores, NodeScores
from qkcircuits._tasks.selection import TaskCircuit
from qkcircuits._weights.circuit import Circuit as HeadCircuit
from qkcircuits._weights.composition import CompositionScores
from qkcircuits._weights.kv_cache import KVCache
from qkcircuits._weights.rotary import OffsetProfile
from qkcircuits._weights.verify import CircuitCheck

ODD = ["", " ", "é", 'a"b', "back\\slash", "line\nbreak", "tab\t", "\u2028", "🙂", "NaN", "null", "0.1", "L.H",
       "{", "<b>", "x" * 40]
# float32 values next to thresholds and the edges of the format; 0.3999996 reads as 0.4 at 6 decimals
AWKWARD = [0.3999996, 0.4, 0.39999998, 0.8, 0.79999995, 1.0, 0.99999994, -0.0, 0.0, 1e-13, -1e-13, 1.4e-45, 3e38,
           -3e38, 1 / 3, 2 / 3, 0.1, 1e-7, 123456.789]


def text(rng: random.Random) -> str:
    return rng.choice(ODD) if rng.random() < 0.5 else f"s{rng.randrange(10**6)}"


def number(rng: random.Random, nan: bool = True) -> float:
    """A Python float (float64): awkward, random at any scale, or NaN (``nan=True``)."""
    r = rng.random()
    if nan and r < 0.1:
        return math.nan
    if r < 0.4:
        return rng.choice(AWKWARD)
    return rng.gauss(0, 1) * 10 ** rng.randint(-8, 8)


def tensor(rng: random.Random, shape, dtype=torch.float32, nan: bool = True) -> torch.Tensor:
    """Random values of ``dtype`` (awkward ones mixed in, NaN at random when ``nan``)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    t = torch.randn(*shape, generator=g, dtype=torch.float64) * 10 ** rng.randint(-3, 3)
    flat = t.view(-1)
    for i in range(flat.numel()):
        r = rng.random()
        if r < 0.25:
            flat[i] = rng.choice(AWKWARD)
        elif nan and r < 0.35:
            flat[i] = math.nan
    return t.to(dtype)


def json_data(rng: random.Random, depth: int = 0) -> Any:
    """Free-form JSON data: dicts with odd str keys, lists, strings, ints, finite floats, bools, None."""
    r = rng.random()
    if depth < 2 and r < 0.25:
        return {text(rng): json_data(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if depth < 2 and r < 0.4:
        return [json_data(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([text(rng), rng.randint(-2**60, 2**60), number(rng, nan=False), True, False, None])


def settings(rng: random.Random) -> Dict[str, Any]:
    return {text(rng): json_data(rng) for _ in range(rng.randint(0, 4))}


def heads(rng: random.Random, L: int, H: int, n: int) -> List[Head]:
    return [Head(rng.randrange(L), rng.randrange(H)) for _ in range(n)]


def graph(rng: random.Random, model: str, positions: bool = False) -> Graph:
    H = rng.randint(1, 3)
    g = Graph(rng.randint(1, 3), H, rng.choice([h for h in (1, H) if H % h == 0]), rng.random() < 0.7, model,
              rng.random() < 0.3)
    if positions and rng.random() < 0.5:          # a position-aware graph: named groups, then "other"
        g = replace(g, positions=tuple(["END", "IO", text(rng) + "x"][:rng.randint(1, 3)]) + ("other",))
    return g


# ------------------------------------------------------------------------------------------------ one per class
def head_scores(rng):
    L, H = rng.randint(0, 4), rng.randint(1, 4)
    names = rng.sample(["induction", "previous_token", "copying", "é score", "x"], rng.randint(0, 3))
    scores = {n: tensor(rng, (L, H)) for n in names}
    thresholds = {text(rng): (rng.choice(names or ["missing"]), rng.choice([0.4, 0.8, 1.0, number(rng, False)]))
                  for _ in range(rng.randint(0, 3))}
    return HeadScores(text(rng), L, H, scores, settings(rng), thresholds, settings(rng))


def head_effects(rng):
    L, H = rng.randint(1, 4), rng.randint(1, 4)
    return HeadEffects(tensor(rng, (L, H)), number(rng), text(rng), text(rng), text(rng), rng.choice(["sweep", "attribution"]),
                       rng.randint(0, 9), rng.randint(0, 99), rng.random() < 0.5, text(rng),
                       sorted(rng.sample(range(L), rng.randint(0, L))), {text(rng): number(rng, False)},
                       settings(rng), rng.random() < 0.5, settings(rng))


def group_effect(rng):
    return GroupEffect(heads(rng, 9, 9, rng.randint(0, 3)), number(rng), number(rng), text(rng), text(rng),
                       rng.random() < 0.5, settings(rng))


def random_comparison(rng):
    n = rng.randint(0, 4)
    return RandomComparison(heads(rng, 9, 9, 2), number(rng), number(rng), tensor(rng, (n,)),
                            [heads(rng, 9, 9, 2) for _ in range(n)], text(rng), text(rng), rng.randint(0, 2**40),
                            settings(rng))


def head_diagnostics(rng):
    L, H = rng.randint(1, 3), rng.randint(1, 3)
    needed = ["entropy_frac_mean", "max_weight", "sink", "perturb_change", "perturb_input_change", "future_weight"]
    measures = {n: tensor(rng, (L, H), torch.float64) for n in needed + ["qk_var", text(rng)]}
    by_set = {s: {n: tensor(rng, (L, H), torch.float64) for n in rng.sample(needed, 2)}
              for s in rng.sample(["text", "repeated", "é"], rng.randint(0, 2))}
    return HeadDiagnostics(text(rng), L, H, rng.randint(1, 128), measures, tensor(rng, (L,), torch.float64),
                           settings(rng), by_set)


def composition_scores(rng):
    L, H = rng.randint(1, 3), rng.randint(1, 3)
    return CompositionScores(rng.choice("QKV"), tensor(rng, (L, H, L, H)), tensor(rng, (L, H, L, H)), number(rng),
                             settings(rng))


def head_circuit(rng):
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    left, mid, right = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 5)
    A, B = tensor(rng, (left, mid), dtype, nan=False), tensor(rng, (mid, right), dtype, nan=False)
    return HeadCircuit(FactoredMatrix(A, B), rng.choice(["qk", "ov", "full_ov"]), Head(rng.randint(0, 9), rng.randint(0, 9)),
                       settings(rng), [text(rng) for _ in range(rng.randint(0, 2))])


def circuit_check(rng):
    L, H = rng.randint(1, 3), rng.randint(1, 3)
    return CircuitCheck(tensor(rng, (L, H)), tensor(rng, (L, H)), {l: text(rng) for l in range(L)},
                        {l: text(rng) for l in range(L)}, rng.choice([1e-4, number(rng, False)]), settings(rng))


def offset_profile(rng):
    n = rng.randint(1, 6)
    return OffsetProfile(text(rng), torch.tensor(sorted(rng.sample(range(-64, 65), n))), tensor(rng, (n,)),
                         tensor(rng, (n,)), settings(rng))


def kv_cache(rng):
    L = rng.randint(1, 4)
    return KVCache(text(rng), [rng.randint(0, 2**40) for _ in range(L)], [rng.randint(0, 2**40) for _ in range(L)],
                   rng.choice(["float32", "bfloat16", text(rng)]), settings(rng))


def activations(rng):
    n_heads = rng.randint(1, 4)
    tensors = {}
    for _ in range(rng.randint(0, 3)):
        name = rng.choice(sorted(NAMES))
        shape = [rng.randint(0, 2) for _ in range(4 if NAMES[name][1] != "lat" else 3)]
        tensors[(name, rng.randint(0, 5))] = tensor(rng, shape, rng.choice([torch.float32, torch.float64, torch.bfloat16]))
    return Activations(n_heads, tensors, settings(rng))


def path_effects(rng):
    L, H = rng.randint(1, 3), rng.randint(1, 3)
    R = rng.randint(1, 3)
    receivers = rng.sample([Head(l, h) for l in range(L) for h in range(H)], min(R, L * H))
    into = rng.sample(["q", "k", "v"], rng.randint(1, 3))
    metrics = {x: rng.choice(["induction", "direct-logit", text(rng)]) for x in into}
    effects = {x: tensor(rng, (len(receivers), L, H)) for x in into}
    clean = {x: tensor(rng, (len(receivers),)) for x in into}
    spear = {str(r): rng.choice([None, number(rng, False)]) for r in receivers if rng.random() < 0.5}
    labels = {str(h): [text(rng)] for h in heads(rng, L, H, rng.randint(0, 2))}
    return PathEffects(text(rng), text(rng), receivers, into, metrics, effects, clean, rng.choice(["exact", "attribution"]),
                       L, H, settings(rng), labels, spear,
                       rng.choice([None, tensor(rng, (len(receivers),))]))


def zoo(rng):
    return Zoo([{**settings(rng), "model": text(rng)} for _ in range(rng.randint(0, 3))], settings(rng),
               {text(rng): number(rng, False)})


def edge_scores(rng):
    model = text(rng)
    g = graph(rng, model, positions=True)
    scores = tensor(rng, (g.n_senders, g.n_receivers)).masked_fill(~g.valid, math.nan)
    per_group = (tensor(rng, (g.n_groups, g.n_senders, g.n_receivers)).masked_fill(~g.valid, math.nan)
                 if g.positions else None)
    return EdgeScores(g, scores, rng.choice(["eap", "eap-ig", "exact"]), rng.randint(0, 9), number(rng), number(rng),
                      settings(rng), model, settings(rng), {text(rng): number(rng, False)}, per_group)


def node_scores(rng):
    return NodeScores({text(rng): number(rng) for _ in range(rng.randint(0, 5))}, text(rng), text(rng), settings(rng))


def task_circuit(rng, model=None):
    model = text(rng) if model is None else model
    g = graph(rng, model)
    mask = g.valid & (torch.rand(g.n_senders, g.n_receivers, generator=torch.Generator().manual_seed(rng.randrange(99)))
                      < rng.random())
    scores = tensor(rng, (g.n_senders, g.n_receivers)).masked_fill(~mask, math.nan)   # the JSON keeps the circuit's
    pct = rng.choice([None, 5, 2.5, number(rng, False)])
    return TaskCircuit(g, mask, scores, rng.choice(["abs", "signed"]), pct, rng.randint(0, 99), model,
                       rng.choice(["top", "greedy"]))


def faithfulness(rng):
    sizes = sorted({rng.choice([0.1, 1.0, 2.5, 10.0, 100.0, number(rng, False)]) for _ in range(rng.randint(1, 4))})
    model = text(rng)
    c = task_circuit(rng, model)
    return Faithfulness({p: number(rng) for p in sizes}, {p: number(rng) for p in sizes},
                        {p: rng.randint(0, 99) for p in sizes}, number(rng), number(rng), number(rng), number(rng),
                        rng.choice(sizes), c, number(rng), c.heads, model, settings(rng),
                        {text(rng): number(rng, False)}, {},
                        rng.choice([{}, {"n": rng.randint(2, 9), "clean": number(rng), "corrupt": number(rng),
                                         "curve": {p: number(rng) for p in sizes}, "cpr": number(rng),
                                         "cmd": number(rng), "node_faithfulness": number(rng),
                                         "bootstrap": {"n": 200, "cpr": [number(rng, False)] * 2}}]))


def roles(rng):
    def evidence():
        return {"direct_effect": number(rng, False), "direct_share": number(rng, False),
                "node_effect": number(rng, False), "node_share": number(rng, False), **settings(rng)}

    names = ["name mover", "negative name mover", "minor", "unclassified", text(rng)]
    return Roles({f"{rng.randint(0, 9)}.{h}": {"role": rng.choice(names), "evidence": evidence(), "why": text(rng)}
                  for h in range(rng.randint(0, 3))}, text(rng), settings(rng))


def core_circuit(rng):
    nodes = [f"{rng.randint(0, 29)}.{h}" for h in range(rng.randint(0, 4))]
    mlps = [f"mlp{L}" for L in range(rng.randint(0, 2))]
    ranking = [(n, number(rng)) for n in nodes + mlps + [f"{rng.randint(0, 9)}.9"]]
    held = rng.choice([{}, {"n": rng.randint(2, 99), "f": number(rng), "interval": [number(rng), number(rng)],
                             "clean": number(rng), "corrupt": number(rng), "enough": rng.random() < 0.5}])
    return CoreCircuit(nodes, mlps, number(rng), {rng.randint(1, 30): number(rng) for _ in range(rng.randint(0, 4))},
                       text(rng), ranking, nodes[:1], number(rng), number(rng), rng.choice([0.8, 0.3999996]),
                       text(rng), settings(rng), {text(rng): number(rng, False)},
                       rng.choice([[], [number(rng), number(rng)]]), held, rng.choice(["interval", "none"]),
                       {n: number(rng) for n in nodes}, [[rng.randint(0, 9), rng.randint(0, 3), number(rng), number(rng)]
                                                          for _ in range(rng.randint(0, 3))])


def stability(rng):
    nodes = [f"{rng.randint(0, 29)}.{h}" for h in range(rng.randint(0, 4))] + ["mlp3"]
    draws = [{"draw": i, "seed": rng.choice([None, rng.randint(0, 9)]), "template": rng.choice([None, 2]),
              "resampled": rng.random() < 0.5, "n": rng.randint(2, 64), "heads": nodes[:-1], "mlps": nodes[-1:],
              "f": number(rng), "interval": [number(rng), number(rng)], "holdout_f": number(rng),
              "template_f": number(rng)} for i in range(rng.randint(1, 3))]
    summ = {"mean": number(rng), "min": number(rng), "pairs": rng.randint(0, 3)}
    return Stability(draws, {n: number(rng, False) for n in nodes}, {"nodes": dict(summ), "edges": dict(summ)},
                     {h: {rng.choice(["name mover", "-", text(rng)]): number(rng, False)} for h in nodes[:-1]},
                     {"heads": nodes[:-1], "mlps": ["mlp3"], "share": 0.8, "holdout_f": number(rng),
                      "interval": [number(rng), number(rng)]}, text(rng), settings(rng), {text(rng): number(rng, False)})


def attribution(rng):
    n_rows = rng.randint(1, 3)
    qn = [f"q{i}{text(rng)}" for i in range(rng.randint(1, 3))]
    kn = [f"k{i}{text(rng)}" for i in range(rng.randint(1, 3))]
    rows = [{"prompt": rng.randint(0, 9), "query": rng.randint(0, 9), "key": rng.randint(0, 9),
             "attention": number(rng, False), "tokens": [text(rng)]} for _ in range(n_rows)]
    pq, pk = qn[:2] + ["other"], kn[:2] + ["other"]
    expanded = [{"source": rng.choice(kn), "side": "key", "offset": rng.randint(-3, 0), "share": number(rng, False),
                 "whole": number(rng, False), "example": text(rng)} for _ in range(rng.randint(0, 2))]
    return Attribution(text(rng), f"{rng.randint(0, 9)}.{rng.randint(0, 9)}", rng.choice(["raw", "contrast", "versus"]),
                       rows, qn, kn, tensor(rng, (n_rows, len(qn)), torch.float64),
                       tensor(rng, (n_rows, len(kn)), torch.float64), pq, pk,
                       tensor(rng, (len(pq), len(pk)), torch.float64), number(rng), settings(rng), expanded)


def circuit_report(rng):
    edges = [[f"{rng.randint(0, 9)}.{rng.randint(0, 3)}", rng.choice(["logits", "mlp3", "5.kv0"]), rng.choice(["q", "in"]),
              number(rng)] for _ in range(rng.randint(0, 4))]
    data = {"model": text(rng), "task": text(rng), "curve": {f"{p:g}": number(rng) for p in (0.1, 5, 100)},
            "circuit": {"edges": edges, "heads": sorted({e[0] for e in edges}), "named": rng.random() < 0.5},
            "roles": {f"{rng.randint(0, 9)}.1": {"role": text(rng), "why": text(rng), "evidence": settings(rng)}},
            "warnings": [text(rng) for _ in range(rng.randint(0, 2))], "summary": [text(rng), text(rng)],
            **rng.choice([{}, {"core": {"heads": ["1.0"], "mlps": [], "node_faithfulness": number(rng)}}]),
            "extra": json_data(rng)}
    return CircuitReport(data)


GENERATORS: Dict[type, Callable[[random.Random], Any]] = {
    HeadScores: head_scores, HeadEffects: head_effects, GroupEffect: group_effect, RandomComparison: random_comparison,
    HeadDiagnostics: head_diagnostics, CompositionScores: composition_scores, HeadCircuit: head_circuit,
    CircuitCheck: circuit_check, OffsetProfile: offset_profile, KVCache: kv_cache, Activations: activations,
    PathEffects: path_effects, Zoo: zoo, EdgeScores: edge_scores, NodeScores: node_scores, TaskCircuit: task_circuit,
    Faithfulness: faithfulness, Roles: roles, Attribution: attribution, CoreCircuit: core_circuit,
    Stability: stability, CircuitReport: circuit_report,
}
