"""The public API, imported on the first use of any ``qkcircuits`` name (``qkcircuits/__init__`` stays light:
``import qkcircuits`` and ``qkcircuits --help`` do not import torch or TransformerLens).

Add new public names here (the import) and to ``__all__`` in ``qkcircuits/__init__.py``; specialised ones go to a
public submodule instead (``qk.weights``, ``qk.results``, ``qk.tasks``, ``qk.plot``).
"""

# ruff: noqa: F401
# Foundation: loading, heads, prompt sets, hooks.
from ._foundation.capture import capture, edit, has_rotary, hook_name, stream
from ._foundation.errors import QKCircuitsError
from ._foundation.heads import Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads
from ._foundation.model import load, pick_device
from ._foundation.sequences import natural_text, repeated_tokens, segment_length, text_tokens, token_pool

# Circuits: weights only (their weight-level pieces: qk.weights).
from ._weights.circuit import circuit
from ._weights.circuits import ov, qk
from ._weights.kv_cache import kv_cache
from ._weights.verify import verify_circuits
from ._weights.composition import composition_scores, k_composition_partners
from ._weights.contextual import ov_copying
from ._weights.copying import copying_scores
from ._weights.rotary import offset_profile

# Analyses: detectors, ablation, diagnostics.
from ._analysis.ablate import METHODS as ABLATION_METHODS
from ._analysis.ablate import ablate, compare_to_random, group_effect
from ._analysis.attribution import attribution
from ._analysis.detect import confirm_induction, mask_score, scan
from ._analysis.detectors import (PROMPT_SETS, Detector, ScanContext, detector, detectors, diagonal_mask,
                                  register_detector, target_masks, thresholds, unregister_detector)
from ._analysis.diagnose import diagnose, qk_statistics
from ._analysis.metrics import Metric, as_metric, induction_loss, logit_diff, text_loss
from ._analysis.sweep import sweep

# How heads work together: path patching, edge attribution, the induction trace.
from ._paths.edges import edge_attribution
from ._paths.patching import path_patch
from ._paths.path_effects import INPUTS as INTO
from ._weights.contextual import INPUTS as VIEWS     # the token views ("direct", ...); qk.INPUTS is the old name
from ._paths.trace import trace_induction

# Why a head attends: exact QK attribution of its scores into pairs of upstream sources.
from ._explain.attend import attend, attend_heads

# Explain a behaviour: tasks, the whole graph's edge scores, circuits and their faithfulness (the builders: qk.tasks).
from ._tasks.core import core_circuit
from ._tasks.find import find_circuit
from ._tasks.evaluation import evaluate
from ._tasks.faithfulness import faithfulness
from ._tasks.graph import graph
from ._tasks.registry import register_task
from ._tasks.scores import edge_scores, node_scores
from ._tasks.task import Task

# Where analyses run (Ray itself is imported only when a qk.Ray backend runs), and many models at once.
from ._foundation.backends import Backend, BackendPool, Local, Ray, as_backend
from ._scale.zoo import zoo

# The one Result base of every result class (the classes: qk.results), and a reader of any result JSON by its schema.
from ._foundation.result import Result, load_result
