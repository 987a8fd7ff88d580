"""QK evidence for roles: which sources shape chosen heads' queries and keys at a task's positions (one forward).

>>> task = qk.tasks.induction(model, n=4, seg_len=6)
>>> ev = qk_evidence(model, task, ["1.0"])
>>> ev["1.0"]["key"][0][0], ev["1.0"]["query"][0][0]      # the induction head: keys from 0.0, queries from the token
('0.0', 'emb')

Where each head is read: the induction task's rows (each repeated token → the token after its earlier copy); a task
with an ``IO`` position (IOI): END → IO, contrast; any other task: END → the named position the head attends most
from END (its mean attention), or the rows of the head's own largest attention when the task names none.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from .._foundation.heads import model_heads
from . import words
from .attend import attend_heads


def key_position(model, task, head, patterns: Optional[Dict[int, torch.Tensor]] = None) -> Optional[str]:
    """The key position a head is read at (module docstring), or None: the induction rows, or a task that names
    no position but END (no evidence then). ``patterns``: {layer: pattern} captured once for several heads."""
    if getattr(task, "pattern", None) == "induction":
        return None
    if "IO" in task.positions:
        return "IO"
    names = [n for n in task.positions if n != "END"]
    if not names:
        return None
    from .._foundation.capture import capture

    h = model_heads(model, head)[0]
    if patterns is None or h.layer not in patterns:
        got = capture(model, task.clean.to(model.W_E.device), ["pattern"], layers=[h.layer])["pattern", h.layer]
        if patterns is not None:
            patterns[h.layer] = got
    pattern = got if patterns is None else patterns[h.layer]
    rows = torch.arange(task.n)
    end = task.positions["END"]
    att = {n: float(pattern[rows, h.head, end, task.positions[n]].mean()) for n in names
           if bool((task.positions[n] <= end).all())}
    return max(att, key=att.get) if att else None


def qk_evidence(model, task, heads: Sequence, k: int = 3, labels: Optional[Dict[str, str]] = None,
                errors: Optional[Dict[str, str]] = None) -> Dict[str, Dict]:
    """{head: {"query": [[source, share], ...], "key": [...], "query_values": [[source, value], ...], "key_values",
    "query_rest": {"n": sources not listed, "value": their sum, "largest": the largest |value| among them},
    "key_rest", "from": "END", "to": "IO" (or "induction"), "reading": "contrast", "total": value, "attention",
    "exact_error": ...}} for each of ``heads`` (the ``k`` largest sources of each side by |value|). Heads that share a key position are attributed in one forward. With ``errors`` (a
    dict), a group the attribution refuses (or that fails) is left out and its heads map to the reason there,
    so the other groups keep their evidence; without it the first refusal raises."""
    groups: Dict[Optional[str], List[str]] = {}
    patterns: Dict[int, torch.Tensor] = {}
    for h in model_heads(model, list(heads)):
        groups.setdefault(key_position(model, task, str(h), patterns), []).append(str(h))
    patterns.clear()
    out: Dict[str, Dict] = {}
    for key, hs in groups.items():
        if key is None and getattr(task, "pattern", None) != "induction":
            continue                          # a task with no position to read the head at: no evidence
        try:
            res = attend_heads(model, hs, task=task, **({} if key is None else {"query": "END", "key": key}),
                               labels=labels)
        except Exception as e:  # noqa: BLE001  evidence is extra: one refused group must not cost the others
            if errors is None:
                raise
            errors.update({h: f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" for h in hs})
            continue
        for h, r in res.items():
            out[h] = {"query": [[n, round(s, 4)] for n, _, s in r.query_sources(k)],
                      "key": [[n, round(s, 4)] for n, _, s in r.key_sources(k)],
                      "query_values": [[n, v] for n, v, _ in r.query_sources(k)],
                      "key_values": [[n, v] for n, v, _ in r.key_sources(k)],
                      "query_rest": _rest(r.query_sources(), k), "key_rest": _rest(r.key_sources(), k),
                      "from": "END" if key else "each repeated token", "to": key or "the token after its earlier copy",
                      "reading": r.reading, "total": r.total, "attention": r.attention, "exact_error": r.exact_error}
    return out


def _rest(items, k: int) -> Dict[str, Any]:
    rest = items[k:]
    return {"n": len(rest), "value": sum(v for _, v, _ in rest), "largest": max((abs(v) for _, v, _ in rest),
                                                                                 default=0.0)}


def evidence_clause(ev: Dict, role_of: Optional[Dict[str, str]] = None) -> str:
    """The two sides of one head's QK evidence (``qk_evidence``), sources named with their roles, each with its
    coverage: "query side 20.0 (S-inhibition head) 31 %, ... (these 3 sources: 62 % of the total; 38 % spread over
    290 others, none above 4 %); key side ...". Shares only of a positive total; values (score units) otherwise.
    An entry written before coverage was recorded (no ``*_rest``) lists its sources alone."""
    role_of = role_of or {}
    total = ev.get("total")
    total = float(total) if isinstance(total, (int, float)) else None
    shares = total is not None and words.shares_shown(total)

    def side(name: str) -> str:
        items = ev.get(name, []) or []
        values = ev.get(f"{name}_values")
        if not shares and total is not None and not values:
            values = [[n, float(s) * total] for n, s in items]          # an older entry: its shares × the total
        shown = [(n, float(s)) for n, s in items] if shares or not values else [(n, float(v)) for n, v in values]
        text = ", ".join(f"{n}{f' ({role_of[n]})' if n in role_of else ''} "
                         f"{words.pct(x) if shares or not values else f'{x:+.3g}'}" for n, x in shown)
        rest = ev.get(f"{name}_rest")
        if isinstance(rest, dict) and total is not None:
            listed = [float(v) for _, v in values] if values else [float(s) * total for _, s in items]
            text += " (" + words.coverage_of(sum(listed), len(listed), float(rest.get("value", 0.0)),
                                             int(rest.get("n", 0)), float(rest.get("largest", 0.0)), total) + ")"
        return text

    return f"query side {side('query')}; key side {side('key')}"


def evidence_sentence(head: str, ev: Dict, role_of: Optional[Dict[str, str]] = None) -> str:
    """One line: "why 23.0 attends from END to IO (attention 0.57): query side 20.0 (S-inhibition head) 23 %, ...
    (coverage); key side ...", or, for a head that does not attend its key (``words.verdict``), "17.4 does not
    prefer this key (from END to IO): attention 0.01 (below 0.10) ...; what sets its contrast -0.53, in score
    units: query side ..."."""
    where = f" from {ev['from']} to {ev['to']}" if "from" in ev and "to" in ev else ""
    attention = ev.get("attention") if isinstance(ev.get("attention"), (int, float)) else None
    total = ev.get("total") if isinstance(ev.get("total"), (int, float)) else None
    no = words.verdict(attention, float(total), str(ev.get("reading", "contrast"))) if total is not None else None
    if no is None and attention is not None and attention < words.MIN_ATTENTION:
        no = words.verdict(attention, 1.0, "raw")
    clause = evidence_clause(ev, role_of)
    if no is None:
        att = f" (attention {attention:.2f})" if attention is not None else ""
        return f"why {head} attends{where}{att}: {clause}"
    return (f"{head}{where} {no}; not why it attends, what sets its {ev.get('reading', 'contrast')} "
            f"{words.number(total)}: {clause}")


# the scan's labelled scores and the rows their heads are explained on, on the scan's own [BOS] + R + R prompts
TOP_ROWS = {"induction": "induction", "previous_token": "previous", "duplicate_token": "duplicate"}


def explain_top_heads(model, scores, k: int = 1, n_seqs: int = 4, seg_len: int = 20) -> List:
    """``attend`` for the ``k`` top heads of each labelled score the scan has (induction: each repeated token → the
    token after its earlier copy; previous-token: each token → the one before; duplicate-token: each repeated
    token → its earlier copy) on ``n_seqs`` fresh [BOS] + R + R prompts, sources labelled by the scan. A head whose
    attention cannot be decomposed is left out (the report says so)."""
    from .._foundation.errors import QKCircuitsError
    from .._foundation.sequences import repeated_tokens
    from .labels import source_labels

    seg = max(3, min(seg_len, (int(model.cfg.n_ctx) - 1) // 2))
    tokens = repeated_tokens(model, n_seqs=n_seqs, seg_len=seg, seed=1).cpu()
    out, seen = [], set()
    for score, key in TOP_ROWS.items():
        if score not in scores.scores:
            continue
        for head, _ in scores.top(k, score):
            if (str(head), key) in seen:
                continue
            seen.add((str(head), key))
            try:
                res = attend_heads(model, [head], tokens, key=key)[str(head)]
            except QKCircuitsError as e:
                out.append((str(head), score, str(e)))
                continue
            res.settings["labels"] = source_labels(model, res, scores=scores)
            res.settings["explains"] = score
            res.settings["prompts"] = {"task": "[BOS] + R + R (repeated random tokens)", "n": n_seqs, "seed": 1}
            out.append(res)
    return out


# the roles a circuit's "why it attends" sections follow, in this order (name movers and S-inhibition heads first)
ROLE_ORDER = ("name mover", "S-inhibition head", "negative name mover", "induction head", "duplicate-token head",
              "previous-token head")


def explain_roles(model, task, roles: Dict[str, str], k: int = 4, prompts: Optional[Dict] = None) -> List:
    """``attend`` for the ``k`` heads of ``roles`` ({head: role}, e.g. a circuit file's) whose role is in
    ``ROLE_ORDER``, in that order, each at the task's rows the roles read it at (``key_position``: END → IO on
    IOI, the induction rows on the induction task); ``prompts`` ({"task", "n", "seed"}) is recorded in each
    result. A head that cannot be explained gives (head, role, reason), as ``explain_top_heads``."""
    from .._foundation.errors import QKCircuitsError

    order = {r: n for n, r in enumerate(ROLE_ORDER)}
    chosen = sorted((h for h, r in roles.items() if r in order), key=lambda h: (order[roles[h]], h))[:k]
    out = []
    patterns: Dict[int, torch.Tensor] = {}
    for h in chosen:
        try:
            key = key_position(model, task, h, patterns)
            if key is None and getattr(task, "pattern", None) != "induction":
                out.append((h, roles[h], f"the task {getattr(task, 'name', '')!r} names no position to read {h} at"))
                continue
            res = attend_heads(model, [h], task=task, **({} if key is None else {"query": "END", "key": key}))[h]
        except QKCircuitsError as e:
            out.append((h, roles[h], str(e)))
            continue
        res.settings["explains_role"] = roles[h]
        if prompts:
            res.settings["prompts"] = dict(prompts)
        out.append(res)
    return out
