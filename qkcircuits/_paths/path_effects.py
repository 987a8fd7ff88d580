"""Path-patching results as data: per receiver head and input (q, k, v), one effect per sender head.

>>> res = qk.path_patch(model, "1.0")                    # doctest: +SKIP
>>> res.top("1.0", "k", 3)                               # doctest: +SKIP  [(Head(0, 0), 0.97), ...]
>>> res.baseline("1.0", "k")                             # doctest: +SKIP  {"mean": 0.003, "p95": 0.01}
>>> res.to_frame()                                       # doctest: +SKIP  one row per (receiver, input, sender)
>>> PathEffects.from_json(res.to_json())                 # doctest: +SKIP  the JSON contract of ``qkcircuits trace``

``effects[input]`` is ``Float[Tensor, "receiver layer head"]``: the effect of sender (layer, head)
on that input of receiver ``receivers[i]``, NaN where (layer, head) is not a sender of that
receiver (same or later layer, or not in ``senders``). A positive effect always means "this path
matters": clean − patched for a score, patched − clean for a loss (``higher_is_better``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.display import Displayed
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import check_int, dump_json, json_number, load_json

INPUTS = ("q", "k", "v")
SCHEMA = "qkcircuits.path_effects/1"


def _check_input(x: str) -> str:
    if x not in INPUTS:
        raise QKCircuitsError(f"unknown receiver input {x!r}; choose from q, k, v")
    return x


@dataclass(repr=False)      # the repr comes from Displayed (_foundation.display)
class PathEffects(Displayed):
    """What ``path_patch`` / ``edge_attribution`` / ``trace_induction`` measured; see the module docstring.

    ``clean[input]`` is ``Float[Tensor, "receiver"]``: the receiver's metric on the clean run.
    ``metrics`` names the metric per input; ``kind`` is ``"exact"`` (path patching) or
    ``"attribution"`` (first-order estimate). ``labels`` (sender scan labels) and
    ``k_composition_spearman`` (per receiver) are filled by ``trace_induction``.
    """

    model: str
    method: str
    receivers: List[Head]
    into: List[str]
    metrics: Dict[str, str]
    effects: Dict[str, Float[Tensor, "receiver layer head"]]
    clean: Dict[str, Float[Tensor, "receiver"]]
    kind: str = "exact"
    n_layers: int = 0
    n_heads: int = 0
    settings: Dict[str, Any] = field(default_factory=dict)
    labels: Dict[str, List[str]] = field(default_factory=dict)
    k_composition_spearman: Dict[str, Optional[float]] = field(default_factory=dict)
    # [receiver] the receiver's clean induction attention: the JSON's "clean" (issue 10's contract), whatever
    # ``into`` and ``metrics`` are; None when the producer did not compute it (then an induction-metric input's)
    clean_attention: Optional[Float[Tensor, "receiver"]] = None

    # ------------------------------------------------------------------------------------- access
    def _index(self, receiver) -> int:
        r = Head.parse(receiver)
        try:
            return self.receivers.index(r)
        except ValueError:
            raise QKCircuitsError(f"{r} is not a receiver here; receivers: "
                                  f"{', '.join(str(h) for h in self.receivers)}") from None

    def _row(self, receiver, into: str) -> Tensor:
        _check_input(into)
        if into not in self.effects:
            raise QKCircuitsError(f"input {into!r} was not patched; patched: {', '.join(self.into)}")
        return self.effects[into][self._index(receiver)]

    def senders(self, receiver) -> List[Head]:
        """The heads measured as senders of ``receiver`` (non-NaN entries), layer by layer."""
        row = self._row(receiver, self.into[0])
        return [Head(int(l), int(h)) for l, h in (~row.isnan()).nonzero().tolist()]

    def top(self, receiver, into: str = "k", k: int = 5) -> List[Tuple[Head, float]]:
        """The ``k`` senders with the largest effect on ``into`` of ``receiver``, largest first."""
        check_int("k", k)
        row = self._row(receiver, into)
        flat = torch.nan_to_num(row.flatten(), nan=-math.inf)
        n = int((~row.isnan()).sum())
        vals, idx = flat.topk(min(k, n)) if n else (flat[:0], flat[:0].long())
        H = row.shape[1]
        return [(Head(int(i) // H, int(i) % H), float(v)) for v, i in zip(vals, idx)]

    def baseline(self, receiver, into: str = "k") -> Dict[str, float]:
        """Mean and 95th percentile of the effect over all senders of ``receiver`` (the "typical head")."""
        row = self._row(receiver, into)
        vals = row[~row.isnan()].double()
        if not len(vals):
            return {"mean": float("nan"), "p95": float("nan")}
        return {"mean": float(vals.mean()), "p95": float(torch.quantile(vals, 0.95))}

    def clean_value(self, receiver, into: str = "k") -> float:
        return float(self.clean[_check_input(into)][self._index(receiver)])

    # ------------------------------------------------------------------------------------- frames and JSON
    def to_frame(self):
        """A pandas DataFrame, one row per (receiver, input, sender): effect, clean metric, metric name."""
        import pandas as pd

        rows = []
        for i, r in enumerate(self.receivers):
            for x in self.into:
                for s in self.senders(r):
                    rows.append({"receiver": str(r), "input": x, "sender": str(s),
                                 "effect": float(self.effects[x][i, s.layer, s.head]),
                                 "clean": float(self.clean[x][i]), "metric": self.metrics[x],
                                 "labels": ",".join(self.labels.get(str(s), []))})
        return pd.DataFrame(rows)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON contract: ``receivers[r][input]`` maps every sender "layer.head" to its effect."""
        recv: Dict[str, Any] = {}
        for i, r in enumerate(self.receivers):
            d: Dict[str, Any] = {"clean": self._clean_attention(i)}
            for x in self.into:
                d[x] = {str(s): json_number(self.effects[x][i, s.layer, s.head]) for s in self.senders(r)}
            d["baseline"] = {x: {k: json_number(v) for k, v in self.baseline(r, x).items()} for x in self.into}
            d["clean_metric"] = {x: json_number(self.clean[x][i]) for x in self.into}
            if str(r) in self.k_composition_spearman:
                v = self.k_composition_spearman[str(r)]
                d["k_composition_spearman"] = None if v is None else json_number(v)
            recv[str(r)] = d
        return {"schema": SCHEMA, "model": self.model, "method": self.method, "kind": self.kind,
                "metrics": {x: self.metrics[x] for x in self.into}, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "receivers": recv, "labels": self.labels, "settings": self.settings}

    def _clean_attention(self, i: int) -> Optional[float]:
        """Receiver i's clean induction attention, or None when nothing here measured it."""
        if self.clean_attention is not None:
            return json_number(self.clean_attention[i])
        for x in ("k", "q"):
            if x in self.clean and self.metrics.get(x) == "induction":
                return json_number(self.clean[x][i])
        return None

    def to_json(self, path: Optional[Union[str, Path]] = None, indent: int = 1) -> str:
        """JSON text (written atomically to ``path`` when given); NaN as ``null``."""
        return dump_json(self.to_dict(), path, indent)

    @classmethod
    def from_json(cls, text_or_path: Union[str, Path]) -> "PathEffects":
        d = load_json(text_or_path, "a trace's --json output", schema=SCHEMA)
        try:
            L, H = int(d["n_layers"]), int(d["n_heads"])
            receivers = [Head.parse(r) for r in d["receivers"]]
            into = [x for x in INPUTS if x in d["metrics"]]
            effects = {x: torch.full((len(receivers), L, H), float("nan")) for x in into}
            clean = {x: torch.full((len(receivers),), float("nan")) for x in into}
            spear: Dict[str, Optional[float]] = {}
            attn = torch.full((len(receivers),), float("nan"))
            for i, (name, rd) in enumerate(d["receivers"].items()):
                attn[i] = float("nan") if rd.get("clean") is None else float(rd["clean"])
                for x in into:
                    for s, v in rd[x].items():
                        h = Head.parse(s)
                        effects[x][i, h.layer, h.head] = float("nan") if v is None else float(v)
                    cm = rd.get("clean_metric", {}).get(x)
                    clean[x][i] = float("nan") if cm is None else float(cm)
                if "k_composition_spearman" in rd:
                    spear[name] = rd["k_composition_spearman"]
            return cls(model=d["model"], method=d["method"], receivers=receivers, into=into,
                       metrics=dict(d["metrics"]), effects=effects, clean=clean, kind=d.get("kind", "exact"),
                       n_layers=L, n_heads=H, settings=d.get("settings", {}), labels=d.get("labels", {}),
                       k_composition_spearman=spear, clean_attention=attn)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError) as e:
            raise QKCircuitsError(f"not a qkcircuits trace JSON ({type(e).__name__}: {e}); expected the keys model, "
                                  f"method, metrics, n_layers, n_heads, receivers") from None

    # ------------------------------------------------------------------------------------- display
    def summary(self, receiver, into: str = "k") -> str:
        """One line, e.g. "1.0 reads its keys from 0.0 (previous-token; effect 0.80 of the clean 0.86; next
        sender 0.05; baseline mean 0.01)"."""
        r = Head.parse(receiver)
        word = {"q": "queries", "k": "keys", "v": "values"}[_check_input(into)]
        top = self.top(r, into, 2)
        if not top:
            return f"{r} has no earlier heads to read its {word} from"
        (s, e), nxt = top[0], (top[1][1] if len(top) > 1 else float("nan"))
        lab = ", ".join(self.labels.get(str(s), [])) or "no label"
        b = self.baseline(r, into)
        return (f"{r} reads its {word} from {s} ({lab}; effect {e:.2f} of the clean {self.clean_value(r, into):.2f}; "
                f"next sender {nxt:.2f}; baseline mean {b['mean']:.2f})")

