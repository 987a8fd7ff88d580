"""Path-patching results as data: per receiver head and input (q, k, v), one effect per sender head.

>>> res = qk.path_patch(model, "1.0", progress=False)
>>> [(str(h), round(e, 2)) for h, e in res.top(1, receiver="1.0", into="k")]
[('0.0', 1.0)]
>>> {k: round(v, 2) for k, v in res.baseline("1.0", "k").items()}     # the typical sender: mean, 95th percentile
{'mean': 0.5, 'p95': 0.95}
>>> res.to_frame().shape                          # one row per (receiver, input, sender): 1 x 3 x 2
(6, 7)
>>> PathEffects.from_json(res.to_json()).to_json() == res.to_json()   # the JSON contract of ``qkcircuits trace``
True

``effects[input]`` is ``Float[Tensor, "receiver layer head"]``: the effect of sender (layer, head)
on that input of receiver ``receivers[i]``, NaN where (layer, head) is not a sender of that
receiver (same or later layer, or not in ``senders``). A positive effect always means "this path
matters": clean − patched for a score, patched − clean for a loss (``higher_is_better``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation import display as show
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import check_int, json_number, read_float
from .._foundation.result import Result

INPUTS = ("q", "k", "v")
SCHEMA = "qkcircuits.path_effects/1"
# A receiver "reads" an input from a sender only when the sender's effect is at least this share of the receiver's
# own clean metric (|clean|) AND above the 95th percentile of all its senders (docs/mechanism.md): "5.2 reads its
# values from 4.1" for an effect of 0.01 against a clean -0.14 (7 %), or 0.04 of 11.86, said more than the numbers.
READS_FROM = 0.10
# When the weights-only K-composition ranking and the run's key sources disagree (Spearman below AGREE), which to trust:
AGREE = 0.5
COMPOSITION_VS_RUN = ("weights-only K-composition and the path patching above disagree: trust the path patching for "
                      "where this head's keys come from (it measures what the run writes and the head reads on these "
                      "prompts); K-composition scores what W_K could read of each earlier head's W_O for any input, "
                      "including directions the run never writes")


def _decimals(scale: float) -> int:
    """Decimals that show a value to two significant digits of ``scale`` (at least 2): 0.88 → 2, 0.0094 → 4."""
    a = abs(float(scale))
    return 2 if not (a == a and 0 < a < math.inf) else max(2, 1 - math.floor(math.log10(a)))


def _check_input(x: str) -> str:
    if x not in INPUTS:
        raise QKCircuitsError(f"unknown receiver input {x!r}; choose from q, k, v")
    return x


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class PathEffects(Result):
    """What ``path_patch`` / ``edge_attribution`` / ``trace_induction`` measured; see the module docstring.

    ``clean[input]`` is ``Float[Tensor, "receiver"]``: the receiver's metric on the clean run.
    ``metrics`` names the metric per input; ``kind`` is ``"exact"`` (path patching) or
    ``"attribution"`` (first-order estimate). ``labels`` (sender scan labels) and
    ``k_composition_spearman`` (per receiver) are filled by ``trace_induction``.
    """

    SCHEMA = SCHEMA
    WHAT = "a qkcircuits trace JSON (a trace's --json output)"
    KEYS = ("model", "method", "metrics", "n_layers", "n_heads", "receivers")

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

    def top(self, k: int = 5, *, receiver: Any = None, into: str = "k") -> List[Tuple[Head, float]]:
        """The ``k`` senders with the largest effect on input ``into`` of ``receiver`` (default the first
        receiver), largest first."""
        check_int("k", k)
        row = self._row(self.receivers[0] if receiver is None else receiver, into)
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

    def reads(self, receiver, into: str, effect: float) -> bool:
        """Whether an effect on ``receiver``'s ``into`` is large enough to say it "reads from" its sender:
        ≥ ``READS_FROM`` × |the receiver's clean metric| and above the 95th percentile of its senders."""
        clean = self.clean_value(receiver, into)
        floor = READS_FROM * abs(clean) if clean == clean else 0.0
        p95 = self.baseline(receiver, into)["p95"]
        return effect > 0 and effect >= floor and not (p95 == p95 and effect <= p95)

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
            measured = ~torch.stack([self.effects[x][i].isnan() for x in self.into]).all(0)    # any input's
            senders = [Head(int(l), int(h)) for l, h in measured.nonzero().tolist()]
            for x in self.into:          # exact numbers (json_number); a NaN of one input among others' values: null
                d[x] = {str(s): json_number(self.effects[x][i, s.layer, s.head]) for s in senders}
            d["baseline"] = {x: {k: json_number(v) for k, v in self.baseline(r, x).items()} for x in self.into}
            d["clean_metric"] = {x: json_number(self.clean[x][i]) for x in self.into}
            if str(r) in self.k_composition_spearman:
                v = self.k_composition_spearman[str(r)]
                d["k_composition_spearman"] = None if v is None else json_number(v)
            recv[str(r)] = d
        # "clean" per receiver is the clean induction attention (the contract); "clean_attention" says whether it was
        # measured as such (the field) or read off an induction metric, so that from_json rebuilds the same field
        return {"schema": SCHEMA, "model": self.model, "method": self.method, "kind": self.kind,
                "metrics": {x: self.metrics[x] for x in self.into}, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "receivers": recv, "labels": self.labels, "settings": self.settings,
                "clean_attention": self.clean_attention is not None}

    def _clean_attention(self, i: int) -> Optional[float]:
        """Receiver i's clean induction attention, or None when nothing here measured it."""
        if self.clean_attention is not None:
            return json_number(self.clean_attention[i])
        for x in ("k", "q"):
            if x in self.clean and self.metrics.get(x) == "induction":
                return json_number(self.clean[x][i])
        return None

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "PathEffects":
        L, H = int(d["n_layers"]), int(d["n_heads"])
        receivers = [Head.parse(r) for r in d["receivers"]]
        into = list(d["metrics"])           # in the order written (= the result's ``into``)
        if any(x not in INPUTS for x in into):
            raise QKCircuitsError(f"metrics name inputs {into}; inputs are {', '.join(INPUTS)}")
        effects = {x: torch.full((len(receivers), L, H), float("nan")) for x in into}
        clean = {x: torch.full((len(receivers),), float("nan")) for x in into}
        spear: Dict[str, Optional[float]] = {}
        attn = torch.full((len(receivers),), float("nan"))
        for i, (name, rd) in enumerate(d["receivers"].items()):
            attn[i] = read_float(rd.get("clean"))
            for x in into:
                for s, v in rd[x].items():
                    h = Head.parse(s)
                    effects[x][i, h.layer, h.head] = read_float(v)
                clean[x][i] = read_float(rd.get("clean_metric", {}).get(x))
            if "k_composition_spearman" in rd:
                spear[name] = rd["k_composition_spearman"]
        return cls(model=d["model"], method=d["method"], receivers=receivers, into=into,
                   metrics=dict(d["metrics"]), effects=effects, clean=clean, kind=d.get("kind", "exact"),
                   n_layers=L, n_heads=H, settings=d.get("settings", {}), labels=d.get("labels", {}),
                   k_composition_spearman=spear, clean_attention=attn if d.get("clean_attention", True) else None)

    # ------------------------------------------------------------------------------------- display
    def summary(self, receiver, into: str = "k") -> str:
        """One line, e.g. "1.0 reads its keys from 0.0 (previous-token; effect 0.80 = 93 % of the clean 0.86; next
        sender 0.05; baseline mean 0.01)"; when no sender passes ``reads`` (≥ ``READS_FROM`` of the clean value
        and above p95), it says so, names the largest and which condition it misses, instead of claiming a source.
        Numbers carry two significant digits of the clean value (0.0012 of 0.0094, not 0.00 of 0.01), so the
        sentence shows the comparison it makes."""
        r = Head.parse(receiver)
        word = {"q": "queries", "k": "keys", "v": "values"}[_check_input(into)]
        top = self.top(2, receiver=r, into=into)
        if not top:
            return f"{r} has no earlier heads to read its {word} from"
        (s, e), nxt = top[0], (top[1][1] if len(top) > 1 else float("nan"))
        lab = ", ".join(self.labels.get(str(s), [])) or "no label"
        b = self.baseline(r, into)
        clean = self.clean_value(r, into)
        d = _decimals(clean)
        share = f"{e / abs(clean):.0%}" if clean == clean and clean != 0 else "n/a"
        if not self.reads(r, into, e):
            floor = READS_FROM * abs(clean) if clean == clean else 0.0
            why = ("is not above zero" if e <= 0 else
                   f"is {share} of the clean {clean:.{d}f}, under {READS_FROM:.0%}" if e < floor else
                   f"is not above the other senders (p95 {b['p95']:.{d}f})")
            return f"{r} reads its {word} from no single earlier head: the largest effect, {s} ({lab}) {e:.{d}f}, {why}"
        return (f"{r} reads its {word} from {s} ({lab}; effect {e:.{d}f} = {share} of the clean {clean:.{d}f}; "
                f"next sender {nxt:.{d}f}; baseline mean {b['mean']:.{d}f})")

    def _text(self) -> str:
        first = [(rc, x) for rc in self.receivers[:3] for x in self.into if self.top(1, receiver=rc, into=x)]
        tops = "; ".join(f"{rc}<-{t[0]} {x} {show.number(t[1], 3)}"
                         for rc, x in first[:6] for t in self.top(1, receiver=rc, into=x))
        more = f"; ... {len(self.receivers) - 3} more receivers" if len(self.receivers) > 3 else ""
        return (f"PathEffects({self.kind}, {self.model}: {len(self.receivers)} receiver"
                f"{'s' * (len(self.receivers) != 1)}, into {','.join(self.into)}, {self.method}; top senders: "
                f"{tops}{more})")

    def _html(self) -> str:
        """Per receiver and input the top senders (effect, baseline); grids of the first receivers' effects."""
        shown = self.receivers[:3 * show.TOP]                # at most 15 receivers × 3 inputs rows
        rows = []
        for rc in shown:
            for x in self.into:
                b, top3 = self.baseline(rc, x), self.top(3, receiver=rc, into=x)
                rows.append((str(rc), x, show.number(self.clean_value(rc, x)),
                             show.heads_text([(str(h), v) for h, v in top3]),
                             f"{show.number(b['mean'])} / {show.number(b['p95'])}",
                             ", ".join(self.labels.get(str(top3[0][0]), [])) if top3 else ""))
        if len(self.receivers) > len(shown):
            rows.append((f"… {len(self.receivers) - len(shown)} more receivers", "", "", "", "", ""))
        x0 = "k" if "k" in self.effects else self.into[0]
        grids = "".join(show.grid(self.effects[x0][i], f"{rc} ← senders ({x0})", True)
                        for i, rc in enumerate(self.receivers[:show.MAX_GRIDS]))
        return show.box(f"PathEffects ({self.kind}): {self.model}, method {self.method}, {self.n_layers} layers × "
                        f"{self.n_heads} heads",
                        show.table(rows, ("receiver", "input", "clean", "top 3 senders (effect)",
                                          "baseline mean / p95", "top sender's labels")), grids)
