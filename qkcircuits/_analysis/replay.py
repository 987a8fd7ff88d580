"""Replaying a model from a cached residual: blocks ``start..`` run on a residual in a loop (``sliced``, the one
sliced-model context manager), and ``Runner``, the replay engine of ablation sweeps and path patching.

>>> runner = Runner(model, tokens)                  # one clean pass: residuals and each block's call arguments
>>> runner.mode
'blocks'
>>> logits = runner.run(1, [], 2)                   # blocks 1.. on two stacked copies of the batch
>>> bool(torch.equal(logits, runner.clean_logits.repeat(2, 1, 1)))      # exactly the model's own forward
True

Why a loop: ``TransformerBridge``'s ``start_at_layer`` injects the residual at block ``start`` but still
computes (and discards) blocks ``0..start−1`` of a Hugging Face model. A block, though, is a function of its
input and of what the model's forward hands every block (the attention mask, the rotary cos/sin of the block's
own layer type, the positions), which one clean run records (``BlockInputs``: caches dropped, a mask whose rows
agree kept as one row that broadcasts). ``sliced`` calls ``model.blocks[start:stop]`` with those arguments,
then the final norm, the unembedding and the model's own logits transform (Gemma-2's soft-cap): bit for bit the
model's forward on GPT-2, Llama (GQA), Gemma-2/3, GPT-NeoX, GPT-J, DeepSeek-V3 (tests/test_replay.py) and the toy
(above), and each block gets its own layer's mask and rotary (Gemma's sliding/global layers), which the ModuleList
slicing this replaced could not give (it renumbered the kept blocks). Every ``Runner`` checks a resumed clean run
against the full one and falls back to ``start_at_layer``, then to full forwards (``Runner.mode``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Int
from torch import Tensor

from .._foundation.arch.model_facts import final_norm_module, logits_transform
from .._foundation.errors import QKCircuitsError

Tokens = Int[Tensor, "batch pos"]


def _is_cache(x: Any) -> bool:
    """A key/value cache object (Hugging Face's ``Cache``): a replay must not append to the clean run's."""
    return any(c.__name__.endswith("Cache") for c in type(x).__mro__)


def _one_row(x: Any) -> Any:
    """A batch-first tensor whose rows agree, as one row (it broadcasts over any batch); anything else as is."""
    if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[0] > 1 and bool((x == x[:1]).all()):
        return x[:1]
    if isinstance(x, tuple):
        return tuple(_one_row(v) for v in x)
    if isinstance(x, list):
        return [_one_row(v) for v in x]
    if isinstance(x, dict):
        return {k: _one_row(v) for k, v in x.items()}
    return None if _is_cache(x) else x


def _stack(x: Any, b: int, n: int) -> Any:
    """``x`` for ``n`` rows stacked from copies of the recorded ``b`` (a batch-first tensor of ``b`` rows
    repeated; everything else, one-row tensors included, as is)."""
    if isinstance(x, Tensor):
        return x.repeat(n // b, *([1] * (x.dim() - 1))) if x.dim() >= 2 and x.shape[0] == b != n else x
    if isinstance(x, tuple):
        return tuple(_stack(v, b, n) for v in x)
    if isinstance(x, list):
        return [_stack(v, b, n) for v in x]
    if isinstance(x, dict):
        return {k: _stack(v, b, n) for k, v in x.items()}
    return x


class BlockInputs:
    """What the model's forward hands each block besides the residual (``args[1:]``, ``kwargs``), recorded in
    one run of ``batch`` rows: ``with inputs.recording(): model(tokens)``."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls: Dict[int, Tuple[tuple, dict]] = {}
        self.batch = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator["BlockInputs"]:
        def keep(layer: int):
            def fn(module, args, kwargs) -> None:
                self.batch = int(args[0].shape[0]) if args and isinstance(args[0], Tensor) else \
                    int(kwargs["hidden_states"].shape[0])
                self.calls[layer] = (_one_row(tuple(args[1:])), _one_row(dict(kwargs)))
            return fn

        handles = [block.register_forward_pre_hook(keep(L), with_kwargs=True)
                   for L, block in enumerate(self.model.blocks)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def covers(self, layers: Sequence[int]) -> bool:
        return bool(self.calls) and all(L in self.calls for L in layers)

    def call(self, layer: int, rows: int) -> Tuple[tuple, dict]:
        """Block ``layer``'s arguments for ``rows`` rows (a multiple of the recorded batch, or its own)."""
        b = self.batch
        if rows != b and rows % b:
            raise QKCircuitsError(f"a replay of {rows} rows cannot reuse block inputs recorded on {b} rows")
        args, kwargs = self.calls[layer]
        return _stack(args, b, rows), _stack(kwargs, b, rows)


@contextlib.contextmanager
def sliced(model, inputs: BlockInputs, start: int, stop: Optional[int] = None,
           hooks: Sequence = ()) -> Iterator[Callable[..., Tensor]]:
    """The model as blocks ``start..stop−1`` on a residual, with ``hooks`` on for the duration:
    ``with sliced(model, inputs, 3) as forward: logits = forward(resid)`` (``resid`` [n, pos, d_model] entering
    block 3; n a multiple of the recorded batch). With ``stop`` (< n_layers) ``forward`` returns the residual
    leaving block ``stop − 1``; without, the logits after the final norm, the unembedding and the model's own
    logits transform, of the last ``keep`` positions when ``forward(resid, keep=k)``. Gradient mode is the
    caller's; a hook may end the forward early (``StopForward``), and only the blocks reached need recorded
    inputs."""
    n_layers = model.cfg.n_layers
    stop = n_layers if stop is None else stop
    if not 0 <= start < stop <= n_layers:
        raise QKCircuitsError(f"blocks {start}..{stop - 1} are not a slice of the model's {n_layers} blocks")
    norm, transform = final_norm_module(model), logits_transform(model)

    def forward(resid: Tensor, keep: Optional[int] = None) -> Tensor:
        h = resid
        for L in range(start, stop):
            if L not in inputs.calls:    # checked here: a hook may stop the forward before (path patching's receivers)
                raise QKCircuitsError(f"no recorded inputs for block {L}; run the model once inside "
                                      f"BlockInputs.recording() up to it")
            args, kwargs = inputs.call(L, h.shape[0])
            out = model.blocks[L](h, *args, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if stop < n_layers:
            return h
        if keep is not None:
            h = h[:, -keep:]
        logits = model.unembed(norm(h) if norm is not None else h)
        return transform(logits) if transform is not None else logits

    with model.hooks(fwd_hooks=list(hooks)):
        yield forward


def _close(a: Tensor, b: Tensor, atol: float = 1e-4, rtol: float = 1e-5) -> bool:
    """``torch.allclose`` one position at a time: its temporaries are [b, vocab], not two more logits-sized
    tensors (0.5 GB each for SmolLM2 at 2 × 1,281 tokens)."""
    return all(torch.allclose(a[:, i], b[:, i], atol=atol, rtol=rtol) for i in range(a.shape[1]))


MODES = ("blocks", "start_at_layer", "full")


class Runner:
    """Runs ``tokens`` once clean, then re-runs batched ablations from the layer where they start.

    The clean pass caches ``blocks.L.hook_resid_pre`` for the layers ``from_layer..`` that runs may start at
    (memory: (n_layers − from_layer) × batch × pos × d_model floats), the clean logits and each block's call
    arguments (``BlockInputs``). ``run(start, hooks, copies)`` stacks ``copies`` of the batch and runs only blocks
    ``start..`` (``sliced``). A self-check at construction compares a resumed clean run with the full clean run
    and falls back to TransformerBridge's ``start_at_layer`` (which computes and discards the blocks below) or to
    full forwards if the loop ever disagrees (``self.mode`` says which).
    """

    def __init__(self, model, tokens: Tokens, *, from_layer: int = 0, check: bool = True):
        self.model, self.tokens = model, tokens
        n = model.cfg.n_layers
        if not 0 <= from_layer < n:
            raise QKCircuitsError(f"from_layer must be in 0-{n - 1}, got {from_layer!r}")
        self.from_layer = from_layer
        self.resid: Dict[int, Tensor] = {}
        self.inputs = BlockInputs(model)

        def keep(layer: int):
            def fn(t: Tensor, hook) -> None:
                self.resid[layer] = t.detach().clone()
            return fn

        with torch.no_grad(), self.inputs.recording():
            self.clean_logits = model.run_with_hooks(
                tokens, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", keep(L)) for L in range(from_layer, n)])
        self.mode = "blocks"
        if check:
            self._self_check()

    def _self_check(self) -> None:
        layer = max(self.model.cfg.n_layers // 2, self.from_layer)
        clean = self.clean_logits
        for mode in MODES:
            if mode == "blocks" and not self.inputs.covers(range(layer, self.model.cfg.n_layers)):
                continue
            self.mode = mode
            try:
                out = self.run(layer, [], 1)
            except Exception:  # a bridge without start_at_layer support: try the next, slower mode
                continue
            if out.shape == clean.shape and _close(out, clean):
                break
        else:
            self.mode = "full"
        # logits_to_keep: HF causal LMs unembed only the last k positions; TL-native models do not take it.
        self.keep_ok = True
        try:
            out = self.run(layer, [], 1, keep=2)
            self.keep_ok = out.shape[1] == 2 and _close(out, clean[:, -2:])
        except Exception:
            self.keep_ok = False

    def run(self, start: int, hooks: list, copies: int, keep: Optional[int] = None) -> Tensor:
        """Logits of ``copies`` stacked copies of the batch with ``hooks``, computed from block ``start``.

        ``keep``: only the last ``keep`` positions' logits are wanted (and returned).
        """
        if start < self.from_layer:      # a caller bug: the residual there was not cached
            raise ValueError(f"this Runner cached layers {self.from_layer}.. only; cannot start at layer {start}")
        with torch.no_grad():
            if self.mode == "blocks":
                with sliced(self.model, self.inputs, start, hooks=hooks) as forward:
                    return forward(self.resid[start].repeat(copies, 1, 1), keep=keep)
            kwargs = {"logits_to_keep": keep} if keep is not None and self.keep_ok else {}
            if self.mode == "full" or start == 0:
                out = self.model.run_with_hooks(self.tokens.repeat(copies, 1), fwd_hooks=hooks, **kwargs)
            else:
                out = self.model.run_with_hooks(self.resid[start].repeat(copies, 1, 1), fwd_hooks=hooks,
                                                start_at_layer=start, **kwargs)
        return out[:, -keep:] if keep is not None else out

    def run_resid(self, start: int, resid: Tensor, hooks: list) -> Tensor:
        """Run blocks ``start..`` on a given residual batch ``resid`` [n, pos, d_model] (e.g. the cached
        residual plus a patch) with ``hooks``; gradient mode is the caller's. In ``full`` mode the tokens
        are run from the start (repeated to ``n`` rows) and ``blocks.start.hook_resid_pre`` is replaced."""
        model, n = self.model, resid.shape[0]
        if self.mode == "blocks":
            with sliced(model, self.inputs, start, hooks=hooks) as forward:
                return forward(resid)
        if self.mode == "full" or start == 0:
            b = self.tokens.shape[0]
            tokens = self.tokens.repeat(n // b, 1)
            splice = (f"blocks.{start}.hook_resid_pre", lambda t, hook: resid.to(t.dtype))
            return model.run_with_hooks(tokens, fwd_hooks=[splice] + list(hooks))
        return model.run_with_hooks(resid, fwd_hooks=hooks, start_at_layer=start)

    @classmethod
    def from_cache(cls, model, tokens: Tokens, resid: Dict[int, Tensor], clean_logits: Optional[Tensor], *,
                   from_layer: int, inputs: Optional[BlockInputs] = None, check: bool = True) -> "Runner":
        """A Runner built from a clean pass the caller already ran (``resid`` holds ``hook_resid_pre`` of
        every layer ``from_layer..``; ``inputs`` what that pass recorded of the blocks' calls), so that pass is
        not repeated. ``clean_logits`` is None when that pass stopped before the unembedding (the caller needs no
        logits)."""
        self = cls.__new__(cls)
        self.model, self.tokens, self.from_layer = model, tokens, from_layer
        self.resid, self.clean_logits = resid, clean_logits
        self.inputs = inputs if inputs is not None else BlockInputs(model)
        self.mode = "blocks" if self.inputs.covers([from_layer]) else "start_at_layer"
        self.keep_ok = False
        if check:
            self._self_check()
        return self
