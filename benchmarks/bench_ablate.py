"""Ablation sweeps on SmolLM2-135M (30 layers x 9 heads = 270 heads): ours vs the references, one process.

    .venv/bin/python benchmarks/bench_ablate.py [--n-seqs 4] [--seg-len 20] [--method zero]

Times, on the same model and prompts ([BOS] + R + R, induction-loss metric), one thread:
  1. naive loop: one full forward per head inside ``qk.ablate`` (the definition ``sweep`` must equal);
  2. TransformerLens ``patching.get_act_patch_attn_head_out_all_pos`` (one forward per head, patching
     the replacement z in from a "clean cache" holding it);
  3. ``qk.sweep`` (cached residual stream + ablations of a layer stacked along the batch);
  4. ``qk.attribution`` (one forward + one backward), with its Spearman rank correlation to the sweep.
Prints each time, the ratios, and the largest |difference| between the effect grids.
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
from qkcircuits._analysis.ablate import make_replacement  # noqa: E402
from qkcircuits._foundation.stats import spearman  # noqa: E402
from qkcircuits._analysis.sweep import naive_sweep  # noqa: E402


def tl_sweep(model, tokens, metric, method, reference):
    """TransformerLens's per-head patching helper, patching in the replacement z."""
    from transformer_lens import patching

    n = model.cfg.n_layers
    repl = make_replacement(model, method, range(n), reference=reference, tokens=tokens)
    b, p = tokens.shape
    cache = {}
    for L in range(n):
        z = torch.stack([repl.value(L, h, b, p).expand(b, p, model.cfg.d_head)
                         for h in range(model.cfg.n_heads)], dim=2)
        cache[f"blocks.{L}.attn.hook_z"] = z
    with torch.no_grad():
        base = float(metric(model(tokens), tokens))
        out = patching.get_act_patch_attn_head_out_all_pos(model, tokens, cache, lambda lg: metric(lg, tokens))
    return out.cpu() - base


def timed(fn, *a):
    """(result, CPU seconds of this process): on a shared machine CPU time, not wall time, is what
    one thread spends; the wall time is printed too."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*a)
    c, w = time.process_time() - c0, time.perf_counter() - w0
    WALL.append(w)
    return out, c


WALL: list = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-seqs", type=int, default=4)
    ap.add_argument("--seg-len", type=int, default=20)
    ap.add_argument("--method", default="zero", choices=qk.ABLATION_METHODS)
    ap.add_argument("--skip-tl", action="store_true")
    args = ap.parse_args()
    model = qk.load("smollm2-135m", device="cpu", verbose=False)
    tokens = qk.repeated_tokens(model, n_seqs=args.n_seqs, seg_len=args.seg_len, seed=0)
    metric = qk.as_metric("induction-loss")
    reference = None
    if args.method != "zero":
        reference = tokens if args.method == "mean" else tokens.roll(1, 0)
    print(f"SmolLM2-135M, {tokens.shape[0]} prompts x {tokens.shape[1]} tokens, metric induction-loss, "
          f"method {args.method}, 1 thread, torch {torch.__version__}", flush=True)

    fast, t_fast = timed(lambda: qk.sweep(model, tokens, metric, args.method, reference=reference,
                                          progress=False))
    print(f"(times are CPU seconds of this one-thread process; wall seconds in brackets)")
    print(f"sweep        {t_fast:7.1f} s [{WALL[-1]:.0f}]  baseline {fast.baseline:.4f}", flush=True)
    naive, t_naive = timed(lambda: naive_sweep(model, tokens, metric, args.method, reference=reference))
    print(f"naive loop   {t_naive:7.1f} s [{WALL[-1]:.0f}]  sweep is {t_naive / t_fast:.2f}x faster; "
          f"max |sweep - naive| = {(fast.effects - naive).abs().max():.2e} nats", flush=True)
    if not args.skip_tl:
        try:
            tl, t_tl = timed(tl_sweep, model, tokens, metric, args.method, reference)
            print(f"TL patching  {t_tl:7.1f} s [{WALL[-1]:.0f}]  sweep is {t_tl / t_fast:.2f}x faster; "
                  f"max |sweep - TL| = {(fast.effects - tl).abs().max():.2e} nats", flush=True)
        except Exception as e:  # report, do not hide, a helper that cannot run on a bridge
            print(f"TL patching  failed on TransformerBridge: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    est, t_attr = timed(lambda: qk.attribution(model, tokens, metric, args.method, reference=reference))
    rho = spearman(est.effects, fast.effects)
    print(f"attribution  {t_attr:7.1f} s [{WALL[-1]:.0f}]  {t_fast / t_attr:.1f}x faster than sweep; Spearman vs sweep "
          f"{rho:.3f}; top-5 overlap {len({h for h, _ in est.top(5)} & {h for h, _ in fast.top(5)})}/5", flush=True)
    print("top-5 by sweep:      ", ", ".join(f"{h} {v:+.3f}" for h, v in fast.top(5)))
    print("top-5 by attribution:", ", ".join(f"{h} {v:+.3f}" for h, v in est.top(5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
