"""qkcircuits: what does each attention head do?

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")      # hand-built: 0.0 previous-token, 1.0 induction
>>> scores = qk.scan(model, progress=False)
>>> [(str(h), round(s, 2)) for h, s in scores.top(2, "induction")]
[('1.0', 1.0), ('1.1', 0.0)]
>>> model = qk.load("smollm2-135m")       # doctest: +SKIP (needs SmolLM2)

The public API is re-exported here (imported from ``qkcircuits._api`` on first use, so ``import qkcircuits``
and ``qkcircuits --help`` stay light); the modules behind it are private.
"""

from ._foundation.io import qkcircuits_version as _version

__version__ = _version()      # from the installed metadata (pyproject.toml), the one place it is written
del _version

# Views (plotly, circuitsvis, Flask) load on first use: `import qkcircuits` stays light.
_VIEWS = {"create_app", "report_html", "write_report"}
# Submodules, imported on first use for the same reason: qk.plot (figures for notebooks), qk.tasks (task builders and
# the task analyses' other names), qk.weights (the weight-level pieces of circuits), qk.results (every result class).
_LAZY_MODULES = {"plot", "results", "tasks", "weights"}

__all__ = sorted([
    # foundation
    "Head", "QKCircuitsError", "all_heads", "capture", "edit", "has_rotary", "hook_name", "kv_head", "load",
    "model_heads", "n_kv_heads", "natural_text", "parse_heads", "pick_device", "repeated_tokens", "segment_length",
    "stream", "text_tokens", "token_pool",
    # circuits (their weight-level pieces: qk.weights)
    "circuit", "composition_scores", "copying_scores", "k_composition_partners", "kv_cache", "offset_profile", "ov",
    "ov_copying", "qk", "verify_circuits",
    # analyses
    "ABLATION_METHODS", "Metric", "Detector", "PROMPT_SETS", "ScanContext", "detector", "detectors", "diagonal_mask",
    "register_detector", "thresholds", "unregister_detector", "ablate", "as_metric", "attribution",
    "compare_to_random", "confirm_induction", "diagnose", "group_effect", "induction_loss", "logit_diff", "mask_score",
    "qk_statistics", "scan", "sweep", "target_masks", "text_loss",
    "INTO", "VIEWS", "Backend", "BackendPool", "Local", "Ray", "as_backend",
    "edge_attribution", "path_patch", "trace_induction", "zoo",
    # why a head attends
    "attend", "attend_heads",
    # tasks and circuits over the whole graph (builders and the rest: qk.tasks)
    "Task", "core_circuit", "edge_scores", "evaluate", "faithfulness", "find_circuit", "graph", "node_scores",
    "register_task",
    # every result class is in qk.results; the base and the reader of any result file are here
    "Result", "load_result",
    # views
    *_VIEWS,
    *_LAZY_MODULES,
])


_DEPRECATED = {"SCORE_NAMES", "TEXT_SCORES", "THRESHOLDS"}      # read from the detector registry, with a warning

# Root names that moved to a submodule: the old root name works for one release, with a DeprecationWarning
# (docs/architecture.md, "Root names that moved").
_MOVED = {
    **dict.fromkeys(["LayerWeights", "RotarySpec", "TokenInputs", "all_ov", "all_qk", "attn_input_hook", "attn_scale",
                     "circuit_caveats", "composition_baseline", "composition_column", "copying_accuracy",
                     "copying_rank", "eigen_copying", "embed_factor", "embed_rows", "full_ov", "full_qk",
                     "head_logits", "layer_weights", "offset_scores", "ov_affine", "positional_qk", "qk_affine",
                     "qk_at_offset", "rotary_spec", "rotation", "token_inputs", "token_qk", "top_tokens",
                     "unembed_cols", "unembed_embed", "unembed_factor"], "weights"),
    **dict.fromkeys(["Activations", "Attribution", "Circuit", "CircuitCheck", "CompositionScores", "CoreCircuit",
                     "EdgeScores", "Faithfulness", "GroupEffect", "HeadDiagnostics", "HeadEffects", "HeadScores",
                     "KVCache", "NodeScores", "OffsetProfile", "PathEffects", "RandomComparison", "Roles",
                     "TaskCircuit", "Zoo"], "results"),
    **dict.fromkeys(["Evaluation", "Graph", "node_faithfulness"], "tasks"),
}
_RENAMED = {"INPUTS": "VIEWS"}          # qk.INPUTS (the token views) is qk.VIEWS


def __getattr__(name: str):
    """Public names load on first use (see ``_api``): ``import qkcircuits`` imports no torch."""
    import importlib

    if name in _DEPRECATED:
        return getattr(importlib.import_module("._analysis.detect", __name__), name)
    if name in _MOVED or name in _RENAMED:
        import warnings

        new = f"{_MOVED[name]}.{name}" if name in _MOVED else _RENAMED[name]
        warnings.warn(f"qk.{name} is deprecated; use qk.{new} (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        if name in _RENAMED:
            return globals()[new] if new in globals() else __getattr__(new)
        return getattr(importlib.import_module(f".{_MOVED[name]}", __name__), name)
    if name in _VIEWS:
        from . import viz

        return getattr(viz, name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in __all__:
        api = importlib.import_module("._api", __name__)
        globals().update((k, v) for k, v in vars(api).items() if k in __all__)   # later lookups skip this hook
        if name in globals():
            return globals()[name]
    elif not name.startswith("__"):
        try:                                   # a submodule: qkcircuits._foundation, qkcircuits.fixtures ...
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'qkcircuits' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
