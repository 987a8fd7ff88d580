"""Fold LayerNorm into the weights holding ONE copy of them at a time (``qk.load(..., lean=True)``).

>>> bridge = TransformerBridge.boot_transformers(...)        # doctest: +SKIP (needs a checkpoint)
>>> fold_in_place(bridge)                                    # doctest: +SKIP (needs a checkpoint)

``fold_in_place(bridge)`` leaves the bridge with the weights ``bridge.enable_compatibility_mode()`` would give, bit
for bit (tests/test_lean.py compares every parameter, buffer and logit with ``torch.equal``).

Where the extra copies of ``enable_compatibility_mode()`` live (measured on SmolLM2, fp32, CPU:
538 MB of weights, see docs/benchmarks.md "Memory"):

1. TransformerLens's weight processing is a chain of pure functions over the whole state dict
   (``fold_layer_norm``, ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``),
   and each starts with ``{k: v.clone() ...}``. While one step runs, the model's own parameters,
   the step's input dict and its output dict are all alive: three copies (peak +1.3 GB).
2. Untying the embedding from the unembedding (so that centring W_U leaves W_E alone) adds one
   [vocab, d_model] matrix (113 MB): a real, needed copy.
3. ``process_weights`` upcasts every bf16/fp16 weight to fp32 before the steps and casts back after:
   a bf16 load held a whole fp32 copy at its peak (SmolLM2: 1.73x a plain bf16 load).
4. What is freed is kept by glibc's allocator: tensors under its dynamic mmap threshold (32 MB)
   come from the heap, and a fragmented heap is not returned to the system, so the process stays
   ~0.7 GB above what its live tensors need.

What this module changes (the arithmetic is TransformerLens's own, so the weights come out
bit-identical to ``enable_compatibility_mode()``; tests/test_lean.py checks it on GPT-2-, Llama-GQA-,
MQA- and Gemma-3-shaped models): the model's parameters are handed over to the processing (their
storage is released: they point at the meta device until the processed weights are put back), each
step's defensive clone becomes a view (the processing owns every tensor it sees), and the dict the
previous step returned is emptied as the next step takes it, so a weight that a step replaces is
freed at once; and the whole ``process_weights`` runs once per group of keys (each block, the
embedding, the final norm with the unembedding), the other groups' tensors replaced by data-less
``meta`` stand-ins, so only one block is upcast (and one block's replaced weights are pending) at a
time (``_by_group``). Afterwards ``malloc_trim`` gives the freed heap back (glibc only). If the
processing leaves any parameter unplaced (an architecture whose processed weights do not reach
every parameter), ``LeanIncomplete`` is raised and ``load`` starts over without the lean path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import re
from typing import Dict, Iterator

import torch
from torch import Tensor

# The whole-state-dict steps of transformer_lens.weight_processing.ProcessWeights that clone their input.
_STEPS = ("fold_layer_norm", "center_writing_weights", "center_unembed", "fold_value_biases",
          "refactor_factored_attn_matrices")


class LeanIncomplete(RuntimeError):
    """The processed weights did not reach every parameter; the caller reloads without the lean path."""


class _Owned(torch.Tensor):
    """A tensor the weight processing owns outright: its ``clone()`` MOVES the data, no copy.

    ``clone()`` returns a plain tensor on the same storage and empties this one: CPython keeps a
    call's arguments alive on the caller's stack until the call returns, so the dict a step was
    given (and every tensor in it) outlives the step; emptied, it holds no memory. Arithmetic on
    an ``_Owned`` gives ordinary tensors (torch-function dispatch is disabled), so the subclass
    never leaks past the one ``{k: v.clone()}`` comprehension it exists for.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def clone(self, *args, **kwargs) -> Tensor:  # noqa: D102  (see class docstring)
        out = torch.Tensor.detach(self)            # a new plain tensor on the same storage
        torch.Tensor.set_(self)                    # this one lets go of it
        return out


def _owned(state_dict: Dict[str, object]) -> Dict[str, object]:
    """The dict's tensors moved into ``_Owned`` ones; the dict and the tensors it held are emptied.

    Emptying the given tensors (not only the dict) matters: TransformerLens's processing keeps a
    reference to some of them in a running frame until it ends, which kept ~0.3 GB of replaced
    SmolLM2 weights alive.
    """
    out: Dict[str, object] = {}
    for k, v in state_dict.items():
        if type(v) is torch.Tensor:
            out[k] = torch.Tensor.detach(v).as_subclass(_Owned)
            torch.Tensor.set_(v)
        else:
            out[k] = v
    state_dict.clear()
    return out


def _release_parameters(model: torch.nn.Module, state_dict: Dict[str, object]) -> int:
    """Point every parameter that IS a state-dict entry at the meta device (same shape).

    A parameter the dict only holds slices of (GPT-2's joint q/k/v weight, split by the bridge)
    keeps its storage: the processing never puts it back, and TransformerLens leaves it as it was.
    """
    held = {(v.data_ptr(), tuple(v.shape), v.stride()) for v in state_dict.values() if isinstance(v, Tensor)}
    n = 0
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type == "meta" or (p.data_ptr(), tuple(p.shape), p.stride()) not in held:
                continue
            module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                          requires_grad=p.requires_grad)
            n += 1
    return n


@contextlib.contextmanager
def _lean_steps(bridge, store=None) -> Iterator[None]:
    # Patches TransformerLens's ProcessWeights static methods for the duration of one load (not thread-safe:
    # do not load two models at once in one process). Checked against transformer-lens 4.3 (pyproject pins
    # <5); a TransformerLens whose steps leave a parameter unplaced trips LeanIncomplete, and ``load`` then
    # falls back to the plain fold (tests/test_lean.py checks bit-identical weights on four model shapes).
    from transformer_lens.weight_processing import ProcessWeights

    saved = {name: ProcessWeights.__dict__[name] for name in _STEPS + ("process_weights",)
             if name in ProcessWeights.__dict__}

    def step(fn):
        def run(state_dict, *args, **kwargs):
            return fn(_owned(state_dict), *args, **kwargs)
        return staticmethod(run)

    def process(fn):
        def run(state_dict, *args, **kwargs):
            # The bridge's caller keeps its own reference to this dict; hand the tensors over
            # and empty it, then release the parameters they came from.
            mine = _owned(state_dict)
            _release_parameters(bridge, mine)
            if store is not None:            # the processed weights of this very input, kept from an earlier load
                done = store.load(mine, kwargs)
                if done is not None:
                    mine.clear()
                    return done
            out = _by_group(lambda d: fn(d, *args, **kwargs), mine)
            if store is not None:
                store.save(out, kwargs)
            return out
        return staticmethod(run)

    try:
        for name, fn in saved.items():
            setattr(ProcessWeights, name, process(fn.__func__) if name == "process_weights" else step(fn.__func__))
        yield
    finally:
        for name, fn in saved.items():
            setattr(ProcessWeights, name, fn)


_LAYER = re.compile(r"^blocks\.(\d+)\.")
_WITH = {"ln_final": "unembed"}      # the final norm folds into the unembedding: one group


def _group(key: str) -> str:
    """The group a state-dict key is processed in: its block (``blocks.3.``) or its top-level component."""
    m = _LAYER.match(key)
    if m:
        return f"blocks.{m.group(1)}"
    top = key.split(".", 1)[0]
    return _WITH.get(top, top)


def _stub(v: object) -> object:
    """A stand-in for a tensor of another group: same shape and dtype, no data (meta device)."""
    return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, Tensor) else v


def _by_group(process, state_dict: Dict[str, object]) -> Dict[str, object]:
    """``process(state_dict)`` (TransformerLens's whole ``process_weights``), run once per group of keys.

    ``process_weights`` upcasts EVERY weight to fp32 before folding and casts back after, so a bf16 model
    held a whole fp32 copy at the peak. Its arithmetic never mixes two blocks (LayerNorm folds into the
    same block's weights, centring and the value-bias fold are per tensor, the final norm folds into the
    unembedding), so the full chain runs once per block (and once per embedding / unembedding group) on a
    dict in which every other group's tensors are data-less ``meta`` stand-ins of the same shape and dtype:
    only one group is ever upcast, and each tensor goes through the same fp32 steps as in one whole run
    (same results bit for bit; tests/test_lean.py). A group whose real output came out on ``meta``, or an
    operation mixing real and ``meta`` tensors (torch raises), means the arithmetic did cross groups:
    ``LeanIncomplete``, and ``load`` falls back to TransformerLens's own processing.
    """
    order = list(state_dict)
    groups: Dict[str, list] = {}
    for k in order:
        groups.setdefault(_group(k), []).append(k)
    if len(groups) == 1:
        return process(_pop(state_dict))
    out: Dict[str, object] = {}
    for name, keys in groups.items():
        mine = set(keys)
        sub = {k: (state_dict[k] if k in mine else _stub(v)) for k, v in state_dict.items()}
        for k in keys:                                 # the caller's dict lets go of this group's tensors
            state_dict[k] = _stub(state_dict[k])
        try:
            done = process(sub)
        except RuntimeError as e:
            raise LeanIncomplete(f"processing group {name} read another group's weights ({e})") from None
        del sub
        for k, v in done.items():
            if _group(k) != name:
                continue                               # another group's key: that group's own run makes it
            if isinstance(v, Tensor) and v.device.type == "meta":
                raise LeanIncomplete(f"{k} came out of group {name}'s processing without data")
            out[k] = v
        del done
        trim_heap()
    state_dict.clear()
    # The whole run's key order: the given keys first, then those the processing added.
    return {**{k: out.pop(k) for k in order if k in out}, **out}


def _pop(d: Dict[str, object]) -> Dict[str, object]:
    """``d``'s items in a new dict, ``d`` emptied: the caller's frame keeps no reference to the tensors."""
    out = dict(d)
    d.clear()
    return out


def fold_in_place(bridge, store=None) -> None:
    """``bridge.enable_compatibility_mode(disable_warnings=True)`` with one copy of the weights at a time.

    ``store`` (``gguf_cache.Processed``): where the processed weights of this checkpoint were kept by an earlier
    load (``load(input, options)`` gives them, or None) and are kept for the next (``save(output, options)``);
    TransformerLens's own steps around the processing (placing the weights, its flags) run as always.

    Raises ``LeanIncomplete`` (the bridge is then unusable: reload it) if a parameter was left on
    the meta device.
    """
    trim_heap()                                    # what the dequantisation freed, before the peak
    with _lean_steps(bridge, store):
        bridge.enable_compatibility_mode(disable_warnings=True)
    missing = [n for n, p in bridge.named_parameters() if p.device.type == "meta"]
    if missing:
        raise LeanIncomplete(f"{len(missing)} parameters were not placed back, e.g. {missing[0]}")
    trim_heap()


def trim_heap() -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
