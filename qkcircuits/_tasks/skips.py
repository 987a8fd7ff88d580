"""Work a circuit forward would throw away is not done: q/k/v projections it overwrites, MLPs it knows.

>>> hooks = [("blocks.1.attn.hook_q", lambda q, hook: torch.zeros_like(q))]   # replaces the value it skips
>>> with skipped(model, [(1, "q")]) as done:
...     logits = model.run_with_hooks(tokens, fwd_hooks=hooks)  # hooks MUST replace blocks.1.attn.hook_q
>>> done
{(1, 'q')}

In ``runs.patched_run`` most receiver groups' hook_q/k/v values are replaced (recomputed from each head's own
residual, or taken from the corrupt run), so the model's own q/k/v matmul of that layer is wasted: on
SmolLM2 the q/k/v projections are 16 % of a block's linear FLOPs (960 of 5,568 output columns per input
row, with the MLP's 3 × 1,536 and W_O's 576). Inside ``skipped`` each named projection returns an
UNINITIALISED tensor of its output's shape; the caller's hook on ``hook_q/k/v`` must replace every such value
(``patched_run`` does: a group it does not replace is never skipped).

A projection is skipped only where it is safe to know that nothing but the hook reads its output: the
hook point ``blocks.L.attn.hook_x`` IS the projection's own output hook (TransformerLens 4's
``LinearBridge.hook_out``; GPT-2's fused ``c_attn`` is split into such q/k/v bridges too) and the projection
is a plain ``nn.Linear``, and no hook is already attached there (``model.add_hook``: it would see the
uninitialised value). Anything else (latent attention, a scaled hook_k, an unknown module) computes as usual
and is left out of the returned set. The stubs live on the model instance while a run is open: a model must
not run a circuit forward and another forward at once from two threads.

``known_mlps(model, {L: output})``: an MLP whose input the circuit forward would set to the corrupt run's
(no edge into it) gives the corrupt run's output, so it is not run: it returns ``output`` through its own
``hook_out`` (which the caller's hooks still see). Only a dense ``MLPBridge`` / ``GatedMLPBridge`` whose
hook_out IS ``hook_mlp_out`` (not Gemma's, whose post-feedforward norm comes after it).

``known_attention(model, {L: output})``: an attention layer whose q, k and v inputs the circuit forward would
ALL set to the corrupt run's gives the corrupt run's attention output (it reads nothing else of the residual),
so it is not run: it returns ``output()`` in the attention module's own output form, ``(attn_output, None)``.
Its hooks do not fire (hook_q/k/v, hook_pattern, hook_z, hook_out: ``output()`` is the caller's place to write
what those hooks would have recorded). Only the attention bridges whose output form is known (they all return
``(attn_output, attn_weights)``, as transformers' attention modules do) and only where no hook of anyone else
is attached inside the layer's attention (only TransformerLens hook points are looked at: a plain PyTorch hook
on the wrapped transformers module or its q/k/v linears does not fire for a skipped layer).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, Set, Tuple, Union

from torch import Tensor, nn

from .._foundation.arch import adapter
from .._foundation.arch import model_facts as model_facts

Group = Tuple[int, str]


def _hook_points(model) -> Dict[str, object]:
    """name → HookPoint, aliases included. TransformerLens 4 rebuilds this dict on every ``hook_dict`` access
    (~2 ms for SmolLM2): asked once per context, not once per layer."""
    try:
        return model.hook_dict
    except AttributeError:
        return {}


def _projection(model, layer: int, into: str, hooks: Dict[str, object]):
    """The nn.Linear whose output is ``blocks.layer.attn.hook_<into>``, or None."""
    try:
        found = adapter(model, layer).projection(into)
    except (AttributeError, IndexError, TypeError):
        return None
    if found is None:
        return None
    lin, hook_out = found
    hook = hooks.get(f"blocks.{layer}.attn.hook_{into}")
    if hook is None or hook is not hook_out or _has_hooks(hook):
        return None                                      # someone's own hook would see the uninitialised value
    return lin


def _has_hooks(hook_point) -> bool:
    """Whether a hook point carries forward hooks of someone else's (a run that skips its module would not fire
    them)."""
    return bool(getattr(hook_point, "_forward_hooks", None))


@contextmanager
def _overriding(forwards: Dict[object, Tuple[nn.Module, Callable]]) -> Iterator[Set]:
    """While open, each ``forwards[key] = (module, fn)`` module runs ``fn`` instead of its forward (an
    instance attribute, set past any ``__setattr__`` of the bridge's own, which would route it elsewhere);
    a module someone else already overrides keeps theirs. Yields the keys overridden; restores on exit
    (also on error)."""
    done: Set = set()
    patched = []
    try:
        for key, (module, fn) in forwards.items():
            if "forward" in vars(module):
                continue
            object.__setattr__(module, "forward", fn)
            patched.append(module)
            done.add(key)
        yield done
    finally:
        for module in patched:
            object.__delattr__(module, "forward")


def _empty_like_output(lin: nn.Linear) -> Callable:
    def empty(x: Tensor, *_, _n: int = lin.out_features) -> Tensor:
        return x.new_empty(*x.shape[:-1], _n)
    return empty


def skipped(model, groups: Iterable[Group]):
    """While open, the projections of ``groups`` ((layer, "q" | "k" | "v")) return ``x.new_empty`` of their
    output shape; yields the groups actually skipped. Restores every projection on exit (also on error)."""
    groups = list(groups)
    hooks = _hook_points(model) if groups else {}
    lins = {(layer, into): _projection(model, layer, into, hooks) for layer, into in groups}
    return _overriding({key: (lin, _empty_like_output(lin)) for key, lin in lins.items() if lin is not None})


def _mlp(model, layer: int, hooks: Dict[str, object]):
    try:
        mlp = model_facts.mlp_module(model, layer)
    except (AttributeError, IndexError, TypeError):
        return None
    hook = hooks.get(f"blocks.{layer}.hook_mlp_out")
    if mlp is None or hook is None or hook is not mlp.hook_out or _has_hooks(mlp.hook_in):
        return None                                      # someone's own hook on its input would not fire
    return mlp


def _known_output(mlp, value: Union[Tensor, Callable[[], Tensor]]) -> Callable:
    def known(x: Tensor, *_, **__) -> Tensor:
        # a callable builds a fresh tensor when the MLP is reached (no copy of it held before); a tensor is
        # someone's (the corrupt record's) and is copied
        return mlp.hook_out(value().to(x.dtype) if callable(value) else value.to(x.dtype).clone())
    return known


def _attention(model, layer: int):
    try:
        attn = model_facts.replaceable_attention(model, layer)
    except (AttributeError, IndexError, TypeError):
        return None
    if attn is None:
        return None
    # a hook of someone's on a hook point inside would not fire (transformers' own output-capturing hooks on the
    # wrapped module only act when attention weights are asked for, which a circuit forward does not)
    if any(_has_hooks(m) for m in attn.modules() if type(m).__name__ == "HookPoint"):
        return None
    return attn


def _known_attention_output(value: Callable[[], Tensor]) -> Callable:
    def known(*_, **__):
        return value(), None
    return known


def known_attention(model, outputs: Dict[int, Callable[[], Tensor]]):
    """While open, layer L's attention (for each L in ``outputs``) returns ``(outputs[L](), None)`` without
    computing (the caller's function makes a fresh tensor when the layer is reached, and writes whatever the
    skipped hooks would have). Yields the layers actually replaced. Restores every module on exit (also on
    error)."""
    mods = {layer: (_attention(model, layer), value) for layer, value in outputs.items()}
    return _overriding({layer: (attn, _known_attention_output(value)) for layer, (attn, value) in mods.items()
                        if attn is not None})


def known_mlps(model, outputs: Dict[int, Union[Tensor, Callable[[], Tensor]]]):
    """While open, layer L's MLP (for each L in ``outputs``) returns ``hook_out`` of its known output without
    computing: ``outputs[L].clone()``, or ``outputs[L]()`` (a fresh tensor, made only when that MLP runs: a
    caller's k stacked copies of a record then exist one layer at a time). Yields the layers actually
    replaced. Restores every MLP on exit (also on error)."""
    hooks = _hook_points(model) if outputs else {}
    mlps = {layer: (_mlp(model, layer, hooks), value) for layer, value in outputs.items()}
    return _overriding({layer: (mlp, _known_output(mlp, value)) for layer, (mlp, value) in mlps.items()
                        if mlp is not None})
