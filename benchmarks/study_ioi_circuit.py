"""The SmolLM2 IOI circuit study behind docs/tasks.md (issue 17's done-when), reproducible in one process.

    PYTHONPATH=$PWD python benchmarks/study_ioi_circuit.py [--n 64] [--scores PATH] [--out study.json]

1. EAP-IG (5 steps) edge scores of ``qk.tasks.ioi(model, n)`` (saved to / read from ``--scores``).
2. The faithfulness curve over MIB's grid for both rankings, signed and |score| (CPR, CMD of each).
3. The node view against the issue's node baselines at equal head counts: the heads of the smallest
   signed top-edge circuit that touches at least k heads, against the top-k heads by |EAP-IG node score|,
   by the signed node score and by direct effect (the head -> logits edge score); f of each set with every
   other head's output replaced by its corrupt-run output.

One thread (``torch.set_num_threads(1)``); prints every table and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--scores", default=None, help="edge-scores JSON to reuse (written when missing)")
    ap.add_argument("--heads", default="5,10,14,27,54", help="head counts for the node view")
    ap.add_argument("--out", default=None, help="write the tables as JSON")
    ap.add_argument("--skip-curves", action="store_true", help="only the node view")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import qkcircuits as qk
    from qkcircuits._tasks.faithfulness import SIZES, circuit_metric, node_mask
    from qkcircuits._tasks.selection import select
    from qkcircuits._tasks.scores import shard_rows

    t0 = time.perf_counter()
    model = qk.load(args.model, device="cpu", verbose=False)
    task = qk.tasks.ioi(model, n=args.n)
    g = qk.graph(model)
    print(f"{args.model}: {task.n} IOI prompts x {task.clean.shape[1]} tokens; {g.n_edges} edges", flush=True)
    if args.scores and os.path.exists(args.scores):
        scores = qk.load_result(args.scores)
    else:
        t = time.perf_counter()
        scores = qk.edge_scores(model, task, method="eap-ig", steps=5)
        print(f"EAP-IG(5): {time.perf_counter() - t:.0f} s", flush=True)
        if args.scores:
            scores.to_json(args.scores)
    print(f"clean {scores.clean:+.3f}, corrupt {scores.corrupt:+.3f}", flush=True)
    out = {"model": args.model, "n_prompts": task.n, "clean": scores.clean, "corrupt": scores.corrupt,
           "n_edges": g.n_edges, "threads": 1}

    for by in () if args.skip_curves else ("signed", "abs"):
        t = time.perf_counter()
        f = qk.faithfulness(model, task, scores, by=by, progress=False)
        cells = {p: {"f": round(v, 4), "edges": f.n_edges[p],
                     "heads": len(select(scores, percent=p, by=by).heads)} for p, v in f.curve.items()}
        out[f"curve_{by}"] = {"curve": cells, "cpr": f.cpr, "cmd": f.cmd, "chosen_percent": f.chosen_percent,
                              "chosen_heads": len(f.node_heads), "node_faithfulness": f.node_faithfulness}
        print(f"\nranking {by}: CPR {f.cpr:.3f}, CMD {f.cmd:.3f}; chosen {f.chosen_percent:g}% "
              f"({len(f.node_heads)} heads, node view f {f.node_faithfulness:.3f}); {time.perf_counter() - t:.0f} s")
        print("| % | f | edges | heads |\n|---|---|---|---|")
        for p, c in cells.items():
            print(f"| {p:g} | {c['f']:.3f} | {c['edges']} | {c['heads']} |", flush=True)

    # node view vs the node baselines at equal head counts
    heads_all = [s for s in g.senders if s[0].isdigit()]
    node = scores.node_scores()
    t = time.perf_counter()        # the issue's "attribution estimate": one-gradient (EAP) node scores
    eap_node = qk.node_scores(model, task, method="eap", progress=False)
    eap = dict(eap_node.scores)
    print(f"EAP node scores: {time.perf_counter() - t:.0f} s", flush=True)
    logits_r = g.logits_receiver
    direct = {h: float(torch.nan_to_num(scores.scores[g.senders.index(h), logits_r])) for h in heads_all}
    ranked = [h for h in sorted(heads_all, key=lambda h: -abs(node[h]))]

    def circuit_heads(k: int, how: str = "top"):
        lo, hi = 1, g.n_edges                              # the smallest signed circuit touching >= k heads
        while lo < hi:
            mid = (lo + hi) // 2
            if len(select(scores, edges=mid, by="signed", how=how).heads) >= k:
                hi = mid
            else:
                lo = mid + 1
        c = select(scores, edges=lo, by="signed", how=how)
        return c.heads, lo

    rows = shard_rows(model, g, task, buffers=3)
    table = []
    for k in [int(x) for x in args.heads.split(",")]:
        ch, n_edges = circuit_heads(k)
        gh, _ = circuit_heads(k, "greedy")
        sets = {"circuit": ch,
                "greedy_circuit": gh,
                "eap_abs": sorted(heads_all, key=lambda h: -abs(eap[h]))[:len(ch)],
                "eap_signed": sorted(heads_all, key=lambda h: -eap[h])[:len(ch)],
                "abs_attr": ranked[:len(ch)],
                "signed_attr": sorted(heads_all, key=lambda h: -node[h])[:len(ch)],
                "direct": sorted(heads_all, key=lambda h: -direct[h])[:len(ch)]}
        vals, clean, corrupt = circuit_metric(model, task, [node_mask(g, s) for s in sets.values()], rows)
        fs = {name: (v - corrupt) / (clean - corrupt) for name, v in zip(sets, vals)}
        table.append({"k": k, "heads": len(ch), "greedy_heads": len(gh), "circuit_edges": n_edges, **{n: round(v, 4) for n, v in fs.items()}})
        print(f"heads {len(ch)} (asked {k}; signed circuit of {n_edges} edges): " +
              ", ".join(f"{n} {v:.3f}" for n, v in fs.items()), flush=True)
    out["node_view"] = table
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    print(f"\nwall {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
