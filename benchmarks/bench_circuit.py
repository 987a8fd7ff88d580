"""Cost of circuit discovery in units of ONE plain forward of the clean batch (issue 17 ask 10).

    PYTHONPATH=$PWD python benchmarks/bench_circuit.py [--model smollm2-135m] [--n 64] [--exact-edges 64]

One process, one thread (``torch.set_num_threads(1)``). Times, each after a warm-up: one plain forward
of the task's clean rows (no hooks), EAP, EAP-IG with 5 steps, the 10-point faithfulness curve (plus its
node view), and exact edge patching on ``--exact-edges`` edges, extrapolated to the whole graph. The plain
forward is re-timed around every run: each run's ratio is to the mean of the forwards just before and after it
(printed per run: ``--repeats`` runs of each method, the first a fresh call, the others warm), and the table's
seconds are the fastest run against the median forward. Targets: EAP <= 4 forwards, EAP-IG(5) <= 20, the curve <= 12 (printed on its own too: the
node view is one more patched forward, not part of the curve).

``--whole`` (issue 41 ask 4) instead runs the whole ``qkcircuits circuit MODEL --task ioi`` command in this process
(``--n`` prompts, the default held-out third) and then ``--resamples 5``, and prints each step's seconds (the
command's own ``--timing``) in plain forwards of the ``--n`` prompts, timed before and after in the same
process. Targets: the whole command <= 60 forwards, with ``--resamples 5`` <= 5 x that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def whole(args) -> None:
    """The whole circuit command with --resamples 5, each step in plain forwards of the batch: the command without
    resamples is every step but "stability" (draw 0 is the command's own run)."""
    import json

    import qkcircuits as qk
    from qkcircuits.cli import main as cli

    model = qk.load(args.model, device="cpu", verbose=False)
    task = qk.tasks.ioi(model, n=args.n)
    times = []

    def forward() -> None:
        with torch.no_grad():
            t = time.perf_counter()
            model(task.clean)
            times.append(time.perf_counter() - t)

    forward(), forward(), forward()
    path = args.save or os.path.join(tempfile.mkdtemp(), "c.json")
    assert cli(["circuit", args.model, "--task", "ioi", "--n", str(args.n), "--resamples", "5", "--json", path,
                "--quiet", "--threads", "1"] + (["-o", args.save[:-5] + ".html"] if args.save else [])) == 0
    forward(), forward(), forward()
    timing = json.load(open(path))["timing"]
    fwd = statistics.median(times)
    print(f"model {args.model}: {args.n} IOI prompts; one plain forward of them {fwd:.2f} s (median of {len(times)}, "
          f"range {min(times):.2f}-{max(times):.2f}, before and after); load average {os.getloadavg()[0]:.1f}; "
          f"torch threads {torch.get_num_threads()}; the command's own load (load_s) is not counted")
    steps = {k[:-2]: v for k, v in timing.items() if k not in ("total_s", "load_s")}
    plain = sum(v for k, v in steps.items() if k != "stability")
    print("  steps (forwards): " + ", ".join(f"{k} {v / fwd:.1f}" for k, v in steps.items() if v))
    print(f"  {'circuit --task ioi':<36} {plain:8.1f} s  {plain / fwd:7.1f} forwards   (target <= 60)")
    total = timing["total_s"] - timing["load_s"]
    print(f"  {'circuit --task ioi --resamples 5':<36} {total:8.1f} s  {total / fwd:7.1f} forwards   (target <= "
          f"{5 * plain / fwd:.0f}, 5 x the command)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--exact-edges", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each method (a fresh one, then warm ones)")
    ap.add_argument("--save", default="", help="torch.save the EAP / EAP-IG scores and the curve here "
                                                "(to check that a change keeps the results)")
    ap.add_argument("--whole", action="store_true", help="the whole circuit command with --resamples 5 (issue 41)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.whole:
        return whole(args)
    import qkcircuits as qk
    from qkcircuits._tasks.runs import patched_run, record
    from qkcircuits._tasks.scores import EXACT_BYTES, shard_rows

    model = qk.load(args.model, device="cpu", verbose=False)
    try:
        task = qk.tasks.ioi(model, n=args.n)
    except qk.QKCircuitsError:             # no tokenizer, or no single-token names: the induction task
        task = qk.tasks.induction(model, n=args.n)
    g = qk.graph(model)
    fwd_times = []

    def forward() -> float:
        with torch.no_grad():
            t = time.perf_counter()
            model(task.clean)
            fwd_times.append(time.perf_counter() - t)
        return fwd_times[-1]

    forward()
    forward()
    rows = {}
    cpu = {}

    # each run's ratio is to the mean of the plain forwards timed just before and just after it (the VM's speed
    # drifts by 10-20 % within minutes); with --repeats 2 the first run is a fresh call (its buffers' first
    # touch included) and the second a warm one, and both are printed
    runs_of: dict = {}

    def timed(name, fn):
        out = None
        for i in range(args.repeats):
            before = forward()
            t, c = time.perf_counter(), time.process_time()
            out = fn()
            wall, cp = time.perf_counter() - t, time.process_time() - c
            after = forward()
            runs_of.setdefault(name, []).append((wall, cp, wall / ((before + after) / 2)))
            if i == 0 or wall < rows[name]:
                rows[name], cpu[name] = wall, cp
            if hasattr(out, "timing") and "curve_s" in getattr(out, "timing", {}):
                runs_of.setdefault("  of which the curve (10 sizes)", []).append(
                    (out.timing["curve_s"], float("nan"), out.timing["curve_s"] / ((before + after) / 2)))
                runs_of.setdefault("  of which the node view", []).append(
                    (out.timing["node_view_s"], float("nan"), out.timing["node_view_s"] / ((before + after) / 2)))
        return out

    eap = timed("eap", lambda: qk.edge_scores(model, task, method="eap", progress=False))
    ig = timed("eap-ig (5 steps)", lambda: qk.edge_scores(model, task, method="eap-ig", steps=5, progress=False))
    fa = timed("faithfulness curve (10 sizes) + node view", lambda: qk.faithfulness(model, task, ig, progress=False))
    # the two parts of that call, from its own timing (the curve is what the target is about)
    for part in ("  of which the curve (10 sizes)", "  of which the node view"):
        rows[part] = min(w for w, _, _ in runs_of[part])
        cpu[part] = float("nan")
    if args.save:
        torch.save({"eap": eap.scores, "eap_ig": ig.scores, "curve": fa.curve, "metric_values": fa.metric_values,
                    "node_faithfulness": fa.node_faithfulness, "clean": fa.clean, "corrupt": fa.corrupt}, args.save)
    # exact: args.exact_edges edges on the first shard of rows, extrapolated to all edges and all rows
    shard = task.rows(slice(0, shard_rows(model, g, task, buffers=3, budget=EXACT_BYTES)))
    corr = record(model, g, shard, shard.corrupt)
    s_idx, r_idx = g.valid.nonzero(as_tuple=True)
    pick = torch.randperm(len(s_idx), generator=torch.Generator().manual_seed(0))[:args.exact_edges]
    t, c = time.perf_counter(), time.process_time()
    for start in range(0, len(pick), 32):
        p = pick[start:start + 32]
        mask = g.valid[None].repeat(len(p), 1, 1)
        mask[torch.arange(len(p)), s_idx[p], r_idx[p]] = False
        patched_run(model, g, shard, corr, mask)
    per_edge = (time.perf_counter() - t) / len(pick) * task.n / shard.n
    rows["exact, all edges (extrapolated)"] = per_edge * g.n_edges
    cpu["exact, all edges (extrapolated)"] = ((time.process_time() - c) / len(pick) * task.n / shard.n
                                              * g.n_edges)
    with torch.no_grad():                  # CPU time of one plain forward (the wall-time unit's twin)
        c = time.process_time()
        model(task.clean)
        fwd_cpu = time.process_time() - c
    fwd = statistics.median(fwd_times)
    print(f"model {args.model}: {g.n_edges} edges, {task.n} prompts x {task.clean.shape[1]} tokens; one forward "
          f"{fwd:.2f} s (median of {len(fwd_times)}, range {min(fwd_times):.2f}-{max(fwd_times):.2f}); "
          f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}; one forward's CPU "
          f"time {fwd_cpu:.2f} s")
    for name, sec in rows.items():
        each = "  ".join(f"{r:.2f}" for _, _, r in runs_of.get(name, []))
        print(f"  {name:<45} {sec:10.1f} s  {sec / fwd:10.1f} forwards  CPU {cpu[name]:10.1f} s"
              + (f"   per run vs its own forwards: {each}" if each else ""))


if __name__ == "__main__":
    main()
