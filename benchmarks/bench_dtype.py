"""bfloat16 against float32 on SmolLM2-135M: scan scores and sweep effects, same prompts, one process.

    .venv/bin/python benchmarks/bench_dtype.py [--layers 0 1 16 17 18] [--n-seqs 4] [--seg-len 20]

Loads the model twice (fp32, then bf16; both with fold_ln, the default), runs ``qk.scan`` and a
zero-ablation ``qk.sweep`` (induction loss) on the same token ids, and prints the largest absolute
differences, the rank agreement (Spearman) and whether the top heads agree. Times in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

import qkcircuits as qk  # noqa: E402
from qkcircuits._foundation.stats import spearman  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="*", default=[0, 1, 16, 17, 18])
    ap.add_argument("--n-seqs", type=int, default=4)
    ap.add_argument("--seg-len", type=int, default=20)
    args = ap.parse_args()
    out = {}
    tokens = None
    for dtype in ("float32", "bfloat16"):
        model = qk.load("smollm2-135m", device="cpu", dtype=dtype, verbose=False)
        if tokens is None:
            tokens = qk.repeated_tokens(model, n_seqs=args.n_seqs, seg_len=args.seg_len, seed=0)
        t0 = time.perf_counter()
        scores = qk.scan(model, progress=False)
        t1 = time.perf_counter()
        eff = qk.sweep(model, tokens, "induction-loss", "zero", layers=args.layers, progress=False)
        t2 = time.perf_counter()
        out[dtype] = (scores, eff, t1 - t0, t2 - t1, model.W_Q.dtype)
        print(f"{dtype}: weights {model.W_Q.dtype}; scan {t1 - t0:.1f} s, sweep of layers {args.layers} "
              f"{t2 - t1:.1f} s; baseline {eff.baseline:.4f}", flush=True)
        del model
    (s32, e32, *_), (s16, e16, *_) = out["float32"], out["bfloat16"]
    print(f"load avg {open('/proc/loadavg').read().split()[:3]}")
    for name in s32.scores:
        a, b = s32[name], s16[name]
        ok = ~(a.isnan() | b.isnan())
        top32 = [str(h) for h, _ in s32.top(5, name)]
        top16 = [str(h) for h, _ in s16.top(5, name)]
        print(f"scan {name:<16} max |bf16 - fp32| {(a - b)[ok].abs().max():.4f}  Spearman {spearman(a[ok], b[ok]):.4f}"
              f"  top-5 fp32 {top32}  bf16 {top16}")
    m = ~e32.effects.isnan()
    d = (e32.effects - e16.effects)[m].abs()
    print(f"sweep baseline fp32 {e32.baseline:.4f} bf16 {e16.baseline:.4f}; effects max |diff| {d.max():.4f} nats, "
          f"mean {d.mean():.4f}; Spearman {spearman(e32.effects[m], e16.effects[m]):.4f}; "
          f"top-5 fp32 {[str(h) for h, _ in e32.top(5)]} bf16 {[str(h) for h, _ in e16.top(5)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
