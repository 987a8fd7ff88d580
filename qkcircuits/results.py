"""Every result class: what the analyses return (tensors and settings first; ``to_json``, ``from_json``,
``to_frame``, ``top``), for ``isinstance`` checks and for reading a file back by its class.

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")
>>> scores = qk.scan(model, scores="induction", progress=False)
>>> isinstance(scores, qk.results.HeadScores), isinstance(scores, qk.Result)
(True, True)
>>> type(qk.load_result(scores.to_json())).__name__        # any result file, by its schema
'HeadScores'

These were root names (``qk.HeadScores``, ...) before 0.2.0 (CHANGELOG.md); ``qk.Result`` (the base) and
``qk.load_result`` are at the root too. The explicit imports below are the module's one list of names (``__all__``
is read from them).
"""

# ruff: noqa: F401
from ._analysis.ablate import GroupEffect, RandomComparison
from ._analysis.diagnose import HeadDiagnostics
from ._analysis.head_scores import HeadScores
from ._analysis.sweep import HeadEffects
from ._explain.attribution import Attribution
from ._foundation.capture import Activations
from ._foundation.result import Result, load_result
from ._paths.path_effects import PathEffects
from ._scale.zoo import Zoo
from ._tasks.circuit_report import CircuitReport
from ._tasks.core import CoreCircuit
from ._tasks.faithfulness import Faithfulness
from ._tasks.roles import Roles
from ._tasks.scores import EdgeScores, NodeScores
from ._tasks.selection import TaskCircuit
from ._tasks.stability import Stability
from ._weights.circuit import Circuit
from ._weights.composition import CompositionScores
from ._weights.kv_cache import KVCache
from ._weights.rotary import OffsetProfile
from ._weights.verify import CircuitCheck

__all__ = sorted(n for n in dir() if not n.startswith("_"))      # the imports above: the one list
