"""SmolLM2-135M full zero-ablation sweep: 2 Ray workers (1 thread each) against the local sweep (1 thread).

    .venv/bin/python benchmarks/bench_ray.py [--workers 2] [--n-seqs 4] [--seg-len 20]

Run it on a quiet machine (it prints /proc/loadavg before and after; other processes on the
cores inflate both sides, the Ray side more, since it needs every core). Steps:
  1. local: this process loads the model (1 thread) and runs ``qk.sweep`` (all 270 heads);
  2. the model is released, then ``qk.sweep("smollm2-135m", ..., backend="ray", ray_address="local:N")``:
     a fresh local Ray instance, N workers that each load the model once; this process loads no weights.
Prints the local sweep time, Ray's start-up / load / sweep times, the speed-up of the sweep itself
and end to end, and the largest |difference| between the two effect grids (goal: identical, <= 1e-5).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

import qkcircuits as qk  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n-seqs", type=int, default=4)
    ap.add_argument("--seg-len", type=int, default=20)
    ap.add_argument("--method", default="zero")
    args = ap.parse_args()
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores)", flush=True)
    t0 = time.perf_counter()
    model = qk.load("smollm2-135m", device="cpu", verbose=False)
    load_local = time.perf_counter() - t0
    tokens = qk.repeated_tokens(model, n_seqs=args.n_seqs, seg_len=args.seg_len, seed=0)
    t0, c0 = time.perf_counter(), time.process_time()
    local = qk.sweep(model, tokens, "induction-loss", args.method, progress=False)
    t_local, c_local = time.perf_counter() - t0, time.process_time() - c0
    print(f"local  1 thread: load {load_local:.1f} s, sweep {t_local:.1f} s wall ({c_local:.1f} s CPU); "
          f"{tokens.shape[0]} prompts x {tokens.shape[1]} tokens, {args.method}", flush=True)
    del model
    gc.collect()
    t0 = time.perf_counter()
    res = qk.sweep("smollm2-135m", tokens, "induction-loss", args.method, backend="ray",
                   ray_address=f"local:{args.workers}", progress=False)
    total = time.perf_counter() - t0
    t = res.timing
    diff = (res.effects - local.effects).abs().max().item()
    print(f"ray {args.workers} workers x 1 thread ({res.backend['shards']} shards): start-up {t['startup_s']:.1f} s, "
          f"load {t['load_s']:.1f} s, sweep {t['sweep_s']:.1f} s; end to end {total:.1f} s", flush=True)
    print(f"speed-up of the sweep: {t_local / t['sweep_s']:.2f}x; end to end (local load+sweep vs ray total): "
          f"{(load_local + t_local) / total:.2f}x; max |ray - local| = {diff:.2e} nats; "
          f"baselines {local.baseline:.6f} / {res.baseline:.6f}")
    print(f"top-5 local {[str(h) for h, _ in local.top(5)]}, ray {[str(h) for h, _ in res.top(5)]}")
    # Per-shard cost: block passes x prompts (plan_sweep's unit) and the seconds the worker spent.
    for p in res.backend["plan"]:
        print(f"  shard rows {p['rows']} layers {p['layers'][0]}-{p['layers'][-1]}: cost {p['cost']:.0f} block-prompt "
              f"passes, {p['seconds']:.1f} s -> {1e3 * p['seconds'] / p['cost']:.2f} ms per block-prompt pass "
              f"({tokens.shape[1]} tokens)")
    print(f"load average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
