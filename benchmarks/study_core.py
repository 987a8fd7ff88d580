"""The SmolLM2 IOI core circuit behind docs/tasks.md ("The core circuit"), reproducible in one process.

    PYTHONPATH=$PWD python benchmarks/study_core.py [--n 64] [--scores PATH] [--out core.json]

1. EAP-IG (5 steps) edge scores of ``qk.tasks.ioi(model, n)`` (saved to / read from ``--scores``).
2. The core circuit with MLPs searched (the default) and with every MLP kept clean: its grow curve, the
   nodes, f, the nodes pruned, the time; then f of the core checked again by the edge-level patched run of
   its node mask (an independent way to the same number) and the core's roles (with the heads outside it
   whose effect reaches 5 %).
3. The edge circuit's size for comparison (the signed 2 % circuit's edges and heads).

One thread (``torch.set_num_threads(1)``); prints everything and writes it as JSON.
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
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import qkcircuits as qk
    from qkcircuits._tasks.faithfulness import circuit_metric, ratio
    from qkcircuits._tasks.core import node_mask_of
    from qkcircuits._tasks.scores import shard_rows

    model = qk.load(args.model, device="cpu", verbose=False)
    task = qk.tasks.ioi(model, n=args.n)
    g = qk.graph(model)
    print(f"{args.model}: {task.n} IOI prompts x {task.clean.shape[1]} tokens; {g.n_edges} edges", flush=True)
    if args.scores and os.path.exists(args.scores):
        scores = qk.load_result(args.scores)
    else:
        t = time.perf_counter()
        scores = qk.edge_scores(model, task, method="eap-ig", steps=5, progress=False)
        print(f"EAP-IG(5): {time.perf_counter() - t:.0f} s", flush=True)
        if args.scores:
            scores.to_json(args.scores)
    print(f"clean {scores.clean:+.4f}, corrupt {scores.corrupt:+.4f}", flush=True)
    out = {"model": args.model, "n_prompts": task.n, "clean": scores.clean, "corrupt": scores.corrupt,
           "threads": args.threads, "cores": {}}
    rows = shard_rows(model, g, task, buffers=3)
    for mlps in (True, False):
        t = time.perf_counter()
        core = qk.core_circuit(model, task, scores, mlps=mlps, progress=False)
        secs = time.perf_counter() - t
        (m,), clean, corrupt = circuit_metric(model, task, [node_mask_of(g, core.heads, core.mlps)], rows)
        check = ratio(m, clean, corrupt)
        t = time.perf_counter()
        roles = qk.roles(model, task, core, scores=scores)
        role_s = time.perf_counter() - t
        print(f"\nmlps={'searched' if mlps else 'clean'}: {len(core.heads)} heads + {len(core.mlps)} MLPs, node f "
              f"{core.node_faithfulness:.3f} (edge-level patched run of its mask: {check:.3f}); {secs:.0f} s, "
              f"{core.settings['sets_measured']} sets", flush=True)
        print("  how:", core.how)
        print("  curve:", ", ".join(f"{k}: {v:.3f}" for k, v in core.curve.items()))
        print("  heads:", ", ".join(core.heads))
        print("  MLPs:", ", ".join(core.mlps))
        print("  pruned:", ", ".join(core.pruned))
        for line in roles.sentences():
            print("  ", line)
        out["cores"]["searched" if mlps else "clean"] = {
            **core.to_dict(), "seconds": round(secs, 1), "check_f": check, "roles_s": round(role_s, 1),
            "roles": {h: {"role": r["role"], "in_circuit": r["in_circuit"],
                          "direct_share": r["evidence"]["direct_share"], "node_share": r["evidence"]["node_share"]}
                      for h, r in roles.roles.items()}}
    c = scores.circuit(percent=2)
    out["edge_circuit_2pct"] = {"edges": c.n_edges, "heads": len(c.heads), "mlps": sum(n.startswith("mlp") for n in c.nodes)}
    print(f"\nthe signed 2 % edge circuit: {c.n_edges} edges, {len(c.heads)} heads", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
