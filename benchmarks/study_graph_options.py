"""The SmolLM2 IOI numbers of docs/tasks.md's "Graph options" section, reproducible in one process.

    PYTHONPATH=$PWD python benchmarks/study_graph_options.py [--n 64] [--out graph_options.json]

For each graph (grouped: the default; ungrouped: k/v per query head; positions: every edge split by IO, S1,
S1+1, S2, END and other): EAP-IG (5 steps; ``--rule``, default right as in the docs' table) edge scores of
``qk.tasks.ioi(model, n)``, their identity with the grouped plain scores (the group sums for ungrouped, the sums
over position groups for positions), the signed faithfulness curve over MIB's grid (CPR, CMD) and the chosen
circuit. For the position-aware scores also the
largest position node scores ("20.0@END": the head's output at END, every reader) and, for the heads with the
largest node scores, the share of each head's node score at each position.

One thread (``torch.set_num_threads(1)``); prints everything and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--graphs", default="grouped,ungrouped,positions")
    ap.add_argument("--rule", default="right", choices=("left", "right", "midpoint"),
                    help="EAP-IG's points (default right: the rule the docs' table was measured with, before the "
                         "left rule became the default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import qkcircuits as qk

    model = qk.load(args.model, device="cpu", verbose=False)
    task = qk.tasks.ioi(model, n=args.n, seed=0)
    print(f"{args.model}: IOI, {task.n} prompts x {task.clean.shape[1]} tokens; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    out = {"n": task.n, "rule": args.rule}
    plain = None
    for name in args.graphs.split(","):
        kw = {"gqa": "ungrouped"} if name == "ungrouped" else {"positions": True} if name == "positions" else {}
        t0 = time.perf_counter()
        scores = qk.edge_scores(model, task, method="eap-ig", steps=5, rule=args.rule, progress=False, **kw)
        t1 = time.perf_counter()
        f = qk.faithfulness(model, task, scores, progress=False)
        t2 = time.perf_counter()
        g = scores.graph
        row = {"n_edges": g.n_edges, "edge_scores_s": round(t1 - t0, 1), "curve_s": round(t2 - t1, 1),
               "clean": scores.clean, "corrupt": scores.corrupt,
               "curve": {f"{k:g}": round(v, 3) for k, v in f.curve.items()}, "cpr": round(f.cpr, 3),
               "cmd": round(f.cmd, 3), "chosen_percent": f.chosen_percent, "circuit_edges": f.circuit.n_edges,
               "circuit_heads": len(f.circuit.heads), "node_f": round(f.node_faithfulness, 3),
               "top_edges": [[s, r, x, round(v, 4)] for s, r, x, v in scores.top(8)]}
        if name == "grouped":
            plain = scores
        elif plain is not None:
            gp = plain.graph
            scale = float(plain.scores.nan_to_num().abs().max())
            if name == "ungrouped":
                err = 0.0
                for L in range(g.n_layers):
                    for x in ("k", "v"):
                        summed = scores.scores[:, g.recv_slice(L, x)].nan_to_num().view(g.n_senders, g.n_kv, -1).sum(-1)
                        err = max(err, float((summed - plain.scores[:, gp.recv_slice(L, x)].nan_to_num()).abs().max()))
            else:
                err = float((scores.position_scores.nansum(0) - plain.scores.nan_to_num()).abs().max())
            row["identity_max_error"] = err
            row["identity_relative"] = err / scale
        if name == "positions":
            nodes = scores.node_scores()
            top = sorted(nodes.items(), key=lambda kv: -abs(kv[1]))[:25]
            row["top_position_nodes"] = [[k, round(v, 4)] for k, v in top]
            heads = {}
            for k, v in nodes.items():
                base, grp = k.split("@")
                if base[0].isdigit():
                    heads.setdefault(base, {})[grp] = v
            biggest = sorted(heads, key=lambda h: -abs(sum(heads[h].values())))[:15]
            row["where_heads_act"] = {h: {grp: round(v, 3) for grp, v in heads[h].items()} for h in biggest}
            row["position_nodes_of_circuit"] = f.circuit.position_nodes[:60]
        out[name] = row
        print(json.dumps({name: row}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
