"""Per-head results as data: [n_layers, n_heads] tensors plus the settings that produced them.

>>> s = HeadScores.from_json(qk.scan(model, scores="induction", progress=False).to_json())
>>> [(h, round(v, 4)) for h, v in s.top(1, "induction")]    # the same object a plot, a report and a test read
[(Head(layer=1, head=0), 1.0)]
>>> [int(x) for x in s.to_frame().sort_values("induction").iloc[-1][["layer", "head"]]]   # one row per head
[1, 0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation import display as show
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import check_int, json_floats, read_floats
from .._foundation.result import Result

SCHEMA = "qkcircuits.head_scores/1"


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class HeadScores(Result):
    """Named per-head scores, each ``Float[Tensor, "layer head"]`` on the CPU.

    ``thresholds`` maps a label (e.g. ``"induction"``) to ``(score name, minimum)``; a head gets
    the label when its score reaches the minimum. ``settings`` records the model, prompt sets,
    seeds and library versions. ``extras`` holds further data (e.g. causal confirmation).
    """

    SCHEMA = SCHEMA
    WHAT = "a scan's --json output (qkcircuits scores JSON)"
    KEYS = ("model", "n_layers", "n_heads", "scores")

    model: str
    n_layers: int
    n_heads: int
    scores: Dict[str, Float[Tensor, "layer head"]]
    settings: Dict[str, Any] = field(default_factory=dict)
    thresholds: Dict[str, Tuple[str, float]] = field(default_factory=dict)
    extras: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, t in self.scores.items():
            if tuple(t.shape) != (self.n_layers, self.n_heads):
                raise QKCircuitsError(f"score {name!r} has shape {tuple(t.shape)}, expected "
                                      f"({self.n_layers}, {self.n_heads})")

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.scores[name]
        except KeyError:
            raise QKCircuitsError(f"no score named {name!r}; available: {', '.join(self.scores)}") from None

    def top(self, k: int = 5, score: str = "induction") -> List[Tuple[Head, float]]:
        """The ``k`` highest-scoring heads for ``score`` (NaN scores last), best first."""
        check_int("k", k)
        flat = torch.nan_to_num(self[score].flatten(), nan=-math.inf)
        vals, idx = flat.topk(min(k, flat.numel()))
        return [(Head(int(i) // self.n_heads, int(i) % self.n_heads), float(self[score].flatten()[i]))
                for v, i in zip(vals, idx)]

    def labels(self) -> Dict[Head, List[str]]:
        """Each head that reaches at least one threshold, with its labels."""
        out: Dict[Head, List[str]] = {}
        for label, (score, minimum) in self.thresholds.items():
            if score not in self.scores:
                continue
            for layer, head in (self.scores[score] >= minimum).nonzero().tolist():
                out.setdefault(Head(layer, head), []).append(label)
        return dict(sorted(out.items()))

    def heads_labelled(self, label: str) -> List[Head]:
        return [h for h, labels in self.labels().items() if label in labels]

    def to_frame(self):
        """A pandas DataFrame, one row per head: layer, head, every score, and ``labels``."""
        import pandas as pd

        labels = self.labels()
        rows = []
        for layer in range(self.n_layers):
            for head in range(self.n_heads):
                row: Dict[str, Any] = {"layer": layer, "head": head}
                row.update({name: float(t[layer, head]) for name, t in self.scores.items()})
                row["labels"] = ",".join(labels.get(Head(layer, head), []))
                rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": SCHEMA, "model": self.model, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "settings": self.settings,
            "thresholds": {k: [s, m] for k, (s, m) in self.thresholds.items()},
            "scores": {name: json_floats(t) for name, t in self.scores.items()},       # exact: labels survive
            "labels": {str(h): v for h, v in self.labels().items()},
            "extras": self.extras,
        }

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "HeadScores":
        scores = {k: read_floats(v).reshape(int(d["n_layers"]), int(d["n_heads"])) for k, v in d["scores"].items()}
        return cls(model=d["model"], n_layers=int(d["n_layers"]), n_heads=int(d["n_heads"]), scores=scores,
                   settings=d.get("settings", {}),
                   thresholds={k: (v[0], float(v[1])) for k, v in d.get("thresholds", {}).items()},
                   extras=d.get("extras", {}))

    # ------------------------------------------------------------------------------------------ display
    def _lines(self) -> List[Tuple[str, str, float, int, List[Tuple[str, float]]]]:
        """(label, score, minimum, heads labelled, top heads) per threshold whose score is here."""
        counts: Dict[str, int] = {}
        for names in self.labels().values():
            for n in names:
                counts[n] = counts.get(n, 0) + 1
        return [(label, score, minimum, counts.get(label, 0), show.top_heads(self.scores[score]))
                for label, (score, minimum) in self.thresholds.items() if score in self.scores]

    def _text(self) -> str:
        return (f"HeadScores({self.model}: {self.n_layers} layers x {self.n_heads} heads; scores {', '.join(self.scores)}"
                + "".join(f"; {lab}: {n} head{'s' * (n != 1)} >= {show.number(m)}, top {show.heads_text(top[:3])}"
                          for lab, _, m, n, top in self._lines()) + ")")

    def _html(self) -> str:
        lines = self._lines()
        labelled = [s for _, s, _, _, _ in lines]
        rows = [(lab, f"{s} ≥ {show.number(m)}", str(n), show.heads_text(top)) for lab, s, m, n, top in lines]
        rows += [("", name, "", show.heads_text(show.top_heads(t))) for name, t in self.scores.items()
                 if name not in set(labelled)]
        shown = labelled + [n for n in self.scores if n not in set(labelled)]
        grids = "".join(show.grid(self.scores[n], n) for n in shown[:show.MAX_GRIDS])
        return show.box(f"HeadScores: {self.model}, {self.n_layers} layers × {self.n_heads} heads",
                        show.table(rows, ("label", "threshold", "heads", f"top {show.TOP} (score)")), grids)
