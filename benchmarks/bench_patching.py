"""Edge attribution vs exact path patching of every edge into every head, SmolLM2-135M, one process.

    .venv/bin/python benchmarks/bench_patching.py [--n-seqs 8] [--into k] [--layers 30] [--repeat 2]

Both compute, for every receiver head of layers 1..``--layers``-1 and each input in ``--into``, the
effect of every earlier head (mean ablation, the default metrics): exact ``qk.path_patch`` (one
receiver-layer attention run per sender, batched) and ``qk.edge_attribution`` (one attention forward
+ backward per receiver layer). Prints CPU and wall seconds, the ratio, and the agreement: Spearman
over all edges and over the edges above each receiver's baseline mean, and the share of receivers
whose top sender is the same. Each method is timed ``--repeat`` times (default 2) and the best run of
each is compared (a load spike during the 3 s estimate would otherwise move the ratio most). Also times ``--naive`` edges (default 6) of the plain per-edge recipe (a
full forward per edge to get the sender's Δ, one to get the receiver's patched input, one to splice it in:
what path patching costs without reusing the clean pass or batching) and extrapolates to all edges.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

import qkcircuits as qk  # noqa: E402
from qkcircuits._foundation.stats import spearman  # noqa: E402
from qkcircuits._paths.patching import default_prompts  # noqa: E402


def best_of(repeat, fn, *a, **kw):
    """(the last result, the best CPU seconds, the best wall seconds) over ``repeat`` runs."""
    runs = [timed(fn, *a, **kw) for _ in range(max(1, repeat))]
    return runs[-1][0], min(r[1] for r in runs), min(r[2] for r in runs)


def timed(fn, *a, **kw):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*a, **kw)
    return out, time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seqs", type=int, default=8)
    ap.add_argument("--into", default="k")
    ap.add_argument("--layers", type=int, default=None, help="receivers in layers 1..N-1 (default all)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each method; the best one counts")
    ap.add_argument("--naive", type=int, default=6, help="edges timed with the plain per-edge recipe")
    args = ap.parse_args()
    model = qk.load(args.model, device="cpu", verbose=False)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    top = args.layers or L
    recv = [qk.Head(l, h) for l in range(1, top) for h in range(H)]
    tokens = default_prompts(model, n_seqs=args.n_seqs)
    into = tuple(args.into.split(","))
    print(f"{args.model}: {len(recv)} receivers x {into} , {sum(r.layer * H for r in recv)} edges per input; "
          f"prompts {tuple(tokens.shape)}; load {open('/proc/loadavg').read().split()[:3]}")
    # warm-up (one receiver layer of each method: first-call costs such as TransformerLens's hook tables
    # are paid here, not by whichever method happens to run first)
    qk.edge_attribution(model, recv[-H:], into=into, tokens=tokens)
    qk.path_patch(model, recv[-1:], into=into, tokens=tokens, progress=False)
    est, c_a, w_a = best_of(args.repeat, qk.edge_attribution, model, recv, into=into, tokens=tokens)
    print(f"edge_attribution: {c_a:.1f} s CPU, {w_a:.1f} s wall (best of {args.repeat})")
    _, c_l, w_l = timed(qk.edge_attribution, model, recv, into=into, tokens=tokens, metric="induction-loss")
    print(f"edge_attribution(metric='induction-loss'): {c_l:.1f} s CPU, {w_l:.1f} s wall (one extra forward + backward)")
    exact, c_e, w_e = best_of(args.repeat, qk.path_patch, model, recv, into=into, tokens=tokens, progress=False)
    print(f"path_patch (exact): {c_e:.1f} s CPU, {w_e:.1f} s wall (best of {args.repeat})")
    print(f"ratio exact / attribution: {c_e / c_a:.1f}x CPU, {w_e / w_a:.1f}x wall")
    for x in into:
        e, a = exact.effects[x], est.effects[x]
        keep = ~e.isnan()
        rho_all = spearman(e[keep], a[keep])
        above = torch.stack([e[i] > exact.baseline(r, x)["mean"] for i, r in enumerate(recv)]) & keep
        rho_above = spearman(e[above], a[above])
        same = sum(est.top(1, receiver=r, into=x)[0][0] == exact.top(1, receiver=r, into=x)[0][0] for r in recv) / len(recv)
        print(f"  {x}: Spearman all edges {rho_all:.3f} ({int(keep.sum())}); above baseline {rho_above:.3f} "
              f"({int(above.sum())}); same top sender for {same:.0%} of receivers")
    n_edges = int((~exact.effects[into[0]].isnan()).sum()) * len(into)
    if args.naive:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_patching import _induction, _reference_effect

        edges = [(qk.Head(l, 0), qk.Head(top - 1 - l % 3, 3)) for l in range(args.naive)]
        _, c_n, w_n = timed(lambda: [_reference_effect(model, tokens, s, r, into[0], _induction) for s, r in edges])
        per = c_n / len(edges)
        print(f"naive per-edge recipe: {per:.2f} s CPU per edge ({len(edges)} timed) -> {per * n_edges / 3600:.1f} h "
              f"for all {n_edges} edges (extrapolated): {per * n_edges / c_e:.0f}x path_patch, "
              f"{per * n_edges / c_a:.0f}x edge_attribution")
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
