"""Cost of QK attribution (``qk.attend``) in units of ONE plain forward of the same batch (issue 34 ask 8).

    PYTHONPATH=$PWD python benchmarks/bench_attend.py [--model smollm2-135m] [--n 64] [--repeats 2]

One process, one thread (``torch.set_num_threads(1)``). The plain forward of the IOI clean rows (no hooks) is
re-timed around every run; each run's ratio is to the mean of the forwards just before and after it.

- ``attend 23.0``: one head (the IOI name mover 23.0, END -> IO, contrast) over the ``--n`` IOI prompts; target
  <= 1.5 forwards;
- ``attend_heads all``: every head of the model at one (query, key) pair per row (END -> IO), contrast; target
  <= 6 forwards;
- versus ``trace`` for the same question about the top induction heads: their key sources, by QK attribution
  (``attend`` on the induction task, one call per head) and by exact path patching (``qk.path_patch`` into k of
  the same heads: one patched run per sender), with the ratio and whether the two name the same top source.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-trace", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import qkcircuits as qk
    from qkcircuits._paths.trace import scan_for_trace

    model = qk.load(args.model, device="cpu", verbose=False)
    task = qk.tasks.ioi(model, n=args.n)
    fwd = []

    def forward() -> float:
        with torch.no_grad():
            t = time.perf_counter()
            model(task.clean)
            fwd.append(time.perf_counter() - t)
        return fwd[-1]

    forward()
    forward()

    def timed(label: str, fn):
        for r in range(args.repeats):
            before = forward()
            t = time.perf_counter()
            out = fn()
            took = time.perf_counter() - t
            after = forward()
            print(f"{label:<28} run {r + 1}: {took:7.2f} s = {took / ((before + after) / 2):5.2f} forwards "
                  f"(forward {before:.2f} / {after:.2f} s)", flush=True)
        return out, took

    print(f"{args.model}: IOI {task.n} prompts x {task.clean.shape[1]} tokens; one thread")
    one, _ = timed("attend 23.0 (END->IO)", lambda: qk.attend(model, "23.0", task=task, query="END", key="IO"))
    print(f"  exact_error {one.exact_error:.1e}; " + "; ".join(one.sentences()[1:3]))
    every, _ = timed("attend_heads all (END->IO)",
                     lambda: qk.attend_heads(model, None, task=task, query="END", key="IO"))
    worst = max(r.exact_error for r in every.values())
    print(f"  {len(every)} heads, largest exact_error {worst:.1e}")
    if args.skip_trace:
        return
    scores = scan_for_trace(model, progress=False)
    recv = [h for h, _ in scores.top(3, "induction")]
    ind = qk.tasks.induction(model)
    t = time.perf_counter()
    mine = {str(r): qk.attend(model, r, task=ind).key_sources(1)[0][0] for r in recv}
    t_attend = time.perf_counter() - t
    t = time.perf_counter()
    exact = qk.path_patch(model, recv, into="k", progress=False)
    t_patch = time.perf_counter() - t
    theirs = {str(r): str(exact.top(1, receiver=r, into="k")[0][0]) for r in recv}
    print(f"top induction heads' key sources: attend {mine} in {t_attend:.1f} s; path patching {theirs} in "
          f"{t_patch:.1f} s; path patching / attend = {t_patch / t_attend:.1f}x; same: {mine == theirs}")


if __name__ == "__main__":
    main()
