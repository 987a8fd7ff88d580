"""Position-aware graphs: edges (sender, receiver input, position group) over the task's named positions.

>>> task = qk.tasks.induction(model, n=2, seg_len=5)                    # [BOS] + R + R[:-1]: END is position 9
>>> position_groups(task)                                               # IOI: ('IO', 'S1', 'S1+1', 'S2', 'END', 'other')
('END', 'other')
>>> group_index(task, position_groups(task))[0].tolist()                # [n, pos]: each position's group
[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]
>>> at("20.0", "END"), split("mlp3@S2")
('20.0@END', ('mlp3', 'S2'))

The residual stream is per position: a sender's write at position p is read by every receiver at position p
and nowhere else, while attention moves information across positions INSIDE a receiving head (from its k/v at
p' to its output at p). So the position-aware graph splits every edge s → r of the plain graph by the position
group γ at which r reads s: the groups are the task's named positions (in the task's order) and ``other``,
where every position no name points at is pooled (padding included). A row whose two names point at one
position counts it for the first name. Masks and scores gain a leading group axis, [Γ, S, R].

- Patched run: receiver r at position p (group γ(p)) reads  corrupt_r[p] + Σ_{s: (s, r, γ(p)) ∈ C} Δ_s[p]
  (``grouped_sum``: one matmul per group over that group's positions, so the sums cost one plain matmul);
- EAP / EAP-IG: score(s, r, γ) = Σ_{b, p ∈ γ, d} Δ_s · ∇_r (the plain score's sum split by position, so the
  scores summed over groups ARE the plain scores);
- exact: m(clean) − m(clean with r reading out_s(corrupt) at the positions of γ only);
- pruning (``prune_positions``): an MLP and the logits act per position, a head's output at any position may
  depend on its inputs at every position (attention), so a head is reached when any of its inputs is reached
  at any group and is useful at every group when it is useful at one.

Node names carry the group: ``"20.0@END"``, ``"mlp3@S2"``, ``"emb@IO"``, ``"7.1@other"`` (``at``, ``split``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import OTHER, Graph, position_groups  # noqa: F401  (re-exported)
from .task import Task



def group_index(task, groups: Sequence[str]) -> Int[Tensor, "n pos"]:
    """Each position's group index [n, pos]: ``groups.index(name)`` where a named position points (the first
    name in ``groups`` wins where two names point at one position), else the ``other`` group (the last)."""
    n, p = task.clean.shape
    idx = torch.full((n, p), len(groups) - 1, dtype=torch.long, device=task.clean.device)
    rows = torch.arange(n, device=task.clean.device)
    for gi in range(len(groups) - 2, -1, -1):             # reversed, so that the first name is written last
        name = groups[gi]
        if name not in task.positions:
            raise QKCircuitsError(f"the task names no position {name!r}; its positions: {', '.join(task.positions)}")
        idx[rows, task.positions[name].to(idx.device)] = gi
    return idx


def flat_groups(index: Int[Tensor, "b pos"], n_groups: int) -> List[Tensor]:
    """Per group, the flat indices over (b, pos) of its positions."""
    flat = index.reshape(-1)
    return [(flat == gi).nonzero().squeeze(1) for gi in range(n_groups)]


def grouped_sum(W: Bool[Tensor, "k G nb n"], D: Tensor, start: Tensor, flat: Sequence[Tensor]) -> Tensor:
    """start + Σ_s W[k, γ(p), s, n] · D[s, k, p] for every position p, as [n, k, b·pos, d]: one matmul per group
    over that group's positions (only the senders some receiver of the group takes). ``D``: the senders' Δ
    [nb, k, b·pos, d]; ``start``: [k, b·pos, d]."""
    n = W.shape[-1]
    res = start.unsqueeze(0).repeat(n, 1, 1, 1)
    for gi, idx in enumerate(flat):
        Wg = W[:, gi]                                                              # [k, nb, n]
        used = Wg.any(-1).any(0).nonzero().squeeze(1)
        if not len(idx) or not len(used):
            continue
        # one copy of Δ at the group's positions (of only the senders used, when that is under half of them)
        if 2 * len(used) < Wg.shape[1]:
            Wg, Dg = Wg[:, used], D.index_select(0, used)[:, :, idx]
        else:
            Dg = D[:, :, idx]
        res[:, :, idx] += torch.einsum("ksn,skmd->nkmd", Wg.to(D.dtype), Dg)
    return res


def gather_positions(X: Tensor, idx: Tensor) -> Tensor:
    """``X`` [n, b, pos, d] at the flat (b, pos) positions ``idx``, as [n, len(idx) · d] (a copy)."""
    n, b, p, d = X.shape
    return X.reshape(n, b * p, d)[:, idx].reshape(n, -1)


def layer_reads(g: Graph) -> Tensor:
    """[H, H + 2·n_kv_in] bool: query head h reads a layer's receiver input j (its own q; its KV head's k and v,
    or its own k and v when ungrouped). The same in every layer."""
    H, n = g.n_heads, g.n_kv_in
    q = torch.eye(H, dtype=torch.bool)
    h, j = torch.arange(H)[:, None], torch.arange(n)[None]
    kv = (h == j) if n == H else (h // g.group == j)
    return torch.cat([q, kv, kv], 1)


def prune_positions(g: Graph, mask: Bool[Tensor, "G S R"]) -> Tensor:
    """Keep the edges of a position-aware ``mask`` [Γ, S, R] on a path embedding → … → logits inside it (module
    docstring): one sweep up the layers, one down. With one group it is ``selection.prune``."""
    mask = mask.bool().cpu()
    reads = layer_reads(g)
    G, S, R = mask.shape
    reach = torch.zeros(G, S, dtype=torch.bool)
    reach[:, 0] = True
    for L in range(g.n_layers):
        hs = slice(g.head_sender(L), g.head_sender(L) + g.n_heads)
        rs = slice(g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop)
        fed = (mask[:, :, rs] & reach[:, :, None]).any(1).any(0)                 # each q/k/v input, any group
        reach[:, hs] = (reads & fed[None]).any(1)[None]
        if g.has_mlp:
            r = g.recv_slice(L, "mlp").start
            reach[:, g.mlp_sender(L)] = (mask[:, :, r] & reach).any(1)
    useful = torch.zeros(G, S, dtype=torch.bool)
    recv_useful = torch.zeros(G, R, dtype=torch.bool)
    recv_useful[:, g.logits_receiver] = True
    for L in range(g.n_layers - 1, -1, -1):
        if g.has_mlp:
            m, r = g.mlp_sender(L), g.recv_slice(L, "mlp").start
            useful[:, m] = (mask[:, m] & recv_useful).any(1)
            recv_useful[:, r] = useful[:, m]
        hs = slice(g.head_sender(L), g.head_sender(L) + g.n_heads)
        head_useful = (mask[:, hs] & recv_useful[:, None]).any(2).any(0)           # [H]: useful at some group
        useful[:, hs] = head_useful[None]
        rs = slice(g.recv_slice(L, "q").start, g.recv_slice(L, "v").stop)
        recv_useful[:, rs] = (reads & head_useful[:, None]).any(0)[None]
    return mask & reach[:, :, None] & recv_useful[:, None, :]


# ------------------------------------------------------------------------------------------------ names

def at(name: str, group: str) -> str:
    """``"20.0"``, ``"END"`` → ``"20.0@END"``."""
    return f"{name}@{group}"


def split(name: str) -> Tuple[str, Optional[str]]:
    """``"20.0@END"`` → ``("20.0", "END")``; a name without a group → ``(name, None)``."""
    base, sep, group = str(name).partition("@")
    return base, (group if sep else None)


def position_node_mask(g: Graph, keep: Iterable[str], kinds: Sequence[str] = ("head",)) -> Tensor:
    """[Γ, S, R]: every edge, except those leaving a node of ``kinds`` ("head", "mlp", "emb") at a group where it
    is NOT kept (its readers there read its corrupt output). ``keep`` names nodes with or without a group
    (``"20.0@END"``: at END only; ``"20.0"``: at every group); nodes of other kinds stay clean."""
    if not g.positions:
        raise QKCircuitsError("position_node_mask needs a position-aware graph (qk.graph(model, positions=task))")
    kept: Dict[str, set] = {}
    for name in keep:
        base, group = split(name)
        if group is not None and group not in g.positions:
            raise QKCircuitsError(f"node {name!r}: {group!r} is not one of the graph's position groups "
                                  f"({', '.join(g.positions)})")
        if base not in g.senders:
            raise QKCircuitsError(f"node {name!r}: {base!r} is not a node of {g!r}")
        kept.setdefault(base, set()).update(g.positions if group is None else {group})
    mask = g.valid[None].repeat(g.n_groups, 1, 1)
    for s, base in enumerate(g.senders):
        kind = "emb" if base == "emb" else "mlp" if base.startswith("mlp") else "head"
        if kind not in kinds:
            continue
        for gi, group in enumerate(g.positions):
            if group not in kept.get(base, ()):
                mask[gi, s] = False
    return mask
