"""qkcircuits: what does each attention head do?

>>> import qkcircuits as qk
>>> model = qk.load("smollm2-135m")                     # doctest: +SKIP
>>> scores = qk.scan(model)                             # doctest: +SKIP
>>> scores.top(5, "induction")                          # doctest: +SKIP

The public API is re-exported here explicitly; the modules behind it are private.
"""

# Foundation: loading, heads, prompt sets, hooks.
from ._foundation.capture import Activations, capture, edit, has_rotary, hook_name, stream
from ._foundation.errors import QKCircuitsError
from ._foundation.heads import Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads
from ._foundation.model import load, pick_device
from ._foundation.sequences import natural_text, repeated_tokens, segment_length, text_tokens, token_pool

# Circuits: weights only (plus one cached corpus pass for the contextual token views).
from ._weights.circuits import (Circuit, LayerWeights, all_ov, all_qk, attn_input_hook, attn_scale, circuit,
                                circuit_caveats, embed_factor, embed_rows, full_ov, full_qk, layer_weights, ov,
                                ov_affine, qk, qk_affine, top_tokens, unembed_cols, unembed_embed, unembed_factor)
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
from ._analysis.detect import SCORE_NAMES, TEXT_SCORES, THRESHOLDS, confirm_induction, mask_score, scan, target_masks
from ._analysis.diagnose import HeadDiagnostics, diagnose, qk_statistics
from ._analysis.metrics import Metric, as_metric, induction_loss, logit_diff, text_loss
from ._analysis.results import HeadScores
from ._analysis.sweep import HeadEffects, sweep

# How heads work together: path patching, edge attribution, the induction trace.
from ._paths.edges import edge_attribution
from ._paths.patching import path_patch
from ._paths.path_effects import PathEffects
from ._paths.trace import trace_induction

# Explain a behaviour: tasks, the whole graph's edge scores, circuits and their faithfulness.
from ._tasks import builders as tasks
from ._tasks.circuit import Circuit as TaskCircuit
from ._tasks.circuit import Faithfulness, faithfulness, node_faithfulness
from ._tasks.graph import Graph, graph
from ._tasks.scores import EdgeScores, NodeScores, edge_scores, node_scores
from ._tasks.task import Task

# Many models at once (Ray itself is imported only for backend="ray").
from ._scale.zoo import Zoo, zoo

__version__ = "0.1.0"

# Views (plotly, circuitsvis, Flask) load on first use: `import qkcircuits` stays light.
_VIEWS = {"create_app", "report_html", "write_report"}
# qk.plot (figures for notebooks) is a submodule, imported on first use for the same reason.
_LAZY_MODULES = {"plot"}

__all__ = sorted([
    # foundation
    "Activations", "Head", "QKCircuitsError", "all_heads", "capture", "edit", "has_rotary", "hook_name", "kv_head",
    "load", "model_heads", "n_kv_heads", "natural_text", "parse_heads", "pick_device", "repeated_tokens", "segment_length", "stream",
    "text_tokens", "token_pool",
    # circuits
    "Circuit", "CompositionScores", "LayerWeights", "OffsetProfile", "RotarySpec", "all_ov", "all_qk",
    "attn_input_hook", "attn_scale", "circuit", "circuit_caveats", "composition_baseline", "composition_column",
    "composition_scores", "copying_accuracy", "copying_scores", "eigen_copying", "embed_factor", "embed_rows",
    "full_ov", "full_qk", "k_composition_partners", "layer_weights", "offset_profile", "offset_scores", "ov",
    "ov_affine", "positional_qk", "qk", "qk_affine", "qk_at_offset", "rotary_spec", "rotation", "top_tokens",
    "unembed_cols", "unembed_embed", "unembed_factor",
    "INPUTS", "TokenInputs", "copying_rank", "head_logits", "ov_copying", "token_inputs", "token_qk",
    # analyses
    "ABLATION_METHODS", "GroupEffect", "HeadDiagnostics", "HeadEffects", "HeadScores", "Metric", "RandomComparison",
    "SCORE_NAMES", "TEXT_SCORES", "THRESHOLDS", "ablate", "as_metric", "attribution", "compare_to_random", "confirm_induction", "diagnose",
    "group_effect", "induction_loss", "logit_diff", "mask_score", "qk_statistics", "scan", "sweep", "target_masks",
    "text_loss",
    "PathEffects", "edge_attribution", "path_patch", "trace_induction", "Zoo", "zoo",
    # tasks and circuits over the whole graph
    "EdgeScores", "Faithfulness", "Graph", "NodeScores", "Task", "TaskCircuit", "edge_scores", "faithfulness",
    "graph", "node_faithfulness", "node_scores", "tasks",
    # views
    *_VIEWS,
    *_LAZY_MODULES,
])


def __getattr__(name: str):
    if name in _VIEWS:
        from . import viz

        return getattr(viz, name)
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'qkcircuits' has no attribute {name!r}")
