"""qkcircuits: what does each attention head do?

>>> import qkcircuits as qk
>>> model = qk.load("smollm2-135m")                     # doctest: +SKIP
>>> scores = qk.scan(model)                             # doctest: +SKIP
>>> scores.top(5, "induction")                          # doctest: +SKIP

The public API is re-exported here explicitly; the modules behind it are private.
"""

from ._ablate import METHODS as ABLATION_METHODS, GroupEffect, RandomComparison, ablate, compare_to_random, group_effect
from ._attribution import attribution
from ._circuits import (Circuit, LayerWeights, all_ov, all_qk, attn_input_hook, attn_scale, circuit, circuit_caveats,
                        embed_factor, embed_rows, full_ov, full_qk, layer_weights, ov, ov_affine, qk, qk_affine, top_tokens,
                        unembed_cols, unembed_embed, unembed_factor)
from ._composition import (CompositionScores, composition_baseline, composition_column, composition_scores,
                           k_composition_partners)
from ._copying import copying_accuracy, copying_scores, eigen_copying
from ._rotary import (OffsetProfile, RotarySpec, offset_profile, offset_scores, positional_qk, qk_at_offset, rotary_spec,
                      rotation)
from ._capture import Activations, capture, edit, has_rotary, hook_name, stream
from ._diagnose import HeadDiagnostics, diagnose, qk_statistics
from ._detect import THRESHOLDS, confirm_induction, mask_score, scan, target_masks
from ._errors import QKCircuitsError
from ._heads import Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads
from ._metrics import Metric, as_metric, induction_loss, logit_diff, text_loss
from ._model import load, pick_device
from ._results import HeadScores
from ._sequences import natural_text, repeated_tokens, text_tokens, token_pool
from ._sweep import HeadEffects, sweep

__version__ = "0.1.0"

__all__ = [
    "Activations", "Head", "HeadScores", "QKCircuitsError", "THRESHOLDS",
    "all_heads", "capture", "confirm_induction", "edit", "has_rotary", "hook_name", "kv_head", "load", "mask_score", "model_heads", "n_kv_heads",
    "natural_text", "parse_heads", "pick_device", "repeated_tokens", "scan", "stream", "target_masks", "text_tokens", "token_pool",
]
__all__ += ["HeadDiagnostics", "diagnose", "qk_statistics"]
__all__ += ["ABLATION_METHODS", "GroupEffect", "HeadEffects", "Metric", "RandomComparison", "ablate", "as_metric", "attribution",
            "compare_to_random", "group_effect", "induction_loss", "logit_diff", "sweep", "text_loss"]
__all__ += ["Circuit", "CompositionScores", "LayerWeights", "OffsetProfile", "RotarySpec", "all_ov", "all_qk", "attn_input_hook",
            "attn_scale", "circuit", "circuit_caveats", "composition_baseline", "composition_column", "composition_scores", "copying_accuracy",
            "copying_scores", "eigen_copying", "embed_rows", "full_ov", "full_qk", "k_composition_partners", "layer_weights",
            "offset_profile", "offset_scores", "ov", "ov_affine", "positional_qk", "qk", "qk_affine", "qk_at_offset",
            "rotary_spec", "rotation", "top_tokens", "unembed_cols", "embed_factor", "unembed_embed", "unembed_factor"]

from .viz import create_app, report_html, write_report  # noqa: E402  (browser views: report and app)
__all__ += ["create_app", "report_html", "write_report"]
