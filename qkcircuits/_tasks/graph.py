"""The computational graph of a model: senders (embedding, heads, MLPs), receivers (each head's q, k, v
input, each MLP's input, the logits) and the edges between them.

>>> g = qk.graph(model)
>>> g.n_senders, g.n_receivers, g.n_edges
(5, 13, 29)
>>> g.senders[:3], g.receivers[:3]
(('emb', '0.0', '0.1'), (('0.0', 'q'), ('0.1', 'q'), ('0.0', 'k')))
>>> qk.graph(model, positions=qk.tasks.induction(model, n=2)).n_edges     # every edge at END and at the other positions
58

Nodes, in the order the forward computes them: ``emb`` (token + positional embedding, i.e. the residual
entering block 0); per layer L the heads ``"L.H"`` and the MLP ``"mlpL"`` (models with MLPs); ``logits``.
Receiver inputs: ``("L.H", "q")`` per query head; ``("L.G", "k")`` and ``("L.G", "v")`` per KEY-VALUE head G
(with grouped-query attention the k and v inputs belong to the KV head, written ``"L.kvG"``, which query
heads G·group … G·group+group−1 share); ``("mlpL", "in")``; ``("logits", "in")``. The UNGROUPED graph
(``qk.graph(model, gqa="ungrouped")``, as the EAP-IG authors and MIB count edges) gives every query head its own
k and v input, ``("L.H", "k")``: an edge into it patches only the keys that query head reads (``ungrouped.py``); on
a model without grouped-query attention the two graphs are the same. An edge is a sender whose
output is added to the residual stream before the receiver reads it (heads of layer L feed MLP L and
everything from layer L+1). In a PARALLEL block (GPT-J, GPT-NeoX / Pythia, Phi-1/2, Falcon:
``resid_post = resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre))``) MLP L reads the residual its layer's
heads read, so they do not feed it: ``Graph.parallel``, and MLP L's senders are those of the heads of layer L.

Residual semantics (the same as path patching's): every sender has one output per run, added to the
residual — a head's is ``z_h W_O[h]`` (under Gemma's post-attention norm, its share of the normed layer
output ``z_h W_O[h] · (1+w)/rms(y)`` with that run's rms, so the shares still add up to what the block
adds), an MLP's is ``hook_mlp_out``, the embedding's the residual entering block 0. A receiver reads the
SUM of its senders' outputs (plus the constant biases) through its own norm, recomputed: ln1 → W_Q/W_K/W_V
for q/k/v (q/k-norm and rotary then run inside the model's attention as usual), ln2 for an MLP, the final
norm for the logits. ``split_qkv_from_residuals`` is the one place that turns per-head residuals into
hook_q/k/v values.

POSITION-AWARE graphs (``qk.graph(model, positions=task)``): the residual stream is per position, so a sender's
write at position p reaches a receiver's input at p only; attention moves information across positions inside
the receiving head. An edge is then (sender, receiver input, position group): the groups are the task's named
positions (``END``, ``S2``, …) and ``other`` (the rest, pooled), ``Graph.positions``; a mask or a score gains
a leading group axis [groups, S, R] (``positions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterable, List, Sequence, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.arch import adapter
from .._foundation.errors import QKCircuitsError
from .._foundation.fingerprint import fingerprint
from .._foundation.arch.model_facts import (has_mlps, logits_transform, mlp_input, model_name,  # noqa: F401  (re-exported)
                                      parallel_blocks, post_norm_module)
from .._foundation.heads import n_kv_heads
from .task import Task

Receiver = Tuple[str, str]


@dataclass(frozen=True)
class Graph:
    """Node and edge indexing of one model (no tensors of activations). ``valid[s, r]``: s feeds r."""

    n_layers: int
    n_heads: int
    n_kv: int
    has_mlp: bool
    model_name: str = ""
    parallel: bool = False          # attention and MLP of a block read the same residual (no head → own-MLP edge)
    ungrouped: bool = False         # k/v inputs per QUERY head (the EAP-IG authors' and MIB's count), not per KV head
    positions: Tuple[str, ...] = ()  # position groups (the task's named positions, then "other"); () = not split
    # the model's fingerprint (``_foundation/fingerprint``): which model the graph (and every result on it) is of;
    # not compared (a graph is the same graph whichever model of its shape it was built from)
    fingerprint: str = field(default="", compare=False)

    @property
    def n_groups(self) -> int:
        """Position groups (1 when the graph is not position-aware)."""
        return max(1, len(self.positions))

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv

    @property
    def n_kv_in(self) -> int:
        """k (and v) receiver inputs per layer: one per KV head, or one per query head when ungrouped."""
        return self.n_heads if self.ungrouped else self.n_kv

    def input_heads(self, into: str) -> List[int]:
        """The model's head (query head for q, KV head for k/v) each receiver of a layer's ``into`` group reads
        its weights from: ungrouped k/v receivers of query heads h use KV head h // group."""
        if into == "q":
            return list(range(self.n_heads))
        return [h // self.group for h in range(self.n_heads)] if self.ungrouped else list(range(self.n_kv))

    # ---------------------------------------------------------------------------------------- senders
    @cached_property
    def senders(self) -> Tuple[str, ...]:
        out = ["emb"]
        for L in range(self.n_layers):
            out += [f"{L}.{h}" for h in range(self.n_heads)]
            if self.has_mlp:
                out.append(f"mlp{L}")
        return tuple(out)

    def head_sender(self, layer: int, head: int = 0) -> int:
        return 1 + layer * (self.n_heads + self.has_mlp) + head

    def mlp_sender(self, layer: int) -> int:
        return self.head_sender(layer, self.n_heads)

    # ---------------------------------------------------------------------------------------- receivers
    def kv_name(self, layer: int, g: int) -> str:
        """Receiver name of k/v input ``g`` (a KV head, or a query head when ungrouped)."""
        return f"{layer}.{g}" if self.n_kv_in == self.n_heads else f"{layer}.kv{g}"

    @cached_property
    def receivers(self) -> Tuple[Receiver, ...]:
        out: List[Receiver] = []
        for L in range(self.n_layers):
            out += [(f"{L}.{h}", "q") for h in range(self.n_heads)]
            out += [(self.kv_name(L, g), "k") for g in range(self.n_kv_in)]
            out += [(self.kv_name(L, g), "v") for g in range(self.n_kv_in)]
            if self.has_mlp:
                out.append((f"mlp{L}", "in"))
        out.append(("logits", "in"))
        return tuple(out)

    @property
    def per_layer(self) -> int:
        return self.n_heads + 2 * self.n_kv_in + int(self.has_mlp)

    def recv_slice(self, layer: int, into: str) -> slice:
        """Receiver indices of layer ``layer``'s input ``into`` (q, k, v or mlp)."""
        base = layer * self.per_layer
        H, G = self.n_heads, self.n_kv_in
        start, width = {"q": (0, H), "k": (H, G), "v": (H + G, G), "mlp": (H + 2 * G, 1)}[into]
        return slice(base + start, base + start + width)

    @property
    def logits_receiver(self) -> int:
        return len(self.receivers) - 1

    def n_below(self, r: int) -> int:
        """Receiver ``r`` reads senders 0 … n_below(r) − 1 (senders are in forward order)."""
        if r == self.logits_receiver:
            return self.n_senders
        layer, off = divmod(r, self.per_layer)
        own_heads = off == self.per_layer - 1 and self.has_mlp and not self.parallel
        return self.mlp_sender(layer) if own_heads else self.head_sender(layer)

    @cached_property
    def valid(self) -> Tensor:
        v = torch.zeros(self.n_senders, self.n_receivers, dtype=torch.bool)
        for r in range(self.n_receivers):
            v[:self.n_below(r), r] = True
        return v

    @property
    def n_senders(self) -> int:
        return len(self.senders)

    @property
    def n_receivers(self) -> int:
        return len(self.receivers)

    @property
    def n_edges(self) -> int:
        """Edges of the graph: (sender, receiver input) pairs, times the position groups when position-aware."""
        return int(self.valid.sum()) * self.n_groups

    @property
    def n_nodes(self) -> int:
        """Embedding, heads, MLPs (each once per position group) and logits (a head's three inputs are one node)."""
        return self.n_senders * self.n_groups + 1

    def sender_node(self, s: int) -> str:
        return self.senders[s]

    def receiver_heads(self, r: int) -> List[str]:
        """The query heads a receiver input belongs to (k/v of a KV head: every head of its group)."""
        name, into = self.receivers[r]
        if into == "in":
            return [name]
        layer = int(name.split(".")[0])
        if into == "q" or self.n_kv_in == self.n_heads:
            return [name]
        g = int(name.split(".")[1].replace("kv", ""))
        group = self.n_heads // self.n_kv
        return [f"{layer}.{h}" for h in range(g * group, (g + 1) * group)]

    def to_dict(self) -> Dict[str, object]:
        return {"n_nodes": self.n_nodes, "n_senders": self.n_senders, "n_receivers": self.n_receivers,
                "n_edges": self.n_edges, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv, "mlps": self.has_mlp, "parallel": self.parallel,
                "gqa": "ungrouped" if self.ungrouped else "grouped", "positions": list(self.positions),
                "kv_note": ("" if self.n_kv == self.n_heads else "k and v inputs per query head (ungrouped)"
                            if self.ungrouped else "k and v inputs belong to the key-value head"),
                **({"fingerprint": self.fingerprint} if self.fingerprint else {})}

    @classmethod
    def from_dict(cls, gd: Dict[str, object], model_name: str = "") -> "Graph":
        """The graph ``to_dict`` wrote (files written before ``gqa``/``positions`` existed: grouped, not split)."""
        gqa = gd.get("gqa", "grouped")
        if gqa not in GQA:
            raise QKCircuitsError(f"graph gqa {gqa!r} is not one of {', '.join(GQA)}")
        fp = gd.get("fingerprint", "")
        return cls(int(gd["n_layers"]), int(gd["n_heads"]), int(gd["n_kv_heads"]), bool(gd["mlps"]), model_name,
                   bool(gd.get("parallel", False)), gqa == "ungrouped", tuple(str(p) for p in gd.get("positions", ())),
                   fp if isinstance(fp, str) else "")

    def __repr__(self) -> str:
        kv = (f", {self.n_kv} KV heads (k/v inputs per {'query' if self.ungrouped else 'KV'} head)"
              if self.n_kv != self.n_heads else "")
        at = f", positions {'/'.join(self.positions)}" if self.positions else ""
        return (f"Graph({self.model_name or 'model'}: {self.n_layers} layers x {self.n_heads} heads{kv}"
                f"{', MLPs' if self.has_mlp else ''}{' (parallel blocks)' if self.parallel else ''}{at}; {self.n_nodes} nodes, "
                f"{self.n_receivers} receiver inputs, {self.n_edges} edges)")


GQA = ("grouped", "ungrouped")


def provenance(g: Graph, task=None) -> Dict[str, str]:
    """``{"fingerprint": ..., "task": ...}`` for the settings of a result on graph ``g`` (its model's fingerprint, when
    the graph was built from a model; ``task``'s name, when given): where a task result came from."""
    out = {"fingerprint": g.fingerprint} if g.fingerprint else {}
    if task is not None:
        out["task"] = str(task.name)
    return out
OTHER = "other"          # the position group of the positions no name points at


def position_groups(spec, task=None) -> Tuple[str, ...]:
    """The position groups: a ``Task`` gives its named positions (in its order) then ``other``; a sequence of
    names gives those (each must be one of ``task``'s names when a task is given) then ``other``; ``True`` with a
    task is the task's names."""
    if isinstance(spec, Task):
        task, spec = spec, True
    if spec is True:
        if task is None:
            raise QKCircuitsError("positions=True needs the task whose named positions split the graph: pass "
                                  "positions=task (qk.graph) or call edge_scores(model, task, positions=True)")
        names = list(task.positions)
    elif isinstance(spec, str) or not isinstance(spec, Iterable):
        raise QKCircuitsError(f"positions must be True, a Task or a sequence of position names, got {spec!r}")
    else:
        names = [str(n) for n in spec]
    if task is not None:
        unknown = [n for n in names if n not in task.positions]
        if unknown:
            raise QKCircuitsError(f"position {unknown[0]!r} is not one of the task's named positions "
                                  f"({', '.join(task.positions)})")
    for n in names:
        if "@" in n or not n or n == OTHER:
            raise QKCircuitsError(f"position name {n!r} cannot name a position group (no '@', not empty, not "
                                  f"{OTHER!r}: the group of the positions no name points at)")
    if len(set(names)) != len(names):
        raise QKCircuitsError(f"position names repeat: {names}")
    return tuple(names) + (OTHER,)



def graph(model, gqa: str = "grouped", positions=None) -> Graph:
    """The graph of ``model`` (counts only; see the module docstring). ``gqa="ungrouped"``: k/v inputs per
    query head. ``positions``: a ``Task`` (its named positions, then ``other``), or a sequence of position names
    (``"other"`` added): a position-aware graph (``positions.py``)."""
    if gqa not in GQA:
        raise QKCircuitsError(f"gqa must be one of {', '.join(GQA)}, got {gqa!r}")
    groups: Tuple[str, ...] = ()
    if positions is not None and positions is not False:
        groups = position_groups(positions)
    cfg = model.cfg
    return Graph(cfg.n_layers, cfg.n_heads, n_kv_heads(model), has_mlps(model), model_name(model),
                 parallel_blocks(model), gqa == "ungrouped" and n_kv_heads(model) != cfg.n_heads, groups,
                 fingerprint(model))


# ------------------------------------------------------------------------------------------ the graph's reads
# Every module and config read goes through the adapters (``_foundation/arch``).

def post_norm(model, layer: int):
    """The norm a block applies to its attention output before adding it (Gemma's ln1_post), or None."""
    return post_norm_module(model, layer)


def head_outputs(model, layer: int, z: Float[Tensor, "b p h e"], y=None, out=None) -> Float[Tensor, "h b p d"]:
    """Each head's output added to the residual (one batched matmul over the layer's heads). ``y``: the
    attention output before a post-norm (needed only where the block has one). ``out``: a contiguous
    [h, b, p, d] tensor to write into (the runs' sender buffers), else a new one."""
    W_O = adapter(model, layer).W_O()            # per head [h, e, d_model], every attention family
    b, p, h, e = z.shape
    zh = z.permute(2, 0, 1, 3).reshape(h, b * p, e)                                    # [h, b·p, e], small
    W = W_O.to(z.dtype)
    post = post_norm(model, layer)
    if post is None and out is not None and out.is_contiguous() and out.dtype == z.dtype:
        torch.bmm(zh, W, out=out.view(h, b * p, W.shape[-1]))
        return out
    res = torch.bmm(zh, W).view(h, b, p, W.shape[-1])
    if post is not None:                          # the norm's linear part per head at the layer's frozen 1/σ(y)
        norm = adapter(model, layer).post_norm()
        res = norm.linear(res) * norm.inv_scale(y.float()).to(res.dtype)[None]
    if out is not None:
        out.copy_(res)
        return out
    return res


def split_qkv_from_residuals(model, layer: int, into: str, resid: Float[Tensor, "n b p d"],
                             heads: Sequence[int]) -> Float[Tensor, "b p n e"]:
    """hook_q/k/v values of ``heads`` (query heads for q, KV heads for k/v) of ``layer`` (the adapter's
    ``inputs_from_residuals``), head i computed
    from ITS OWN residual ``resid[i]``: ln1 recomputed per copy (cheap, elementwise), then one einsum with
    the heads' W_Q/W_K/W_V (the flops of the model's own projection). q/k-norm and rotary are applied
    after hook_q/k by the model's attention, so they need nothing here.

    Multi-head latent attention (the ``latent`` adapter): head i's input is the layer's own recompute from
    ``resid[i]`` (``adapter.head_inputs``: the latent and its norm from that residual, then only head i's
    up-projection; the decoupled rotary key, shared by every head, is recomputed from the same residual, so
    an edge into head i's k carries the sender's effect through both parts). That costs one projection per
    copy, not one einsum for all: fine at MLA test sizes, and said here."""
    return adapter(model, layer).inputs_from_residuals(resid, into, list(heads))


def logits_input(model, resid: Tensor) -> Tensor:
    """What the unembedding reads (``unembed.hook_in``) from the final residual: the final norm recomputed."""
    return model.ln_final(resid)


def unembed_logits(model, x: Tensor) -> Tensor:
    """The model's logits from what the unembedding reads (``unembed.hook_in``): ``model.unembed`` and then the
    architecture's own post-unembedding transform, which the model's forward applies after the unembedding
    (Gemma-2's final soft-cap ``cap · tanh(logits / cap)``, and whatever else TransformerLens'
    ``adapter.apply_output_logits_transform`` declares; the identity for most models). ``check_graph`` checks the
    result against the model's own logits."""
    logits = model.unembed(x)
    transform = logits_transform(model)
    return transform(logits) if transform is not None else logits


INPUT_HOOKS = {"q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v", "mlp": "mlp.hook_in"}
