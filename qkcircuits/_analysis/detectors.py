"""Detectors as data: each head score is one ``Detector`` in a registry that ``scan``, the CLI table, the views,
``zoo`` and ``trace`` read.

>>> [d.name for d in qk.detectors()][:4]
['induction', 'prefix_matching', 'previous_token', 'duplicate_token']
>>> qk.detector("induction").label, qk.detector("induction").threshold
('induction', 0.4)
>>> self_attn = qk.Detector("self_attention", prompts="repeated", threshold=0.5, label="self-attending",
...                         mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens),
...                         description="attention of each query to its own position")
>>> _ = qk.register_detector(self_attn, replace=True)
>>> s = qk.scan(model, scores="self_attention,induction", progress=False)
>>> [round(float(x), 3) for x in s["self_attention"].flatten()]      # 0.1 and 1.1 attend to themselves
[0.0, 1.0, 0.0, 1.0]
>>> qk.unregister_detector("self_attention")

A detector gives its score one of three ways (docs/detectors.md has the formulas and a worked example):

- ``mask(tokens, seg_len, first_query) -> Bool[batch, q, k]``: the targets of each query on its prompt set;
  the score is ``mask_score``: the attention mass on the targets, averaged over the queries that have any.
- ``reducer(model, tokens, seg_len) -> fn(layer, tensors) -> Float[head]`` with ``needs`` (hook names such as
  ``("pattern", "z")``): a per-layer reduction in the same streamed pass as the masks (Olsson's copying).
- ``score(model, seed=...) -> Float[layer, head]`` or ``(Float[layer, head], settings)`` on ``prompts="model"``:
  the detector makes its own inputs (weights, a corpus).

Prompt sets (``PROMPT_SETS``): ``"repeated"`` [BOS]+R+R (``n_seqs`` × ``seg_len``), ``"prefix"`` [BOS]+R×4
(``prefix_seqs`` × ``prefix_len``), ``"text"`` natural text (queries from position 1), ``"model"`` none.
One streamed pass runs per prompt set that a selected detector needs; masks and reducers share it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError

PROMPT_SETS: Dict[str, str] = {
    "repeated": "[BOS] + R + R: n_seqs random segments R of seg_len tokens, repeated once",
    "prefix": "[BOS] + R x 4 (Olsson): prefix_seqs segments of prefix_len tokens, queries in repeats 2-4",
    "text": "natural text rows of min(128, n_ctx - 1) tokens; every query from position 1",
    "model": "no prompts from scan: the detector's score function makes its own (weights, a corpus)",
}
SWITCHES = ("copying", "eigen_copying", "text")        # scan(...) flags that add or drop detectors


@dataclass(frozen=True)
class Detector:
    """One head score: how to compute it, on which prompts, and the label its heads get.

    ``threshold``/``label``: a head whose score is ≥ ``threshold`` gets ``label`` (both or neither).
    ``default``: in a scan that names no scores. ``switch``: the scan flag that controls it (``"copying"``,
    ``"eigen_copying"``: on by default, the flag drops it; ``"text"``: off by default, ``text=True`` adds it).
    """

    name: str
    prompts: str
    mask: Optional[Callable[..., Tensor]] = None
    reducer: Optional[Callable[..., Callable[[int, Dict[str, Tensor]], Tensor]]] = None
    score: Optional[Callable[..., object]] = None
    needs: Tuple[str, ...] = ("pattern",)
    threshold: Optional[float] = None
    label: Optional[str] = None
    default: bool = True
    switch: Optional[str] = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise QKCircuitsError(f"detector name must be a Python identifier (it is a JSON key and a column), "
                                  f"got {self.name!r}")
        if self.prompts not in PROMPT_SETS:
            raise QKCircuitsError(f"detector {self.name!r}: unknown prompt set {self.prompts!r}; choose from "
                                  f"{', '.join(PROMPT_SETS)}")
        given = [k for k in ("mask", "reducer", "score") if getattr(self, k) is not None]
        if len(given) != 1:
            raise QKCircuitsError(f"detector {self.name!r}: give exactly one of mask, reducer, score (got "
                                  f"{', '.join(given) or 'none'})")
        if (self.prompts == "model") != (self.score is not None):
            raise QKCircuitsError(f"detector {self.name!r}: a score function goes with prompts='model', and a "
                                  f"mask or reducer with a prompt set ({', '.join(p for p in PROMPT_SETS if p != 'model')})")
        if (self.threshold is None) != (self.label is None):
            raise QKCircuitsError(f"detector {self.name!r}: give both threshold and label, or neither")
        if self.threshold is not None and (isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float))):
            raise QKCircuitsError(f"detector {self.name!r}: threshold must be a number, got {self.threshold!r}")
        if self.switch is not None and self.switch not in SWITCHES:
            raise QKCircuitsError(f"detector {self.name!r}: unknown switch {self.switch!r}; choose from "
                                  f"{', '.join(SWITCHES)}")


@dataclass(frozen=True)
class ScanContext:
    """What a ``score`` function may read of the scan that calls it: the prompt settings and the token pool."""

    seed: int = 0
    n_seqs: int = 8
    seg_len: int = 40
    prefix_seqs: int = 10
    prefix_len: int = 25
    ov_tokens: int = 64
    ov_method: str = "sample"
    exclude_bos: bool = False
    bos: Optional[int] = None
    pool: object = None


_REGISTRY: Dict[str, Detector] = {}
ENTRY_POINT_GROUP = "qkcircuits.detectors"
_plugins: Dict[str, object] = {"loaded": False, "by_entry": {}}      # entry point "name = value" -> its names
_plugins_lock = threading.RLock()


def _registry() -> Dict[str, Detector]:
    """The registry, with the installed packages' detectors (``load_plugins``) added on first use (under a lock:
    a second thread's first use waits for them; re-entrant, so a plugin may read the registry while loading)."""
    if not _plugins["loaded"]:
        with _plugins_lock:
            if not _plugins["loaded"]:
                _plugins["loaded"] = True
                load_plugins()
    return _REGISTRY


def load_plugins(entry_points=None) -> List[str]:
    """Register the detectors installed packages declare under the ``qkcircuits.detectors`` entry point (a
    ``Detector``, a list of them, or a function returning either), so that every process (the CLI, ``zoo``,
    ``roles``, a Ray worker) sees them without an import. In a package's ``pyproject.toml``::

        [project.entry-points."qkcircuits.detectors"]
        self_attention = "my_package.detectors:self_attention"

    Runs once per process, on the registry's first use; returns the names registered. A plugin is all or
    nothing: one that fails to load, or any of whose names is already registered (a built-in, another plugin's,
    the user's), is skipped whole with one warning naming it; loading the same entry point again replaces its
    own detectors."""
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group=ENTRY_POINT_GROUP)
    from .._foundation.plugins import load_entry_points

    with _plugins_lock:
        return load_entry_points(entry_points, Detector, "qk.Detector", "detector", _REGISTRY, _plugins["by_entry"],
                                 lambda d: register_detector(d, replace=True))


def register_detector(det: Detector, *, replace: bool = False) -> Detector:
    """Add ``det`` to the registry (after the built-ins, in registration order); ``replace=True`` to redefine."""
    if not isinstance(det, Detector):
        raise QKCircuitsError(f"register_detector takes a qk.Detector, got {type(det).__name__}")
    if det.name in _REGISTRY and not replace:
        raise QKCircuitsError(f"a detector named {det.name!r} exists; pass replace=True to redefine it")
    clash = [d.name for d in _REGISTRY.values() if det.label and d.label == det.label and d.name != det.name]
    if clash:
        raise QKCircuitsError(f"label {det.label!r} is already given by detector {clash[0]!r}; choose another label")
    _REGISTRY[det.name] = det
    return det


def unregister_detector(name: str) -> None:
    """Remove a detector (built-ins included; re-register to restore)."""
    detector(name)
    del _REGISTRY[name]


def detectors() -> List[Detector]:
    """Every registered detector, in JSON/column order."""
    return list(_registry().values())


def detector(name: str) -> Detector:
    try:
        return _registry()[name]
    except KeyError:
        raise QKCircuitsError(f"unknown score {name!r}; choose from {', '.join(_REGISTRY)}") from None


def thresholds() -> Dict[str, Tuple[str, float]]:
    """label -> (score name, minimum), for every labelled detector (what ``HeadScores.labels`` reads)."""
    return {d.label: (d.name, float(d.threshold)) for d in _registry().values() if d.label is not None}


def labelled_scores() -> Tuple[str, ...]:
    """The scores that labels read (what a trace scans for)."""
    return tuple(d.name for d in _registry().values() if d.label is not None)


def select(scores: Union[None, str, Sequence[str]] = None, *, text: bool = False, copying: bool = True,
           eigen_copying: bool = True) -> List[str]:
    """The score names a scan computes, in registry order. ``scores`` (names or one comma-separated string)
    wins over the defaults; ``text=True`` adds the text detectors either way."""
    on = {"copying": copying, "eigen_copying": eigen_copying, "text": text}
    if scores is None:
        names = [d.name for d in _registry().values()
                 if (d.switch == "text" and text) or (d.switch != "text" and d.default and on.get(d.switch, True))]
        return names
    if isinstance(scores, str):
        scores = [x.strip() for x in scores.split(",") if x.strip()]
    names = list(scores)
    for n in names:
        detector(n)
    if not names:
        raise QKCircuitsError(f"name at least one score ({', '.join(_REGISTRY)})")
    if text:
        names += [d.name for d in _registry().values() if d.switch == "text" and d.name not in names]
    return [n for n in _registry() if n in names]


# ---------------------------------------------------------------------------------------------- target masks
def diagonal_mask(tokens: Int[Tensor, "batch pos"]) -> Bool[Tensor, "batch q k"]:
    """Each query's own position, for queries from position 1 (position 0 can attend to nothing else)."""
    b, n = tokens.shape
    eye = torch.eye(n, dtype=torch.bool, device=tokens.device)
    eye[0, 0] = False
    return eye[None].expand(b, n, n)


def target_masks(tokens: Int[Tensor, "batch pos"], seg_len: int,
                 first_query: Optional[int] = None) -> Dict[str, Bool[Tensor, "batch q k"]]:
    """Boolean [batch, query, key] masks of each score's targets (queries outside the region are all False).

    ``first_query`` (default ``1 + seg_len``: the first token of the second copy) starts the
    query region of the induction and duplicate masks; previous-token uses every i ≥ 2.
    """
    b, n = tokens.shape
    first = 1 + seg_len if first_query is None else first_query
    i = torch.arange(n, device=tokens.device)
    query_region = (i >= first)[None, :, None]
    earlier = i[None, :] < i[:, None]                                  # [q, k]: k < q
    same = tokens[:, :, None] == tokens[:, None, :]                    # tok[q] == tok[k]
    dup = same & earlier & query_region
    # induction: key k follows an earlier copy of tok[q]: tok[k-1] == tok[q], k-1 < q, k >= 1
    shifted = torch.zeros_like(same)
    shifted[:, :, 1:] = same[:, :, :-1] & earlier[None, :, :-1]
    ind = shifted & query_region
    prev = torch.zeros(n, n, dtype=torch.bool, device=tokens.device)
    prev[i[2:], i[2:] - 1] = True
    return {"induction": ind, "duplicate_token": dup, "previous_token": prev[None].expand(b, n, n)}


def induction_mask(tokens: Int[Tensor, "batch pos"], seg_len: int,
                   first_query: Optional[int] = None) -> Bool[Tensor, "batch q k"]:
    """Each query's induction targets (the token after an earlier copy of the current token), from
    ``first_query`` on: THE induction mask (the detector's; the induction receiver metric passes the ``seg_len``
    of its ``[BOS]+R+R`` rows, ``metrics.repeat_length``).

    >>> t = torch.tensor([[9, 1, 2, 1, 2]])             # [BOS] + R + R, R = (1, 2)
    >>> induction_mask(t, seg_len=2)[0].nonzero().tolist()   # query 3 (1) -> key 2, query 4 (2) -> key 3
    [[3, 2], [4, 3]]
    """
    return target_masks(tokens, seg_len, first_query)["induction"]


def previous_token_mask(tokens: Int[Tensor, "batch pos"], seg_len: int,
                        first_query: Optional[int] = None) -> Bool[Tensor, "batch q k"]:
    """The previous-token targets of ``target_masks`` (every query from position 2)."""
    return target_masks(tokens, seg_len, first_query)["previous_token"]


def duplicate_token_mask(tokens: Int[Tensor, "batch pos"], seg_len: int,
                         first_query: Optional[int] = None) -> Bool[Tensor, "batch q k"]:
    """The duplicate-token targets of ``target_masks`` (earlier copies of the query's token)."""
    return target_masks(tokens, seg_len, first_query)["duplicate_token"]
