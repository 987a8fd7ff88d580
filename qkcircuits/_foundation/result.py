"""``Result``: the one base of every result class (data first: tensors + ``settings`` + versions; JSON; pandas).

>>> scores = qk.scan(model, scores="induction,previous_token", progress=False)
>>> text = scores.to_json(tmp / "scores.json")          # the JSON text, also written atomically to the path
>>> back = qk.results.HeadScores.from_json(tmp / "scores.json")  # a path or the JSON text itself
>>> back.top(1, "induction")[0][0]
Head(layer=1, head=0)
>>> sorted(back.settings["versions"])
['qkcircuits', 'torch', 'transformer_lens', 'transformers']

Every subclass has the same methods and signatures:

==============================  ============================================================================
``to_dict()``                   plain JSON-ready data, with ``"schema": "qkcircuits.<name>/<n>"``
``to_json(path=None, indent)``  the JSON text (NaN as ``null``); also written atomically when ``path`` given
``from_json(path_or_text)``     read it back: the schema name and version are checked, errors name the file
``to_frame()``                  a pandas DataFrame (one row per head, pair, offset, ... as the class says)
``top(k=5, ...)``               the ``k`` largest entries, largest first, as ``(what, value)`` pairs
``repr(r)`` / ``_repr_html_``   the class's own ``_text()`` / ``_html()`` (shared helpers: ``display``)
==============================  ============================================================================

Results are data: every subclass is a frozen dataclass (a changed copy is ``dataclasses.replace(r, model="x")``;
its dict fields, ``settings`` among them, are the producer's to fill before handing the result out), and computing
is a function of the model and inputs (``qk.core_circuit(model, task, scores)``, not a method of ``scores``); the
``roles(model, task, ...)`` of ``TaskCircuit`` and ``CoreCircuit`` are the methods left that run the model (issue 44,
ask 3).

Library versions live in ONE place: ``settings["versions"]`` (``versions()``), written by the producer when it
makes the result. A JSON file without ``"schema"`` (written before schemas existed) is read as the class's
version 1; one with another schema name, or a newer version than this library reads, fails with one line
that says what was expected.
"""

from __future__ import annotations

import contextvars
import functools
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Union

import torch

from .display import Displayed
from .errors import QKCircuitsError
from .io import check_schema, dump_json, load_json, looks_like_json, package_version, parse_schema, qkcircuits_version

PathOrText = Union[str, Path]
# True while from_json builds a result: a loaded result keeps the versions its file recorded (or none)
_loading: contextvars.ContextVar = contextvars.ContextVar("qkcircuits_result_loading", default=False)


@functools.lru_cache(maxsize=1)
def versions() -> Dict[str, str]:
    """The library versions a result records under ``settings["versions"]`` (one key for every result; the one
    place they are written: producers call ``stamped``, or ``Result.__post_init__`` fills them in)."""
    return {"qkcircuits": qkcircuits_version(), "torch": str(torch.__version__),     # a str, not TorchVersion
            "transformer_lens": package_version("transformer-lens"), "transformers": package_version("transformers")}


def stamped(settings: Optional[Dict[str, Any]] = None, model: Any = None, task: Any = None,
            name: bool = False) -> Dict[str, Any]:
    """``settings`` (a fresh dict) with ``"versions"`` filled in; a producer's one call before returning a result.
    With ``model``: also ``"fingerprint"`` (``fingerprint.fingerprint``: the model's architecture and weights'
    shapes), ``"task"`` (the task's name, when ``task`` is given) and, with ``name=True`` (a result class without
    a ``model`` field), ``"model"``: what readers check a result file against (``fingerprint.mismatch``)."""
    out = dict(settings or {})
    if not _loading.get():
        out.setdefault("versions", dict(versions()))
        if model is not None:
            from .fingerprint import record

            rec = record(model, task)
            if not name:
                rec.pop("model")
            out.update(rec)
    return out


def read_json(path_or_text: PathOrText, what: str) -> Tuple[Dict[str, Any], str]:
    """Parse JSON text, or the file at a path (read once), into a dict; returns ``(data, source)`` where
    ``source`` names the file (or says "JSON text") for error messages. ``what`` names the expected producer.
    The parsing is ``io.load_json``'s (binary files, ``1e400``, ``NaN`` and deep nesting refused in one line)."""
    is_path = isinstance(path_or_text, Path) or not looks_like_json(str(path_or_text))
    source = str(path_or_text) if is_path else "JSON text"
    return load_json(Path(path_or_text) if is_path else str(path_or_text), what), source


class Result(Displayed):
    """Base of every result: subclasses are dataclasses that set ``SCHEMA``/``WHAT`` and define ``to_dict``,
    ``_from_dict``, ``to_frame``, ``top``, ``_text`` and ``_html``; the JSON plumbing is here, once."""

    SCHEMA: ClassVar[str] = ""           # "qkcircuits.<name>/<n>"
    WHAT: ClassVar[str] = "a qkcircuits result JSON"     # what from_json's errors say they expected
    KEYS: ClassVar[Tuple[str, ...]] = ()                 # the keys a valid file must have (named in errors)
    _by_schema: ClassVar[Dict[str, type]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("SCHEMA"):
            Result._by_schema[parse_schema(cls.SCHEMA)[0]] = cls

    def __post_init__(self) -> None:
        """A new result records the library versions in ``settings["versions"]`` (not one read from a file)."""
        settings = getattr(self, "settings", None)
        if isinstance(settings, dict) and "versions" not in settings and not _loading.get():
            settings["versions"] = dict(versions())

    # ------------------------------------------------------------------------------------------ the contract
    def to_dict(self) -> Dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__}.to_dict")

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "Result":
        raise NotImplementedError(f"{cls.__name__}._from_dict")

    def to_frame(self):
        raise QKCircuitsError(f"{type(self).__name__} has no table form")

    def top(self, k: int = 5) -> List[Tuple[Any, float]]:
        raise QKCircuitsError(f"{type(self).__name__} has no ranking")

    # ------------------------------------------------------------------------------------------ JSON, once
    def to_json(self, path: Optional[PathOrText] = None, indent: Optional[int] = 1) -> str:
        """The JSON text (NaN as ``null``), also written atomically to ``path`` when given (whole file or none)."""
        d = self.to_dict()
        if self.SCHEMA:
            d = {"schema": self.SCHEMA, **{k: v for k, v in d.items() if k != "schema"}}
        return dump_json(d, path, indent)

    @classmethod
    def from_json(cls, path_or_text: PathOrText) -> "Result":
        """Read ``to_json`` output: JSON text, or the path of a file holding it (read once)."""
        d, source = read_json(path_or_text, cls.WHAT)
        return cls.build(d, source)

    @classmethod
    def build(cls, d: Dict[str, Any], source: str = "JSON text") -> "Result":
        """``from_json`` after parsing: check the schema, then build; a malformed field fails in one line."""
        cls.check_schema(d, source)
        token = _loading.set(True)
        try:
            return cls._from_dict(d)
        except QKCircuitsError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            keys = f"; expected the keys {', '.join(cls.KEYS)}" if cls.KEYS else ""
            where = "" if source == "JSON text" else f"{source}: "
            raise QKCircuitsError(f"{where}not {cls.WHAT} ({type(e).__name__}: {e}){keys}") from None
        finally:
            _loading.reset(token)

    @classmethod
    def check_schema(cls, d: Dict[str, Any], source: str = "JSON text") -> None:
        """Accept a file without ``schema`` (older files) or with this class's schema at a version it reads
        (``io.check_schema``, the one check; another result's schema is named with the class that reads it)."""
        if not cls.SCHEMA:
            return

        def hint(name: str) -> str:
            other = Result._by_schema.get(name)
            return f"(that is a {other.__name__}: use {other.__name__}.from_json)" if other else ""

        check_schema(d, cls.SCHEMA, source, cls.WHAT, hint)


def load_result(path_or_text: PathOrText) -> Result:
    """Any result JSON, by its ``schema``: ``qk.load_result("scores.json")`` is a ``HeadScores``.

    >>> r = qk.load_result(qk.scan(model, scores="induction", progress=False).to_json())
    >>> type(r).__name__
    'HeadScores'
    """
    d, source = read_json(path_or_text, "a qkcircuits result JSON")
    if "schema" not in d:
        raise QKCircuitsError(f"{source} has no 'schema'; read it with the class's from_json (e.g. "
                              f"qk.results.HeadEffects.from_json)")
    name, _ = parse_schema(d["schema"])
    cls = Result._by_schema.get(name)
    if cls is None:
        known = ", ".join(sorted(c.SCHEMA for c in Result._by_schema.values()))
        raise QKCircuitsError(f"{source} has schema {d['schema']!r}, which no loaded result class reads; known: {known}")
    return cls.build(d, source)
