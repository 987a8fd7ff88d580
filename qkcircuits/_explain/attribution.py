"""``Attribution``: what ``qk.attend`` returns — a head's score on some rows split into (query source, key source)
pairs, with the two marginals, per-row values and how exactly the parts rebuild the model's own attention.

>>> r = qk.attend(model, "0.0", torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), query=4, key=3)
>>> round(r.total, 2), [(n, round(s, 2)) for n, _, s in r.key_sources(1)]   # it attends by position
(30.0, [('pos', 1.0)])
>>> r.exact_error < 1e-5
True

Values are the reading's (``raw``, ``contrast`` or ``versus``; see ``attend``) averaged over rows, in score units
(after the layer's scale). ``share`` = value / total: shares of one side add up to 1 (a source working against
the choice has a negative share). The pair table keeps the ``KEEP`` largest sources of each side and one
``other`` row and column holding the rest, so its entries still add up to the total exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation import display as show
from .._foundation.io import json_floats, json_number, read_float, read_floats
from .._foundation.model import model_name
from .._foundation.model_cache import remembered
from .._foundation.result import Result
from . import words

KEEP = 40            # sources per side in the pair table (the rest in "other")


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Attribution(Result):
    """``query_values``/``key_values`` [rows, sources]: each row's marginal per source (its pairs summed over the
    other side); ``pair_values`` [Nq + 1, Nk + 1] the mean pair values over the kept sources (``pair_query`` /
    ``pair_key`` name them, "other" last); ``rows``: per row its prompt, positions, tokens, attention and value;
    ``expanded``: per expanded head source and offset, the value and share of what it read there."""

    SCHEMA = "qkcircuits.attribution/1"
    WHAT = "a qkcircuits attend JSON (qkcircuits attend --json)"
    KEYS = ("model", "head", "reading", "rows", "attention", "total", "exact_error", "query_sources", "key_sources",
            "pairs", "settings")

    model: str
    head: str
    reading: str
    rows: List[Dict[str, Any]]
    query_names: List[str]
    key_names: List[str]
    query_values: Tensor
    key_values: Tensor
    pair_query: List[str]
    pair_key: List[str]
    pair_values: Tensor
    exact_error: float
    settings: Dict[str, Any]
    expanded: List[Dict[str, Any]] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------ numbers
    @property
    def total(self) -> float:
        """The reading, averaged over rows (= the sum of either side's sources)."""
        return float(self.key_values.sum(1).mean())

    @property
    def attention(self) -> float:
        """The head's mean attention from the query to the key position over the rows."""
        return float(sum(r["attention"] for r in self.rows) / max(1, len(self.rows)))

    def _side(self, names: List[str], values: Tensor, k: Optional[int]) -> List[Tuple[str, float, float]]:
        mean = values.mean(0)
        total = float(mean.sum())
        order = sorted(range(len(names)), key=lambda n: -abs(float(mean[n])))
        out = [(names[n], float(mean[n]), _share(float(mean[n]), total)) for n in order]
        return out if k is None else out[:k]

    def query_sources(self, k: Optional[int] = None) -> List[Tuple[str, float, float]]:
        """(source, value, share) on the query side, largest |value| first (all, or the first ``k``)."""
        return self._side(self.query_names, self.query_values, k)

    def key_sources(self, k: Optional[int] = None) -> List[Tuple[str, float, float]]:
        """(source, value, share) on the key side, largest |value| first."""
        return self._side(self.key_names, self.key_values, k)

    def pairs(self, k: Optional[int] = 10) -> List[Tuple[str, str, float, float]]:
        """(query source, key source, value, share), largest |value| first, among the kept sources."""
        total = self.total
        cells = [(a, b, float(self.pair_values[i, j])) for i, a in enumerate(self.pair_query)
                 for j, b in enumerate(self.pair_key) if a != "other" and b != "other"]
        cells.sort(key=lambda c: -abs(c[2]))
        out = [(a, b, v, _share(v, total)) for a, b, v in cells]
        return out if k is None else out[:k]

    def top(self, k: int = 5) -> List[Tuple[Any, float]]:
        """The ``k`` largest pairs as ((query source, key source), value)."""
        return [((a, b), v) for a, b, v, _ in self.pairs(k)]

    def label(self, source: str) -> str:
        lab = self.settings.get("labels", {}).get(source)
        return f"{source} ({lab})" if lab else source

    # ------------------------------------------------------------------------------------------ words
    def attends(self) -> bool:
        """Whether the head attends its key here (``words.verdict``): attention at least ``words.MIN_ATTENTION`` and,
        for the contrast and versus readings, a positive total. Otherwise no sentence says why it attends."""
        return words.verdict(self.attention, self.total, self.reading) is None

    def sentences(self, k: int = 3) -> List[str]:
        """What a researcher can quote: where the head attends, which sources shape its key and its query (and how
        much of the total the listed ones cover), the top pair, how exact the split is, and what the expansion
        found above noise. A head that does not attend its key (``attends``) is said so, with values in score
        units instead of shares."""
        what = {"raw": "score", "contrast": "contrast (score at the key minus the mean over the other keys)",
                "versus": "score at the key minus the score at the versus position"}[self.reading]
        total, shares = self.total, words.shares_shown(self.total)

        def amount(v: float, s: float) -> str:
            return _pct(s) if shares else f"{v:+.3g}"

        def side(items):
            return ", ".join(f"{self.label(n)} {amount(v, s)}" for n, v, s in items[:k]) + \
                f" ({words.coverage([v for _, v, _ in items], k, total)})"

        no = words.verdict(self.attention, total, self.reading)
        rows = f"{self.settings.get('rows', '')}{self.prompts_text()}"
        if no is None:
            out = [f"{self.head} attends {rows} (attention {self.attention:.2f}, {len(self.rows)} rows); {what}: "
                   f"{show.number(total)}."]
        else:
            out = [f"{self.head} {no} ({rows}, {len(self.rows)} rows); {what}: {show.number(total)}. What follows is "
                   f"what sets that {self.reading}, not why the head attends"
                   + ("" if shares else "; in score units, not shares of a negative total") + "."]
        out += [f"Key side: {side(self.key_sources())}.", f"Query side: {side(self.query_sources())}."]
        top = self.pairs(1)
        if top:
            a, b, v, s = top[0]
            out.append(f"Top pair: query {self.label(a)} x key {self.label(b)} ("
                       + (f"{_pct(s)}, {show.number(v)}" if shares else show.number(v)) + ").")
        out.append(f"Exact to {self.exact_error:.1e} (softmax of the rebuilt rows vs the model's pattern"
                   f"{', and the captured scores' if self.settings.get('score_error') else ''}).")
        out += self._expansion_sentences()
        for c in self.settings.get("caveats", []):
            out.append(f"Caveat: {c}.")
        return out

    def prompts_text(self) -> str:
        """ " on ioi (n 32, seed 0)": the prompts the rows come from, where the command recorded them."""
        p = self.settings.get("prompts")
        if not isinstance(p, dict) or not p.get("task"):
            return ""
        bits = [f"{key} {p[key]}" for key in ("n", "seed") if p.get(key) is not None]
        return f" on {p['task']}" + (f" ({', '.join(bits)})" if bits else "")

    def expansions(self) -> List[Dict[str, Any]]:
        """The expansion entries worth a sentence: per expanded source its largest part, when both the source's
        value and that part are at least ``words.NOISE`` of the head's total."""
        total = self.total
        return [e for e in _top_offsets(self.expanded)
                if words.above_noise(float(e["whole"]), total) and words.above_noise(float(e["value"]), total)]

    def _expansion_sentences(self) -> List[str]:
        out, over = [], False
        for e in self.expansions():
            where = "key" if e["side"] == "key" else "query"
            pos = "j" if where == "key" else "i"
            if "position" in e:
                at = f"the task's position {e['position']}"
            else:
                off = int(e["offset"])
                at = f"position {pos if off == 0 else f'{pos}{-off:+d}'}" + (
                    f", {abs(off)} before the {where}" if off > 0 else f", the {where} itself" if off == 0 else
                    f", {-off} after the {where}")
            ex, token = e.get("example"), e.get("example_token")
            example = f"; e.g. {ex!r}" if ex is not None else f"; e.g. token {token!r}, no whole word there" \
                if token is not None else ""
            s = float(e["share"]) if e.get("share") is not None else math.nan
            over = over or (s == s and not 0 <= s <= 1)
            out.append(f"{self.label(e['source'])}'s write at the {where}, which {self.head} reads, came from {at} "
                       f"({_pct(s)} of its {show.number(e['whole'])}{example}).")
        if over:
            out.append(f"Note: {words.OVER_100}.")
        return out

    def summary(self) -> str:
        return "\n".join(self.sentences())

    # ------------------------------------------------------------------------------------------ data
    def to_frame(self):
        """One row per (row, side, source): row, prompt, query, key, side, source, value."""
        import pandas as pd

        recs = []
        for side, names, vals in (("query", self.query_names, self.query_values), ("key", self.key_names, self.key_values)):
            for r, row in enumerate(self.rows):
                recs += [{"row": r, "prompt": row["prompt"], "query": row["query"], "key": row["key"], "side": side,
                          "source": n, "value": float(vals[r, s])} for s, n in enumerate(names)]
        return pd.DataFrame(recs)

    def to_dict(self) -> Dict[str, Any]:
        return {"model": self.model, "head": self.head, "reading": self.reading, "rows": self.rows,
                "attention": self.attention, "total": self.total, "exact_error": self.exact_error,
                "query_sources": [list(x) for x in self.query_sources()],
                "key_sources": [list(x) for x in self.key_sources()],
                "pairs": [[a, b, json_number(self.pair_values[i, j]), _share(float(self.pair_values[i, j]), self.total)]
                          for i, a in enumerate(self.pair_query) for j, b in enumerate(self.pair_key)],  # NaN: null
                "per_row": {"query": {"names": self.query_names, "values": json_floats(self.query_values)},
                            "key": {"names": self.key_names, "values": json_floats(self.key_values)}},
                "expanded": self.expanded, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "Attribution":
        pq = list(dict.fromkeys(p[0] for p in d["pairs"]))
        pk = list(dict.fromkeys(p[1] for p in d["pairs"]))
        P = torch.zeros(len(pq), len(pk), dtype=torch.float64)
        for a, b, v, *_ in d["pairs"]:
            P[pq.index(a), pk.index(b)] = read_float(v)
        q, k = d["per_row"]["query"], d["per_row"]["key"]
        as_t = lambda x: read_floats(x, torch.float64).reshape(len(d["rows"]), -1)   # noqa: E731
        return cls(str(d["model"]), str(d["head"]), str(d["reading"]), list(d["rows"]), list(q["names"]),
                   list(k["names"]), as_t(q["values"]), as_t(k["values"]), pq, pk, P,
                   read_float(d["exact_error"]), dict(d.get("settings", {})), list(d.get("expanded", [])))

    def _text(self) -> str:
        total = self.total

        def side(items) -> str:
            return (f"{', '.join(n for n, _, _ in items[:3])} "
                    f"({words.coverage([v for _, v, _ in items], 3, total)})")

        no = words.verdict(self.attention, total, self.reading)
        return (f"Attribution({self.head} on {self.model}: {self.reading} {show.number(total)} over "
                f"{len(self.rows)} rows, attention {self.attention:.2f}{'; ' + no if no else ''}; key side "
                f"{side(self.key_sources())}; query side {side(self.query_sources())}; exact to "
                f"{self.exact_error:.1e})")

    def _html(self) -> str:
        pc = _pct if words.shares_shown(self.total) else (lambda s: "n/a")      # noqa: E731
        rows = [(self.label(a), self.label(b), show.number(v), pc(s)) for a, b, v, s in self.pairs(8)]
        sides = [(self.label(n), show.number(v), pc(s)) for n, v, s in self.key_sources(8)]
        qs = [(self.label(n), show.number(v), pc(s)) for n, v, s in self.query_sources(8)]
        text = "".join(f"<div>{show.escape(s)}</div>" for s in self.sentences())
        title = f"why {self.head} attends" if self.attends() else f"{self.head} does not prefer this key"
        return show.box(f"Attribution: {title}", text,
                        show.table(sides, ("key source", "value", "share")),
                        show.table(qs, ("query source", "value", "share")),
                        show.table(rows, ("query source", "key source", "value", "share")))


def _share(v: float, total: float) -> float:
    return v / total if total != 0 and math.isfinite(total) else math.nan


_pct = words.pct


def _top_offsets(expanded: List[Dict[str, Any]], per_source: int = 1) -> List[Dict[str, Any]]:
    seen: Dict[str, int] = {}
    out = []
    for e in expanded:
        if seen.get(e["source"], 0) < per_source:
            out.append(e)
            seen[e["source"]] = seen.get(e["source"], 0) + 1
    return out


def summarise(model, head: str, reading: str, rows, names: List[str], pairs, q_vals: Tensor, k_vals: Tensor,
              attention: Tensor, *, exact_error: float, settings: Dict[str, Any],
              expanded: Dict[str, Dict[str, Tensor]], side: Optional[str], extra: Sequence[str] = (),
              keep: int = KEEP) -> Attribution:
    """The ``Attribution`` of the per-row marginals ``q_vals`` [n, Sq], ``k_vals`` [n, Sk] (query sources: ``names``
    then bias_q; key sources: ``names`` then bias_k) and ``pairs``: the mean pair table [Sq, Sk] over every source,
    or ``pair_table``'s (kept query sources, kept key sources, kept table). Gives the kept pair table with its
    "other" row and column, the rows' tokens, the expansion grouped by position or offset."""
    names_q, names_k = names + ["bias_q", *extra], names + ["bias_k", *extra]
    kq, kk, Pk = pairs if isinstance(pairs, tuple) else pair_table_of(pairs, q_vals, k_vals, keep)
    decode = _decoder(model)
    toks = rows.tokens.tolist()
    vs = rows.v.tolist() if rows.v is not None else None
    row_list = []
    for r, (b, i, j, a, v) in enumerate(zip(rows.b.tolist(), rows.i.tolist(), rows.j.tolist(), attention.tolist(),
                                            k_vals.sum(1).tolist())):
        entry = {"prompt": b, "query": i, "key": j, "query_token": decode(toks[b][i]), "key_token": decode(toks[b][j]),
                 "attention": a, "value": v}
        if vs is not None:
            entry["versus"] = vs[r]
            entry["versus_token"] = decode(toks[b][vs[r]])
        row_list.append(entry)
    exp = _offsets(expanded, rows, side, decode) if side else []
    if side:
        settings["expand_error"] = max((float((e["values"].sum(1) - e["whole"]).abs().max()) for e in expanded.values()),
                                       default=0.0)
    return Attribution(model_name(model), head, reading, row_list, names_q, names_k, q_vals, k_vals,
                       [names_q[i] for i in kq] + ["other"], [names_k[i] for i in kk] + ["other"], Pk,
                       float(exact_error), settings, exp)


def pair_table(Q: Tensor, K: Tensor, q_vals: Tensor, k_vals: Tensor, keep: int = KEEP):
    """(kept query sources, kept key sources, the mean pair table over them [Nq + 1, Nk + 1]) from the parts
    Q [n, Sq, d] (× the scale) and K [n, Sk, d]: only the kept pairs are formed; "other" is the whole minus the kept."""
    kq, kk = _kept(q_vals, keep), _kept(k_vals, keep)
    Qk, Kk = Q[:, kq], K[:, kk]
    Qk = torch.cat([Qk, (Q.sum(1) - Qk.sum(1))[:, None]], 1)
    Kk = torch.cat([Kk, (K.sum(1) - Kk.sum(1))[:, None]], 1)
    return kq, kk, torch.einsum("nad,nbd->ab", Qk, Kk) / Q.shape[0]


def pair_table_of(P: Tensor, q_vals: Tensor, k_vals: Tensor, keep: int = KEEP):
    """``pair_table`` from the full mean pair table ``P`` [Sq, Sk] (prompt shards summed)."""
    kq, kk = _kept(q_vals, keep), _kept(k_vals, keep)
    rq = sorted(set(range(P.shape[0])) - set(kq))
    rk = sorted(set(range(P.shape[1])) - set(kk))
    rows_kept = torch.cat([P[kq], P[rq].sum(0, keepdim=True)], 0)
    return kq, kk, torch.cat([rows_kept[:, kk], rows_kept[:, rk].sum(1, keepdim=True)], 1)


def _kept(vals: Tensor, keep: int) -> List[int]:
    order = torch.argsort(vals.mean(0).abs(), descending=True)[:keep]
    return sorted(int(i) for i in order)


def _decoder(model):
    """Token id → its text (the id itself without a tokenizer), remembered per model (``model_cache``)."""
    tok = getattr(model, "tokenizer", None)
    seen = remembered(model, "decoded tokens", id(tok), dict) if tok is not None else {}

    def decode(t) -> Any:
        t = int(t)
        if t not in seen:
            try:
                seen[t] = t if tok is None else tok.decode([t])
            except Exception:  # noqa: BLE001  (an id the tokenizer cannot decode: keep the id)
                seen[t] = t
        return seen[t]
    return decode


def _offsets(expanded: Dict[str, Dict[str, Tensor]], rows, side: str, decode, k: int = 3) -> List[Dict[str, Any]]:
    """Per expanded source: its value by where it read, averaged over rows, the ``k`` largest |value| first, with
    the share of the source's whole value there and an example: a token there that is a whole word on its own
    (``example``), else the first token there (``example_token``, ``example`` None). Where it read is a task's named position
    when the rows come from a task ("S2") and the source position is one of that prompt's, else the offset from
    the key (or query) position (``offset`` 1: the position before)."""
    out = []
    anchor = (rows.j if side == "key" else rows.i).tolist()
    named = {name: pos.tolist() for name, pos in (rows.named or {}).items()}
    prompts = rows.b.tolist()
    for name, e in expanded.items():
        vals, whole = e["values"], float(e["whole"].mean())
        n = vals.shape[0]
        by: Dict[Any, float] = {}
        example: Dict[Any, Any] = {}
        pieces: Dict[int, List[Any]] = {}
        for r, row in enumerate(vals.tolist()):
            b, a = prompts[r], anchor[r]
            for m, v in enumerate(row):
                where = next((p for p, pos in named.items() if pos[b] == m), a - m)
                by[where] = by.get(where, 0.0) + v / n
                if m < rows.tokens.shape[1] and (where not in example or not example[where][2]):
                    if b not in pieces:
                        pieces[b] = [decode(t) for t in rows.tokens[b].tolist()]
                    word, token = words.whole_word(pieces[b], m), pieces[b][m]
                    # a token that is a word on its own is the example; else the first token, said to be one
                    is_word = isinstance(token, str) and word == token.strip() and bool(word)
                    example[where] = (word if is_word else None, token, is_word)
        for where in sorted(by, key=lambda x: -abs(by[x]))[:k]:
            word, token, _ = example.get(where, (None, None, False))
            entry = {"source": name, "side": side, "value": by[where], "share": _share(by[where], whole),
                     "whole": whole, "example": word, "example_token": token}
            entry.update({"position": where} if isinstance(where, str) else {"offset": int(where)})
            out.append(entry)
    return out
