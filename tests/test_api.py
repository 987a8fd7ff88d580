"""The public API is what __all__ says: every name resolves, none is listed twice, no private leak; the root names that
moved to a submodule (``qk.weights``, ``qk.results``, ``qk.tasks``) are gone from the root (0.2.0)."""

import importlib
import subprocess
import sys

import pytest

import qkcircuits as qk


def test_every_exported_name_resolves_once():
    assert len(qk.__all__) == len(set(qk.__all__))
    for name in qk.__all__:
        assert getattr(qk, name) is not None, name
        assert not name.startswith("_")


def test_views_load_lazily():
    code = "import sys, qkcircuits; print('flask' in sys.modules, 'plotly' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    assert qk.write_report is importlib.import_module("qkcircuits.viz").write_report


# The root names that moved to a submodule in 0.2.0 (CHANGELOG.md), each with its home; the old root names are gone.
MOVED = {
    "weights": ["LayerWeights", "RotarySpec", "TokenInputs", "all_ov", "all_qk", "attn_input_hook", "attn_scale",
                "circuit_caveats", "composition_baseline", "composition_column", "copying_accuracy", "copying_rank",
                "eigen_copying", "embed_factor", "embed_rows", "full_ov", "full_qk", "head_logits", "layer_weights",
                "offset_scores", "ov_affine", "positional_qk", "qk_affine", "qk_at_offset", "rotary_spec", "rotation",
                "token_inputs", "token_qk", "top_tokens", "unembed_cols", "unembed_embed", "unembed_factor"],
    "results": ["Activations", "Attribution", "Circuit", "CircuitCheck", "CompositionScores", "CoreCircuit",
                "EdgeScores", "Faithfulness", "GroupEffect", "HeadDiagnostics", "HeadEffects", "HeadScores", "KVCache",
                "NodeScores", "OffsetProfile", "PathEffects", "RandomComparison", "Roles", "TaskCircuit", "Zoo"],
    "tasks": ["Evaluation", "Graph", "node_faithfulness"],
}


def test_old_root_names_are_gone_and_live_in_their_submodule():
    assert len(qk.__all__) < 90 and {"weights", "results", "tasks", "plot"} <= set(qk.__all__)
    for home, names in MOVED.items():
        sub = getattr(qk, home)
        for name in names:
            assert name not in qk.__all__ and name not in dir(qk), name
            with pytest.raises(AttributeError, match=rf"no attribute {name!r}"):
                getattr(qk, name)
            assert name in sub.__all__ and getattr(sub, name) is not None, (name, home)
    for old in ("INPUTS", "THRESHOLDS", "SCORE_NAMES", "TEXT_SCORES", "_MOVED", "_DEPRECATED", "_RENAMED"):
        with pytest.raises(AttributeError):
            getattr(qk, old)
    assert qk.VIEWS == ("direct", "effective", "contextual")
    # every result class lives in qk.results: each Result subclass the package defines, the test-only ones aside
    for cls in qk.Result.__subclasses__():
        if cls.__module__.startswith("qkcircuits."):
            assert getattr(qk.results, cls.__name__, None) is cls, cls
    # each submodule's names are its imports, each once
    for sub in (qk.weights, qk.results, qk.tasks):
        assert len(sub.__all__) == len(set(sub.__all__)) and all(getattr(sub, n) is not None for n in sub.__all__)
