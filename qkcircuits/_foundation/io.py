"""Small shared helpers for inputs and outputs: integer checks, atomic file writes, JSON numbers.

>>> check_int("n_seqs", 8)
8
>>> json_number(float("nan")) is None
True
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from .errors import QKCircuitsError
from .jsonread import (MAX_JSON_BYTES, JSONProblem, json_error, json_path, parse_json,  # noqa: F401  (one reader)
                       read_text_file)

# Read once at import: flipping the process umask later to read it would race with other threads.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def check_int(name: str, value, least: int = 1) -> int:
    """``value`` if it is an integer (not a bool) ``>= least``; else a one-line ``QKCircuitsError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise QKCircuitsError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_writable(path: Union[str, Path]) -> Path:
    """Fail early (before minutes of work) when ``path`` cannot be written: missing folder, a folder itself."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise QKCircuitsError(f"cannot write {str(path)!r}: it is a folder; give a file path")
    if not target.parent.is_dir():
        raise QKCircuitsError(f"cannot write {str(path)!r}: folder {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise QKCircuitsError(f"cannot write {str(path)!r}: folder {str(target.parent)!r} is not writable")
    return target


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (by ``cli.main`` and around ``write_atomic``): like Ctrl-C, it
    unwinds through ``finally`` blocks, so no temporary file is left behind."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While the block runs in the main thread, SIGTERM raises ``Terminated`` instead of killing the process
    outright (which would skip the clean-up). A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class OutputSet:
    """One run's outputs, committed as one set (``output_set``): ``write_atomic`` to one of ``targets`` leaves its
    temporary file staged; ``commit`` renames them all in at the end (SIGINT/SIGTERM held for those few renames;
    a rename that fails puts the earlier ones back), ``discard`` removes them all, leaving earlier files as they
    were."""

    def __init__(self, targets):
        self.targets = {Path(t).expanduser().resolve() for t in targets}
        self.staged: Dict[Path, str] = {}
        self.lock = threading.Lock()

    def owns(self, target: Path) -> bool:
        return target.resolve() in self.targets

    def stage(self, target: Path, tmp: str) -> None:
        with self.lock:
            old = self.staged.pop(target.resolve(), None)
            if old is not None:
                Path(old).unlink(missing_ok=True)
            self.staged[target.resolve()] = tmp

    def discard(self) -> None:
        with self.lock:
            for tmp in self.staged.values():
                Path(tmp).unlink(missing_ok=True)
            self.staged.clear()

    def commit(self) -> None:
        held = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
        if held:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        done: list = []                                   # (target, backup of the earlier file or None)
        try:
            with self.lock:
                for target, tmp in self.staged.items():
                    backup = None
                    if target.exists():
                        backup = f"{tmp}.old"
                        try:
                            os.link(target, backup)       # the earlier file, kept until every rename went in
                        except OSError:
                            backup = None
                    try:
                        os.replace(tmp, target)
                    except OSError as e:
                        if backup:
                            Path(backup).unlink(missing_ok=True)
                        for t, b in reversed(done):       # put the earlier ones back
                            if b:
                                os.replace(b, t)
                            else:
                                t.unlink(missing_ok=True)
                        done.clear()
                        raise QKCircuitsError(f"cannot write {str(target)!r}: {e.strerror or e}; no output of this "
                                              f"run was written (earlier files are unchanged)") from None
                    done.append((target, backup))
        finally:
            for _, b in done:
                if b:
                    Path(b).unlink(missing_ok=True)
            self.discard()
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


_SETS: list = []          # the output sets open now (cli.main opens one per command)


@contextlib.contextmanager
def output_set(targets):
    """Commit the files written to ``targets`` (by ``write_atomic``, in this block) together at its end; on an
    exception, Ctrl-C or SIGTERM, none of them is written and earlier files at those paths are untouched.

    >>> with output_set([tmp / "a.json", tmp / "b.csv"]):
    ...     write_atomic(tmp / "a.json", "{}")
    ...     print(sorted(p.name for p in tmp.iterdir() if not p.name.startswith(".")))
    []
    >>> sorted(p.name for p in tmp.iterdir())
    ['a.json']
    """
    s = OutputSet(targets)
    _SETS.append(s)
    try:
        yield s
    except BaseException:
        s.discard()
        raise
    else:
        s.commit()
    finally:
        _SETS.remove(s)


def write_atomic(path: Union[str, Path], text: str) -> None:
    """Write ``text`` through a temporary file in the same folder and rename it: the whole file or none.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600. Ctrl-C and
    SIGTERM during the write remove the temporary file. Inside ``output_set`` a target of the set is only staged:
    the rename happens with the others at the end of the set.

    >>> write_atomic(tmp / "a.txt", "hello")
    >>> sorted(p.name for p in tmp.iterdir())
    ['a.txt']
    """
    target = check_writable(path)
    with _sigterm_unwinds():
        try:                # no temporary file (a full disk, a folder that turned read-only): one line too
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        except OSError as e:
            raise QKCircuitsError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            owner = next((s for s in reversed(_SETS) if s.owns(target)), None)
            if owner is not None:
                owner.stage(target, tmp)
                return
            os.replace(tmp, target)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise QKCircuitsError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_field(value: Any) -> Any:
    """One CSV cell made inert (the OWASP rule for CSV injection): a string starting with ``= + - @``, a tab or a
    carriage return gets a leading ``'`` so a spreadsheet shows it as text instead of running it as a formula;
    numbers stay numbers (``-0.5`` is a number, not a formula); NaN/inf and None are an empty cell.

    >>> csv_field("=1+1"), csv_field(-0.5), csv_field("5.1"), csv_field(float("nan"))
    ("'=1+1", -0.5, '5.1', '')
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return "'" + value if value.startswith(_FORMULA_START) else value
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    item = getattr(value, "item", None)            # numpy / torch scalars: as the Python number
    if callable(item) and getattr(value, "shape", None) == ():
        return csv_field(item())
    return value


def csv_text(header: Sequence[str], rows) -> str:
    """CSV text of ``header`` and ``rows`` (sequences of cells): THE CSV writer of the project. The ``csv`` module
    quotes each field as needed (commas, quotes, newlines inside a name stay in one cell), and every cell goes
    through ``csv_field`` (formulas made inert). Lines end with ``\n``.

    >>> print(csv_text(["name", "score"], [["=1+1,evil", -0.5], ["a\\nb", 1]]), end="")
    name,score
    "'=1+1,evil",-0.5
    "a
    b",1
    """
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    w.writerow([csv_field(h) for h in header])
    for row in rows:
        w.writerow([csv_field(v) for v in row])
    return buf.getvalue()


def frame_csv(frame) -> str:
    """``csv_text`` of a pandas DataFrame (its columns as the header, no index)."""
    return csv_text([str(c) for c in frame.columns], frame.itertuples(index=False, name=None))


def json_number(x, significant: Optional[int] = None) -> Optional[float]:
    """A float for JSON that reads back as the same value: NaN and infinities become ``null``; a Python float (or a
    float64 tensor/array element) is kept as is (JSON writes its ``repr``, which round-trips); a float32 (bf16,
    fp16) element becomes the SHORTEST decimal that reads back as the same float32 (``0.3999996``, not
    ``0.39999958872795105`` nor ``0.4``). ``significant`` rounds to that many significant digits instead (lossy:
    for display only). Why exact: a score of 0.3999996 rounded to 6 decimals reads back as 0.4 and crosses a 0.4
    threshold (a round trip must not change a label).

    >>> json_number(torch.tensor(0.3999996)), json_number(0.1 + 0.2), json_number(float("nan"))
    (0.3999996, 0.30000000000000004, None)
    """
    dtype = getattr(x, "dtype", None)
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return None
    if significant is not None:
        return float(f"{x:.{int(significant)}g}")
    return _shortest32(x) if _is_narrow(dtype) else x


SCORE_DIGITS = 9     # float32 → 9 significant digits → the same float32 (json_number is exact without it)


def _is_narrow(dtype) -> bool:
    """A torch or numpy dtype whose values are all float32 values (float32, bfloat16, float16)."""
    return str(dtype).replace("torch.", "") in ("float32", "bfloat16", "float16")


def _shortest32(x: float) -> float:
    # numpy prints a float32 as the shortest decimal that parses back to it (Dragon4, "unique"); parsed as a
    # Python float and then rounded to float32 it is the same float32 again (checked on 2 M random bit patterns
    # and every 7th subnormal; tests/test_roundtrip.py checks the tensors it writes).
    import numpy as np

    return float(str(np.float32(x)))


def json_floats(t) -> Any:
    """A tensor as nested lists of ``json_number``s (``null`` for NaN and ±inf), exact for its dtype: float64 as
    is, float32 / bf16 / fp16 as the shortest decimal of each float32 value (readable, and read back exactly by
    ``read_floats(..., torch.float32)``); integers as ints.

    >>> json_floats(torch.tensor([[0.3999996, float("nan")]]))
    [[0.3999996, None]]
    """
    import numpy as np

    t = t.detach().cpu()
    if not t.is_floating_point() or t.numel() == 0:
        return t.tolist()
    if not _is_narrow(t.dtype):
        return finite_json(t.double().tolist())
    flat = [None if not np.isfinite(v) else float(str(v)) for v in t.float().numpy().ravel()]
    if t.dim() == 0:
        return flat[0]
    for n in reversed(t.shape[1:]):
        flat = [flat[i:i + n] for i in range(0, len(flat), n)]
    return flat


def read_float(v) -> float:
    """The inverse of ``json_number``: ``null`` (NaN or ±inf when written) reads as NaN."""
    return math.nan if v is None else float(v)


def read_floats(nested, dtype=None):
    """The inverse of ``json_floats``: nested lists (``null`` as NaN) as a tensor of ``dtype`` (default float32).

    >>> read_floats([[0.3999996, None]]).tolist()[0][0] == float(torch.tensor(0.3999996))
    True
    """
    import torch

    def walk(x):
        return [walk(v) for v in x] if isinstance(x, list) else read_float(x)

    return torch.tensor(walk(nested), dtype=dtype or torch.float32)


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float (anywhere in dicts, lists, tuples) replaced by ``None``: JSON has no
    NaN or Infinity, and a file holding them is refused by strict readers (``read_json`` among them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def dump_json(data: Dict[str, Any], path: Optional[Union[str, Path]] = None, indent: Optional[int] = 1) -> str:
    """JSON text of ``data`` (non-finite floats as ``null``: ``finite_json``), also written atomically to ``path``
    when given."""
    text = json.dumps(finite_json(data), indent=indent, allow_nan=False)
    if path is not None:
        write_atomic(path, text)
    return text


def looks_like_json(text: str) -> bool:
    """A string that is JSON text rather than a path: it starts with ``{``/``[`` or spans lines."""
    return text.lstrip().startswith(("{", "[")) or "\n" in text


def load_json(text_or_path: Union[str, Path], what: str, schema: Optional[str] = None) -> Dict[str, Any]:
    """Parse JSON text, or the file at a path (read once, never re-read as a path); a JSON object comes back.

    A ``Path`` is always a file; a string is JSON text when it starts with ``{``/``[``, else a path. Errors
    are one line naming the file (not its content) and ``what`` is expected. With ``schema`` (e.g.
    ``"qkcircuits.head_scores/1"``) the object's ``"schema"`` field, when present, is checked (``check_schema``).
    The parsing is ``parse_json``'s: infinite numbers (``1e400``), ``NaN``, huge integers, repeated keys, deep
    nesting, files over 1 GiB and binary files are refused, naming the place in the file.

    >>> load_json('{"schema": "qkcircuits.x/1", "a": 1}', "an x", schema="qkcircuits.x/1")["a"]
    1
    >>> load_json('{"schema": "qkcircuits.x/2"}', "an x", schema="qkcircuits.x/1")
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.errors.QKCircuitsError: JSON text: it has schema 'qkcircuits.x/2', and this qkcircuits reads qkcircuits.x versions 1 to 1; ...
    """
    if isinstance(text_or_path, Path) or not looks_like_json(str(text_or_path)):
        p = Path(text_or_path).expanduser()
        source = f"{str(text_or_path)!r}"
        if not p.is_file():
            raise QKCircuitsError(f"no JSON file at {source}; pass the path of {what}"
                                  + ("" if isinstance(text_or_path, Path) else " or its JSON text"))
        text = read_text_file(p, source, what)
    else:
        text, source = str(text_or_path), "JSON text"
    try:
        d = parse_json(text)
    except JSONProblem as e:
        raise json_error(source, e, what) from None
    if not isinstance(d, dict):
        raise QKCircuitsError(f"{source} holds a JSON {type(d).__name__}, not an object; expected {what}")
    if schema is not None:
        check_schema(d, schema, source, what)
    return d


def parse_schema(schema: Any) -> Tuple[str, int]:
    """``"qkcircuits.head_scores/1"`` -> ``("qkcircuits.head_scores", 1)``.

    >>> parse_schema("qkcircuits.head_scores/1")
    ('qkcircuits.head_scores', 1)
    """
    name, _, n = str(schema).rpartition("/")
    if not name or not n.isdigit():
        raise QKCircuitsError(f"malformed schema {schema!r}; expected 'qkcircuits.<name>/<version>'")
    return name, int(n)


def check_schema(d: Dict[str, Any], schema: Union[str, Sequence[str]], source: str = "JSON text", what: str = "",
                 hint: Optional[Callable[[str], str]] = None) -> None:
    """THE schema check of every reader (``Result.from_json``, ``load_json(schema=)``, the circuit views).

    ``schema``: ``"qkcircuits.<name>/<n>"`` (or several): a file without ``"schema"`` (written before schemas
    existed) passes; one with a listed name at version 1 to n passes; anything else is one line saying what
    it has and what was expected. ``hint(name)`` may add a clause for another known schema name (e.g.
    "(that is a HeadEffects: use HeadEffects.from_json)").

    >>> check_schema({"schema": "qkcircuits.head_scores/1"}, "qkcircuits.head_scores/1")
    >>> check_schema({"schema": "qkcircuits.head_scores/3"}, "qkcircuits.head_scores/2", "s.json", "a scan")
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.errors.QKCircuitsError: s.json: it has schema 'qkcircuits.head_scores/3', and this qkcircuits reads qkcircuits.head_scores versions 1 to 2; expected 'qkcircuits.head_scores/2' (a newer qkcircuits wrote it?)
    """
    if "schema" not in d:
        return
    wanted = [schema] if isinstance(schema, str) else list(schema)
    reads = dict(parse_schema(w) for w in wanted)
    expected = " or ".join(repr(w) for w in wanted)
    try:
        got, n = parse_schema(d["schema"])
    except QKCircuitsError:
        got, n = str(d["schema"]), -1
    if got not in reads:
        extra = hint(got) if hint is not None else ""
        raise QKCircuitsError(f"{source}: it has schema {d['schema']!r}, not {what or 'the expected file'}"
                              f"{' ' + extra if extra else ''}; expected {expected}")
    if not 1 <= n <= reads[got]:
        raise QKCircuitsError(f"{source}: it has schema {d['schema']!r}, and this qkcircuits reads {got} versions 1 "
                              f"to {reads[got]}; expected {expected} (a newer qkcircuits wrote it?)")


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist`` (e.g. "transformer-lens", which has no ``__version__``),
    or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def qkcircuits_version() -> str:
    """This package's version, read from its installed metadata (``pyproject.toml``'s ``version``: one place), or
    ``"unknown"`` for a source tree that was never installed. ``qk.__version__`` and ``versions()`` read it here,
    so no module imports the package root for it."""
    v = package_version("qkcircuits")
    return "unknown" if v == "not installed" else v
