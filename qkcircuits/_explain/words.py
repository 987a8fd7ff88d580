"""The words of an attribution: whether a head attends at all, how much of its total the listed sources cover, and
which expansions are above noise. One place for the rules every "why it attends" text follows (``Attribution``'s
sentences, the figure, roles' QK evidence, the report's roles table).

>>> verdict(0.02, -1.15, "contrast")            # no "why it attends" for a head that does not attend the key
'does not prefer this key: attention 0.02 (below 0.10), and its contrast is negative (-1.15: the key scores below the other keys)'
>>> verdict(0.66, 8.64, "contrast") is None
True
>>> coverage([0.07, 0.06, 0.05, 0.05, 0.06] + [0.71 / 290] * 290, 5, 1.0)
'these 5 sources: 29 % of the total; 71 % spread over 290 others, none above 0 %'

Rules:

- a head *attends* its key when its mean attention there is at least ``MIN_ATTENTION`` and, for the contrast and
  versus readings, the total is positive (the key beats the others); otherwise the text says the head does not
  prefer that key and lists what sets its score, in score units (never percentages of a negative total);
- every list of sources says its coverage: the listed sources' share of the total, and the rest with how many
  sources hold it and the largest of them;
- an expansion (where a head source read what it wrote) is shown only when that source's value and the part shown
  are at least ``NOISE`` of the head's total; shares above 100 % are explained once.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

from .._foundation.display import number

MIN_ATTENTION = 0.1      # below it a head does not attend the key: no "why it attends"
NOISE = 0.1              # an expansion is shown when the source and the part are >= this fraction of |total|
OVER_100 = ("a share above 100 % (or below 0) means the writes it read at other positions count against it "
            "(they add up to the rest)")




def pct(share: Optional[float]) -> str:
    """ "29 %" ("0 %", never "-0 %"; "n/a" for no share)."""
    if share is None or (isinstance(share, float) and math.isnan(share)):
        return "n/a"
    return f"{round(100 * share) + 0:.0f} %"


def verdict(attention: Optional[float], total: float, reading: str) -> Optional[str]:
    """None when the head attends its key (module docstring), else why the text must not explain it: "does not
    prefer this key: attention 0.02 (below 0.10), ..."."""
    low = attention is not None and attention == attention and attention < MIN_ATTENTION
    negative = reading in ("contrast", "versus") and not total > 0
    if not (low or negative):
        return None
    bits = []
    if low:
        bits.append(f"attention {attention:.2f} (below {MIN_ATTENTION:.2f})")
    if negative:
        what = "the key scores below the other keys" if reading == "contrast" else "the key scores below the versus key"
        bits.append(f"its {reading} is {'negative' if total < 0 else 'zero'} ({number(total)}: {what})")
    return "does not prefer this key: " + ", and ".join(bits)


def shares_shown(total: float) -> bool:
    """Shares (percent of the total) only of a positive total; values otherwise."""
    return total > 0 and math.isfinite(total)


def coverage(values: Sequence[float], k: int, total: float) -> str:
    """How much of ``total`` the first ``k`` of ``values`` (one side's sources, largest |value| first) cover and how
    the rest is spread: "these 5 sources: 29 % of the total; 71 % spread over 290 others, none above 3 %"; in
    score units when the total is not positive."""
    listed, rest = list(values[:k]), list(values[k:])
    return coverage_of(float(sum(listed)), len(listed), float(sum(rest)), len(rest),
                       float(max((abs(v) for v in rest), default=0.0)),
                       total)


def coverage_of(listed: float, n_listed: int, rest: float, n_rest: int, largest: float, total: float) -> str:
    """``coverage`` from its sums: the listed sources' value and count, the rest's value, count and largest
    |value|."""
    as_pct = shares_shown(total)
    fmt = (lambda v: pct(v / total)) if as_pct else number             # noqa: E731
    plural = "s" if n_listed != 1 else ""
    text = (f"these {n_listed} source{plural}" if n_rest else f"all {n_listed} source{plural}") + f": {fmt(listed)}" \
        + (" of the total" if as_pct else f" of the total {number(total)}")
    if not n_rest:
        return text
    return (f"{text}; {fmt(rest)} spread over {n_rest} other{'s' if n_rest != 1 else ''}, none above "
            f"{pct(largest / total) if as_pct else number(largest)}" + ("" if as_pct else " in size"))


def above_noise(value: float, total: float) -> bool:
    return abs(value) >= NOISE * abs(total) and abs(total) > 0


def whole_word(pieces: List[Any], m: int) -> Any:
    """The word around piece ``m`` of a prompt's decoded tokens: its neighbours joined while they continue the word
    (no leading space, letters or digits at the joint): the example an expansion quotes instead of a fragment.

    >>> whole_word([" the", " super", "vis", "or", ",", " John"], 2)
    'supervisor'
    """
    def starts_word(s: str) -> bool:
        return not s or not (s[0].isalnum() or s[0] in "'’-")

    if not 0 <= m < len(pieces):
        return None
    if not isinstance(pieces[m], str):            # no tokenizer: the id itself
        return pieces[m]
    lo = hi = m
    while lo > 0 and isinstance(pieces[lo - 1], str) and not starts_word(pieces[lo]) and pieces[lo - 1][-1:].isalnum():
        lo -= 1
    while hi + 1 < len(pieces) and isinstance(pieces[hi + 1], str) and not starts_word(pieces[hi + 1]) \
            and pieces[hi][-1:].isalnum():
        hi += 1
    return "".join(pieces[lo:hi + 1]).strip()
