"""qkcircuits: what does each attention head do?

>>> import qkcircuits as qk
>>> model = qk.load("smollm2-135m")                     # doctest: +SKIP
>>> scores = qk.scan(model)                             # doctest: +SKIP
>>> scores.top(5, "induction")                          # doctest: +SKIP

The public API is re-exported here explicitly; the modules behind it are private.
"""

from ._capture import Activations, capture, edit, has_rotary, hook_name, stream
from ._diagnose import HeadDiagnostics, diagnose, qk_statistics
from ._errors import QKCircuitsError
from ._heads import Head, all_heads, kv_head, model_heads, n_kv_heads, parse_heads
from ._model import load, pick_device
from ._sequences import natural_text, repeated_tokens, text_tokens, token_pool

__version__ = "0.1.0"

__all__ = [
    "Activations", "Head", "QKCircuitsError",
    "all_heads", "capture", "edit", "has_rotary", "hook_name", "kv_head", "load", "model_heads", "n_kv_heads",
    "natural_text", "parse_heads", "pick_device", "repeated_tokens", "stream", "text_tokens", "token_pool",
]
__all__ += ["HeadDiagnostics", "diagnose", "qk_statistics"]
