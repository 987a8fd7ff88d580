"""qkcircuits: what does each attention head do?

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")      # hand-built: 0.0 previous-token, 1.0 induction
>>> scores = qk.scan(model, progress=False)
>>> [(str(h), round(s, 2)) for h, s in scores.top(2, "induction")]
[('1.0', 1.0), ('1.1', 0.0)]
>>> model = qk.load("smollm2-135m")       # doctest: +SKIP (needs SmolLM2)

The public API is ONE list, ``_EXPORTS`` below: each root name once, next to the module it comes from. A name is
imported from its module on first use, so ``import qkcircuits`` and ``qkcircuits --help`` load no torch;
``__all__`` and ``dir(qk)`` are that list. Specialised names live in the public submodules (each with its own
explicit imports): ``qk.weights`` (the weight-level pieces of circuits), ``qk.results`` (every result class),
``qk.tasks`` (task builders and the task analyses' other names), ``qk.plot`` (figures for notebooks).
"""

from ._foundation.io import qkcircuits_version as _version

__version__ = _version()      # from the installed metadata (pyproject.toml), the one place it is written
del _version

# The root names, by the module each comes from ("name as alias" where the root name differs). Add a new export
# here; a specialised one goes to a public submodule instead (weights, results, tasks, plot).
_EXPORTS = {
    # Foundation: loading, heads, prompt sets, hooks.
    "._foundation.capture": "capture, edit, has_rotary, hook_name, stream",
    "._foundation.errors": "QKCircuitsError",
    "._foundation.heads": "Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads",
    "._foundation.model": "load, pick_device",
    "._foundation.sequences": "natural_text, repeated_tokens, segment_length, text_tokens, token_pool",
    # Circuits: weights only (their weight-level pieces: qk.weights).
    "._weights.circuit": "circuit",
    "._weights.qk_ov": "ov, qk",
    "._weights.kv_cache": "kv_cache",
    "._weights.verify": "verify_circuits",
    "._weights.composition": "composition_scores, k_composition_partners",
    "._weights.contextual": "ov_copying, INPUTS as VIEWS",            # the token views ("direct", ...)
    "._weights.copying": "copying_scores",
    "._weights.rotary": "offset_profile",
    # Analyses: detectors, ablation, diagnostics.
    "._analysis.ablate": "METHODS as ABLATION_METHODS, ablate, compare_to_random, group_effect",
    "._analysis.attribution_patching": "attribution",
    "._analysis.detect": "confirm_induction, mask_score, scan",
    "._analysis.detectors": "PROMPT_SETS, Detector, ScanContext, detector, detectors, diagonal_mask, register_detector, "
                            "target_masks, thresholds, unregister_detector",
    "._analysis.diagnose": "diagnose, qk_statistics",
    "._analysis.metrics": "Metric, as_metric, induction_loss, logit_diff, text_loss",
    "._analysis.sweep": "sweep",
    # How heads work together: path patching, edge attribution, the induction trace.
    "._paths.edges": "edge_attribution",
    "._paths.patching": "path_patch",
    "._paths.path_effects": "INPUTS as INTO",                          # the q/k/v inputs
    "._paths.trace": "trace_induction",
    # Why a head attends: exact QK attribution of its scores into pairs of upstream sources.
    "._explain.attend": "attend, attend_heads",
    # Explain a behaviour: tasks, the whole graph's scores, circuits and their faithfulness (the builders: qk.tasks).
    "._tasks.core": "core_circuit",
    "._tasks.find": "find_circuit",
    "._tasks.evaluation": "evaluate",
    "._tasks.faithfulness": "faithfulness",
    "._tasks.graph": "graph",
    "._tasks.registry": "register_task",
    "._tasks.roles": "roles",
    "._tasks.scores": "edge_scores, node_scores",
    "._tasks.task": "Task",
    # Where analyses run (Ray itself is imported only when a qk.Ray backend runs), and many models at once.
    "._foundation.backends": "Backend, BackendPool, Local, Ray, as_backend",
    "._scale.zoo": "zoo",
    # The one Result base of every result class (the classes: qk.results), and a reader of any result JSON.
    "._foundation.result": "Result, load_result",
    # Views (plotly, circuitsvis, Flask load with them).
    ".viz": "create_app, report_html, write_report",
    # The public submodules.
    ".": "plot, results, tasks, weights",
}
_HOME = {}                        # name -> (module, attribute), read from the list above
for _module, _names in _EXPORTS.items():
    for _name in _names.split(", "):
        _attr, _, _alias = _name.partition(" as ")
        _HOME[_alias or _attr] = (_module, _attr)
del _module, _names, _name, _attr, _alias
__all__ = sorted(_HOME)


def __getattr__(name: str):
    """A root name, imported from its module on first use (``import qkcircuits`` imports no torch); or a
    submodule (``qk.fixtures``, ``qk._foundation`` ...)."""
    import importlib

    if name in _HOME:
        module, attr = _HOME[name]
        if module == ".":                                           # a public submodule
            return importlib.import_module(f".{attr}", __name__)
        # the views load alone (plotly, Flask); any other name loads the rest of the API with it, as one import
        wanted = [n for n, (m, _) in _HOME.items() if m not in (".", ".viz")] if module != ".viz" else [name]
        for n in wanted:
            m, a = _HOME[n]
            globals()[n] = getattr(importlib.import_module(m, __name__), a)      # later lookups skip this hook
        return globals()[name]
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'qkcircuits' has no attribute {name!r}")


def __dir__():
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__))
