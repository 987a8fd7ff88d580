"""THE strict JSON reader of every file the project reads: results (``--scores/--trace/--attend/--circuit``), MIB
files, JSONL task lines, circuit files. ``parse_json`` refuses repeated keys, ``NaN``/``Infinity``, numbers out of
float range (``1e400``), integers past ``MAX_JSON_INT_DIGITS`` digits and nesting past ``MAX_JSON_DEPTH``, naming
the place in the document (``json_path``: ``edges["a3.h2->m5"].score``); ``read_text_file`` bounds the size and
refuses binary files; ``json_error`` is a reader's one line. ``io.load_json`` is the file/text front end.

>>> parse_json('{"a": [1, 2.5, true]}')
{'a': [1, 2.5, True]}
>>> parse_json('{"a": [1, 1e400]}')
Traceback (most recent call last):
...
qkcircuits._foundation.jsonread.JSONProblem: a[1] is 1e400, which is out of range for a float; numbers must be finite
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .errors import QKCircuitsError

MAX_JSON_BYTES = 1 << 30     # a JSON file the project reads (results, MIB, task files): at most 1 GiB
MAX_JSON_DEPTH = 64          # nesting of any JSON the project reads (its own results need fewer than 10)
MAX_JSON_INT_DIGITS = 20     # an integer in a JSON file (a 64-bit seed has 20 digits)


class JSONProblem(ValueError):
    """What ``parse_json`` refuses: ``detail`` says it in a few words; ``syntax`` is true for text that is not
    JSON at all (``error`` is then the ``json.JSONDecodeError``). Readers turn it into one line naming their file."""

    def __init__(self, detail: str, syntax: bool = False, error: Optional[json.JSONDecodeError] = None):
        super().__init__(detail)
        self.detail, self.syntax, self.error = detail, syntax, error


class _Refused:
    """A value that parsed but is refused (NaN, Infinity, ``1e400``, a huge integer): kept as a marker so that the
    walk after the parse can say WHERE it is in the file."""
    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def _hooks(refused: list):
    """The parser's number hooks for one parse; each refused value is also appended to ``refused`` (so a document
    without any is never walked for one)."""
    def refuse(text: str, why: str) -> _Refused:
        r = _Refused(text, why)
        refused.append(r)
        return r

    def flt(text: str):
        x = float(text)
        return x if math.isfinite(x) else refuse(text, "is out of range for a float")

    def integer(text: str):
        if len(text) > MAX_JSON_INT_DIGITS and len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
            return refuse(text, f"has {len(text.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS})")
        return int(text)

    def constant(name: str):
        return refuse(name, "is not a JSON number (JSON has no NaN or Infinity)")

    return flt, integer, constant


def _deeper_than(data: Any, depth: int) -> bool:
    """Whether ``data`` nests containers more than ``depth`` levels (breadth first, containers only: fast)."""
    level = [data] if isinstance(data, (dict, list)) else []
    for _ in range(depth):
        nxt: list = []
        for x in level:
            nxt.extend(v for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (dict, list)))
        if not nxt:
            return False
        level = nxt
    return True


def _unique_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen, twice = set(), []
        for k, _ in pairs:
            if k in seen and k not in twice:
                twice.append(k)
            seen.add(k)
        raise JSONProblem(f"key(s) {', '.join(map(repr, twice[:3]))} given more than once")
    return d


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def json_path(parts: Sequence[Union[str, int]]) -> str:
    """A place inside a JSON document as a reader writes it: ``edges["a3.h2->m5"].score``, ``rows[3]``.

    >>> json_path(["edges", "a3.h2->m5", "score"]), json_path(["rows", 3]), json_path([])
    ('edges["a3.h2->m5"].score', 'rows[3]', 'the top level')
    """
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _NAME.match(p):
            out += ("." if out else "") + p
        else:
            out += "[" + json.dumps(p if len(p) <= 60 else p[:60] + "...") + "]"
    return out or "the top level"


def _check_tree(data: Any, depth: int) -> None:
    """Walk the parsed value (iteratively): the first refused number, or nesting past ``depth``, is a
    ``JSONProblem`` naming its path."""
    stack = [(data, ())]
    while stack:
        x, path = stack.pop()
        if isinstance(x, _Refused):
            shown = x.text if len(x.text) <= 24 else x.text[:20] + "..."
            raise JSONProblem(f"{json_path(path)} is {shown}, which {x.why}; numbers must be finite")
        if isinstance(x, (dict, list)):
            if len(path) >= depth:
                where = json_path(path[:4]) + ("..." if len(path) > 4 else "")
                raise JSONProblem(f"{where} is nested more than {depth} levels deep")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            stack.extend((v, path + (k,)) for k, v in reversed(list(items)))


def parse_json(text: str, depth: int = MAX_JSON_DEPTH) -> Any:
    """THE strict JSON parser of every file the project reads (results, MIB files, JSONL task lines, circuit
    files): a repeated key, ``NaN``/``Infinity``, a number out of float range (``1e400``), an integer of more than
    ``MAX_JSON_INT_DIGITS`` digits, nesting past ``depth`` levels are refused with ``JSONProblem``, whose detail
    names the place in the document (``json_path``). Text over ``MAX_JSON_BYTES`` is refused unread.

    >>> parse_json('{"edges": {"a->b": {"score": 1}}}')["edges"]["a->b"]["score"]
    1
    >>> parse_json('{"edges": {"a3.h2->m5": {"score": NaN}}}')
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.jsonread.JSONProblem: edges["a3.h2->m5"].score is NaN, which is not a JSON number (JSON has no NaN or Infinity); numbers must be finite
    """
    if len(text) > MAX_JSON_BYTES:
        raise JSONProblem(f"it is {len(text) / 2 ** 20:.0f} MiB of text; at most {MAX_JSON_BYTES >> 20} MiB are read")
    refused: list = []
    flt, integer, constant = _hooks(refused)
    try:
        data = json.loads(text, parse_float=flt, parse_int=integer, parse_constant=constant,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise JSONProblem(f"it is nested too deeply (at most {depth} levels)") from None
    except JSONProblem:
        raise
    except json.JSONDecodeError as e:
        raise JSONProblem(" ".join(str(e).split())[:160], syntax=True, error=e) from None
    except ValueError as e:                  # e.g. int() past Python's own digit limit inside the parser
        raise JSONProblem(" ".join(str(e).split())[:160]) from None
    if refused or _deeper_than(data, depth):
        _check_tree(data, depth)                # the slow walk, only to name the place of what is refused
    return data


def read_text_file(p: Path, source: str, what: str) -> str:
    """The UTF-8 text of the file ``p`` (at most ``MAX_JSON_BYTES``), or one line naming it and ``what`` was
    expected."""
    try:
        size = p.stat().st_size
        if size > MAX_JSON_BYTES:
            raise QKCircuitsError(f"{source} is {size / 2 ** 20:.0f} MiB; at most {MAX_JSON_BYTES >> 20} MiB are "
                                  f"read (expected {what})")
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise QKCircuitsError(f"{source} is not a text (UTF-8 JSON) file; expected {what}") from None
    except OSError as e:
        raise QKCircuitsError(f"cannot read {source} ({e.strerror or e}); expected {what}") from None


def json_error(source: str, problem: JSONProblem, what: str) -> QKCircuitsError:
    """The one line of a reader for what ``parse_json`` refused: ``'x.json' is not valid JSON (...)``,
    ``'x.json': edges["a->b"].score is NaN, ...``; both end with what was expected."""
    if problem.syntax:
        return QKCircuitsError(f"{source} is not valid JSON ({problem.detail}); expected {what}")
    return QKCircuitsError(f"{source}: {problem.detail}; expected {what}")
