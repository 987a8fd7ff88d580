"""The plain instrumented forward every circuit method starts from, and the check that the graph's residual
semantics hold on the model.

- ``record``: a forward (no grad) that keeps every sender's output [S, b, p, d], every receiver's hook value
  (hook_q/k/v, mlp.hook_in, unembed.hook_in), the residuals the receivers read and the metric per row;
- ``clean_rows``: the metric per row of a plain forward (what a circuit holding every edge measures);
- ``check_graph``: per-head recomputed inputs equal the model's own, and the final residual is the sum of
  every sender's output plus a constant;
- ``_hooks``: the hook list the three runs share (``runs.py``'s gradient and patched runs splice through it);
- ``reuse``: pooled buffers across prompt shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._foundation.capture import _Stop
from .._foundation.errors import QKCircuitsError
from .._foundation.hugepages import advise
from .graph import (INPUT_HOOKS, Graph, head_outputs, logits_input, mlp_input, post_norm, split_qkv_from_residuals,
                    unembed_logits)

Key = Tuple[str, int]

@dataclass
class Record:
    """One run's sender outputs ``out`` [S, b, p, d], receiver hook values ``hooks[(x, L)]`` (x in q, k,
    v, mlp; ``("logits", 0)`` = unembed.hook_in; also ``("z", L)``, each layer's hook_z [b, p, H, e], and
    ``("attn_out", L)``, its attention module's output [b, p, d] (attn.hook_out)), the
    residuals receivers read ``resid[(x, L)]`` (x in attn, mlp, final) and the metric of each row ``rows`` [b]."""

    out: Tensor
    hooks: Dict[Key, Tensor] = field(default_factory=dict)
    resid: Dict[Key, Tensor] = field(default_factory=dict)
    rows: Optional[Tensor] = None
    heads: bool = True            # False: the heads' slots of ``out`` were not written (record(heads=False))


def _hooks(model, g: Graph, out: Optional[Tensor], stream: Dict[Key, Tensor], splice: Optional[Callable],
           keep: Optional[Dict[Key, Tensor]], emb_override: Optional[Tensor] = None, grad: bool = False,
           heads: bool = True, z_minus: Optional[Dict[Key, Tensor]] = None):
    """The hook list shared by the three runs: capture stream/outputs (``out`` None: no sender outputs,
    and no head-output einsums), optionally splice receiver inputs. ``heads=False``: the heads' slots of ``out``
    are not written (only z is kept); ``z_minus`` ({("z", L): z}): the heads' slots get the outputs of z − that
    z, i.e. the heads' Δ against that run (only where a head's output is linear in its z: no post-norm)."""
    z_of: Dict[int, Tensor] = {}
    hooks = []

    def resid_pre(L: int):
        def fn(t: Tensor, hook):
            if L == 0 and emb_override is not None:
                t = emb_override.to(t.dtype)
            if L == 0 and grad:           # frozen weights: the embedding is where the gradient graph starts
                t = t.detach().requires_grad_(True)
            stream[("attn", L)] = t
            if g.parallel and g.has_mlp:  # a parallel block's MLP reads the same residual as its attention
                stream[("mlp", L)] = t
            if L == 0 and out is not None:
                out[0] = t.detach()
            return t
        return fn

    def z_hook(L: int):
        def fn(t: Tensor, hook) -> None:
            z_of[L] = t.detach()
            if keep is not None:          # the record keeps z (small: [b, p, H, e]) for node patching
                keep[("z", L)] = z_of[L]
            if post_norm(model, L) is None and heads:
                z = z_of[L] if z_minus is None else z_of[L] - z_minus[("z", L)].to(z_of[L].dtype)
                with torch.no_grad():
                    head_outputs(model, L, z, out=out[g.head_sender(L):g.head_sender(L) + g.n_heads])
        return fn

    def y_hook(L: int):
        def fn(t: Tensor, hook) -> None:
            with torch.no_grad():
                head_outputs(model, L, z_of[L], t.detach(), out=out[g.head_sender(L):g.head_sender(L) + g.n_heads])
        return fn

    def keep_stream(key: Key):
        def fn(t: Tensor, hook) -> None:
            stream[key] = t
        return fn

    def attn_out(L: int):
        def fn(t: Tensor, hook) -> None:
            keep[("attn_out", L)] = t.detach()
        return fn

    def mlp_out(L: int):
        def fn(t: Tensor, hook) -> None:
            out[g.mlp_sender(L)] = t.detach()
        return fn

    def receiver(x: str, L: int):
        def fn(t: Tensor, hook):
            if keep is not None:
                keep[(x, L)] = t.detach()
            if splice is None:
                return None
            new = splice(x, L, t)
            return None if new is None else new.to(t.dtype)
        return fn

    for L in range(g.n_layers):
        hooks.append((f"blocks.{L}.hook_resid_pre", resid_pre(L)))
        if out is not None:
            hooks.append((f"blocks.{L}.attn.hook_z", z_hook(L)))
            if post_norm(model, L) is not None and (not heads or z_minus is not None):
                raise QKCircuitsError("heads=False / z_minus need head outputs linear in z (no post-attention norm)")
            if post_norm(model, L) is not None:
                hooks.append((f"blocks.{L}.attn.hook_out", y_hook(L)))
        if keep is not None and heads:    # a circuit forward whose layer reads only corrupt q/k/v returns it
            hooks.append((f"blocks.{L}.attn.hook_out", attn_out(L)))
        hooks += [(f"blocks.{L}.{INPUT_HOOKS[x]}", receiver(x, L)) for x in ("q", "k", "v")]
        if g.has_mlp:
            if not g.parallel:
                hooks.append((f"blocks.{L}.hook_resid_mid", keep_stream(("mlp", L))))
            hooks.append((f"blocks.{L}.{INPUT_HOOKS['mlp']}", receiver("mlp", L)))
            if out is not None:
                hooks.append((f"blocks.{L}.hook_mlp_out", mlp_out(L)))
    hooks.append(("ln_final.hook_in", keep_stream(("final", 0))))
    hooks.append(("unembed.hook_in", receiver("logits", 0)))
    return hooks


def clean_rows(model, task) -> Tensor:
    """The metric per row of a plain forward of ``task``'s clean rows (no hooks, no sender outputs): what a
    circuit holding every edge measures (``patched_run`` with the full mask reproduces this run exactly)."""
    with torch.no_grad():
        return _metric_rows(model, task, task.clean, [])


def _metric_rows(model, task, tokens: Tensor, hooks, copies: int = 1) -> Tensor:
    """Run with ``hooks`` and return the metric per row. A task metric reads one position per row, so the
    forward stops at the unembedding's input and only those b rows are unembedded (not b × pos)."""
    if task.metric.prompts != "task":           # a metric on token rows reads every position's logits
        return task.row_values(model.run_with_hooks(tokens, fwd_hooks=hooks), tokens)
    got: Dict[str, Tensor] = {}

    def stop(t: Tensor, hook):
        got["x"] = t
        raise _Stop

    try:
        model.run_with_hooks(tokens, fwd_hooks=list(hooks) + [("unembed.hook_in", stop)])
    except _Stop:
        pass
    if "x" not in got:
        raise QKCircuitsError("this model never fired unembed.hook_in; the circuit graph needs it")
    x = got["x"]
    rows = torch.arange(x.shape[0], device=x.device)
    end = task.positions["END"].to(x.device).repeat(copies)
    logits = unembed_logits(model, x[rows, end].unsqueeze(1))                          # [b, 1, vocab]
    return task.at_end().row_values(logits)


def reuse(pool: Optional[Dict[str, Tensor]], name: str, shape: Tuple[int, ...], dtype, device) -> Tensor:
    """An uninitialised tensor of ``shape``: a view of ``pool[name]``'s first elements when that flat buffer
    is large enough (a caller running many prompt shards allocates the first shard's buffers once, sparing
    every later shard a fresh allocation's page faults), else a new buffer kept there."""
    n = 1
    for s in shape:
        n *= int(s)
    flat = None if pool is None else pool.get(name)
    if flat is None or flat.numel() < n or flat.dtype != dtype or flat.device != torch.device(device):
        flat = advise(torch.empty(n, dtype=dtype, device=device))     # huge pages: a cheap first touch
        if pool is not None:
            pool[name] = flat
    return flat[:n].view(shape)


def _buffer(model, g: Graph, tokens: Tensor, pool: Optional[Dict[str, Tensor]] = None, name: str = "out") -> Tensor:
    b, p = tokens.shape
    # uninitialised, not zeros: every run writes each sender's slot before anything reads it
    return reuse(pool, name, (g.n_senders, b, p, model.cfg.d_model), model.W_E.dtype, model.W_E.device)


def record(model, g: Graph, task, tokens: Tensor, pool: Optional[Dict[str, Tensor]] = None,
           heads: bool = True) -> Record:
    """A plain forward of ``tokens`` (a shard's clean or corrupt rows) keeping what ``Record`` lists; its
    sender outputs in ``pool["record"]`` when given (``reuse``). ``heads=False`` (only without post-attention
    norms): the heads' slots of ``out`` are left unwritten (a caller that needs only their Δ computes it from
    z, ``runs.grad_run(z_minus=)``); ``Record.heads`` says which."""
    out = _buffer(model, g, tokens, pool, "record")
    stream: Dict[Key, Tensor] = {}
    keep: Dict[Key, Tensor] = {}
    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, None, keep, heads=heads)).detach()
    missing = [k for k in [("q", 0), ("logits", 0)] if k not in keep]
    if missing or ("final", 0) not in stream:
        raise QKCircuitsError("this model never fired hook_q / ln_final.hook_in / unembed.hook_in; the circuit "
                              "graph needs a TransformerLens bridge (or native model) with those hook points")
    return Record(out, keep, {k: v.detach() for k, v in stream.items()}, rows, heads)


def check_graph(model, g: Graph, rec: Record, tokens: Tensor, atol: float = 1e-4, rows: int = 2) -> None:
    """The residual semantics hold on this model: per-head recomputed inputs equal the model's own, and the
    final residual is the sum of every sender's output plus a constant (the biases). Raises otherwise.
    Tolerances are at least the residual dtype's epsilon (bf16: 0.0078), so rounding alone never fails it.
    Checks the record's first ``rows`` prompts: every identity is per prompt (the attention mixing is
    inside the recorded values), so more rows would repeat the same check at the cost of a forward."""
    out = rec.out[:, :rows]
    if not rec.heads:                 # the heads' outputs of these rows, from the z the record kept
        out = out.clone()
        for L in range(g.n_layers):
            head_outputs(model, L, rec.hooks[("z", L)][:rows], out=out[g.head_sender(L):g.head_sender(L) + g.n_heads])
    rec = Record(out, {k: v[:rows] for k, v in rec.hooks.items()}, {k: v[:rows] for k, v in rec.resid.items()})
    eps = float(torch.finfo(rec.resid[("final", 0)].dtype).eps)
    atol, rtol = max(atol, eps), max(1e-3, eps)
    with torch.no_grad():
        for L in range(g.n_layers):
            x = rec.resid[("attn", L)]
            for into, n in (("q", g.n_heads), ("k", g.n_kv), ("v", g.n_kv)):
                mine = split_qkv_from_residuals(model, L, into, x.unsqueeze(0).expand(n, *x.shape), range(n))
                if not torch.allclose(mine, rec.hooks[(into, L)], atol=atol, rtol=rtol):
                    raise QKCircuitsError(f"recomputing layer {L}'s hook_{into} from the residual (ln1, W_{into.upper()})"
                                          f" does not reproduce the model's (max diff "
                                          f"{float((mine - rec.hooks[(into, L)]).abs().max()):.3g}); the circuit "
                                          f"graph does not support this architecture yet")
            if g.has_mlp:
                mine = mlp_input(model, L, rec.resid[("mlp", L)])
                if not torch.allclose(mine, rec.hooks[("mlp", L)], atol=atol, rtol=rtol):
                    raise QKCircuitsError(f"layer {L}'s MLP input is not ln2 of the residual; unsupported architecture")
        mine = logits_input(model, rec.resid[("final", 0)])
        if not torch.allclose(mine, rec.hooks[("logits", 0)], atol=atol, rtol=rtol):
            raise QKCircuitsError("the unembedding's input is not the final norm of the last residual; unsupported")
        # a task metric's logits are computed from the unembedding's input (``_metric_rows``): they must be the
        # model's own, post-unembedding transforms (soft-caps, logit scales) included
        own = model(tokens[:rows])
        own = own.logits if hasattr(own, "logits") else own
        mine = unembed_logits(model, rec.hooks[("logits", 0)])
        scale = float(own.abs().max()) + 1.0
        if float((mine - own).abs().max()) > atol * scale * 10:
            raise QKCircuitsError(f"the unembedding of unembed.hook_in does not reproduce this model's logits (max "
                                  f"difference {float((mine - own).abs().max()):.3g}): it transforms its logits after "
                                  f"the unembedding in a way TransformerLens does not declare; unsupported")
        total = rec.out.sum(0)
        rest = rec.resid[("final", 0)] - total              # the biases: must not depend on the prompt
        scale = float(rec.resid[("final", 0)].abs().max()) + 1.0
        if float((rest - rest[:1, :1]).abs().max()) > atol * scale * 10:
            raise QKCircuitsError(f"the final residual is not the sum of the embedding, the heads' and the MLPs' "
                                  f"outputs plus a constant (max deviation {float((rest - rest[:1, :1]).abs().max()):.3g}"
                                  f"); the circuit graph does not support this architecture yet")
