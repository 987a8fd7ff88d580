"""The instrumented forwards built on ``record.py``'s plain one (one prompt shard each).

- ``grad_run``: a forward with gradients in which each receiver reads its OWN copy of the residual, then
  ONE backward of the metric sum; each copy's gradient ∂m/∂(receiver input) [n, b, p, d] is handed to
  ``on_grad`` as the backward reaches it and then dropped (only one layer's gradients exist at a time).
  The q/k/v copies are virtual where the input has a closed form (``inputs.py``: the model's own hook_q/k/v
  gradient through the closed-form VJP), else expanded copies through ``split_qkv_from_residuals``; the
  MLP and the logits read a clone (ln2 / the final norm).
- ``plain_run``: a forward (no grad) filling the sender outputs, for the gradient methods whose points do not
  include the clean run itself.
- ``node_run``: the node view's one forward (the left-out heads' z from the corrupt run).

The circuit forward, ``patched_run``, is ``patched.py`` (re-exported here for the tests and tools that reach
every run through this module).

``grad_run`` and ``patched_run`` take the ungrouped graph (``ungrouped.py``): its k/v receivers are per query head,
and every layer's hook_k/hook_v then returns one value per query head.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import INPUT_HOOKS, Graph, logits_input, mlp_input, post_norm, split_qkv_from_residuals
from .._foundation.inputs import InputParts, closed_form, input_vjp
# re-exported for the tests and tools that reach every run through this module
from .patched import PatchedRun, Strategy, patched_run  # noqa: F401
from .record import Key, Record, _buffer, _hooks, _metric_rows, check_graph, clean_rows, record, reuse  # noqa: F401
from .ungrouped import expand, per_query_kv


def grad_run(model, g: Graph, task, tokens: Tensor, on_grad: Callable[[slice, Tensor], None],
             emb_override: Optional[Tensor] = None, out: Optional[Tensor] = None,
             dest: Optional[Callable[[slice], Optional[Tensor]]] = None,
             z_minus: Optional[Dict[Key, Tensor]] = None, extra_hooks: Sequence = (),
             cut_layers: Sequence[int] = ()) -> float:
    """Forward with every receiver reading its own residual copy, one backward of the metric SUM over
    the rows; ``on_grad(receiver slice, grad [n, b, p, d])`` per receiver group. Fills ``out`` (sender
    outputs, detached) when given; without it records none. Returns the metric sum. ``dest(slice)``: where
    the closed-form VJP may write a group's gradient (a caller summing into one buffer spares a copy; the
    tensor handed to ``on_grad`` is then that one), or None. ``z_minus``: another run's hook_z per layer
    (``record``'s): the heads' slots of ``out`` then hold their Δ against that run, (z − z') W_O, not their
    outputs (no post-attention norms).

    Every copy of a layer's residual equals the layer's one residual in this run, so where the q/k/v
    input has a closed form (``inputs.py``: RMSNorm or LayerNorm, checked on the run) the copies are never
    made: the model computes its own hook_q/k/v, the backward hands their gradient [b, p, n, e], and the
    closed-form VJP turns it into each head's ∂m/∂(own copy). Elsewhere (bf16, latent attention, other
    norms) each head reads an expanded copy through ``split_qkv_from_residuals`` and autograd does it.
    The MLP and the logits read a clone of their residual. Holds one forward's autograd graph (no copies
    in it on the closed-form path; [H + 2 G, b, p, d] normed copies per layer otherwise); it grows with
    the shard's tokens and has no cap of its own (docs/benchmarks.md: EAP +10.69 GB for SmolLM2 at 2 × 1,281
    tokens on the closed-form path, +11.8 GB with the copies): mostly the model's own attention scores and
    patterns, kept for the backward.

    ``extra_hooks``: more (hook name, fn) pairs for this forward (EAP-IG on activations replaces one node's
    output by a constant); ``cut_layers``: the layers whose attention output such a hook replaces, so that no
    gradient reaches their q/k/v (their receivers get none, which is then not an error)."""
    stream: Dict[Key, Tensor] = {}
    hooked: List[str] = []              # every closed-form gradient hook registered, and those that fired
    fired: set = set()

    def from_hook_grad(sl: slice, parts: InputParts, xb: Tensor, heads: List[int], name: str):
        def fn(grad: Tensor) -> None:
            fired.add(name)
            on_grad(sl, input_vjp(parts, xb, grad, heads, out=dest(sl) if dest is not None else None))
        return fn

    def splice(x: str, L: int, t: Tensor) -> Optional[Tensor]:
        if x in ("q", "k", "v"):
            heads = g.input_heads(x)             # ungrouped k/v: one receiver per query head, W of its KV head
            n = len(heads)
            wide = g.ungrouped and x != "q"
            base = stream[("attn", L)]
            sl = g.recv_slice(L, x)
            parts = closed_form(model, L, x, base, t) if t.requires_grad else None
            if parts is not None:
                xb = base.detach()
                # a NEW view carries the hook: the bridge reads an unedited hook value (the same object back)
                # from its own pre-hook tensor, so a gradient hook on ``t`` itself would never fire. Ungrouped:
                # the value per query head, whose gradient arrives per query head
                mine = expand(t, g.group) if wide else t.view(t.shape)
                mine.register_hook(from_hook_grad(sl, parts, xb, heads, f"blocks.{L}.{INPUT_HOOKS[x]}"))
                hooked.append(f"blocks.{L}.{INPUT_HOOKS[x]}")
                return mine
            copies = base.unsqueeze(0).expand(n, *base.shape)
            copies.register_hook(lambda grad, sl=sl: on_grad(sl, grad))
            return split_qkv_from_residuals(model, L, x, copies, heads)
        base = stream[("mlp", L)] if x == "mlp" else stream[("final", 0)]
        own = base.clone()
        sl = g.recv_slice(L, "mlp") if x == "mlp" else slice(g.logits_receiver, g.logits_receiver + 1)
        own.register_hook(lambda grad, sl=sl: on_grad(sl, grad.unsqueeze(0)))
        return mlp_input(model, L, own) if x == "mlp" else logits_input(model, own)

    with torch.enable_grad(), per_query_kv(model, g):
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, splice, None, emb_override, True,
                                                        z_minus=z_minus) + list(extra_hooks))
        total = rows.sum()
        # Gradients of the activations only (the receiver copies' hooks fire on the way to the embedding
        # leaf): ``total.backward()`` would also compute and KEEP a weights-sized ``.grad`` on every
        # parameter, accumulating over calls.
        torch.autograd.grad(total, stream[("attn", 0)])
    # every q/k/v value is on the way to the metric: a hook the backward never reached means the attention did
    # not read the value the hook returned, and those receivers' edges would silently score 0
    cut = {f"blocks.{L}.{INPUT_HOOKS[x]}" for L in cut_layers for x in ("q", "k", "v")}
    missed = [h for h in hooked if h not in fired and h not in cut]
    if missed:
        raise QKCircuitsError(f"the backward never reached this model's {', '.join(missed[:3])}"
                              f"{' …' if len(missed) > 3 else ''} (its attention does not read the value the hook "
                              f"returns); its edge scores cannot be computed this way")
    return float(total.detach())


def plain_run(model, g: Graph, task, tokens: Tensor, out: Tensor, z_minus: Optional[Dict[Key, Tensor]] = None,
              keep: Optional[Dict[Key, Tensor]] = None) -> float:
    """A forward (no grad) of ``tokens`` that fills ``out`` with the sender outputs (with ``z_minus``, the heads'
    slots with their Δ against that run, as ``grad_run``) and ``keep`` with the hook values ``record`` keeps
    (each layer's attention output among them); returns the metric sum. The gradient methods whose points do
    not include the clean run itself (EAP-IG's left and midpoint rules, on activations) take Δ and m(clean)
    from it."""
    stream: Dict[Key, Tensor] = {}
    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, _hooks(model, g, out, stream, None, keep, z_minus=z_minus))
    return float(rows.sum())


def _check_z(z: Tensor, g: Graph, layer: int) -> None:
    """node_run patches z[:, :, heads]: the hook value must be [b, p, H, e] (a flat or head-major layout would
    patch features or positions instead, silently)."""
    if z.dim() != 4 or z.shape[2] != g.n_heads:
        raise QKCircuitsError(f"blocks.{layer}.attn.hook_z is {tuple(z.shape)}, not [batch, pos, {g.n_heads} heads, "
                              f"d_head]: the node view cannot patch heads of this model this way")


def z_patchable(model, g: Graph) -> bool:
    """Whether ``node_run`` applies: every head's output is z_h W_O[h], a function of its own z (no block has a
    post-attention norm, whose rms mixes the layer's heads)."""
    return all(post_norm(model, L) is None for L in range(g.n_layers))


def node_run(model, g: Graph, task, corrupt: Record, heads_out: Sequence[Tuple[int, int]],
             mlps_out: Sequence[int] = (), where: Optional[Dict[Tuple[int, int], Tensor]] = None
             ) -> Optional[Tensor]:
    """The metric per row [b] when every head in ``heads_out`` ((layer, head) pairs) gives its corrupt-run
    output to every reader and everything else is this run's: ``patched_run`` with ``circuit.node_mask``'s
    mask, as ONE plain forward of the clean rows whose hook_z takes the corrupt record's z for those heads.
    ``mlps_out``: layers whose MLP output (hook_mlp_out, the MLP sender's output) is the corrupt run's too
    (the record must hold them: ``z_record(mlps=True)``). ``where[(layer, head)]``: a bool [b, pos] of the
    positions at which that head gives its corrupt output (a position-aware node view: its output elsewhere
    stays this run's); absent: every position.

    The same thing, not an estimate: a head's output is z_h W_O[h] (graph.py), a function of its z alone, so
    with z_h patched every reader reads its corrupt output; every receiver reads the same residual
    (no per-receiver sums, no per-head projections). Holds no sender outputs. Returns None where the graph's
    head output is NOT a function of z alone (Gemma's post-attention norm divides by the rms of the whole
    layer's output, so a head's share depends on the others): the caller uses ``patched_run`` there."""
    if not z_patchable(model, g):
        return None
    if any(("z", L) not in corrupt.hooks for L in range(g.n_layers)):
        raise QKCircuitsError("the corrupt record holds no hook_z values; record it with runs.record")
    if any(("mlp_out", int(L)) not in corrupt.hooks for L in mlps_out):
        raise QKCircuitsError("the corrupt record holds no MLP outputs; record it with runs.z_record(mlps=True)")
    by_layer: Dict[int, List[int]] = {}
    for L, h in heads_out:
        by_layer.setdefault(int(L), []).append(int(h))

    def patch(L: int, heads: List[int]):
        idx = torch.tensor(sorted(set(heads)))

        def fn(z: Tensor, hook) -> Tensor:
            _check_z(z, g, L)
            z = z.clone()
            corr = corrupt.hooks[("z", L)].to(z.dtype)
            if where is None:
                z[:, :, idx] = corr[:, :, idx]
                return z
            for h in idx.tolist():
                at = where.get((L, h))
                z[:, :, h] = corr[:, :, h] if at is None else torch.where(at.to(z.device)[..., None], corr[:, :, h],
                                                                          z[:, :, h])
            return z
        return fn

    def corrupt_mlp(L: int):
        def fn(t: Tensor, hook) -> Tensor:
            return corrupt.hooks[("mlp_out", L)].to(t.dtype)
        return fn

    hooks = [(f"blocks.{L}.attn.hook_z", patch(L, hs)) for L, hs in by_layer.items()]
    hooks += [(f"blocks.{int(L)}.hook_mlp_out", corrupt_mlp(int(L))) for L in sorted(set(mlps_out))]
    with torch.no_grad():
        return _metric_rows(model, task, task.clean, hooks)


def z_record(model, g: Graph, task, tokens: Tensor, mlps: bool = False) -> Record:
    """What ``node_run`` reads of a corrupt run, alone: each layer's hook_z [b, p, H, e] (and with ``mlps`` its
    MLP output, hook_mlp_out [b, p, d], as ``("mlp_out", L)``) and the metric per row (a plain forward; no
    sender outputs, so none of ``record``'s [S, b, p, d] buffer)."""
    keep: Dict[Key, Tensor] = {}

    def grab(L: int):
        def fn(z: Tensor, hook) -> None:
            _check_z(z, g, L)
            keep[("z", L)] = z.detach()
        return fn

    def grab_mlp(L: int):
        def fn(t: Tensor, hook) -> None:
            keep[("mlp_out", L)] = t.detach()
        return fn

    hooks = [(f"blocks.{L}.attn.hook_z", grab(L)) for L in range(g.n_layers)]
    if mlps and g.has_mlp:
        hooks += [(f"blocks.{L}.hook_mlp_out", grab_mlp(L)) for L in range(g.n_layers)]
    with torch.no_grad():
        rows = _metric_rows(model, task, tokens, hooks)
    return Record(torch.empty(0), keep, {}, rows.detach())
