"""The public API, imported on the first use of any ``qkcircuits`` name (``qkcircuits/__init__`` stays light:
``import qkcircuits`` and ``qkcircuits --help`` do not import torch or TransformerLens).

Add new public names here (the import) and to ``__all__`` in ``qkcircuits/__init__.py``.
"""

# ruff: noqa: F401
# Foundation: loading, heads, prompt sets, hooks.
from ._foundation.capture import Activations, capture, edit, has_rotary, hook_name, stream
from ._foundation.errors import QKCircuitsError
from ._foundation.heads import Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads
from ._foundation.model import load, pick_device
from ._foundation.sequences import natural_text, repeated_tokens, segment_length, text_tokens, token_pool

# Circuits: weights only (plus one cached corpus pass for the contextual token views).
from ._weights.circuit import Circuit, circuit
from ._weights.circuits import (LayerWeights, all_ov, all_qk, attn_input_hook, attn_scale, circuit_caveats, embed_factor,
                                embed_rows, full_ov, full_qk, layer_weights, ov, ov_affine, qk, qk_affine, top_tokens,
                                unembed_cols, unembed_embed, unembed_factor)
from ._weights.kv_cache import KVCache, kv_cache
from ._weights.verify import CircuitCheck, verify_circuits
from ._weights.composition import (CompositionScores, composition_baseline, composition_column, composition_scores,
                                   k_composition_partners)
from ._weights.contextual import INPUTS, TokenInputs, copying_rank, head_logits, ov_copying, token_inputs, token_qk
from ._weights.copying import copying_accuracy, copying_scores, eigen_copying
from ._weights.rotary import (OffsetProfile, RotarySpec, offset_profile, offset_scores, positional_qk, qk_at_offset,
                              rotary_spec, rotation)

# Analyses: detectors, ablation, diagnostics.
from ._analysis.ablate import METHODS as ABLATION_METHODS
from ._analysis.ablate import GroupEffect, RandomComparison, ablate, compare_to_random, group_effect
from ._analysis.attribution import attribution
from ._analysis.detect import confirm_induction, mask_score, scan
from ._analysis.detectors import (PROMPT_SETS, Detector, ScanContext, detector, detectors, diagonal_mask,
                                  register_detector, target_masks, thresholds, unregister_detector)
from ._analysis.diagnose import HeadDiagnostics, diagnose, qk_statistics
from ._analysis.metrics import Metric, as_metric, induction_loss, logit_diff, text_loss
from ._analysis.results import HeadScores
from ._analysis.sweep import HeadEffects, sweep

# How heads work together: path patching, edge attribution, the induction trace.
from ._paths.edges import edge_attribution
from ._paths.patching import path_patch
from ._paths.path_effects import INPUTS as INTO
from ._paths.path_effects import PathEffects
from ._weights.contextual import INPUTS as VIEWS     # the token views ("direct", ...); qk.INPUTS is the old name
from ._paths.trace import trace_induction

# Why a head attends: exact QK attribution of its scores into pairs of upstream sources.
from ._explain.attend import attend, attend_heads
from ._explain.attribution import Attribution

# Explain a behaviour: tasks, the whole graph's edge scores, circuits and their faithfulness.
from ._tasks import builders as tasks
from ._tasks.faithfulness import Faithfulness, faithfulness, node_faithfulness
from ._tasks.core import CoreCircuit, core_circuit
from ._tasks.evaluation import Evaluation, evaluate
from ._tasks.graph import Graph, graph
from ._tasks.roles import Roles
from ._tasks.selection import TaskCircuit
from ._tasks.scores import EdgeScores, NodeScores, edge_scores, node_scores
from ._tasks.task import Task

# Where analyses run (Ray itself is imported only when a qk.Ray backend runs), and many models at once.
from ._foundation.backends import Backend, Local, Ray, as_backend
from ._scale.zoo import Zoo, zoo

# The one Result base of every result class, and a reader of any result JSON by its schema.
from ._foundation.result import Result, load_result
