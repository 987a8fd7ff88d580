"""Which model a result came from: its name and a short fingerprint of its architecture and weights' shapes.

>>> fp = fingerprint(model)
>>> len(fp), fp == fingerprint(qk.load("toy-induction"))      # the same model loaded twice agrees
(12, True)
>>> record(model)["fingerprint"] == fp
True

``fingerprint(model)`` is the first 12 hex digits of the sha256 of ``facts(model)`` written as canonical JSON
(sorted keys, no spaces). ``facts`` holds exactly:

- ``family`` (the attention adapter's family: ``standard``, ``latent``, ...) and ``architecture`` (HF's
  ``config.architectures[0]``, else TransformerLens' ``cfg.architecture``);
- the config's ``n_layers``, ``n_heads``, ``n_kv_heads``, ``d_model``, ``d_head``, ``d_mlp``, ``d_vocab``,
  ``n_ctx``, ``normalization_type``, ``rotary_dim`` and the positional kind (``standard``, ``rotary``, ...);
- the weights' shapes: ``W_E`` [d_vocab, d_model], ``W_U`` [d_model, d_vocab_out], ``W_pos`` [n_ctx, d_model]
  (null without learned positions), and per layer the attention's ``[n_heads, n_kv_heads, d_qk, d_v]`` as its
  adapter reads them (so W_Q is [n_heads, d_model, d_qk], W_K [n_kv_heads, d_model, d_qk], W_V [n_kv_heads,
  d_model, d_v], W_O [n_heads, d_v, d_model]).

Not in it: the weights' values, the dtype, the device, and how the weights were processed (``fold_ln``): the
same checkpoint loaded twice, on another device, in bf16 or without folding has the same fingerprint; two
checkpoints of one shape (a model and its fine-tune) have the same one too, so the name is compared as well.
Cost: the config, three shape reads and one adapter per layer (no weight is touched; well under a millisecond
per layer).

Where it is recorded: ``settings["fingerprint"]`` of every result a model produces (``result.stamped(settings,
model)``), the ``fingerprint`` of a graph (``qk.graph``; so every task result and circuit file holds it under
``graph``), and the circuit command's JSON (``record(model)``). Readers call ``mismatch``: the same name and
fingerprint pass; a file that records no fingerprint (written before they existed) is compared by name; another
fingerprint is refused in one line naming both models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

from .arch import adapter, architecture, family
from .arch.model_facts import model_name, shape_config

LENGTH = 12          # hex digits kept: 48 bits, enough to tell the models of one machine apart


def facts(model) -> Dict[str, Any]:
    """What the fingerprint hashes (the module docstring lists it)."""
    out = dict(shape_config(model))
    out["family"] = family(model)
    out["architecture"] = architecture(model)
    layers = []
    for layer in range(int(model.cfg.n_layers)):
        a = adapter(model, layer)
        layers.append([int(a.n_heads), int(a.n_kv_heads), int(a.d_qk), int(a.d_v)])
    out["attention"] = layers
    return out


def fingerprint(model) -> str:
    """A short stable hash (12 hex digits) of ``facts(model)``: architecture and weights' shapes, not values."""
    text = json.dumps(facts(model), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:LENGTH]


def record(model, task=None) -> Dict[str, str]:
    """``{"model": name, "fingerprint": ..., "task": task name}`` (``task`` only when given: a ``qk.Task`` or a
    name): what a saved result says about where it came from."""
    out = {"model": model_name(model), "fingerprint": fingerprint(model)}
    if task is not None:
        out["task"] = str(task if isinstance(task, str) else task.name)
    return out


def _text(v: Any) -> Optional[str]:
    return v if isinstance(v, str) and v.strip() else None


def recorded(result: Any) -> Tuple[Optional[str], Optional[str]]:
    """(model name, fingerprint) a result records, None where it records none: a result object (its ``model``
    field, else ``settings["model"]``; ``settings["fingerprint"]``, else its graph's), a circuit file's view
    (``info``) or a plain dict (a file's top level, its ``settings``, its ``graph``)."""
    if isinstance(result, dict):
        d = result
    elif isinstance(getattr(result, "info", None), dict):
        d = result.info
    else:
        d = {"model": getattr(result, "model", None), "settings": getattr(result, "settings", None),
             "graph": {"fingerprint": getattr(getattr(result, "graph", None), "fingerprint", None)}}
    settings = d.get("settings") if isinstance(d.get("settings"), dict) else {}
    graph = d.get("graph") if isinstance(d.get("graph"), dict) else {}
    circuit = d.get("circuit") if isinstance(d.get("circuit"), dict) else {}
    name = _text(d.get("model")) or _text(settings.get("model"))
    fp = (_text(d.get("fingerprint")) or _text(settings.get("fingerprint")) or _text(graph.get("fingerprint"))
          or _text((circuit.get("graph") or {}).get("fingerprint") if isinstance(circuit.get("graph"), dict) else None))
    return name, fp


def mismatch(model, result: Any, names: Iterable[str] = ()) -> Optional[str]:
    """None when ``result`` may be shown as ``model``'s, else what differs (the recorded name and fingerprint,
    then this model's). ``names``: the names this model goes by besides ``model_name(model)`` (the spec it was
    loaded from, its file name ...). A result with no name passes; one with a name but no fingerprint (an older
    file) is compared by name; a fingerprint is compared as well."""
    name, fp = recorded(result)
    if name is None:
        return None
    known = {model_name(model), *names}
    if name not in known and Path(name).name not in known:
        return f"model {name[:80]!r}" + (f" (fingerprint {fp})" if fp else "")
    if fp is not None and fp != fingerprint(model):
        return f"model {name[:80]!r} with fingerprint {fp[:40]!r}"
    return None
